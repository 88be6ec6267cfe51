"""How a rank's run ended: the one type the monitor decides an early end with and the training
loop returns (:meth:`osft.trainer.run.loop.Trainer.run`); the ``run_finished`` record carries its reason and exit
code (docs/architecture.md section 4)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..contract import FinishReason


@dataclass(frozen=True)
class RunEnd:
    """How a run ends.

    Attributes:
        reason: the ``reason`` of ``run_finished`` (:class:`.contract.FinishReason`).
        exit_code: 0 completed or ended by an evaluation rule, :data:`.contract.EXIT_STOPPED` on a
            stop request, :data:`.contract.EXIT_FAILED` after a divergence.
        message: the console line of an early end (by an evaluation rule or a divergence).
        export_final: whether the final model is exported (early stopping); else ``export_dir`` is
            the run's export (None: none).
        checkpoint: the last full-state checkpoint written (or None).
        fields: extra fields of ``run_finished`` (early ends).
        steps: the step reached; ``steps_run``: the steps this run trained (fewer than ``steps``
            after a resume); ``last_loss``: the last step's loss (NaN when this run trained none);
            ``violations_total``: the orthogonality violations of the whole run.
    """

    reason: str = FinishReason.COMPLETED
    exit_code: int = 0
    message: str = ""
    export_final: bool = False
    export_dir: str | None = None
    checkpoint: str | None = None
    fields: dict = field(default_factory=dict)
    steps: int = 0
    steps_run: int = 0
    last_loss: float = math.nan
    violations_total: int = 0

    def summary(self) -> str:
        """One line for the console: steps, last loss and violations; after a resume with no
        step left, that no step was trained (tests/test_stop_rule.py)."""
        if self.steps_run == 0:
            return (f"no step left to train: the run was resumed at step {self.steps}, its last step; "
                    f"orthogonality violations {self.violations_total}")
        resumed = f" ({self.steps_run} in this run)" if self.steps_run != self.steps else ""
        return (f"{self.steps} steps{resumed}, last loss {self.last_loss:.4f}, "
                f"orthogonality violations {self.violations_total}")
