"""torchrun entry point of one rank: ``torchrun --nproc-per-node K -m osft.trainer.worker <flags>``.

Takes the same flags as ``osft-train`` (the launch flags are ignored: torchrun already placed this
process); the ``osft-train`` launcher passes only ``--config logs/node<N>/config-<job>.yaml``, the
config it resolved (:func:`.config_file.worker_config_yaml`). Exit codes (:mod:`.exit_codes`): 0 completed **or stopped after a complete checkpoint**,
1 failed (the error is also written to the metrics as an ``error`` record by whichever rank raised
it), 2 bad input. A rank does not exit 75 after a stop: torchrun's agent takes any non-zero exit
of a rank for a failure (it stops the other ranks and exits 1 itself), so the stop is told by the
``run_finished`` record, which the ``osft-train`` launcher reads to exit 75. A worker group started
by hand (``torchrun -m osft.trainer.worker``) therefore ends 0 after a stop: read ``run_finished``
(its ``reason`` and ``exit_code``) to tell a stop from a completion. The checkpoint signals are
held from the first line of :func:`main`, before the training modules are imported.
"""

from __future__ import annotations

import faulthandler
import os
import sys

from rich.console import Console

from .checkpoint.signals import hold_signals, release_held_signals
from .config import build_parser, check_config, config_from_args
from .config_file import ConfigFileError, config_to_yaml, parse_with_config_file
from .contract import EXIT_BAD_INPUT, EXIT_COMPLETED, EXIT_FAILED, JOB_ID_ENV, Event
from .launch.failure_report import record_error
from .rundir import RunDir


def main(argv: list[str] | None = None) -> int:
    """Run this rank's part of the job; returns the exit code (:mod:`.exit_codes`)."""
    hold_signals()  # before anything slow is imported: a request during start-up is served (test_stop_rule.py)
    try:
        return _main(sys.argv[1:] if argv is None else argv)
    finally:
        release_held_signals(deliver=False)


def _main(argv: list[str]) -> int:
    from .data.validate import DataValidationError
    from .run.loop import Trainer

    console = Console(stderr=True)
    try:
        args = parse_with_config_file(build_parser("osft.trainer.worker"), argv)
    except ConfigFileError as exc:
        console.print(f"osft worker: error: {exc}", markup=False, highlight=False, soft_wrap=True)
        return 2
    cfg = config_from_args(args)
    if not cfg.on_demand_checkpointing:
        release_held_signals()  # no request to serve: what arrived takes its default action now
    if args.print_config:
        sys.stdout.write(config_to_yaml(cfg))
        return 0
    try:
        check_config(cfg)
        trainer = Trainer(cfg, console)
    except (ValueError, FileNotFoundError) as exc:
        console.print(f"osft worker: error: {exc}", markup=False, highlight=False, soft_wrap=True)
        return 2
    except Exception as exc:  # before the trainer has its metrics (a tracker that fails to import)
        record_error(None, RunDir(cfg.output_dir).metrics, os.environ.get(JOB_ID_ENV, ""), exc, EXIT_FAILED)
        console.print(f"osft worker: failed: {type(exc).__name__}: {exc}", markup=False, highlight=False,
                      soft_wrap=True)
        return EXIT_FAILED
    try:
        trainer.prepare()
        result = trainer.run()
    except (DataValidationError, ValueError, FileNotFoundError) as exc:
        trainer.metrics.log(Event.ERROR, message=str(exc), exit_code=EXIT_BAD_INPUT)
        console.print(f"osft worker: error: {exc}", markup=False, highlight=False, soft_wrap=True)
        return 2
    except BaseException as exc:
        code = exc.code if isinstance(exc, SystemExit) else EXIT_FAILED
        record_error(trainer.metrics, trainer.run_dir.metrics, trainer.job_id, exc, code)  # best effort: a full disk
        if not isinstance(exc, Exception):  # SystemExit, KeyboardInterrupt: as Python ends on them
            raise
        # One line here (a peer's death makes every other rank fail too); the launcher reports the
        # failure as one paragraph, and the traceback is in the error record.
        console.print(f"osft worker: rank {trainer.dist.rank} failed: {type(exc).__name__}: {exc} "
                      f"(traceback: the error record in {trainer.metrics.path})",
                      markup=False, highlight=False, soft_wrap=True)
        return EXIT_FAILED
    # A stop on request exits 0 (the launcher reads exit code 75 from the run_finished record); a
    # divergence fails the worker group.
    return EXIT_FAILED if result.exit_code == EXIT_FAILED else EXIT_COMPLETED  # a divergence fails the group


if __name__ == "__main__":
    # A rank that dies in native code (SIGABRT from a C++ std::terminate, SIGSEGV, SIGBUS) writes the
    # Python stack of every thread to its stderr first, so the rank's log under logs/ says where it was.
    faulthandler.enable(all_threads=True)
    code = main()
    from .distributed import exit_rank  # torch is loaded by now; signals are held before it is imported

    exit_rank(code)  # without interpreter finalization, which can race gloo's threads (see exit_rank)
