"""The paragraph ``osft-train`` prints when a run fails, on one rank (in process) or many (a worker
group; tests/test_stop_rule.py::test_a_dead_rank_ends_with_one_paragraph_and_a_worker_holds_start_up_signals,
tests/test_checkpoint_units.py::test_a_failed_background_write_on_one_rank_gives_the_failure_paragraph):
which rank died and how (exit code or signal, its error message, the last error line of its log when that
says more), at which step, the newest complete checkpoint, the command that resumes from it and where
the logs are. Exit code 1 (:data:`.exit_codes.EXIT_FAILED`), no traceback.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from ..contract import Event, read_records
from ..exit_codes import describe
from ..rundir import RunDir


def _job_records(run_dir: RunDir, job_id: str) -> list[dict]:
    """This job's records from every metrics file of the run directory, in file order."""
    found = []
    for path in sorted(run_dir.metrics.glob("*.jsonl")):
        records, _problems = read_records(path)
        found += [r for r in records if r.get("job_id") == job_id]
    return found


#: A traceback's last line (``ValueError: ...``, ``torch.OutOfMemoryError: ...``) or the worker's own error line.
_ERROR_LINE = re.compile(r"^(?:[\w.]*(?:Error|Exception|Interrupt|Exit)(?::|$)|osft worker: )")


T = TypeVar("T")


def best_effort(write: Callable[[], T]) -> T | None:
    """``write()``, or None when it fails with an ``OSError`` (a full or read-only disk): the
    failure path records what it can and never fails on the disk that made the run fail."""
    try:
        return write()
    except OSError:
        return None


def headline(exc: BaseException) -> str | None:
    """The one line an error gives before the failure paragraph, if it has one (a checkpoint not
    written for lack of space or permission: :class:`.checkpoint.full_state.CheckpointWriteError`)."""
    return getattr(exc, "headline", None)


def error_fields(exc: BaseException) -> dict:
    """Fields of an ``error`` record beyond the message: ``headline`` and the error's own fields
    (``checkpoint``, ``errno``, ``bytes_needed``, ``bytes_free`` for a checkpoint not written)."""
    line = headline(exc)
    return {"headline": line, **getattr(exc, "fields", {})} if line else {}


def record_error(metrics, metrics_dir: Path, job_id: str, exc: BaseException, exit_code: int) -> None:
    """Write the ``error`` record of a failure (message, traceback, exit code, :func:`error_fields`)
    through ``metrics`` (a :class:`osft.trainer.observe.metrics.MetricsLogger`), or, when the failure came before there
    was one, through a new one for ``metrics_dir``; then close it. Best effort (:func:`best_effort`)."""
    import traceback

    from ..contract import Event

    if metrics is None:
        from ..distributed import DistEnv
        from ..observe.metrics import MetricsLogger

        metrics = best_effort(lambda: MetricsLogger(metrics_dir, DistEnv.from_env(), job_id))
    if metrics is None:
        return
    best_effort(lambda: metrics.log(Event.ERROR, message=f"{type(exc).__name__}: {exc}", exit_code=exit_code,
                                    traceback="".join(traceback.format_exception(exc)), **error_fields(exc)))
    best_effort(metrics.close)


def read_failures(failures_file: Path) -> dict[str, dict]:
    """The agent's failure file (:mod:`osft.trainer.launch.agent`; {} when absent: no rank failed): per global rank
    (a string), its ``local_rank``, ``pid``, ``exit_code``, ``signal`` and ``message``."""
    return json.loads(failures_file.read_text()) if failures_file.is_file() else {}


def in_process_failure(exc: BaseException, exit_code: int) -> dict[str, dict]:
    """The failure of a one-rank run trained in this process, in the form of :func:`read_failures`."""
    return {"0": {"local_rank": 0, "pid": os.getpid(), "exit_code": exit_code, "signal": None,
                  "message": f"{type(exc).__name__}: {exc}"}}


def last_error_line(run_dir: RunDir, local_rank: int) -> str | None:
    """The last error line of a rank's ``stderr.log`` in the node's newest torchrun log directory
    (``logs/node<N>/<run id>/attempt_<A>/<local rank>/``), or None (no log, no error line)."""
    logs = sorted((run_dir.root / "logs" / f"node{run_dir.node_rank}").glob(f"*/attempt_*/{local_rank}/stderr.log"),
                  key=lambda p: p.stat().st_mtime)
    if not logs:
        return None
    lines = [line.strip() for line in logs[-1].read_text(errors="replace").splitlines()]
    return next((line for line in reversed(lines) if _ERROR_LINE.match(line)), None)


def _how(failure: dict) -> str:
    if failure.get("signal"):
        return f"was killed by {failure['signal']}"
    return f"exited with {describe(int(failure['exit_code']))}"


def _without_resume(argv: list[str]) -> list[str]:
    """``argv`` without ``--resume`` and ``--resume-from-full-state-checkpoint [PATH]``."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--resume-from-full-state-checkpoint":
            skip = True
        elif arg != "--resume" and not arg.startswith("--resume-from-full-state-checkpoint="):
            kept.append(arg)
    return kept


def failure_paragraph(run_dir: RunDir, job_id: str, agent_code: int, failures: dict[str, dict], argv: list[str],
                      cause: str | None = None, in_process: bool = False, first_line: str | None = None) -> str:
    """What happened to a failed run, as one paragraph.

    Args:
        run_dir: the run directory (metrics, checkpoints, logs).
        job_id: the job's id (its records are told apart by it).
        agent_code: torchrun agent's exit code (negative: killed by that signal); the exit code of a
            run trained in process.
        failures: per failed rank, how it ended (:func:`read_failures`, :func:`in_process_failure`).
        argv: the ``osft-train`` command line, for the resume command.
        cause: what the launcher did, if it ended the group itself (grace period over).
        in_process: one rank trained in this process: its log is this console, its traceback is
            in its ``error`` record.
        first_line: a line printed before the paragraph (:func:`headline`); by default the
            ``headline`` of the first failed rank's ``error`` record, if any.
    """
    records = _job_records(run_dir, job_id)
    steps = [r["step"] for r in records if r.get("event") == Event.STEP]
    error_records = {r.get("rank"): r for r in records if r.get("event") == Event.ERROR}
    errors = {rank: r.get("message") for rank, r in error_records.items()}
    parts = ["training failed."]
    if cause:
        parts.append(cause)
    for n, (rank, failure) in enumerate(failures.items()):  # the likely cause first (.agent.cause_first)
        if not n and first_line is None:
            first_line = (error_records.get(int(rank)) or {}).get("headline")
        if n:  # torchrun stops the other ranks once one has failed
            parts.append(f"Then rank {rank} {_how(failure)}.")
            continue
        line = f"Rank {rank} (local rank {failure['local_rank']}, pid {failure['pid']}) {_how(failure)}"
        message = errors.get(int(rank)) or failure.get("message")
        parts.append(f"{line}: {message}." if message else f"{line}.")
        logged = None if in_process else last_error_line(run_dir, int(failure["local_rank"]))
        if logged and (not message or (message not in logged and logged not in message)):  # it says more
            parts.append(f"Its last error line: {logged}" + ("" if logged.endswith(".") else "."))
    if not failures and not cause:
        started = any(r.get("event") == Event.RUN_STARTED for r in records)
        parts.append(f"torchrun's agent ended with {describe(agent_code)}"
                     f"{'' if started else ' before any rank started'}, and no rank reported a failure.")
    in_progress = sorted(p.name.split(".tmp-")[0] for p in run_dir.checkpoints.glob(f"step_*.tmp-{job_id}"))
    at = f"Last step finished: {max(steps)}" if steps else "No step had finished"
    parts.append(at + (f"; the checkpoint {in_progress[-1]} was being written and is incomplete." if in_progress else "."))
    from ..checkpoint.store import newest_complete

    newest, _skipped = newest_complete(run_dir.checkpoints)
    resume = _without_resume(argv)
    if newest is None:
        parts.append("There is no complete checkpoint; this starts the run again:")
    else:
        parts.append(f"Newest complete checkpoint: {newest}. Resume with:")
        resume.append("--resume")
    parts.append(shlex.join(["osft-train", *resume]))
    if in_process:
        parts.append(f"(traceback: the error record in {run_dir.metrics / f'node{run_dir.node_rank}.jsonl'})")
    else:
        parts.append(f"(rank logs: {run_dir.root / 'logs' / f'node{run_dir.node_rank}'})")
    paragraph = " ".join(parts)
    return f"{first_line}\n{paragraph}" if first_line else paragraph
