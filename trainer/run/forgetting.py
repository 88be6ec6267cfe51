"""What an evaluation means for the run: forgetting against the step-0 retention losses, the best
evaluation (within the forgetting budget), early stopping and the budget's verdict.

``forgetting = retention loss - retention loss at step 0`` per retention set, nats per token
(positive: the model got worse on text it was not trained on). ``--max-forgetting X`` applies to
every set: the largest forgetting counts. The evaluation at step 0 only sets the baselines; best
and patience count the evaluations after training steps. The best evaluation is the lowest
evaluation loss among evaluations within budget; a run without an evaluation set (retention sets
only) takes the latest evaluation within budget as its best. Early stopping counts evaluations
since the evaluation loss last dropped by at least ``--early-stopping-threshold``.

:class:`EvalState` is plain data and goes into every full-state checkpoint, so a resumed run
judges exactly as the uninterrupted one would.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from .eval_sets import EVAL, RETENTION
from .evaluation import EvalResult


@dataclass
class EvalState:
    """The evaluation state a resume needs.

    ``baselines``: retention set -> ``[loss, step it was measured at, samples, tokens]``;
    ``best_loss``/``best_step``: the best evaluation (None before the first); ``patience_ref``:
    evaluation loss of the last improvement by at least the threshold; ``since_improvement``:
    evaluations since then; ``last``: the latest ``eval_loss`` and ``forgetting_max`` (for the console).
    """

    baselines: dict[str, list] = field(default_factory=dict)
    best_loss: float | None = None
    best_step: int | None = None
    patience_ref: float | None = None
    since_improvement: int = 0
    last: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """Plain data (JSON: Python writes floats so that they read back bit for bit)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict | None) -> EvalState:
        """Read :meth:`to_dict`'s output (None or {}: a fresh state)."""
        return cls(**(data or {}))


@dataclass(frozen=True)
class Verdict:
    """One evaluation judged: ``forgetting`` per retention set (None before its baseline), the
    largest, whether it is over budget, a new best (to export), and early stop."""

    forgetting: dict[str, float]
    forgetting_max: float | None
    over_budget: bool
    new_best: bool
    early_stop: bool


class EvalRules:
    """The rules of ``--max-forgetting``, ``--early-stopping-patience`` and
    ``--early-stopping-threshold`` (None / 0: off)."""

    def __init__(self, max_forgetting: float | None, patience: int, threshold: float) -> None:
        self.max_forgetting = max_forgetting
        self.patience = patience
        self.threshold = threshold

    def judge(self, state: EvalState, step: int, results: list[EvalResult]) -> Verdict:
        """Judge the evaluation of ``step`` and update ``state`` (baselines of retention sets not
        yet measured are set from this evaluation; at step 0 that is all of them).

        Returns:
            the verdict; at the evaluation that sets a set's baseline its forgetting is 0.
        """
        for r in results:
            if r.kind == RETENTION and r.name not in state.baselines:
                state.baselines[r.name] = [r.loss, step, r.samples, r.tokens]
        forgetting = {r.name: r.loss - state.baselines[r.name][0] for r in results if r.kind == RETENTION}
        worst = max(forgetting.values()) if forgetting else None
        over = (self.max_forgetting is not None and worst is not None
                and (worst > self.max_forgetting or not math.isfinite(worst)))
        eval_loss = next((r.loss for r in results if r.kind == EVAL), None)
        state.last = {"step": step, "eval_loss": eval_loss, "forgetting_max": worst}
        new_best = early_stop = False
        if step > 0 and not over:
            if eval_loss is None:  # retention sets only: the latest evaluation within budget
                new_best = self.max_forgetting is not None
            elif math.isfinite(eval_loss) and (state.best_loss is None or eval_loss < state.best_loss):
                new_best = True
            if new_best:
                state.best_loss, state.best_step = eval_loss, step
        if step > 0 and eval_loss is not None:
            if state.patience_ref is None or eval_loss < state.patience_ref - self.threshold:
                state.patience_ref, state.since_improvement = eval_loss, 0
            else:
                state.since_improvement += 1
            early_stop = self.patience > 0 and state.since_improvement >= self.patience
        return Verdict(forgetting, worst, over, new_best, early_stop)
