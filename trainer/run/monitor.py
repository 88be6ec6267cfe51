"""A running training loop's evaluations and divergences: when to evaluate (step 0, every
``--eval-every-steps``, on a ``control/evaluate`` request, at the end), what to record, export and
print, and how the run ends early (forgetting budget, early stopping, divergence).

The monitor sees its run through a :class:`MonitorContext` (console and metrics, model, loss,
export, checkpoints), never the trainer. The loop only calls in: :meth:`RunMonitor.start` before the
first step, :meth:`check_step` before each optimizer step, :meth:`after_step` after it, and
:meth:`on_divergence` when a step diverged. Its state (:class:`osft.trainer.run.forgetting.EvalState`,
:class:`osft.trainer.run.divergence.DivergenceState`) is saved in every full-state checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint.manager import CheckpointManager
from ..checkpoint.store import newest_complete
from ..config import EvaluationConfig
from ..distributed import DistEnv, agree, control_group, is_distributed
from .divergence import Diverged, DivergenceCheck, DivergenceState, data_position
from .eval_sets import EVAL, RETENTION, EvalSet
from ..contract import EXIT_COMPLETED, EXIT_FAILED, Event, FinishReason
from .evaluation import EvalResult, evaluate_set, evaluation_mode
from .forgetting import EvalRules, EvalState, Verdict
from ..observe.metrics import Reporter
from ..rundir import RunDir, write_json_atomic
from .end import RunEnd
from ..test_hooks import injected_divergence

#: ``best_eval.json`` in ``hf_format/best``: the step, evaluation loss and forgetting of the export.
BEST_INFO = "best_eval.json"


@dataclass(frozen=True)
class MonitorContext:
    """What the monitor uses of its run.

    ``loss(batch)``: the float64-summed token loss of one packed micro-batch (None: this rank's
    empty one); ``export(step, out)``: the HF export of the model after ``step`` steps to ``out``
    (collective), returning its path; ``reload(path)``: load the full-state checkpoint at ``path``
    for a rollback (collective), returning its step; ``steps_per_epoch``: global batches per epoch;
    ``max_tokens``: the token budget of an evaluation's micro-batch (``--max-tokens-per-gpu``).
    """

    report: Reporter
    dist: DistEnv
    run_dir: RunDir
    model: nn.Module
    checkpoints: CheckpointManager
    loss: Callable[[dict | None], torch.Tensor]
    export: Callable[[int, Path], str]
    reload: Callable[[str], int]
    steps_per_epoch: int
    max_tokens: int


class RunMonitor:
    """The evaluation sets, their rules and the divergence policy of one rank's run (every rank
    holds one and calls every method at the same points: most are collective).

    ``sets``: the sets to evaluate (:attr:`osft.trainer.launch.startup.RunData.sets`: evaluation set first, then
    retention sets)."""

    def __init__(self, cfg: EvaluationConfig, context: MonitorContext, sets: list[EvalSet]) -> None:
        self.run = context
        self.cfg = cfg
        self.sets = sets
        self.rules = EvalRules(cfg.max_forgetting, cfg.early_stopping_patience, cfg.early_stopping_threshold)
        self.state = EvalState()
        self.check = DivergenceCheck(cfg.loss_spike_factor)
        self.divergence = DivergenceState([], [])
        self._fired: set[int] = set()

    # -- state -------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Plain data for ``trainer_state.json`` (key ``monitor``)."""
        return {"eval": self.state.to_dict(), "divergence": self.divergence.to_dict()}

    def load_state_dict(self, data: dict | None, keep_divergence: bool = False) -> None:
        """Take the state of a checkpoint (None: a checkpoint without one). ``keep_divergence``
        keeps this run's skipped batches and rollback count (a rollback)."""
        data = data or {}
        self.state = EvalState.from_dict(data.get("eval"))
        loaded = DivergenceState.from_dict(data.get("divergence"))
        if keep_divergence:
            loaded.skipped, loaded.rollbacks = self.divergence.skipped, self.divergence.rollbacks
        self.divergence = loaded

    def position(self, step: int) -> int:
        """Data position (global batch of the data order) of optimizer step ``step`` (1-based)."""
        return data_position(step, self.divergence.skipped)

    # -- divergence --------------------------------------------------------------------------------
    def injected(self, step: int) -> str | None:
        """The test hook's divergence for ``step`` (see :data:`.test_hooks.DIVERGE_AT_ENV`)."""
        return injected_divergence(step, self._fired)

    def check_step(self, step: int, loss: float, grad_norm: float, lines: Callable[[], list[int]]) -> None:
        """Accept step ``step`` into the spike window, or refuse it (``lines``: the data lines of
        its batch, asked for only then).

        Raises:
            Diverged: a non-finite loss or gradient norm, or a loss spike.
        """
        reason = self.check.reason(self.divergence, loss, grad_norm)
        if reason:
            raise Diverged(step, reason, loss, grad_norm, lines())
        self.check.accept(self.divergence, loss)

    def on_divergence(self, bad: Diverged, step: int) -> RunEnd | int:
        """Act on a diverged step (its update was not applied; ``step`` is the last good one).

        Returns:
            the step the rolled-back run continues after, or how the run ends (stop).
        """
        t, cfg = self.run, self.cfg
        t.report.log(Event.DIVERGENCE, step=bad.step, reason=bad.reason, loss=bad.loss, grad_norm=bad.grad_norm,
                      lines=bad.lines, policy=cfg.on_divergence)
        t.report.warn(f"step {bad.step} diverged: {bad.reason} (data lines {bad.lines})")
        why = ""
        if cfg.on_divergence == "rollback":
            if self.divergence.rollbacks >= cfg.max_rollbacks:
                why = f"; --max-rollbacks {cfg.max_rollbacks} already used"
            else:
                found = agree(lambda: str(newest_complete(t.checkpoints.root, max_step=step)[0] or ""), t.dist.rank)
                if found:
                    return self._rollback(bad, found)
                why = f"; no complete checkpoint at or before step {step} to roll back to"
        return RunEnd(FinishReason.DIVERGED, EXIT_FAILED, f"step {bad.step} diverged ({bad.reason}){why}: stopped with a "
                      f"checkpoint of step {step}, the last good one", fields={"divergence": bad.reason})

    def _rollback(self, bad: Diverged, path: str) -> int:
        """Reload ``path``, add the batch of ``bad`` to the skipped ones; returns the reloaded step."""
        t = self.run
        position = self.position(bad.step)
        self.divergence.skipped = sorted(self.divergence.skipped + [position])
        self.divergence.rollbacks += 1
        step = t.reload(path)
        t.checkpoints.saved = None  # the skipped batch and rollback count now differ from every checkpoint on disk
        epoch, index = divmod(position, t.steps_per_epoch)
        t.report.log(Event.ROLLBACK, step=bad.step, reason=bad.reason, to_step=step, path=path,
                      skipped_batch={"position": position, "epoch": epoch, "index": index},
                      rollbacks=self.divergence.rollbacks)
        t.report.say(f"rollback: reloaded {path} (step {step}); batch {index} of epoch {epoch} is skipped "
               f"(rollback {self.divergence.rollbacks} of at most {self.cfg.max_rollbacks})")
        return step

    # -- evaluation --------------------------------------------------------------------------------
    def start(self, step: int) -> None:
        """Before the first step: evaluate every set at step 0, or, after a resume, measure the
        baselines of retention sets the checkpoint has none for (or one of another size)."""
        if not self.sets:
            return
        for name, (_loss, at, samples, tokens) in list(self.state.baselines.items()):
            now = next((s for s in self.sets if s.name == name), None)
            if now is not None and (len(now), int(now.lengths.sum())) != (samples, tokens):
                self.run.report.warn(f"retention set {name} changed since its baseline (step {at}): measured again")
                del self.state.baselines[name]
        if step == 0:
            self._evaluate(0, self.sets, "start")
            return
        missing = [s for s in self.sets if s.kind == RETENTION and s.name not in self.state.baselines]
        if missing:
            names = ", ".join(s.name for s in missing)
            self.run.report.warn(f"no step-0 loss of retention set(s) {names} in the checkpoint: forgetting is "
                               f"measured from step {step}")
            self._evaluate(step, missing, "baseline")

    def after_step(self, step: int, final: bool) -> RunEnd | None:
        """After optimizer step ``step``: evaluate when due (every ``--eval-every-steps``, on a
        ``control/evaluate`` request, at the last step) and judge it.

        Returns:
            how the run ends (forgetting budget, early stopping), or None to go on.
        """
        cfg = self.cfg
        every = cfg.eval_every_steps and step % cfg.eval_every_steps == 0
        requested = self._evaluate_requested()
        if not self.sets or not (final or every or requested):
            return None
        verdict = self._evaluate(step, self.sets, "end" if final else "every" if every else "request")
        if verdict.new_best and (cfg.save_best_eval or cfg.max_forgetting is not None):
            self._export_best(step, verdict)
        if verdict.over_budget:
            best = self.state.best_step
            exported = str(self.run.run_dir.hf_best) if best is not None else None
            what = (f"the best evaluation within budget, step {best}, is exported to {exported}" if best is not None
                    else "no evaluation after step 0 was within budget: nothing exported")
            return RunEnd(FinishReason.FORGETTING_BUDGET, EXIT_COMPLETED, f"forgetting {verdict.forgetting_max:.4f} nats/token at step {step} "
                          f"exceeds --max-forgetting {cfg.max_forgetting}: run ended; {what}",
                          export_dir=exported, fields={"forgetting_max": verdict.forgetting_max, "best_step": best})
        if verdict.early_stop and not final:
            return RunEnd(FinishReason.EARLY_STOPPING, EXIT_COMPLETED, f"early stopping at step {step}: no improvement of the evaluation loss "
                          f"by {cfg.early_stopping_threshold} in {self.state.since_improvement} evaluations "
                          f"(best {self.state.best_loss:.4f} at step {self.state.best_step})", export_final=True,
                          fields={"best_step": self.state.best_step, "best_eval_loss": self.state.best_loss})
        return None

    def console_stats(self) -> str:
        """The latest evaluation for the console line ("" before the first)."""
        last = self.state.last
        parts = []
        if last.get("eval_loss") is not None:
            parts.append(f"eval {last['eval_loss']:.4f}")
        if last.get("forgetting_max") is not None:
            parts.append(f"forgetting {last['forgetting_max']:+.4f}")
        return "  ".join(parts)

    def _evaluate_requested(self) -> bool:
        """Whether ``control/evaluate`` exists (read by rank 0, agreed by all; collective); the
        request is consumed."""
        t = self.run
        path = t.run_dir.evaluate_request
        if not self.sets:  # every rank has the same sets: no collective needed to consume a request
            if t.dist.rank == 0 and path.exists():
                path.unlink(missing_ok=True)
                t.report.warn(f"{path}: nothing to evaluate (no --eval-data-path, --eval-split or --retention-data-path)")
            return False
        flag = int(t.dist.rank == 0 and path.exists())
        if is_distributed():
            box = torch.tensor([flag], dtype=torch.int64)
            dist.all_reduce(box, op=dist.ReduceOp.MAX, group=control_group())
            flag = int(box.item())
        if flag and t.dist.rank == 0:
            path.unlink(missing_ok=True)
        return bool(flag)

    def _evaluate(self, step: int, sets: list[EvalSet], trigger: str) -> Verdict:
        """Evaluate ``sets`` after ``step`` steps, judge, record one ``eval`` record per set and
        print one line."""
        t = self.run
        with evaluation_mode(t.model):
            check = t.checkpoints.stop_check("eval", step)  # a stop abandons the pass: nothing recorded
            results = [evaluate_set(s, t.loss, t.max_tokens, t.dist, check, step) for s in sets]
        verdict = self.rules.judge(self.state, step, results)
        for r in results:
            baseline = self.state.baselines.get(r.name) or [None, None]
            t.report.log(Event.EVAL, step=step, set=r.name, kind=r.kind, eval_loss=r.loss, eval_tokens=r.loss_tokens,
                          eval_samples=r.samples, eval_time_s=r.seconds, trigger=trigger,
                          forgetting=verdict.forgetting.get(r.name), baseline_loss=baseline[0],
                          baseline_step=baseline[1])
        t.report.say(f"eval step {step} ({trigger}): " + "; ".join(_describe(r, verdict) for r in results)
               + (f"; over budget (--max-forgetting {self.cfg.max_forgetting})" if verdict.over_budget else ""))
        return verdict

    def _export_best(self, step: int, verdict: Verdict) -> None:
        """Export this step's model to ``hf_format/best`` with ``best_eval.json``; log ``best_eval``.
        In :func:`osft.trainer.run.evaluation.evaluation_mode`: the input-basis export runs forward passes."""
        t = self.run
        with evaluation_mode(t.model):
            out = t.export(step, t.run_dir.hf_best)
        info = {"step": step, "eval_loss": self.state.best_loss, "forgetting": verdict.forgetting,
                "forgetting_max": verdict.forgetting_max, "max_forgetting": self.cfg.max_forgetting}
        if t.dist.rank == 0:
            write_json_atomic(t.run_dir.hf_best / BEST_INFO, info)
        t.report.log(Event.BEST_EVAL, path=out, **info)
        t.report.say(f"best evaluation so far: step {step}, exported to {out}")


def _describe(r: EvalResult, verdict: Verdict) -> str:
    """``eval loss 1.2345 (512 tokens, 0.8 s)`` or ``retention chat: loss ... forgetting +0.0123``."""
    text = f"{r.name} loss {r.loss:.4f} ({r.loss_tokens} tokens, {r.seconds:.1f} s)"
    forgot = verdict.forgetting.get(r.name)
    if r.kind == RETENTION and forgot is not None and math.isfinite(forgot):
        text += f" forgetting {forgot:+.4f}"
    return text if r.kind == EVAL else f"retention {text}"
