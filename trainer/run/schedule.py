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


def restore_position(scheduler: LambdaLR, state: dict) -> list[float]:
    """Move ``scheduler`` (built with this run's peak lr, schedule, warmup and length) to the
    position saved in ``state`` (a ``LambdaLR.state_dict()`` of the run being resumed), and set
    every parameter group's lr to what this run's schedule gives there.

    Only the position (``last_epoch``, the number of optimizer steps taken) comes from ``state``;
    the peak lr and the multipliers are this run's. With unchanged settings the lrs are the saved
    ones bit for bit (the same product ``peak × multiplier(step)``).

    Returns:
        the lr of each parameter group for the next optimizer step.
    """
    step = state["last_epoch"]
    base_lrs = list(scheduler.base_lrs)
    lrs = [base * fn(step) for base, fn in zip(base_lrs, scheduler.lr_lambdas, strict=True)]
    scheduler.load_state_dict({**state, "base_lrs": base_lrs, "_last_lr": lrs})
    for group, lr in zip(scheduler.optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    return lrs


def check_warmup(warmup_steps: int, total_steps: int, start_step: int = 0) -> str | None:
    """A warmup that covers the whole run (tests/test_schedule.py).

    The warmup rises linearly from 0, so the peak learning rate is first used at step index
    ``warmup_steps``; a run of ``total_steps`` optimizer steps reaches it only if
    ``warmup_steps < total_steps``. A run whose every remaining step (indices ``start_step`` to
    ``total_steps - 1``) would use lr 0 would train nothing: that is refused.

    Returns:
        a warning naming both values when ``warmup_steps >= total_steps`` (None otherwise).

    Raises:
        ValueError: every step from ``start_step`` on would train at learning rate 0.
    """
    if warmup_steps < total_steps:
        return None
    steps = range(start_step, total_steps)
    if steps and not any(lr_multiplier("constant", k, warmup_steps, total_steps) for k in steps):
        raise ValueError(f"--warmup-steps {warmup_steps} with a run of {total_steps} optimizer step(s): every step "
                         "would train at learning rate 0 (the warmup starts at 0), so nothing would be trained; "
                         "use fewer warmup steps than steps")
    highest = lr_multiplier("constant", total_steps - 1, warmup_steps, total_steps)
    return (f"--warmup-steps {warmup_steps} >= the run's {total_steps} optimizer steps: the learning rate never "
            f"reaches its peak (--learning-rate); the last step uses {highest:.3g} × the peak")
