"""The Python API: train from a notebook or a pipeline with the settings and checks of ``osft-train``.

    from osft.trainer.launch.api import InputError, train

    outcome = train("run.yaml", max_steps=100)           # or a dict, or a TrainConfig
    print(outcome.exit_code, outcome.step, outcome.export_dir, outcome.last_step["loss"])

:func:`train` runs the code ``osft-train`` runs once its flags are parsed (:func:`osft.trainer.launch.cli.run_training`):
one rank in this process, or a torchrun worker group (``nproc_per_node`` > 1 or ``nnodes`` > 1)
that this process launches and supervises. Bad input raises :class:`InputError` with the message
``osft-train`` prints after ``osft-train: error:``. The checkpoint signals' handlers (SIGINT's
too, so a notebook keeps its Ctrl-C) are the caller's again when it returns or raises.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import Any, NoReturn

from rich.console import Console

from ..checkpoint.signals import current_handlers, hold_signals, release_held_signals, restore_handlers
from .cli import InputError, run_training
from ..config import TrainConfig, build_parser, config_from_args, config_to_argv
from ..config_file import ConfigFileError, apply_settings, convert_settings, read_config_file
from ..observe.outcome import TrainOutcome, read_outcome
from ..rundir import RunDir

__all__ = ["InputError", "TrainConfig", "TrainOutcome", "resolve_config", "train"]


def _refuse(message: str) -> NoReturn:
    """argparse's ``error`` for the API: raise instead of printing the usage and exiting."""
    raise InputError(message)


def resolve_config(config: TrainConfig | Mapping[str, Any] | str | os.PathLike | None = None,
                   **overrides: Any) -> TrainConfig:
    """The run's config, checked value by value as ``osft-train`` checks its flags and ``--config`` files.

    Args:
        config: a :class:`TrainConfig`, a mapping keyed like a config file (field names:
            ``{"model_name_or_path": ..., "data_path": [...], "output_dir": ..., "osft": False}``),
            the path of a ``--config`` YAML file, or None (every setting from ``overrides``).
        overrides: settings by field name that replace those of ``config`` (as command-line flags
            override a config file).

    Returns:
        the resolved config (the defaults of ``osft-train`` for every setting not given).

    Raises:
        InputError: an unknown key (with the closest one), a value the flag's type or choices
            reject, a config file that cannot be read or parsed (``file:line:``), or a missing
            model, data or output path.
    """
    parser = build_parser()
    parser.error = _refuse  # type: ignore[method-assign]
    try:
        if isinstance(config, TrainConfig):
            settings = convert_settings(config.to_json(), parser)
        elif isinstance(config, Mapping) or config is None:
            settings = convert_settings(config or {}, parser)
        else:
            settings = read_config_file(config, parser)
        settings.update(convert_settings(overrides, parser))
    except ConfigFileError as exc:
        raise InputError(str(exc)) from exc
    apply_settings(parser, settings)
    return config_from_args(parser.parse_args([]))


def train(config: TrainConfig | Mapping[str, Any] | str | os.PathLike | None = None, *,
          console: Console | None = None, **overrides: Any) -> TrainOutcome:
    """Train as ``osft-train`` would with these settings, in this process or on a torchrun worker group.

    Call it from the main thread (signal handlers can only be set there; another thread gets an
    :class:`InputError`, and can run ``osft-train`` in a subprocess). Every checkpoint signal
    is held from the start, as ``osft-train`` holds it (docs/architecture.md section 6); with
    ``on_demand_checkpointing`` a SIGINT (Ctrl-C) asks for a checkpoint and the run returns with
    exit code 75, otherwise it interrupts as usual (``KeyboardInterrupt`` in this process). The
    handlers in place before the call are restored when it returns or raises.

    Args:
        config: a :class:`TrainConfig`, a mapping keyed like a config file, a ``--config`` YAML
            path, or None (:func:`resolve_config`).
        console: where progress and the end of the run are printed (default: stderr).
        overrides: settings by field name that replace those of ``config``.

    Returns:
        what happened (:class:`TrainOutcome`): exit code, step reached, final export, newest
        checkpoint, last step record. A run that failed (on one rank in this process or a worker
        group) or was stopped by a signal returns its exit code (1, or 128 + N) after printing what
        happened, as ``osft-train`` does.

    Raises:
        InputError: a call from another thread than the main thread (before anything is read or
            written); bad settings (:func:`resolve_config`, :func:`.config.check_config`), data,
            model path or sample count, a checkpoint to resume from that does not fit, or an output
            directory another job owns or an earlier run left without ``resume`` or
            ``overwrite_output_dir``, all before any training, with ``osft-train``'s message.
    """
    if threading.current_thread() is not threading.main_thread():
        raise InputError("osft.trainer.launch.api.train must be called from the main thread: it installs the checkpoint "
                         "signal handlers, which Python allows only there; from a worker thread, run osft-train "
                         "in a subprocess instead")
    console = console or Console(stderr=True)
    previous = current_handlers()
    hold_signals()
    try:
        cfg = resolve_config(config, **overrides)
        if not cfg.on_demand_checkpointing:
            release_held_signals()  # no request to serve: what arrived takes its default action now
        argv = config_to_argv(cfg)
        end = run_training(cfg, console, argv, ["osft-train", *argv])
        return read_outcome(RunDir(cfg.output_dir, cfg.node_rank), end.job_id, end.exit_code, end.export_dir)
    finally:
        release_held_signals(deliver=False)
        restore_handlers(previous)
