"""Learning-rate schedules: linear warmup from 0, then constant, linear decay to 0, or cosine decay to 0.

The multipliers are the usual ones (the same values as ``transformers.get_scheduler`` with
``constant_with_warmup``, ``linear`` and ``cosine``, half a cosine period), applied through
``torch.optim.lr_scheduler.LambdaLR``, whose state dict is what full-state checkpoints store.
They are written here rather than taken from ``transformers.optimization``, because importing
that module imports ``peft`` whenever it is installed: 2-4 s more start-up for every rank.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a scheduler is built: the launcher's flag parsing stays light
    import torch
    from torch.optim.lr_scheduler import LambdaLR

#: The schedules ``--lr-scheduler`` accepts.
SCHEDULES = ("constant", "linear", "cosine")


def lr_multiplier(name: str, step: int, warmup_steps: int, total_steps: int) -> float:
    """Multiplier of the peak learning rate for optimizer step index ``step`` (0-based: the lr the
    (step+1)-th update uses).

    Warmup: step / warmup_steps for step < warmup_steps. After it, with progress
    p = (step − warmup) / max(1, total − warmup): ``constant`` 1; ``linear`` max(0, 1 − p);
    ``cosine`` max(0, ½(1 + cos(π·p))).

    Raises:
        ValueError: an unknown schedule name.
    """
    if name not in SCHEDULES:
        raise ValueError(f"unknown learning-rate schedule {name!r} (choose from {', '.join(SCHEDULES)})")
    if step < warmup_steps:
        return float(step) / float(max(1, warmup_steps))
    if name == "constant":
        return 1.0
    if name == "linear":
        return max(0.0, float(total_steps - step) / float(max(1, total_steps - warmup_steps)))
    progress = float(step - warmup_steps) / float(max(1, total_steps - warmup_steps))
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


def build_scheduler(name: str, optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int) -> LambdaLR:
    """A ``LambdaLR`` over every parameter group of ``optimizer`` following :func:`lr_multiplier`.

    Raises:
        ValueError: an unknown schedule name.
    """
    from torch.optim.lr_scheduler import LambdaLR

    lr_multiplier(name, 0, warmup_steps, total_steps)  # reject a bad name before building anything

    def multiplier(step: int) -> float:
        return lr_multiplier(name, step, warmup_steps, total_steps)

    return LambdaLR(optimizer, multiplier)
