"""One optimizer step of one rank, and its record: forward and backward of this rank's micro-batches,
OSFT's projections, clipping, AdamW, the orthogonality check, then the run's counters and the
``step`` metrics record.

Loss = sum of token losses / number of loss tokens in the global batch (all micro-batches of all
ranks), so it does not depend on how samples were packed. A step cut before its update (a request
agreed between micro-batches, a divergence) leaves no trace: its gradients are dropped and every
generator is rewound to the step's start, so the step replays exactly.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from .. import test_hooks
from ..checkpoint.full_state import capture_rng, restore_rng
from ..checkpoint.manager import CheckpointManager
from ..checkpoint.requests import Request
from ..config import OptimizerConfig, OSFTConfig, PrecisionConfig
from ..data.micro_batches import MicroBatches, micro_batches
from ..data.mixture import TrainingData
from ..distributed import DistEnv, gather_float, gather_on_device
from ..dtensor import full_tensor, local_tensor
from ..observe.metrics import Reporter
from ..observe.progress import TrainProgress
from ..osft.projection import check_after_step
from .components import RunParts
from .divergence import Diverged
from .monitor import RunMonitor
from .state_hash import state_sha256


class StepInterrupted(Exception):
    """A checkpoint request agreed between micro-batches: the step is abandoned and replayed."""

    def __init__(self, request: Request) -> None:
        super().__init__(request.signal)
        self.request = request


def rank_micro_batches(data: TrainingData, idx: np.ndarray, max_tokens: int, dist: DistEnv) -> MicroBatches:
    """The training samples at positions ``idx`` packed into this rank's micro-batches of at most
    ``max_tokens`` tokens (``--max-tokens-per-gpu``; :func:`.data.micro_batches.micro_batches`)."""
    return micro_batches(lambda i: data[int(idx[i])], data.lengths[idx], max_tokens, dist.world_size, dist.rank)


class TrainStep:
    """The optimizer steps of one rank: call it with a step number (1-based) and the global batch's
    sample indices; :meth:`log` then counts and logs the record it returned.

    Attributes:
        counters: the run's totals (``ortho_violations_total``, ``samples_seen``, ``tokens_seen``),
            saved in the full-state checkpoint.
        last_loss: the loss of the last step logged (NaN before the first).

    Args:
        optimizer: ``--max-grad-norm``; ``osft``: the orthogonality check's cadence and margin;
            ``outputs``: the console's ``--logging-steps``.
        batches: ``batches(idx)``, the training samples at positions ``idx`` packed into this
            rank's micro-batches (:func:`rank_micro_batches`).
    """

    def __init__(self, optimizer: OptimizerConfig, osft: OSFTConfig, outputs: PrecisionConfig, dist: DistEnv,
                 data: TrainingData, loss_tokens: np.ndarray, parts: RunParts,
                 batches: Callable[[np.ndarray], MicroBatches], checkpoints: CheckpointManager, monitor: RunMonitor,
                 report: Reporter, total_steps: int) -> None:
        self.max_grad_norm, self.logging_steps = optimizer.max_grad_norm, outputs.logging_steps
        self.ortho_check_every, self.ortho_margin_deg = osft.ortho_check_every, osft.ortho_margin_deg
        self.dist, self.data, self.loss_tokens, self.parts, self.batches = dist, data, loss_tokens, parts, batches
        self.checkpoints, self.monitor, self.report, self.total_steps = checkpoints, monitor, report, total_steps
        self.counters = {"ortho_violations_total": 0, "samples_seen": 0, "tokens_seen": 0}
        self.last_loss = float("nan")

    def __call__(self, step: int, indices: list[int]) -> dict:
        """Train step ``step`` on the samples ``indices`` (collective). Returns the numbers of the
        ``step`` metrics record; a cut step is undone first (gradients dropped, generators rewound).

        Raises:
            RuntimeError: the batch has no loss token.
            Diverged: a non-finite loss or gradient norm, or a loss spike (nothing was applied).
            StepInterrupted: a checkpoint request was agreed before the optimizer step.
        """
        rng_at_start = capture_rng()
        try:
            return self._train(step, np.asarray(indices, dtype=np.int64))
        except (StepInterrupted, Diverged):
            self.parts.optimizer.zero_grad(set_to_none=True)
            restore_rng(rng_at_start)
            raise

    def _train(self, step: int, idx: np.ndarray) -> dict:
        """Forward/backward every micro-batch of this rank (:meth:`_forward_backward`), project,
        clip, check for divergence, step, re-project, check orthogonality."""
        parts = self.parts
        start = time.perf_counter()
        total_loss_tokens = int(self.loss_tokens[idx].sum())
        if total_loss_tokens == 0:
            raise RuntimeError(f"step {step}: the global batch has zero trainable tokens (lines {self.lines(idx)})")
        batches = self.batches(idx)
        # FSDP2 averages gradients over ranks; scaling by world size turns that into the sum, so the
        # gradient is that of (sum of token losses of all ranks) / (loss tokens of the global batch).
        loss_by_rank, tokens_by_rank = self._forward_backward(step, batches, self.dist.world_size / total_loss_tokens)
        if parts.projector:
            parts.projector.project_gradients()
        grads = [p for p in parts.model.parameters() if p.grad is not None]
        grad_norm = full_tensor(torch.nn.utils.clip_grad_norm_(grads, self.max_grad_norm))
        # The step's one host sync before the update: the divergence check needs the loss and the grad norm
        # (after it, a step between full orthogonality checks reads the bound: check_after_step).
        *losses, grad_norm = torch.cat([loss_by_rank, grad_norm.detach().double().reshape(1)]).tolist()
        router = parts.loss.router_fields(losses, total_loss_tokens)
        loss = sum(losses) / total_loss_tokens  # the ranks' sums added in rank order, as global_sums does
        self.monitor.check_step(step, loss, grad_norm, lambda: self.lines(idx))
        lr = parts.optimizer.param_groups[0]["lr"]  # what this update uses (also after a resume that changed it)
        parts.optimizer.step()
        parts.scheduler.step()
        parts.optimizer.zero_grad(set_to_none=True)
        if parts.projector:
            parts.projector.project_parameters()
        report, forgetting = check_after_step(parts.projector, step, self.ortho_check_every, self.ortho_margin_deg)
        if report and report.violating:
            self.report.warn(f"step {step}: orthogonality violations in {report.violating}")
        elapsed = time.perf_counter() - start
        return parts.recorder.fields(step, elapsed, loss=loss, grad_norm=grad_norm, lr=lr,
                                     tokens_by_rank=tokens_by_rank, loss_tokens=total_loss_tokens, samples=len(idx),
                                     lengths_by_rank=batches.lengths_by_rank(),
                                     violations=report.violations if report else 0,
                                     max_dev=report.max_dev_deg if report else None, forgetting=forgetting) | router

    def _forward_backward(self, step: int, batches: MicroBatches, scale: float) -> tuple[torch.Tensor, list[int]]:
        """Forward and backward of this rank's micro-batches (loss scaled by ``scale``), polling for a
        request before the forward and before and after the backward of each. Returns every rank's
        summed token loss (float64 on the device, by rank; with a router auxiliary loss
        (:mod:`.router_loss`) each rank's cross-entropy sum and auxiliary term in turn) and tokens
        (collective).

        Raises:
            StepInterrupted: a checkpoint request was agreed.
        """
        def poll(point: str, m: int) -> None:
            if request := self.checkpoints.poll(point, step, m):
                raise StepInterrupted(request)

        loss_fn, device = self.parts.loss, self.parts.loss.device
        loss_sum = torch.zeros(2, dtype=torch.float64, device=device)  # (CE, router term); no sync per micro-batch
        num_tokens, inject = 0, self.monitor.injected(step)
        for m, batch in enumerate(batches):
            poll("before_forward", m)
            mb_loss = loss_fn(batch)
            if m == 0 and inject in ("loss", "spike"):  # test hook (.test_hooks.DIVERGE_AT_ENV)
                mb_loss = mb_loss * (float("nan") if inject == "loss" else 1000.0)
            aux = loss_fn.router_term(batch)
            poll("before_backward", m)
            ((mb_loss if aux is None else mb_loss + aux) * scale).backward()
            poll("after_backward", m)
            loss_sum[0] += mb_loss.detach().double()
            if aux is not None:
                loss_sum[1] += aux.detach().double()
            if batch is not None:
                num_tokens += int(batch["num_tokens"])  # collate_packed's host tensor
        gathered = (gather_on_device(loss_sum if loss_fn.router_coef else loss_sum[0]).reshape(-1),
                    [int(t) for t in gather_float(num_tokens)])
        if inject == "grad":
            params = self.parts.model.parameters()
            local_tensor(next(p.grad for p in params if p.grad is not None)).view(-1)[0] = float("nan")
        return gathered

    def lines(self, idx: np.ndarray) -> list[int]:
        """The data-file lines of the first 20 samples at positions ``idx`` (for error messages)."""
        return [int(self.data[int(i)]["line"]) for i in idx[:20]]

    def log(self, step: int, epoch: int, indices: list[int], record: dict, progress: TrainProgress) -> None:
        """Count step ``step`` in the run's counters, log its ``step`` record and update the progress line."""
        if len(self.data.parts) > 1:
            record["dataset_samples"] = self.data.counts(indices)
        self.counters["ortho_violations_total"] += record["ortho_violations"]
        self.counters["samples_seen"] += record["num_samples"]
        self.counters["tokens_seen"] += record["num_tokens"]
        if test_hooks.warns_at(step, self.dist.local_rank):
            self.report.warn(f"test warning from local rank {self.dist.local_rank} at step {step}")
        self.last_loss = record["loss"]
        if test_hooks.hashes_state():
            record["state_sha256"] = state_sha256(self.parts.model, self.parts.optimizer, self.dist.world_size)
        self.parts.recorder.log(step, epoch, self.counters["ortho_violations_total"], record)
        if step % self.logging_steps == 0 or step == self.total_steps:
            progress.update(step, record["loss"], record["lr"], record["tokens_per_s"],
                            self.counters["ortho_violations_total"], record["mfu"], self.monitor.console_stats())
