"""Checkpoint requests: the seven signals, what each asks for, and the per-job trigger directory.

docs/architecture.md section 6. A signal handler only records the request, as a new file
``sig<NUMBER>.<ns>.<pid>`` in a per-job directory under ``/dev/shm`` (mode 0700): every local rank of the node and the launcher
share it, and a signal sent to any one of them reaches the whole job at the next safe point (see
:mod:`.requests`). The directory is keyed by the job id, so triggers of another job are never read;
a trigger older than this job's start (left by a killed run with the same id) is removed with a
warning. How requests are served and how the run then ends: :mod:`.requests`.
"""

from __future__ import annotations

import enum
import os
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..contract import CONTROL_FILES, JOB_START_ENV

#: Every signal that asks for a checkpoint (docs/architecture.md section 6).
CHECKPOINT_SIGNALS = (
    signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGXCPU, signal.SIGHUP, signal.SIGQUIT,
)


class Action(enum.IntEnum):
    """What a request asks for; larger wins when ranks see different requests."""

    NONE = 0
    CHECKPOINT = 1  # checkpoint, then keep training
    CHECKPOINT_AND_EXIT = 2


def action_for_signal(signum: int, sigusr1_action: str = "checkpoint") -> Action:
    """SIGUSR1 follows ``--sigusr1-action`` (``checkpoint`` or ``checkpoint-and-exit``); every other
    checkpoint signal means checkpoint and exit."""
    if signum == signal.SIGUSR1 and sigusr1_action == "checkpoint":
        return Action.CHECKPOINT
    return Action.CHECKPOINT_AND_EXIT


#: Control-file names and what they ask for: what the signal of :data:`..contract.CONTROL_FILES` asks for.
CONTROL_ACTIONS = {name: action_for_signal(signum) for signum, name in CONTROL_FILES.items()}


def signal_name(signum: int) -> str:
    """``SIGTERM`` for 15; ``control`` for 0 (a request from the run directory's ``control/``)."""
    return signal.Signals(signum).name if signum else "control"


@dataclass(frozen=True)
class Trigger:
    """One recorded request: the signal number (0 for a control file), its file and its time (unix s)."""

    signum: int
    path: Path
    mtime: float


def trigger_root() -> Path:
    """``/dev/shm/osft-<uid>`` (shared memory, node-local, emptied at reboot); the temp dir where
    there is no ``/dev/shm`` (macOS)."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / f"osft-{os.getuid()}"


def request_files(directory: Path | None) -> list[tuple[str, Path, float]]:
    """``(name, path, mtime)`` of the files in ``directory`` (none when it does not exist; files
    removed while it is read are skipped)."""
    if directory is None:
        return []
    found = []
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return []
    for entry in entries:
        try:
            found.append((entry.name, Path(entry.path), entry.stat().st_mtime))
        except FileNotFoundError:
            continue
    return found


#: Name prefix of a trigger file claimed by a checkpoint being written (:meth:`TriggerDir.claim`).
CLAIMED_PREFIX = "claimed-"


class TriggerDir:
    """The per-job trigger directory ``<trigger_root>/<job_id>`` (mode 0700).

    Args:
        job_id: the job's id (shared by every rank and the launcher through :data:`..contract.JOB_ID_ENV`).
        root: parent directory (default :func:`trigger_root`).
    """

    def __init__(self, job_id: str, root: Path | None = None) -> None:
        self.path = (root or trigger_root()) / job_id

    def create(self) -> None:
        """Create the directory (and its parent) with mode 0700."""
        self.path.parent.mkdir(mode=0o700, exist_ok=True)
        self.path.mkdir(mode=0o700, exist_ok=True)
        os.chmod(self.path, 0o700)

    def record(self, signum: int) -> None:
        """Record a request for ``signum`` as a new file ``sig<N>.<ns>.<pid>`` (safe to call from a
        signal handler). A file is never touched again once written, so a request that arrives
        while an earlier one is being served is a file of its own and is never removed with it."""
        self.create()
        (self.path / f"sig{signum}.{time.time_ns()}.{os.getpid()}").touch()

    def files(self) -> list[Trigger]:
        """Every recorded request file, oldest first (files that vanish meanwhile are skipped)."""
        found = []
        for name, path, mtime in request_files(self.path):
            number = name[3:].split(".", 1)[0]
            if name.startswith("sig") and number.isdigit():
                found.append(Trigger(int(number), path, mtime))
        return sorted(found, key=lambda t: t.mtime)

    def claim(self, triggers: list[Path]) -> list[Path]:
        """Rename ``triggers`` to ``claimed-<name>``: no process of the job reads them as requests
        any more (a checkpoint written in the background serves them). Returns the new paths of
        those this process renamed (another rank of the node may have renamed one first)."""
        claimed = []
        for path in triggers:
            target = path.with_name(f"{CLAIMED_PREFIX}{path.name}")
            try:
                os.rename(path, target)
            except FileNotFoundError:
                continue
            claimed.append(target)
        return claimed

    def remove_stale(self, job_start: float) -> list[str]:
        """Delete triggers older than ``job_start`` (unix s); return their signal names."""
        stale = [t for t in self.files() if t.mtime < job_start]
        for t in stale:
            t.path.unlink(missing_ok=True)
        return list(dict.fromkeys(signal_name(t.signum) for t in stale))

    def remove(self) -> None:
        """Delete the directory and what is left in it, claimed requests included (end of the job)."""
        for _name, path, _mtime in request_files(self.path):
            path.unlink(missing_ok=True)
        try:
            self.path.rmdir()
        except OSError:
            pass


@dataclass
class _Held:
    """Signals received while held (:func:`hold_signals`), and the handlers in place before."""

    previous: dict[int, object]
    received: list[int]


_held: _Held | None = None


def hold_signals(signals: tuple[int, ...] = CHECKPOINT_SIGNALS) -> None:
    """Record ``signals`` (default every checkpoint signal) in memory until
    :func:`install_handlers` takes them over (and serves what arrived meanwhile),
    :func:`take_held_signals` hands them to the caller, or :func:`release_held_signals` gives them
    their previous handling back. Each entry point calls it first, before anything slow is
    imported, so a signal during start-up never takes its default action (tests/test_stop_rule.py).
    A second call while held does nothing."""
    global _held
    if _held is not None:
        return
    received: list[int] = []
    _held = _Held({s: signal.signal(s, lambda signum, _frame: received.append(signum)) for s in signals}, received)


def take_held_signals() -> list[int]:
    """End the hold: the previous handlers are back; returns the signals received meanwhile, in
    order (none when nothing was held)."""
    global _held
    held, _held = _held, None
    if held is None:
        return []
    restore_handlers(held.previous)
    return held.received


def release_held_signals(deliver: bool = True) -> None:
    """End the hold (:func:`take_held_signals`) and, with ``deliver``, send this process again what
    arrived meanwhile (a stop signal then takes its default action: no on-demand checkpointing)."""
    received = take_held_signals()
    for signum in received if deliver else ():
        os.kill(os.getpid(), signum)


def install_handlers(on_signal: Callable[[int], None]) -> dict[int, object]:
    """Make every signal of :data:`CHECKPOINT_SIGNALS` call ``on_signal(signum)`` instead of its
    default action (which for SIGUSR1 would kill the process), then pass it the signals received
    while held (:func:`hold_signals`), in order. Returns the handlers to restore: those from before
    the hold, if there was one."""
    global _held

    def handler(signum, _frame):
        on_signal(signum)

    previous = {s: signal.signal(s, handler) for s in CHECKPOINT_SIGNALS}
    held, _held = _held, None
    if held is not None:
        previous = held.previous
        for signum in held.received:
            on_signal(signum)
    return previous


def current_handlers(signals: tuple[int, ...] = CHECKPOINT_SIGNALS) -> dict[int, object]:
    """The handlers of ``signals`` now, for :func:`restore_handlers`; a signal whose handler was not
    set from Python (``signal.getsignal`` gives None) is left out, since it cannot be put back."""
    return {s: h for s in signals if (h := signal.getsignal(s)) is not None}


def restore_handlers(previous: dict[int, object]) -> None:
    """Put back the handlers returned by :func:`install_handlers`."""
    for s, h in previous.items():
        signal.signal(s, h)


def job_start_time() -> float:
    """The job's start (unix s): ``$OSFT_JOB_START`` from the launcher, else this process's start
    (a request recorded while it started up is never stale)."""
    import psutil  # only here: this module is imported before anything slow (hold_signals)

    return float(os.environ.get(JOB_START_ENV) or psutil.Process().create_time())
