"""Serving checkpoint requests at safe points: every rank polls, all agree with one all_reduce(MAX).

DESIGN.md section 6. Requests come from the job's trigger directory (signals to any rank or to the
launcher, see :mod:`.signals`) and, on rank 0, from ``<output_dir>/control/`` (a watcher on another
host creates ``control/checkpoint`` or ``control/checkpoint-and-exit``). Safe points: before the
forward and before and after the backward of each micro-batch, and after the optimizer step.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ..distributed import backend_device, is_distributed
from .signals import Action, TriggerDir, action_for_signal, request_files, signal_name

#: Control-file names and what they ask for.
CONTROL_ACTIONS = {"checkpoint": Action.CHECKPOINT, "checkpoint-and-exit": Action.CHECKPOINT_AND_EXIT}

SAFE_POINTS = ("before_forward", "before_backward", "after_backward", "after_step")

#: Test-only hook: "STEP:POINT:MICRO:SIGNAL[,...]" makes rank 0 send SIGNAL (to $OSFT_LAUNCHER_PID
#: when set, else to itself) at that safe point of that step and micro-batch (0-based; ignored for
#: after_step), and wait until the request is recorded, so the request is served exactly there.
TEST_SIGNAL_ENV = "OSFT_TEST_SIGNAL_AT"


@dataclass(frozen=True)
class Request:
    """An agreed request: the action, the signal number (0: control file) and where it was served."""

    action: Action
    signum: int
    point: str

    @property
    def signal(self) -> str:
        return signal_name(self.signum)


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
        specs = os.environ.get(TEST_SIGNAL_ENV, "") if rank == 0 else ""
        self._test_hooks = [spec.split(":") for spec in specs.split(",") if spec]

    def _control_files(self) -> list[tuple[Path, Action, float]]:
        return [(path, CONTROL_ACTIONS[name], mtime) for name, path, mtime in request_files(self.control_dir)
                if name in CONTROL_ACTIONS]

    def _local_code(self) -> int:
        """This rank's strongest pending request, encoded as action * 256 + signal number."""
        code = 0
        for t in self.trigger.pending():
            code = max(code, int(action_for_signal(t.signum, self.sigusr1_action)) * 256 + t.signum)
        for _path, action, _mtime in self._control_files():
            code = max(code, int(action) * 256)
        return code

    def poll(self, point: str, step: int, micro: int = 0) -> Request | None:
        """Collective: every rank must call it at the same safe point. Returns the agreed request
        (the strongest any rank saw), or None.

        Args:
            point: one of :data:`SAFE_POINTS`. step: the step being trained (1-based) or just
                finished (``after_step``). micro: micro-batch index within the step (0-based).
        """
        self._maybe_test_signal(point, step, micro)
        code = self._local_code()
        if is_distributed():
            t = torch.tensor([code], dtype=torch.int64, device=backend_device())
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            code = int(t.item())
        if code == 0:
            return None
        return Request(Action(code // 256), code % 256, point)

    def served(self, until: float) -> None:
        """Forget every request recorded up to ``until`` (unix s): signals that arrived while the
        checkpoint was being written are served by it, not by a second one."""
        for t in self.trigger.pending():
            if t.mtime <= until:
                t.path.unlink(missing_ok=True)
        for path, _action, mtime in self._control_files():
            if mtime <= until:
                path.unlink(missing_ok=True)

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
        target = int(os.environ.get("OSFT_LAUNCHER_PID") or os.getpid())
        sent = time.time()
        os.kill(target, signum)
        deadline = time.monotonic() + 60
        while not any(t.signum == signum and t.mtime >= sent - 1 for t in self.trigger.pending()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"test hook: {hook[3]} sent to pid {target} was not recorded within 60 s")
            time.sleep(0.01)

