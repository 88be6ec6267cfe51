"""The training loop of one rank: data, model, OSFT, AdamW, metrics and the final HF export.

Rank and world size come from the environment (:class:`.distributed.DistEnv`), so the same loop
runs in-process and under torchrun. Loss = sum of token losses / number of loss tokens in the global
batch (all micro-batches of all ranks), so it does not depend on how samples were packed.
"""

from __future__ import annotations

import os
import random
import time
import uuid
from dataclasses import replace

import numpy as np
import torch
from rich.console import Console

from .. import test_hooks
from ..checkpoint.full_state import (
    capture_rng,
    restore_rng,
)
from ..checkpoint.export import Exporter
from ..checkpoint.manager import CheckpointManager
from ..checkpoint.requests import Request, StopRequested
from ..checkpoint.signals import (
    Action,
)
from ..config import TrainConfig
from ..contract import EXIT_STOPPED, JOB_ID_ENV, Event, FinishReason
from ..data.micro_batches import MicroBatches, micro_batches
from .divergence import Diverged
from ..dtensor import full_tensor, local_tensor
from ..distributed import (
    DistEnv,
    gather_float,
    gather_on_device,
    init_distributed,
    shutdown_distributed,
)
from ..observe.flops import flop_model
from ..observe.metrics import MetricsLogger, console_reporter
from ..observe.step_record import StepRecorder
from .micro_batch_loss import MicroBatchLoss
from ..model.build import build_run_model
from ..model.loading import load_config
from .monitor import MonitorContext, RunMonitor
from .end import RunEnd
from .start import choose_start, prepare_inputs
from .state_hash import state_sha256
from ..osft.projection import check_after_step
from ..observe.progress import TrainProgress
from ..rundir import RunDir
from .schedule import build_scheduler
from ..launch.startup import (
    Resume,
)
from ..observe.trackers import open_trackers


class StepInterrupted(Exception):
    """A checkpoint request agreed between micro-batches: the step is abandoned and replayed."""

    def __init__(self, request: Request) -> None:
        super().__init__(request.signal)
        self.request = request


def resolve_device_dtype(cfg: TrainConfig) -> tuple[torch.device, torch.dtype]:
    """``--device auto`` = CUDA when available, else CPU; ``--dtype auto`` = bf16 on GPU, fp32 on CPU.

    Raises:
        ValueError: ``--device cuda`` without a CUDA device.
    """
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if cfg.dtype == "auto":
        dtype = torch.bfloat16 if use_cuda else torch.float32
    else:
        dtype = getattr(torch, cfg.dtype)
    return device, dtype


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's (CPU and CUDA) generators."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Trainer:
    """One rank's training run. Build with a config, then call :meth:`run`."""

    def __init__(self, cfg: TrainConfig, console: Console | None = None, job_id: str | None = None) -> None:
        self.cfg = cfg
        self.dist = DistEnv.from_env()
        self.console = console or Console(stderr=True)
        self.run_dir = RunDir(cfg.output_dir)
        self.run_dir.create()
        self.job_id = job_id or os.environ.get(JOB_ID_ENV) or uuid.uuid4().hex[:12]
        trackers = open_trackers(cfg.report_to, cfg.output_dir, cfg.to_json(), self.job_id) if self.dist.rank == 0 else []
        self.metrics = MetricsLogger(self.run_dir.metrics, self.dist, self.job_id, sinks=trackers)
        self.device, self.dtype = resolve_device_dtype(cfg)
        self.report = console_reporter(self.console, self.metrics)
        # as early as possible: a request during start-up is kept
        self.checkpoints = CheckpointManager(cfg, self.dist, self.job_id, self.run_dir, self.report)
        init_distributed(self.dist, self.device)
        self.start_step = 0
        self.counters = {"ortho_violations_total": 0, "samples_seen": 0, "tokens_seen": 0}

    def prepare(self) -> None:
        """Prepare the run with the start-up plan the launcher also checks (:mod:`osft.trainer.launch.startup`): the
        data (all validation problems raised before the model loads), the checkpoint to resume from,
        the model with its OSFT decomposition and AdamW, then the LR schedule and the restore."""
        cfg = self.cfg
        seed_everything(cfg.seed)
        self.flop_model = flop_model(load_config(cfg.model_name_or_path))
        self.metrics.log(Event.RUN_STARTED, pid=os.getpid(), config=cfg.to_json(), model_flops=self.flop_model.to_json())
        inputs = prepare_inputs(cfg, self.dist, self.run_dir, self.report)
        self.tokenizer, self.data, self.loss_tokens = inputs.tokenizer, inputs.data, inputs.loss_tokens
        self.lengths, self.sampler, self.total_steps = self.data.lengths, inputs.plan.sampler, inputs.plan.total_steps
        self.checkpoints.remove_stale()
        start = choose_start(cfg, self.dist, inputs.plan, self.report)
        self._build_model_and_optimizer(start.resume)
        self.exporter = Exporter(cfg, self.dist, self.job_id, self.run_dir, self.report, self.model, self.osft,
                                 self.tokenizer, self.device, self.loss, self._micro_batches, self.data.sizes,
                                 self.data.weights, self.checkpoints.stop_check)
        context = MonitorContext(self.report, self.dist, self.run_dir, self.model, self.checkpoints,
                                 lambda batch: self.loss(batch, float64_sum=True), self.exporter.export,
                                 lambda path: self.checkpoints.restore(path, rollback=True), self.sampler.steps_per_epoch)
        self.monitor = RunMonitor(cfg, context, inputs.sets)
        self._restore(start.resume)

    def _build_model_and_optimizer(self, resume: Resume | None) -> None:
        """Build the model (:func:`osft.trainer.model.build.build_run_model`), AdamW and the step records."""
        cfg = self.cfg
        built = build_run_model(cfg, self.dist, self.device, self.dtype, resume, self.tokenizer, self.data,
                                self.lengths, self.report)
        self.model, self.osft, self.projector = built.model, built.osft, built.projector
        self.loss = MicroBatchLoss(self.model, self.device, built.packed_attention)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(  # fused kernels on CUDA (PyTorch's fused AdamW)
            params, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay,
            fused=self.device.type == "cuda" or None,
        )
        self.steps = StepRecorder.measure(self.flop_model, self.dist, self.device, self.dtype, self.report)

    def _restore(self, resume: Resume | None) -> None:
        """Build the LR schedule and the checkpointer (checking the checkpoint root is shared), and
        load the checkpoint to resume from."""
        cfg = self.cfg
        self.scheduler = build_scheduler(cfg.lr_scheduler, self.optimizer, cfg.warmup_steps, self.total_steps)
        self.checkpoints.open(self.model, self.optimizer, self.scheduler, self.osft, self.device, self.sampler,
                              self.monitor, self.counters, self.total_steps, self.data.inputs)
        if resume is not None:
            self.start_step = self.checkpoints.resume(resume.path, resume.state.changed_settings(cfg),
                                                      resume.state.monitor)

    def _micro_batches(self, idx: np.ndarray) -> MicroBatches:
        """The training samples at positions ``idx`` packed into this rank's micro-batches."""
        return micro_batches(lambda i: self.data[int(idx[i])], self.lengths[idx], self.cfg.max_tokens_per_gpu,
                             self.dist.world_size, self.dist.rank)

    def _forward_backward(self, step: int, batches: MicroBatches, scale: float) -> tuple[torch.Tensor, list[int]]:
        """Forward and backward of this rank's micro-batches (loss scaled by ``scale``), polling for a
        request before the forward and before and after the backward of each. Returns every rank's
        summed token loss (float64 on the device, by rank; with a router auxiliary loss
        (:mod:`osft.trainer.run.router_loss`) each rank's cross-entropy sum and auxiliary term in turn) and tokens
        (collective).

        Raises:
            StepInterrupted: a checkpoint request was agreed.
        """
        def poll(point: str, m: int) -> None:
            if request := self.checkpoints.poll(point, step, m):
                raise StepInterrupted(request)

        loss_sum = torch.zeros(2, dtype=torch.float64, device=self.device)  # (CE, router term); no sync per micro-batch
        num_tokens, inject = 0, self.monitor.injected(step)
        for m, batch in enumerate(batches):
            poll("before_forward", m)
            mb_loss = self.loss(batch)
            if m == 0 and inject in ("loss", "spike"):  # test hook (.test_hooks.DIVERGE_AT_ENV)
                mb_loss = mb_loss * (float("nan") if inject == "loss" else 1000.0)
            aux = self.loss.router_term(batch)
            poll("before_backward", m)
            ((mb_loss if aux is None else mb_loss + aux) * scale).backward()
            poll("after_backward", m)
            loss_sum[0] += mb_loss.detach().double()
            if aux is not None:
                loss_sum[1] += aux.detach().double()
            if batch is not None:
                num_tokens += int(batch["num_tokens"])  # collate_packed's host tensor
        gathered = (gather_on_device(loss_sum if self.loss.router_coef else loss_sum[0]).reshape(-1),
                    [int(t) for t in gather_float(num_tokens)])
        if inject == "grad":
            local_tensor(next(p.grad for p in self.model.parameters() if p.grad is not None)).view(-1)[0] = float("nan")
        return gathered

    def train_step(self, step: int, indices: list[int]) -> dict:
        """Forward/backward every micro-batch of this rank (:meth:`_forward_backward`), project, clip,
        step, re-project, check orthogonality. Returns the numbers of the ``step`` metrics record.

        Raises:
            RuntimeError: the batch has no loss token.
            Diverged: a non-finite loss or gradient norm, or a loss spike (nothing was applied).
            StepInterrupted: a checkpoint request was agreed before the optimizer step.
        """
        cfg = self.cfg
        start, waited = time.perf_counter(), self.checkpoints.waited_s  # a wait for a background write is a save's
        idx = np.asarray(indices, dtype=np.int64)
        total_loss_tokens = int(self.loss_tokens[idx].sum())
        if total_loss_tokens == 0:
            raise RuntimeError(f"step {step}: the global batch has zero trainable tokens (lines {self._lines(idx)})")
        batches = self._micro_batches(idx)
        # FSDP2 averages gradients over ranks; scaling by world size turns that into the sum, so the
        # gradient is that of (sum of token losses of all ranks) / (loss tokens of the global batch).
        loss_by_rank, tokens_by_rank = self._forward_backward(step, batches, self.dist.world_size / total_loss_tokens)
        if self.projector:
            self.projector.project_gradients()
        grads = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = full_tensor(torch.nn.utils.clip_grad_norm_(grads, cfg.max_grad_norm))
        # The step's one host sync before the update: the divergence check needs the loss and the grad norm
        # (after it, a step between full orthogonality checks reads the bound: check_after_step).
        *losses, grad_norm = torch.cat([loss_by_rank, grad_norm.detach().double().reshape(1)]).tolist()
        router = self.loss.router_fields(losses, total_loss_tokens)
        loss = sum(losses) / total_loss_tokens  # the ranks' sums added in rank order, as global_sums does
        self.monitor.check_step(step, loss, grad_norm, lambda: self._lines(idx))
        lr = self.optimizer.param_groups[0]["lr"]  # what this update uses (also after a resume that changed it)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.projector:
            self.projector.project_parameters()
        # The check gathers whole factors (DTensor.full_tensor, functional collectives); one ran beside a
        # background checkpoint's collectives and crashed rank 0 (SIGSEGV): the write in flight finishes first.
        report, forgetting = check_after_step(self.projector, step, cfg.ortho_check_every, cfg.ortho_margin_deg,
                                              lambda: self.checkpoints.check(wait=True))
        if report and report.violating:
            self.report.warn(f"step {step}: orthogonality violations in {report.violating}")
        elapsed = time.perf_counter() - start - (self.checkpoints.waited_s - waited)
        return self.steps.fields(step, elapsed, loss=loss, grad_norm=grad_norm, lr=lr,
                                 tokens_by_rank=tokens_by_rank, loss_tokens=total_loss_tokens, samples=len(indices),
                                 lengths_by_rank=batches.lengths_by_rank(), violations=report.violations if report else 0,
                                 max_dev=report.max_dev_deg if report else None, forgetting=forgetting) | router

    def _lines(self, idx: np.ndarray) -> list[int]:
        return [int(self.data[int(i)]["line"]) for i in idx[:20]]

    def run(self) -> RunEnd:
        """Train to ``total_steps`` optimizer steps (from the resumed step), log every step, serve
        checkpoint requests and periodic checkpoints (:class:`.checkpoint.manager.CheckpointManager`),
        export at the end.

        A request agreed in the middle of a step saves the state at the start of that step
        (partial gradients dropped, generators rewound), so a resume replays the step exactly.
        Evaluations, the rules that may end the run and divergences: :class:`osft.trainer.run.monitor.RunMonitor`.
        """
        cfg = self.cfg
        step, self.last_loss, self.last_checkpoint = self.start_step, float("nan"), None
        try:
            self.monitor.start(step)
            with TrainProgress(self.total_steps, self.console, enabled=self.dist.is_local_main) as progress:
                while step < self.total_steps:
                    self.checkpoints.check()  # a failed background write ends the run here
                    position = self.monitor.position(step + 1)
                    rng_at_start, indices = capture_rng(), self.sampler.indices(position)
                    try:
                        record = self.train_step(step + 1, indices)
                    except (StepInterrupted, Diverged) as cut:
                        outcome = self._cut(cut, step, rng_at_start)
                        if isinstance(outcome, RunEnd):
                            return outcome
                        step = outcome  # the step is replayed, or the run rolled back to a checkpoint
                        continue
                    step += 1
                    self._record(step, position // self.sampler.steps_per_epoch, indices, record, progress)
                    end = self.monitor.after_step(step, final=step == self.total_steps)
                    request = self.checkpoints.poll("after_step", step)
                    self.last_checkpoint = self.checkpoints.save_if_due(step, request) or self.last_checkpoint
                    if request and request.action is Action.CHECKPOINT_AND_EXIT:
                        return self._stopped(step, request)
                    if end is not None:
                        return self._end_early(step, end)
                    if cfg.hf_export_every_steps and step % cfg.hf_export_every_steps == 0 and step != self.total_steps:
                        progress.print(f"exported {self.exporter.export(step)}")
            export_dir = self.exporter.export(step)
        except StopRequested as stop:  # agreed inside an evaluation or an export: that pass abandoned, not recorded
            self.last_checkpoint = self.checkpoints.save(step, stop.request)
            return self._stopped(step, stop.request)
        self.report.say(f"export: {export_dir}")
        self.checkpoints.answer_late(step)
        return self._finish(RunEnd(), step, export_dir=export_dir)

    def _cut(self, cut: StepInterrupted | Diverged, step: int, rng_at_start: dict) -> RunEnd | int:
        """A step cut before its update (``step`` is the last one applied): drop its gradients,
        rewind the generators, then checkpoint for its request (a stop ends the run) or act on its
        divergence (:meth:`osft.trainer.run.monitor.RunMonitor.on_divergence`). Returns how the run ends, or the step
        to go on after."""
        self.optimizer.zero_grad(set_to_none=True)
        restore_rng(rng_at_start)
        if isinstance(cut, Diverged):
            self.checkpoints.check(wait=True)  # a rollback picks the newest complete checkpoint
            outcome = self.monitor.on_divergence(cut, step)
            return self._end_early(step, outcome) if isinstance(outcome, RunEnd) else outcome
        self.last_checkpoint = self.checkpoints.save(step, cut.request)
        if cut.request.action is Action.CHECKPOINT_AND_EXIT:
            return self._stopped(step, cut.request)
        return step

    def _record(self, step: int, epoch: int, indices: list[int], record: dict, progress: TrainProgress) -> None:
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
            record["state_sha256"] = state_sha256(self.model, self.optimizer, self.dist.world_size)
        self.steps.log(step, epoch, self.counters["ortho_violations_total"], record)
        if step % self.cfg.logging_steps == 0 or step == self.total_steps:
            progress.update(step, record["loss"], record["lr"], record["tokens_per_s"],
                            self.counters["ortho_violations_total"], record["mfu"], self.monitor.console_stats())

    def release(self) -> None:
        """After a failure in process: free the background writer, give back the signal handlers and
        the trigger directory, leave the process group (what :meth:`_finish` does at a normal end)."""
        if self.checkpoints.checkpointer is not None:
            self.checkpoints.checkpointer.close()
        self.checkpoints.release()
        shutdown_distributed()

    def _end_early(self, step: int, end: RunEnd) -> RunEnd:
        """End the run after ``step`` steps by an evaluation rule or a divergence: a full-state
        checkpoint of that step (unless one was just written), the final export when ``end`` asks
        for it, its message and ``run_finished`` with its reason and exit code."""
        checkpoint = self.checkpoints.at_step(step)
        export_dir = self.exporter.export(step) if end.export_final else end.export_dir
        self.report.say(end.message)
        return self._finish(end, step, checkpoint=checkpoint, export_dir=export_dir, **end.fields)

    def _stopped(self, step: int, request: Request) -> RunEnd:
        checkpoint = self.last_checkpoint
        self.report.say(f"stopped after step {step} on {request.signal}; resume with --resume or "
                  f"--resume-from-full-state-checkpoint {checkpoint}")
        return self._finish(RunEnd(FinishReason.STOPPED, EXIT_STOPPED), step, signal=request.signal, checkpoint=checkpoint)

    def _finish(self, end: RunEnd, step: int, **fields) -> RunEnd:
        """End the run: wait for the checkpoint written in the background (a stop never leaves one
        half-written), log ``run_finished`` with ``fields``, close the metrics and leave the process
        group. Returns ``end`` with the run's numbers."""
        self.checkpoints.close()
        self.metrics.log(Event.RUN_FINISHED, reason=end.reason, exit_code=end.exit_code, step=step, **fields)
        self.metrics.close()
        self.checkpoints.release()
        shutdown_distributed()
        return replace(end, steps=step, steps_run=step - self.start_step, last_loss=self.last_loss,
                       violations_total=self.counters["ortho_violations_total"], export_dir=fields.get("export_dir"),
                       checkpoint=fields.get("checkpoint", self.last_checkpoint))
