"""Checkpoint requests, and the one rule for how every request is served and how the run ends.

docs/architecture.md section 6. Requests come from the job's trigger directory (signals to any rank or to the
launcher, see :mod:`.signals`) and, on rank 0, from ``<output_dir>/control/`` (a watcher on another
host creates ``control/checkpoint`` or ``control/checkpoint-and-exit``). Safe points: before the
forward and before and after the backward of each micro-batch, and after the optimizer step. Every
rank polls at each of them and all agree on the strongest request with one ``all_reduce(MAX)``.

The rule (docs/checkpoints.md, "The rule for every request"):

- **Pending**: a request is pending from the moment it is recorded until a checkpoint serves it.
  Signals are recorded by whichever process of the job receives them (launcher or rank, at any
  moment: each entry point holds the signals from its first line, :func:`.signals.hold_signals`,
  and hands what arrived during start-up to the trigger directory); control files are pending
  while they exist. Nothing else removes a request, except a trigger or control file older than
  the job (left by a killed run): it is removed at start-up with a warning.
- **Served**: by the first complete checkpoint of the training state *after* the request was
  agreed at a safe point. A request agreed inside a step saves the state at the start of that
  step (the step is replayed after a resume). A request that arrives while a checkpoint is being
  written (on request or periodic) stays pending and is served at the next safe point by that
  same checkpoint, since the state has not changed: the same step is never saved twice. Only the
  files a rank saw when the request was agreed are removed (:meth:`RequestPoller.served`), so a
  request recorded meanwhile is never lost. With ``--async-checkpoint`` training goes on while a
  checkpoint is written: the requests it serves are set aside (:meth:`RequestPoller.claim`) and
  removed once it is complete; a request agreed meanwhile first waits for that write, and is served
  by it when the step has not changed since, else by a new checkpoint. A stop request's checkpoint
  is written before the run exits (after the write in flight).
- **Exit code**: a served checkpoint-and-exit request (every stop signal; SIGUSR1 only with
  ``--sigusr1-action checkpoint-and-exit``; ``control/checkpoint-and-exit``) ends the run right
  after that checkpoint with exit code 75; a plain checkpoint request (SIGUSR1,
  ``control/checkpoint``) lets training go on. A request during start-up is served at the first
  safe point (before the forward of the first step): a stop writes a complete checkpoint of the
  start step (0 for a fresh run) and exits 75, except a stop agreed during the SVDs of a fresh
  OSFT run (polled between their rounds, point ``start_up``): there is no model state to save yet,
  so it ends the run at once with exit 75, nothing trained and no checkpoint (run again to start;
  :meth:`.manager.CheckpointManager.answer_start_up`). A resumed run has no SVDs. A stop agreed inside a
  long pass (an evaluation or
  retention pass, an export's input-Gram calibration or its fold of the protected subspaces:
  :meth:`RequestPoller.stop_check`) abandons the pass and is served by a checkpoint of the last
  complete step. Any other request that arrives
  after the last step's safe point (during the final export, or when a resumed run has no step
  left) is answered by the run completing: exit code 0 and the final export, nothing left to
  resume; the run says so.
  Every exit code: :mod:`..exit_codes`.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from .. import test_hooks
from ..contract import LAUNCHER_PID_ENV
from ..distributed import control_group, is_distributed
from .signals import CONTROL_ACTIONS, Action, TriggerDir, action_for_signal, request_files, signal_name

SAFE_POINTS = ("before_forward", "before_backward", "after_backward", "after_step")

#: The requests a rank saw at an agreed poll: trigger files, and (control file, mtime) pairs.
Seen = tuple[list[Path], list[tuple[Path, float]]]

@dataclass(frozen=True)
class Request:
    """An agreed request: the action, the signal number (0: control file) and where it was served."""

    action: Action
    signum: int
    point: str

    @property
    def signal(self) -> str:
        return signal_name(self.signum)

    @property
    def stops(self) -> bool:
        """Whether it asks the run to stop after its checkpoint (checkpoint-and-exit)."""
        return self.action is Action.CHECKPOINT_AND_EXIT


class StopRequested(Exception):
    """A checkpoint-and-exit request agreed inside a long pass (:meth:`RequestPoller.stop_check`):
    the pass is abandoned (an evaluation is not recorded, an export not written) and the caller
    serves ``request`` with a checkpoint of the last complete step."""

    def __init__(self, request: Request) -> None:
        super().__init__(request.signal)
        self.request = request


class RequestPoller:
    """Polls for checkpoint requests at safe points.

    Args:
        trigger: the job's trigger directory (every rank reads it).
        control_dir: ``<output_dir>/control`` (read by rank 0 only), or None.
        sigusr1_action: ``--sigusr1-action``.
        rank: global rank.
    """

    def __init__(self, trigger: TriggerDir, control_dir: Path | None, sigusr1_action: str, rank: int) -> None:
        self.trigger = trigger
        self.control_dir = control_dir if rank == 0 else None
        self.sigusr1_action = sigusr1_action
        self._seen: Seen = ([], [])
        #: (control file, mtime) pairs handed to a checkpoint written in the background (:meth:`claim`)
        self._claimed: set[tuple[Path, float]] = set()
        self._test_hooks = test_hooks.signals_at() if rank == 0 else []  # .test_hooks.SIGNAL_AT_ENV

    def _control_files(self) -> list[tuple[Path, Action, float]]:
        return [(path, CONTROL_ACTIONS[name], mtime) for name, path, mtime in request_files(self.control_dir)
                if name in CONTROL_ACTIONS]

    def poll(self, point: str, step: int, micro: int = 0) -> Request | None:
        """Collective: every rank must call it at the same safe point. Returns the agreed request
        (the strongest any rank saw), or None. The files this rank saw are remembered for
        :meth:`served`.

        Args:
            point: one of :data:`SAFE_POINTS`. step: the step being trained (1-based) or just
                finished (``after_step``). micro: micro-batch index within the step (0-based).
        """
        self._maybe_test_signal(point, step, micro)
        triggers = self.trigger.files()
        controls = [c for c in self._control_files() if (c[0], c[2]) not in self._claimed]
        code = max([int(action_for_signal(t.signum, self.sigusr1_action)) * 256 + t.signum for t in triggers]
                   + [int(action) * 256 for _path, action, _mtime in controls], default=0)
        if is_distributed():
            t = torch.tensor([code], dtype=torch.int64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=control_group())
            code = int(t.item())
        if code == 0:
            return None
        self._seen = ([t.path for t in triggers], [(path, mtime) for path, _action, mtime in controls])
        return Request(Action(code // 256), code % 256, point)

    def stop_check(self, point: str, step: int) -> Callable[[int], None]:
        """The poll of a long pass (an evaluation or retention pass, the input-Gram calibration or the
        fold of an export; docs/architecture.md, "Long passes"): ``check(micro)`` polls at ``point``
        (every rank at the same micro-batch, or round of the fold, ``micro`` of the pass after
        ``step`` steps: collective) and raises
        :class:`StopRequested` when a checkpoint-and-exit request is agreed, so the pass is
        abandoned and the stop served by a checkpoint of ``step`` within one micro-batch. A plain
        checkpoint request stays pending (its files are kept) until the next safe point of training."""

        def check(micro: int) -> None:
            request = self.poll(point, step, micro)
            if request is not None and request.stops:
                raise StopRequested(request)

        return check

    def claim(self) -> Seen:
        """Hand the requests this rank saw when the last request was agreed to a checkpoint written
        in the background (``--async-checkpoint``): later polls of every rank pass over them while
        it is written (trigger files are renamed, :meth:`.signals.TriggerDir.claim`: a peer that
        did not see one yet never agrees it again), and ``served(claimed)`` removes them once it is
        complete. Returns what was claimed."""
        (triggers, controls), self._seen = self._seen, ([], [])
        self._claimed.update(controls)
        return self.trigger.claim(triggers), controls

    def served(self, claimed: Seen | None = None) -> None:
        """Remove the requests this rank saw when the last request was agreed (or the ``claimed``
        ones of :meth:`claim`): a complete checkpoint has served them. A signal recorded since is
        a file of its own and stays pending; a control file written again since is kept."""
        if claimed is None:
            claimed, self._seen = self._seen, ([], [])
        triggers, controls = claimed
        self._claimed.difference_update(controls)
        for path in triggers:
            path.unlink(missing_ok=True)
        for path, mtime in controls:
            claimed = path.with_name(f".served-{path.name}.{time.time_ns()}")
            try:
                os.rename(path, claimed)  # atomic: a file created after this is a new request
            except FileNotFoundError:
                continue
            if claimed.stat().st_mtime > mtime:  # touched again after the poll: still pending
                try:
                    os.link(claimed, path)
                except FileExistsError:
                    pass
            claimed.unlink()

    def remove_stale(self, job_start: float) -> list[str]:
        """Delete requests older than the job (a killed earlier run's leftovers); return what was removed."""
        stale = [f"trigger {name}" for name in self.trigger.remove_stale(job_start)]
        for path, _action, mtime in self._control_files():
            if mtime < job_start:
                path.unlink(missing_ok=True)
                stale.append(f"control file {path}")
        return stale

    def _maybe_test_signal(self, point: str, step: int, micro: int) -> None:
        due = [h for h in self._test_hooks
               if h[0] == str(step) and h[1] == point and (point == "after_step" or h[2] == str(micro))]
        if not due:
            return
        hook = due[0]
        self._test_hooks.remove(hook)
        signum = getattr(signal, hook[3])
        target = int(os.environ.get(LAUNCHER_PID_ENV) or os.getpid())
        sent = time.time()
        os.kill(target, signum)
        deadline = time.monotonic() + 60
        while not any(t.signum == signum and t.mtime >= sent - 1 for t in self.trigger.files()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"test hook: {hook[3]} sent to pid {target} was not recorded within 60 s")
            time.sleep(0.01)

