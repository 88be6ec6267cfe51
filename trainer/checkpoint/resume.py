"""What must match between a full-state checkpoint and the run resuming from it (field cases B12,
B13): checked by the launcher before any rank starts, and again by every rank."""

from __future__ import annotations

import json
from pathlib import Path

from ..config import TrainConfig
from .manifest import CheckpointError

#: Plain trainer state of a checkpoint (step, counters, scheduler, data position, settings).
TRAINER_STATE = "trainer_state.json"

#: Settings a bit-identical resume needs unchanged (trainer_state.json "settings").
RESUME_SETTINGS = ("batch_size", "max_tokens_per_gpu", "max_seq_len", "seed", "osft", "osft_unfreeze_rank_ratio",
                   "osft_target_patterns", "osft_rank_schedule", "osft_importance_samples", "osft_min_frozen_ratio",
                   "osft_max_frozen_ratio", "freeze_non_target", "train_on_all", "overlong", "osft_protect_subspaces",
                   "eval_split")
#: Settings that may change on resume, with a warning that the trajectory then differs.
RESUME_WARN_SETTINGS = ("learning_rate", "lr_scheduler", "warmup_steps", "weight_decay", "beta1", "beta2", "eps",
                        "max_grad_norm", "max_steps", "num_epochs")


def check_resume_compatible(saved: dict, cfg: TrainConfig, world_size: int, num_samples: int, path: Path) -> list[str]:
    """Compare a checkpoint's ``trainer_state.json`` with this run (field cases B12, B13).

    Returns:
        warnings for optimisation settings that changed (the run continues, but not bit-identically).

    Raises:
        CheckpointError: another world size, batch size, micro-batch budget, seed, data size or
            OSFT setting; the message gives both values.
    """
    if saved["world_size"] != world_size:
        raise CheckpointError(f"checkpoint {path} was saved with {saved['world_size']} ranks, now {world_size}: "
                              "a bit-identical resume needs the same world size")
    if saved["sampler"]["num_samples"] != num_samples:
        raise CheckpointError(f"checkpoint {path} was saved with {saved['sampler']['num_samples']} training samples, "
                              f"the data now has {num_samples}: the data position would not match")
    settings = saved["settings"]
    for key in RESUME_SETTINGS:
        if settings.get(key, getattr(cfg, key)) != getattr(cfg, key):
            raise CheckpointError(f"checkpoint {path} was saved with --{key.replace('_', '-')} {settings[key]}, "
                                  f"this run has {getattr(cfg, key)}: resume with the same setting")
    return [f"--{k.replace('_', '-')} changed from {settings[k]} to {getattr(cfg, k)} since checkpoint "
            f"{path}: the resumed run will differ from an uninterrupted one"
            for k in RESUME_WARN_SETTINGS if settings.get(k, getattr(cfg, k)) != getattr(cfg, k)]


def read_trainer_state(step_dir: Path) -> dict:
    """``step_dir/trainer_state.json`` (JSON: nothing in it can run code)."""
    return json.loads((step_dir / TRAINER_STATE).read_text())
