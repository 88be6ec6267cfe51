"""The training run of one rank, as a table of contents: the parts are built
(:mod:`.components`), then each step is trained (:mod:`.step`), watched (:mod:`.monitor`) and
checkpointed (:class:`.checkpoint.manager.CheckpointManager`), and the run ends with the HF export
(:class:`.checkpoint.export.Exporter`) or one of the ways of :mod:`.end`.

Rank and world size come from the environment (:class:`.distributed.DistEnv`), so the same loop
runs in-process and under torchrun.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import replace
from functools import partial

from rich.console import Console

from ..checkpoint.export import Exporter
from ..checkpoint.manager import CheckpointManager
from ..checkpoint.requests import Request, StopRequested
from ..config import TrainConfig
from ..contract import EXIT_STOPPED, JOB_ID_ENV, Event, FinishReason
from ..distributed import DistEnv, init_distributed, shutdown_distributed
from ..model.build import build_run_model
from ..observe.progress import TrainProgress
from ..rundir import RunDir
from .components import build_run_parts, model_flops, open_metrics, resolve_device_dtype, seed_everything
from .divergence import Diverged
from .end import RunEnd
from .monitor import MonitorContext, RunMonitor
from .start import choose_start, prepare_inputs
from .step import StepInterrupted, TrainStep, rank_micro_batches


class Trainer:
    """One rank's training run. Build with a config, then call :meth:`run`."""

    def __init__(self, cfg: TrainConfig, console: Console | None = None, job_id: str | None = None) -> None:
        self.cfg = cfg
        self.dist = DistEnv.from_env()
        self.console = console or Console(stderr=True)
        self.run_dir = RunDir(cfg.output_dir)
        self.run_dir.create()
        self.job_id = job_id or os.environ.get(JOB_ID_ENV) or uuid.uuid4().hex[:12]
        self.metrics, self.report = open_metrics(cfg, self.dist, self.run_dir, self.job_id, self.console)
        self.device, self.dtype = resolve_device_dtype(cfg)
        # as early as possible: a request during start-up is kept
        self.checkpoints = CheckpointManager(cfg, cfg.resume_settings(), self.dist, self.job_id, self.run_dir, self.report)
        init_distributed(self.dist, self.device)
        self.start_step = 0
        self.train_step: TrainStep | None = None
        #: A stop agreed during start-up (inside the start-up SVDs): :meth:`run` ends the run with it.
        self.start_up_stop: Request | None = None

    def prepare(self) -> bool:
        """Prepare the run with the start-up plan the launcher also checks (:mod:`osft.trainer.launch.startup`): the
        data (all validation problems raised before the model loads), the checkpoint to resume from,
        the model with its OSFT decomposition, AdamW and the LR schedule, then the restore. Returns
        False when a stop was agreed during the start-up SVDs (nothing trained; :meth:`run` ends
        the run stopped, with no checkpoint)."""
        cfg, dist = self.cfg, self.dist
        seed_everything(cfg.seed)
        flops = model_flops(cfg)
        self.metrics.log(Event.RUN_STARTED, pid=os.getpid(), config=cfg.to_json(), model_flops=flops.to_json())
        inputs = prepare_inputs(cfg, dist, self.run_dir, self.report)
        self.tokenizer, self.data, self.loss_tokens = inputs.tokenizer, inputs.data, inputs.loss_tokens
        self.lengths, self.sampler, self.total_steps = self.data.lengths, inputs.plan.sampler, inputs.plan.total_steps
        self.checkpoints.remove_stale()
        start = choose_start(cfg, dist, inputs.plan, self.report)
        try:
            built = build_run_model(cfg, dist, self.device, self.dtype, start.resume, self.tokenizer, self.data,
                                    self.lengths, self.report, self.checkpoints.stop_check("start_up", 0))
        except StopRequested as stop:
            self.start_up_stop = stop.request
            return False
        parts = build_run_parts(cfg, built, self.device, self.dtype, dist, self.total_steps, flops, self.report)
        self.model, self.osft, self.optimizer, self.steps = parts.model, parts.osft, parts.optimizer, parts.recorder
        batches = partial(rank_micro_batches, self.data, max_tokens=cfg.max_tokens_per_gpu, dist=dist)
        self.exporter = Exporter(cfg, cfg, cfg, cfg.seed, dist, self.job_id, self.run_dir, self.report, self.model,
                                 self.osft, self.tokenizer, self.device, parts.loss, batches, self.data.sizes,
                                 self.data.weights, self.checkpoints.stop_check)
        context = MonitorContext(self.report, dist, self.run_dir, self.model, self.checkpoints,
                                 lambda batch: parts.loss(batch, float64_sum=True), self.exporter.export,
                                 lambda path: self.checkpoints.restore(path, rollback=True), self.sampler.steps_per_epoch,
                                 cfg.max_tokens_per_gpu)
        self.monitor = RunMonitor(cfg, context, inputs.sets)
        self.train_step = TrainStep(cfg, cfg, cfg, dist, self.data, self.loss_tokens, parts, batches, self.checkpoints,
                                    self.monitor, self.report, self.total_steps)
        self.checkpoints.open(self.model, self.optimizer, parts.scheduler, self.osft, self.device, self.sampler,
                              self.monitor, self.train_step.counters, self.total_steps, self.data.inputs)
        if start.resume is not None:
            self.start_step = self.checkpoints.resume(start.resume.path, start.resume.state.changed_settings(cfg),
                                                      start.resume.state.monitor)
        return True

    def run(self) -> RunEnd:
        """Train to ``total_steps`` optimizer steps (from the resumed step), log every step, serve
        checkpoint requests and periodic checkpoints (:class:`.checkpoint.manager.CheckpointManager`),
        export at the end.

        A request agreed in the middle of a step saves the state at the start of that step
        (partial gradients dropped, generators rewound), so a resume replays the step exactly.
        Evaluations, the rules that may end the run and divergences: :class:`osft.trainer.run.monitor.RunMonitor`.
        """
        cfg = self.cfg
        step, self.last_checkpoint = self.start_step, None
        if self.start_up_stop is not None:
            self.checkpoints.answer_start_up(self.start_up_stop)
            return self._finish(RunEnd(FinishReason.STOPPED, EXIT_STOPPED), step, signal=self.start_up_stop.signal,
                                checkpoint=None)
        try:
            self.monitor.start(step)
            with TrainProgress(self.total_steps, self.console, enabled=self.dist.is_local_main) as progress:
                while step < self.total_steps:
                    self.checkpoints.check()  # completes a background write (collective); a failed one ends the run
                    position = self.monitor.position(step + 1)
                    indices = self.sampler.indices(position)
                    try:
                        record = self.train_step(step + 1, indices)
                    except (StepInterrupted, Diverged) as cut:
                        outcome = self._cut(cut, step)
                        if isinstance(outcome, RunEnd):
                            return outcome
                        step = outcome  # the step is replayed, or the run rolled back to a checkpoint
                        continue
                    step += 1
                    self.train_step.log(step, position // self.sampler.steps_per_epoch, indices, record, progress)
                    end = self.monitor.after_step(step, final=step == self.total_steps)
                    request = self.checkpoints.poll("after_step", step)
                    self.last_checkpoint = self.checkpoints.save_if_due(step, request) or self.last_checkpoint
                    if request and request.stops:
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

    def _cut(self, cut: StepInterrupted | Diverged, step: int) -> RunEnd | int:
        """A step cut before its update (``step`` is the last one applied; :class:`.step.TrainStep`
        undid it): checkpoint for its request (a stop ends the run) or act on its divergence
        (:meth:`osft.trainer.run.monitor.RunMonitor.on_divergence`). Returns how the run ends, or the
        step to go on after."""
        if isinstance(cut, Diverged):
            self.checkpoints.check(wait=True)  # a rollback picks the newest complete checkpoint
            outcome = self.monitor.on_divergence(cut, step)
            return self._end_early(step, outcome) if isinstance(outcome, RunEnd) else outcome
        self.last_checkpoint = self.checkpoints.save(step, cut.request)
        if cut.request.stops:
            return self._stopped(step, cut.request)
        return step

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
        trained = {} if self.train_step is None else {"last_loss": self.train_step.last_loss,
                                                       "violations_total": self.train_step.counters["ortho_violations_total"]}
        return replace(end, steps=step, steps_run=step - self.start_step, export_dir=fields.get("export_dir"),
                       checkpoint=fields.get("checkpoint", self.last_checkpoint), **trained)
