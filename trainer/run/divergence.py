"""Divergence: a step whose loss is not finite, whose gradient norm is not finite while its loss
is, or whose loss spikes above ``--loss-spike-factor`` times the median of the last
:data:`SPIKE_WINDOW` good steps. The step is refused before the optimizer applies it.

``--on-divergence stop`` checkpoints the last good step and ends the run with exit code 1;
``rollback`` reloads the newest complete checkpoint at or before the last good step, skips the
batch that diverged and goes on. Skipped batches are kept as data positions (the global batch
``position`` of the run's data order: epoch ``position // steps_per_epoch``, batch
``position % steps_per_epoch``), and optimizer step ``s`` trains on the ``s``-th position that is
not skipped, so a run with skips reads one more batch per skip at its end.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

#: Good steps whose losses form the running median of the spike check.
SPIKE_WINDOW = 20
#: Good steps needed before the spike check starts.
SPIKE_MIN_STEPS = 5


class Diverged(Exception):
    """Step ``step`` (1-based) diverged for ``reason``; its update was not applied. ``lines``: the
    data file lines of (the first 20 samples of) its batch."""

    def __init__(self, step: int, reason: str, loss: float, grad_norm: float | None, lines: list[int]) -> None:
        super().__init__(f"step {step}: {reason} (lines {lines})")
        self.step = step
        self.reason = reason
        self.loss = loss
        self.grad_norm = grad_norm
        self.lines = lines


@dataclass
class DivergenceState:
    """What a resume needs: the spike window (losses of the last good steps, oldest first), the
    skipped data positions (ascending) and the rollbacks done so far."""

    window: list[float]
    skipped: list[int]
    rollbacks: int = 0

    def to_dict(self) -> dict:
        """Plain data for ``trainer_state.json``."""
        return {"window": list(self.window), "skipped": list(self.skipped), "rollbacks": self.rollbacks}

    @classmethod
    def from_dict(cls, data: dict | None) -> DivergenceState:
        """Read :meth:`to_dict`'s output (None: a fresh state)."""
        data = data or {}
        return cls(list(data.get("window", [])), list(data.get("skipped", [])), int(data.get("rollbacks", 0)))


def data_position(step: int, skipped: list[int]) -> int:
    """Data position of optimizer step ``step`` (1-based): the ``step``-th position not in
    ``skipped`` (ascending), 0-based."""
    position = step - 1
    for p in skipped:
        if p <= position:
            position += 1
    return position


class DivergenceCheck:
    """Checks one step's loss and gradient norm; ``spike_factor`` None turns the spike check off."""

    def __init__(self, spike_factor: float | None) -> None:
        self.spike_factor = spike_factor

    def reason(self, state: DivergenceState, loss: float, grad_norm: float) -> str | None:
        """Why this step diverged, or None for a good step."""
        if not math.isfinite(loss):
            return f"non-finite loss {loss}"
        if not math.isfinite(grad_norm):
            return f"non-finite gradient norm {grad_norm} (loss {loss:.6g})"
        if self.spike_factor is not None and len(state.window) >= SPIKE_MIN_STEPS:
            median = statistics.median(state.window)
            if loss > self.spike_factor * median:
                return (f"loss spike {loss:.6g} > {self.spike_factor:g} x the median {median:.6g} "
                        f"of the last {len(state.window)} steps")
        return None

    @staticmethod
    def accept(state: DivergenceState, loss: float) -> None:
        """Add a good step's loss to the spike window."""
        state.window = (state.window + [loss])[-SPIKE_WINDOW:]


