"""One run per output directory (tests/test_output_dir_ownership.py): who may start a job in a run directory.

Each node's launcher checks its own state file (``run.json`` on node 0, ``run.node<N>.json`` on
node N, :class:`.rundir.RunDir`) before it writes anything:

- no state file: a new directory, the job starts;
- the file names a live process of another job: refused, whatever the flags. On this host the
  launcher's pid must be running with the process creation time the file recorded (a reused pid
  is another process); on another host, where no pid can be checked, the job's heartbeat file
  (rewritten every :data:`HEARTBEAT_S` seconds while it runs) must be newer than :data:`STALE_S`
  seconds. A start of the same job on another host is never refused for an earlier start of
  itself: the same ``$SLURM_JOB_ID`` (a requeue), or the same job id (a multi-node job's id is
  derived from the output directory and the rendezvous endpoint, or given by ``OSFT_JOB_ID``: a
  Kubernetes replacement pod starts within :data:`STALE_S` of its killed predecessor's last
  heartbeat);
- otherwise (completed, stopped, failed, or killed without a word), when the directory holds
  checkpoints or exports: ``--resume`` (or ``--resume-from-full-state-checkpoint``) continues the
  run, ``--overwrite-output-dir`` starts over; without either the job is refused, since a fresh
  run would mix its checkpoints and exports with the old ones. A run that left neither (it failed
  on bad input, say) is simply started again.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
from dataclasses import dataclass

import psutil

from ..contract import ENDED_STATES
from ..rundir import LauncherRecord, RunDir, read_launcher_record, write_json_atomic

#: Seconds between two writes of a running job's heartbeat file.
HEARTBEAT_S = 10.0
#: A heartbeat older than this (seconds, by the file's own clock) means its job has stopped.
STALE_S = 60.0
#: Largest difference (seconds) between a process's creation time and the one recorded for it.
_CREATE_TIME_TOLERANCE_S = 0.5


class OutputDirInUse(ValueError):
    """The output directory belongs to another job (exit code 2, before anything is written)."""


@dataclass(frozen=True)
class Owner:
    """What a state file says about the job that wrote it."""

    job_id: str
    pid: int | None
    hostname: str
    state: str
    exit_code: int | None

    def describe(self) -> str:
        """``job J (pid P on host H)``."""
        return f"job {self.job_id} (pid {self.pid} on host {self.hostname})"


def process_identity() -> dict:
    """This process's fields for ``run.json``: its creation time (with the pid it tells a live
    launcher from a reused pid) and the SLURM job it belongs to."""
    return {"launcher_create_time": psutil.Process().create_time(), "slurm_job_id": os.environ.get("SLURM_JOB_ID")}


def _is_live(record: LauncherRecord, run_dir: RunDir, job_id: str | None) -> bool:
    """Whether the launcher ``record`` (a state file's content) names still runs, as far as the
    job ``job_id`` starting now is concerned. A launcher that recorded its end (an ended state
    with its exit code) holds nothing any more, even while its process is still exiting."""
    if record.state in ENDED_STATES and record.exit_code is not None:
        return False
    if record.hostname != socket.gethostname():
        slurm_job = os.environ.get("SLURM_JOB_ID")
        if (slurm_job and record.slurm_job_id == slurm_job) or (job_id and record.job_id == job_id):
            return False  # an earlier start of this same job, requeued or replaced
        try:
            beat = json.loads(run_dir.heartbeat.read_text())
        except (OSError, ValueError):
            return False
        return beat.get("job_id") == record.job_id and time.time() - float(beat.get("time", 0)) < STALE_S
    pid = record.launcher_pid
    if not isinstance(pid, int) or pid == os.getpid():
        return False
    try:
        created = psutil.Process(pid).create_time()
    except psutil.Error:
        return False
    expected = record.launcher_create_time
    if expected is not None:
        return abs(created - float(expected)) < _CREATE_TIME_TOLERANCE_S
    return created <= float(record.start_time or 0) + 1.0  # a state file from before the creation time was kept


def _has_outputs(run_dir: RunDir) -> bool:
    """Whether ``run_dir`` holds anything of a checkpoint or an export."""
    return any(any(d.glob("[!.]*")) for d in (run_dir.checkpoints, run_dir.root / "hf_format") if d.is_dir())


def check_output_dir(run_dir: RunDir, resuming: bool, overwrite: bool, job_id: str | None = None) -> Owner | None:
    """Decide whether the job ``job_id`` may start in ``run_dir`` (see the module docstring); writes
    nothing.

    Returns:
        the earlier job whose directory this is (for ``--overwrite-output-dir``: its outputs are
        to be removed), or None for a new directory.

    Raises:
        OutputDirInUse: a live process of another job owns the directory, or an earlier run left
            checkpoints or exports there and neither ``resuming`` nor ``overwrite`` is set; the
            message names the job, its pid and host, and what to do.
    """
    try:
        record = read_launcher_record(run_dir.run_json)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise OutputDirInUse(f"--output-dir {run_dir.root}: {run_dir.run_json} cannot be read ({exc}); remove it if "
                             "no job uses the directory") from exc
    owner = Owner(str(record.job_id), record.launcher_pid, str(record.hostname), str(record.state), record.exit_code)
    if _is_live(record, run_dir, job_id):
        raise OutputDirInUse(f"--output-dir {run_dir.root} is in use by {owner.describe()}, which is running "
                             f"(state {owner.state}): wait for it to end or stop it, or choose another --output-dir")
    if resuming or overwrite or not _has_outputs(run_dir):
        return owner
    raise OutputDirInUse(f"--output-dir {run_dir.root} holds the run of {owner.describe()}, state {owner.state}, "
                         f"exit code {owner.exit_code}: continue it with --resume, or start over with "
                         "--overwrite-output-dir (which removes its checkpoints, exports and metrics)")


def clear_previous_run(run_dir: RunDir) -> None:
    """For ``--overwrite-output-dir`` on node 0: remove what an earlier, finished run left that a
    new one would mix with (checkpoints, exports, metrics, data report); logs and the state files
    stay, and are overwritten as the new run goes."""
    for path in (run_dir.checkpoints, run_dir.root / "hf_format", run_dir.metrics):
        shutil.rmtree(path, ignore_errors=True)
    run_dir.data_report.unlink(missing_ok=True)


class Heartbeat:
    """While entered, rewrite ``run_dir.heartbeat`` every :data:`HEARTBEAT_S` seconds from a daemon
    thread (job id, pid, host, time): how a launcher on another host sees that this job runs. The
    file is removed on exit."""

    def __init__(self, run_dir: RunDir, job_id: str) -> None:
        self.path = run_dir.heartbeat
        self.job_id = job_id
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="osft-heartbeat", daemon=True)

    def _beat(self) -> None:
        while True:
            try:
                write_json_atomic(self.path, {"job_id": self.job_id, "pid": os.getpid(),
                                              "hostname": socket.gethostname(), "time": time.time()})
            except OSError:
                pass  # a full or briefly unavailable file system must not stop training
            if self._stop.wait(HEARTBEAT_S):
                return

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()
        self.path.unlink(missing_ok=True)
