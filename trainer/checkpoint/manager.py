"""The run's checkpoint manager: when a full-state checkpoint is saved, how a request is served,
the write in flight in the background, and what is said and logged about each checkpoint.

Cadence: after every ``--checkpoint-every-steps`` steps and on every request (a signal or a
``control/`` file, :mod:`.requests`); a checkpoint of the run's end is asked for by the loop
(:meth:`CheckpointManager.at_step`). A request for a step already saved (or resumed from) is served
by that checkpoint: no step is saved twice. With ``--async-checkpoint`` a periodic or plain
checkpoint request is staged and written in the background (:class:`.background.BackgroundWriter`,
at most one in flight); it is logged, and serves its requests, once complete. A stop request's
checkpoint is written before :meth:`CheckpointManager.save` returns.

What a checkpoint holds of the run beside the model and optimizer (:meth:`CheckpointManager.state`:
counters, data position, schedule, monitor state) and how it is put back
(:meth:`CheckpointManager.restore`) are the manager's too. The loop calls
:meth:`CheckpointManager.poll` at its safe points, :meth:`CheckpointManager.save_if_due`
once after every step, :meth:`CheckpointManager.check` before every step (a background write is
completed there, collectively; a failed one ends the run there) and :meth:`CheckpointManager.close`
at the end.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from .. import test_hooks
from ..config import CheckpointConfig
from ..contract import LAUNCHER_PID_ENV, Event
from ..data.sampler import GlobalBatchSampler, MixtureSampler
from ..distributed import DistEnv, barrier
from ..observe.metrics import Reporter
from ..osft.surgery import OSFTModel
from ..rundir import RunDir
from .background import BackgroundWriter
from .full_state import Checkpointer, PendingSave, SavedCheckpoint, capture_rng, restore_rng
from .requests import Request, RequestPoller, Seen
from .signals import Action, TriggerDir, install_handlers, job_start_time, restore_handlers
from .store import check_shared
from .trainer_state import ModelFacts, TrainerState


class RunPosition(Protocol):
    """What the manager needs of the run's monitor (:class:`..monitor.RunMonitor`): the data
    position of a step (skipped batches counted) and its state in ``trainer_state.json``."""

    def position(self, step: int) -> int: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, data: dict | None, keep_divergence: bool = False) -> None: ...


class CheckpointManager:
    """One rank's checkpoints and checkpoint requests (every rank holds one and calls it at the
    same points: saving, waiting and serving are collective).

    Built as early as possible (a request during start-up is kept: the trigger directory and the
    signal handlers are installed here with ``--on-demand-checkpointing``); :meth:`open` adds the
    checkpointer once the model, optimizer and schedule exist.

    Args:
        cfg: the checkpoint settings.
        settings: what every checkpoint records of the run's settings (:meth:`..config.TrainConfig.resume_settings`).
    """

    def __init__(self, cfg: CheckpointConfig, settings: dict, dist: DistEnv, job_id: str, run_dir: RunDir,
                 report: Reporter) -> None:
        self.cfg, self.settings, self.dist, self.job_id, self.report = cfg, settings, dist, job_id, report
        test_hooks.watch_collective_threads(dist.rank)  # before any thread of the checkpoints starts
        self.root = run_dir.checkpoints
        self.trigger = TriggerDir(job_id)
        self.poller: RequestPoller | None = None
        self._handlers: dict = {}
        if cfg.on_demand_checkpointing:
            self.trigger.create()
            self._handlers = install_handlers(self.trigger.record)
            self.poller = RequestPoller(self.trigger, run_dir.control, cfg.sigusr1_action, dist.rank)
        self.checkpointer: Checkpointer | None = None
        #: (step, path) of this run's newest complete checkpoint (or the one it resumed from)
        self.saved: tuple[int, str] | None = None
        #: the checkpoint being written in the background (--async-checkpoint) and the requests it serves
        self._writing: tuple[PendingSave, Seen | None] | None = None

    def remove_stale(self) -> None:
        """Remove the requests older than this job (each node's local rank 0), with a warning each."""
        if self.poller and self.dist.is_local_main:
            for stale in self.poller.remove_stale(job_start_time()):
                self.report.warn(f"stale checkpoint request removed ({stale}): it is older than this job")

    def open(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, osft: OSFTModel | None,
             device: torch.device, sampler: GlobalBatchSampler | MixtureSampler, monitor: RunPosition, counters: dict[str, int],
             total_steps: int, inputs: dict) -> None:
        """Make the checkpointer (always: a divergence or an evaluation rule that ends the run
        checkpoints it) and, with ``--checkpointing``, check the checkpoint root is shared by every
        node. ``sampler``, ``monitor``, ``counters`` (updated in place by the loop), ``total_steps``
        and ``inputs`` (the fingerprint of :func:`..data.fingerprint.run_inputs`): the run's part of
        every checkpoint."""
        cfg = self.cfg
        self.checkpointer = Checkpointer(self.root, self.dist, self.job_id, model, optimizer, scheduler, osft,
                                         keep_last=cfg.checkpoint_keep_last,
                                         writer=BackgroundWriter(device) if cfg.async_checkpoint else None)
        self._run = (model, scheduler, osft, sampler, monitor, counters, total_steps)
        self._inputs = inputs
        if cfg.checkpointing:
            check_shared(self.root, self.dist.rank, self.dist.hostname)

    def state(self, step: int) -> TrainerState:
        """The trainer state (``trainer_state.json``) after ``step`` optimizer steps."""
        model, scheduler, osft, sampler, monitor, counters, total_steps = self._run
        position = monitor.position(step + 1)  # the data position of the next step (after skipped batches)
        return TrainerState(
            step=step,
            epoch=position // sampler.steps_per_epoch,
            sampler=sampler.state(position),
            counters=dict(counters),
            scheduler=scheduler.state_dict(),
            world_size=self.dist.world_size,
            total_steps=total_steps,
            settings=self.settings,
            model=ModelFacts(vocab_size=model.get_input_embeddings().weight.shape[0],
                             model_type=model.config.model_type),
            osft_plan={name: m.plan.to_dict() for name, m in osft.modules} if osft else None,
            monitor=monitor.state_dict(),
            inputs=self._inputs,
        )

    def restore(self, path: str | Path, rollback: bool = False) -> int:
        """Load the verified full-state checkpoint at ``path`` into the run (collective): model,
        optimizer, scheduler (:meth:`.full_state.Checkpointer.load`), counters, the evaluation and
        divergence state (a ``rollback`` keeps this run's skipped batches), and last the generators.
        Returns the checkpoint's step."""
        _, _, _, sampler, monitor, counters, _ = self._run
        state, rng = self.checkpointer.load(Path(path))
        counters.clear()
        counters.update(state.counters)
        monitor.load_state_dict(state.monitor, keep_divergence=rollback)
        saved = state.sampler  # the data position it was saved at (skipped batches counted)
        sampler.restore(saved, saved["next_epoch"] * sampler.steps_per_epoch + saved["next_index"])
        restore_rng(rng)  # last: nothing after this draws random numbers before training
        return state.step

    def resume(self, path: Path, changed: dict, monitor_state: dict | None) -> int:
        """Resume from the checked checkpoint at ``path`` (:meth:`restore`, then the evaluation state
        ``monitor_state`` of the start check, with what an accepted change of inputs resets, and a
        ``resumed`` record with the ``changed`` settings); a request before the first step is served
        by it. Returns its step."""
        step = self.restore(path)
        monitor = self._run[4]
        monitor.load_state_dict(monitor_state)
        self.saved = (step, str(path))
        self.report.log(Event.RESUMED, from_step=step, path=str(path), changed={k: list(v) for k, v in changed.items()})
        self.report.say(f"resumed from {path} at step {step}")
        return step

    def stop_check(self, point: str, step: int) -> Callable[[int], None] | None:
        """The poll of a long pass after ``step`` steps (:meth:`.requests.RequestPoller.stop_check`;
        None without ``--on-demand-checkpointing``)."""
        return self.poller.stop_check(point, step) if self.poller else None

    def poll(self, point: str, step: int, micro: int = 0) -> Request | None:
        """The request agreed at safe point ``point`` (None: none, or no ``--on-demand-checkpointing``)."""
        return self.poller.poll(point, step, micro) if self.poller else None

    def save_if_due(self, step: int, request: Request | None) -> str | None:
        """After optimizer step ``step``: save when ``request`` asks or ``--checkpoint-every-steps``
        divides ``step`` (collective). Returns the checkpoint's path, or None when none was due."""
        every = self.cfg.checkpoint_every_steps
        if request or (every and step % every == 0):
            return self.save(step, request)
        return None

    def at_step(self, step: int) -> str:
        """A complete checkpoint of the state after ``step`` steps, for the run's end: the one just
        written (or resumed from) at this very state, else a new one written now."""
        self.check(wait=True)
        if self.saved and self.saved[0] == step:
            return self.saved[1]
        return self.save(step, None)

    def save(self, step: int, request: Request | None) -> str:
        """Save a full-state checkpoint of the state after ``step`` optimizer steps (collective;
        the checkpointer applies retention) and return its path, or serve ``request`` with the
        checkpoint of that step (see the module docstring)."""
        if request is not None:
            self.report.log(Event.CHECKPOINT_REQUESTED, signal=request.signal, step=step, point=request.point)
        self.check(wait=True)
        if request is not None:
            if self.saved and self.saved[0] == step and Path(self.saved[1]).is_dir():
                self.poller.served()
                self.report.say(f"{request.signal}: served by the complete checkpoint of step {step}: {self.saved[1]}")
                return self.saved[1]
            self.report.say(f"{request.signal}: saving a full-state checkpoint of step {step} "
                            f"(requested {request.point.replace('_', ' ')})")
        if self.cfg.async_checkpoint and (request is None or request.action is Action.CHECKPOINT):
            pending = self.checkpointer.save_async(step, self.state(step), capture_rng())
            self._writing = (pending, self.poller.claim() if request is not None else None)
            if request is not None:
                barrier()  # see below
            self.report.say(f"checkpoint: writing {pending.path} in the background "
                            f"(training blocked {pending.blocking_s:.2f} s)")
            return str(pending.path)
        saved = self.checkpointer.save(step, self.state(step), capture_rng())
        self._complete(saved, self.poller.served if request is not None else None)
        if request is not None:
            # Every rank has removed (or claimed) the trigger files it saw before any rank polls
            # again: a rank that read the node's trigger directory before a peer's removal would
            # otherwise agree the same request once more.
            barrier()
        return str(saved.path)

    def check(self, wait: bool = False) -> None:
        """Complete the checkpoint written in the background, if any, once every rank's part of it
        is written (with ``wait``: wait for it), on this (the training) thread: its manifest and
        rename (:meth:`.full_state.PendingSave.result`), then log it and serve the requests it was
        written for. Collective while a write is in flight: without ``wait``, one all-reduce of
        one integer over the writer's gloo group (:meth:`.full_state.PendingSave.done`), so every
        rank calls it at the same points (the loop: before every step); every rank waits before
        anything that depends on the newest checkpoint. Nothing happens without a write in flight.

        Raises:
            CheckpointWriteError: on every rank, when its write failed on some rank (it has no manifest).
        """
        if self._writing is None or not (wait or self._writing[0].done()):
            return
        pending, claimed = self._writing
        self._writing = None
        saved = pending.result()
        self._complete(saved, None if claimed is None else lambda: self.poller.served(claimed))

    def _complete(self, saved: SavedCheckpoint, serve: Callable[[], None] | None) -> None:
        """A checkpoint is complete: remember it, serve its requests (``serve``, or None), log it."""
        self.saved = (saved.step, str(saved.path))
        if serve is not None:
            serve()
        self.report.log(Event.CHECKPOINT_SAVED, step=saved.step, path=str(saved.path), bytes=saved.bytes,
                        seconds=saved.seconds, blocking_s=saved.blocking_s, frozen_bytes=saved.frozen_bytes)
        for path in saved.removed:  # rank 0's list; empty on the other ranks
            self.report.say(f"checkpoint retention: removed {path}")
        blocked = f"; training blocked {saved.blocking_s:.2f} s" if saved.blocking_s < saved.seconds else ""
        self.report.say(f"checkpoint: {saved.path} ({saved.bytes / 1e6:.1f} MB in {saved.seconds:.1f} s{blocked})")

    def answer_late(self, step: int) -> None:
        """A request agreed after the last step's safe point (at ``after_export``): the completed
        run answers it, nothing is saved (:mod:`.requests`)."""
        late = self.poll("after_export", step)
        if late:
            self.poller.served()
            self.report.log(Event.REQUEST_AFTER_COMPLETION, signal=late.signal, step=step)
            self.report.say(f"{late.signal} arrived after the last step: the run completed (exit code 0), "
                            "nothing to resume")

    def answer_start_up(self, request: Request) -> None:
        """A stop agreed during start-up before step 0 (inside the SVDs of a fresh run's OSFT
        decomposition: a resumed run has none, its stops are served at the first safe point by the
        checkpoint it resumed from): nothing was trained and there is no model to save, so nothing
        is saved. The request is served (its trigger and control files removed, so a
        ``control/checkpoint-and-exit`` does not stop the next run), logged
        (``checkpoint_requested`` at step 0 and its point) and said in one line."""
        self.poller.served()
        self.report.log(Event.CHECKPOINT_REQUESTED, signal=request.signal, step=0, point=request.point)
        self.report.say(f"{request.signal}: stopped during start-up before step 0: nothing trained; run again to start")

    def close(self) -> None:
        """Wait for the checkpoint written in the background (a stop never leaves one half-written)
        and close the checkpointer (if :meth:`open` made one)."""
        self.check(wait=True)
        if self.checkpointer is not None:
            self.checkpointer.close()

    def release(self) -> None:
        """Give the signals their handlers back and remove the trigger directory (unless the
        launcher owns it: it removes it)."""
        restore_handlers(self._handlers)
        if self.dist.is_local_main and not os.environ.get(LAUNCHER_PID_ENV):
            self.trigger.remove()
