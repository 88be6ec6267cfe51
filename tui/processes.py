"""The processes of a run, found through its run directory and inspected with psutil.

docs/architecture.md section 6 (Roles): checkpoint requests go to the ``osft-train`` launcher (or, when no launcher is
alive, to each rank with ``os.kill``), never to a torchrun agent, whose default action for SIGUSR1
kills it and orphans the ranks. When none of the run's processes is on this host, a request is a
file in the run directory's ``control/``, which rank 0 polls at its safe points.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

import psutil
from osft.trainer.checkpoint.signals import signal_name
from osft.trainer.contract import CONTROL_FILES
from osft.trainer.rundir import RunDir

from .run_state import RunModel

#: A pid whose process started more than this many seconds after the record naming it is a reused pid.
_PID_SLACK_S = 5.0


@dataclass(frozen=True)
class Target:
    """A process to signal: pid, role (``launcher node N`` or ``rank R``)."""

    pid: int
    role: str


@dataclass
class ProcStats:
    """psutil's view of one process: CPU % (of one core, since the previous sample), RSS (bytes)."""

    alive: bool
    cpu_percent: float | None = None
    rss_bytes: int | None = None
    status: str = ""


def this_host(hostname: str | None) -> bool:
    """Whether ``hostname`` (from run.json or a metrics record) names this machine."""
    return hostname is None or hostname in {socket.gethostname(), socket.getfqdn(), "localhost"}


class ProcessView:
    """Finds and samples a run's processes; keeps one ``psutil.Process`` per pid, so CPU % is
    measured between consecutive :meth:`sample` calls.

    Args:
        model: the run as last read (pids come from run.json and ``run_started`` records); the
            dashboard replaces it after each poll.
    """

    def __init__(self, model: RunModel) -> None:
        self.model = model
        self._procs: dict[int, psutil.Process] = {}

    def _process(self, pid: int | None, not_before: float | None = None) -> psutil.Process | None:
        """The live process ``pid`` (None when gone, a zombie, or a pid reused after ``not_before``)."""
        if not pid:
            return None
        proc = self._procs.get(pid)
        try:
            if proc is None:
                proc = psutil.Process(pid)
                if not_before is not None and proc.create_time() > not_before + _PID_SLACK_S:
                    return None
                self._procs[pid] = proc
            if not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE:
                return None
            return proc
        except psutil.Error:
            self._procs.pop(pid, None)
            return None

    def launcher(self, node_rank: int) -> psutil.Process | None:
        info = self.model.launchers.get(node_rank)
        if info is None or not this_host(info.hostname):
            return None
        return self._process(info.pid, info.data.start_time)

    def rank(self, rank: int) -> psutil.Process | None:
        info = self.model.ranks.get(rank)
        if info is None or not this_host(info.hostname) or info.job_id != self.model.job_id:
            return None
        return self._process(info.pid, info.started)

    def sample(self, proc: psutil.Process | None) -> ProcStats:
        """CPU % and RSS of ``proc`` and its children (DataLoader workers), or not alive."""
        if proc is None:
            return ProcStats(False)
        try:
            with proc.oneshot():
                cpu, rss, status = proc.cpu_percent(None), proc.memory_info().rss, proc.status()
            for child in proc.children(recursive=True):
                child = self._procs.setdefault(child.pid, child)
                try:
                    cpu += child.cpu_percent(None)
                    rss += child.memory_info().rss
                except psutil.Error:
                    continue
            return ProcStats(True, cpu, rss, status)
        except psutil.Error:
            return ProcStats(False)

    def local_launchers(self) -> list[Target]:
        """The run's live launchers on this host, node 0 first."""
        return [Target(p.pid, f"launcher of node {n}") for n in sorted(self.model.launchers)
                if (p := self.launcher(n)) is not None]

    def local_ranks(self) -> list[Target]:
        """The current job's live ranks on this host."""
        return [Target(p.pid, f"rank {r}") for r in sorted(self.model.ranks) if (p := self.rank(r)) is not None]

    def request_targets(self) -> list[Target]:
        """Where a checkpoint request can go, in order (:func:`send_request` signals the first): the
        live launchers on this host, else the live ranks on this host; empty: use the control file."""
        return self.local_launchers() or self.local_ranks()

    def kill_targets(self) -> list[Target]:
        """Every live process of the run on this host: launchers, their descendants (torchrun
        agents, ranks, DataLoader workers) and the ranks from ``run_started`` records."""
        targets: dict[int, Target] = {}
        for n in sorted(self.model.launchers):
            proc = self.launcher(n)
            if proc is None:
                continue
            targets[proc.pid] = Target(proc.pid, f"launcher of node {n}")
            try:
                for child in proc.children(recursive=True):
                    targets.setdefault(child.pid, Target(child.pid, f"{child.name()} (node {n})"))
            except psutil.Error:
                pass
        for t in self.local_ranks():
            targets[t.pid] = t
            proc = self._procs.get(t.pid)
            try:
                for child in proc.children(recursive=True) if proc else []:
                    targets.setdefault(child.pid, Target(child.pid, f"{child.name()} ({t.role})"))
            except psutil.Error:
                pass
        return list(targets.values())

    def any_alive(self) -> bool:
        """Whether any launcher or rank of the current job is alive on this host."""
        return bool(self.local_launchers() or self.local_ranks())


def send_request(view: ProcessView, signum: int) -> str:
    """Ask the run for a checkpoint (SIGUSR1) or a checkpoint and stop (SIGUSR2).

    Sends one ``signum`` to the first target of :meth:`ProcessView.request_targets` that is still
    there (the process that receives it records it in the job's trigger, which every rank reads at
    its safe points: one signal asks the whole job, whatever its number of nodes); when there is
    none on this host, creates ``control/checkpoint`` or ``control/checkpoint-and-exit`` instead.

    Returns:
        What was done, for the UI (``"SIGUSR1 sent to launcher of node 0 (pid 123)"``).

    Raises:
        OSError: the control directory cannot be written.
    """
    for t in view.request_targets():
        try:
            os.kill(t.pid, signum)
        except ProcessLookupError:
            continue
        return f"{signal_name(signum)} sent to {t.role} (pid {t.pid})"
    control = RunDir(view.model.root).control
    control.mkdir(parents=True, exist_ok=True)
    name = CONTROL_FILES[signum]
    path = control / name
    path.touch()
    os.utime(path)
    return f"no process of the run on this host: wrote {path}"


def request_evaluation(root: Path) -> Path:
    """Create ``control/evaluate`` in the run directory ``root``: rank 0 sees it at the next step
    boundary, the run evaluates its evaluation and retention sets, removes the file and goes on.
    Returns the file's path.

    Raises:
        OSError: the control directory cannot be written.
    """
    path = RunDir(root).evaluate_request
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    return path


def kill(targets: list[Target], timeout_s: float = 10.0) -> list[int]:
    """SIGKILL every target and wait up to ``timeout_s`` for them to go.

    Returns:
        pids still alive afterwards (empty when all are gone).
    """
    procs = []
    for t in targets:
        try:
            p = psutil.Process(t.pid)
            p.kill()
            procs.append(p)
        except psutil.Error:
            continue
    _gone, alive = psutil.wait_procs(procs, timeout=timeout_s)
    return [p.pid for p in alive]
