"""What must match between a full-state checkpoint and the run resuming from it: checked by the
launcher before any rank starts, and again by every rank (tests/test_resume.py::
test_periodic_checkpoints_retention_vocab_and_bad_checkpoints); and what may change: the
optimisation settings, which the resumed run uses from its first step (tests/test_resume_settings.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import TrainConfig
from .manifest import CheckpointError

if TYPE_CHECKING:  # the launcher's checks stay free of torch
    import torch

#: Plain trainer state of a checkpoint (step, counters, scheduler, data position, settings).
TRAINER_STATE = "trainer_state.json"

#: Settings a bit-identical resume needs unchanged (trainer_state.json "settings").
RESUME_SETTINGS = ("batch_size", "max_tokens_per_gpu", "max_seq_len", "seed", "osft", "osft_unfreeze_rank_ratio",
                   "osft_target_patterns", "osft_rank_schedule", "osft_importance_samples", "osft_min_frozen_ratio",
                   "osft_max_frozen_ratio", "freeze_non_target", "freeze_router", "train_on_all", "overlong",
                   "osft_protect_subspaces", "data_format", "train_reasoning", "train_last_turn_only", "chat_template",
                   "eval_split")
#: Settings that may change on resume: the resumed run uses this run's values from its first step
#: (AdamW's hyperparameters through :func:`with_run_hyperparameters`, the schedule through
#: :func:`..schedule.restore_position`, the clipping threshold and length read every step), with a
#: warning that the trajectory then differs from an uninterrupted run.
RESUME_WARN_SETTINGS = ("learning_rate", "lr_scheduler", "warmup_steps", "weight_decay", "beta1", "beta2", "eps",
                        "max_grad_norm", "max_steps", "num_epochs")


def check_resume_compatible(saved: dict, cfg: TrainConfig, world_size: int, sampler, path: Path) -> list[str]:
    """Compare a checkpoint's ``trainer_state.json`` with this run; ``sampler``
    is this run's (:mod:`..data.sampler`), whose ``layout()`` (the data size, a mixture's sizes and
    weights) must be the checkpoint's.

    Returns:
        one warning per optimisation setting that changed (:data:`RESUME_WARN_SETTINGS`): it is
        used from the first resumed step on, so the run is no longer bit-identical to an
        uninterrupted one.

    Raises:
        CheckpointError: another world size, batch size, micro-batch budget, seed, data size,
            mixture or OSFT setting; the message gives both values.
    """
    if saved["world_size"] != world_size:
        raise CheckpointError(f"checkpoint {path} was saved with {saved['world_size']} ranks, now {world_size}: "
                              "a bit-identical resume needs the same world size")
    layout = sampler.layout()
    if saved["sampler"]["num_samples"] != layout["num_samples"]:
        raise CheckpointError(f"checkpoint {path} was saved with {saved['sampler']['num_samples']} training samples, "
                              f"the data now has {layout['num_samples']}: the data position would not match")
    if saved["sampler"].get("mixture") != layout.get("mixture"):
        raise CheckpointError(f"checkpoint {path} was saved with the mixture (samples, weight per --data-path) "
                              f"{saved['sampler'].get('mixture')}, this run has {layout.get('mixture')}: "
                              "the data positions would not match")
    settings = saved["settings"]
    for key in RESUME_SETTINGS:
        if settings.get(key, getattr(cfg, key)) != getattr(cfg, key):
            raise CheckpointError(f"checkpoint {path} was saved with --{key.replace('_', '-')} {settings[key]}, "
                                  f"this run has {getattr(cfg, key)}: resume with the same setting")
    return [f"--{k.replace('_', '-')} changed from {old} to {new} since checkpoint {path}: used from step "
            f"{saved['step'] + 1} on, so the resumed run differs from an uninterrupted one"
            for k, (old, new) in changed_settings(saved, cfg).items()]


def changed_settings(saved: dict, cfg: TrainConfig) -> dict[str, tuple]:
    """``{setting: (checkpoint's value, this run's value)}`` for every optimisation setting of
    :data:`RESUME_WARN_SETTINGS` that differs between ``saved`` (a ``trainer_state.json``) and ``cfg``."""
    settings = saved["settings"]
    return {k: (settings[k], getattr(cfg, k)) for k in RESUME_WARN_SETTINGS
            if settings.get(k, getattr(cfg, k)) != getattr(cfg, k)}


def with_run_hyperparameters(saved: dict, optimizer: torch.optim.Optimizer) -> dict:
    """A saved optimizer state dict whose parameter groups carry ``optimizer``'s hyperparameters
    (lr, initial_lr, betas, eps, weight_decay, ...; built from this run's settings) instead of the
    saved ones: loading it restores AdamW's moments and step counts, never the old settings.

    Raises:
        CheckpointError: the saved state has another number of parameter groups.
    """
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise CheckpointError(f"the saved optimizer state has {len(saved['param_groups'])} parameter groups, "
                              f"this run's optimizer {len(optimizer.param_groups)}")
    groups = [{**group, **{k: v for k, v in current.items() if k != "params"}}
              for group, current in zip(saved["param_groups"], optimizer.param_groups)]
    return {**saved, "param_groups": groups}


def read_trainer_state(step_dir: Path) -> dict:
    """``step_dir/trainer_state.json`` (JSON: nothing in it can run code)."""
    return json.loads((step_dir / TRAINER_STATE).read_text())
