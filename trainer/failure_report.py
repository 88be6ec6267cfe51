"""The paragraph ``osft-train`` prints when its worker group fails (tests/test_stop_rule.py::test_a_dead_rank_ends_with_one_paragraph_and_a_worker_holds_start_up_signals): which rank died
and how (exit code or signal, its error message), at which step, the newest complete checkpoint and
the command that resumes from it. Exit code 1 (:data:`.exit_codes.EXIT_FAILED`), no traceback.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from .contract import Event, read_records
from .exit_codes import describe
from .rundir import RunDir


def _job_records(run_dir: RunDir, job_id: str) -> list[dict]:
    """This job's records from every metrics file of the run directory, in file order."""
    found = []
    for path in sorted(run_dir.metrics.glob("*.jsonl")):
        records, _problems = read_records(path)
        found += [r for r in records if r.get("job_id") == job_id]
    return found


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


def failure_paragraph(run_dir: RunDir, job_id: str, agent_code: int, failures_file: Path, argv: list[str],
                      cause: str | None = None) -> str:
    """What happened to a failed worker group, as one paragraph.

    Args:
        run_dir: the run directory (metrics, checkpoints, logs).
        job_id: the job's id (its records are told apart by it).
        agent_code: torchrun agent's exit code (negative: killed by that signal).
        failures_file: the agent's failure file (:mod:`.agent`), absent when no rank failed.
        argv: the ``osft-train`` command line, for the resume command.
        cause: what the launcher did, if it ended the group itself (grace period over).
    """
    records = _job_records(run_dir, job_id)
    steps = [r["step"] for r in records if r.get("event") == Event.STEP]
    errors = {r.get("rank"): r.get("message") for r in records if r.get("event") == Event.ERROR}
    parts = ["training failed."]
    if cause:
        parts.append(cause)
    failures = json.loads(failures_file.read_text()) if failures_file.is_file() else {}
    for n, (rank, failure) in enumerate(failures.items()):  # the likely cause first (.agent.cause_first)
        if n:  # torchrun stops the other ranks once one has failed
            parts.append(f"Then rank {rank} {_how(failure)}.")
            continue
        line = f"Rank {rank} (local rank {failure['local_rank']}, pid {failure['pid']}) {_how(failure)}"
        message = errors.get(int(rank)) or failure.get("message")
        parts.append(f"{line}: {message}." if message else f"{line}.")
    if not failures and not cause:
        started = any(r.get("event") == Event.RUN_STARTED for r in records)
        parts.append(f"torchrun's agent ended with {describe(agent_code)}"
                     f"{'' if started else ' before any rank started'}, and no rank reported a failure.")
    in_progress = sorted(p.name.split(".tmp-")[0] for p in run_dir.checkpoints.glob(f"step_*.tmp-{job_id}"))
    at = f"Last step finished: {max(steps)}" if steps else "No step had finished"
    parts.append(at + (f"; the checkpoint {in_progress[-1]} was being written and is incomplete." if in_progress else "."))
    from .checkpoint.store import newest_complete

    newest, _skipped = newest_complete(run_dir.checkpoints)
    resume = _without_resume(argv)
    if newest is None:
        parts.append("There is no complete checkpoint; this starts the run again:")
    else:
        parts.append(f"Newest complete checkpoint: {newest}. Resume with:")
        resume.append("--resume")
    parts.append(shlex.join(["osft-train", *resume]))
    parts.append(f"(rank logs: {run_dir.root / 'logs' / f'node{run_dir.node_rank}'})")
    return " ".join(parts)
