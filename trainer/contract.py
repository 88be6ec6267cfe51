"""The run-directory contract in one place: what a job writes and its watchers read or send
(docs/architecture.md sections 3, 4, 6 and 7).

Metrics event names and the fields every record carries, run states of ``run.json``, exit codes,
control-file names, the environment variables the launcher hands its ranks, and the one reader of
metrics JSONL lines. Standard library only: the dashboard imports it without torch.
"""

from __future__ import annotations

import enum
import json
import signal
from collections.abc import Sequence
from typing import NamedTuple
from pathlib import Path

from .exit_codes import EXIT_BAD_INPUT, EXIT_COMPLETED, EXIT_FAILED, EXIT_SIGNAL_BASE, EXIT_STOPPED

__all__ = [
    "ALWAYS_RECORDED", "AGENT_FAILURES_ENV", "CONTROL_CHECKPOINT", "CONTROL_CHECKPOINT_AND_EXIT", "CONTROL_EVALUATE",
    "CONTROL_FILES", "ENDED_STATES", "EXIT_BAD_INPUT", "EXIT_COMPLETED", "EXIT_FAILED", "EXIT_SIGNAL_BASE",
    "EXIT_STOPPED", "Event", "FinishReason", "JOB_ID_ENV", "JOB_START_ENV", "JsonlBatch", "LAUNCHER_PID_ENV", "LIVE_STATES",
    "RECORD_FIELDS", "RunState", "VERIFIED_CHECKPOINT_ENV", "ended_well", "parse_lines", "read_records",
]


class Event(enum.StrEnum):
    """The ``event`` of a metrics record (docs/architecture.md section 4); a member equals its text."""

    RUN_STARTED = "run_started"
    RESUMED = "resumed"
    OSFT_RANK_PLAN = "osft_rank_plan"
    STEP = "step"
    EVAL = "eval"
    BEST_EVAL = "best_eval"
    CHECKPOINT_REQUESTED = "checkpoint_requested"
    CHECKPOINT_SAVED = "checkpoint_saved"
    SUBSPACES_FOLDED = "subspaces_folded"
    DIVERGENCE = "divergence"
    ROLLBACK = "rollback"
    REQUEST_AFTER_COMPLETION = "request_after_completion"
    RUN_FINISHED = "run_finished"
    WARNING = "warning"
    ERROR = "error"


class FinishReason(enum.StrEnum):
    """The ``reason`` of a ``run_finished`` record: how the run ended (exit code 0, 75, 1, 0, 0)."""

    COMPLETED = "completed"
    STOPPED = "stopped"
    DIVERGED = "diverged"
    FORGETTING_BUDGET = "forgetting_budget"
    EARLY_STOPPING = "early_stopping"


#: Fields every metrics record carries, in the order written: unix time (s), event, the writer's
#: node rank, global rank, local rank, world size, host name and job id.
RECORD_FIELDS = ("ts", "event", "node_rank", "rank", "local_rank", "world_size", "hostname", "job_id")

#: Events every rank records, whatever its local rank (the others only on each node's local rank 0).
ALWAYS_RECORDED = frozenset({Event.WARNING, Event.ERROR, Event.RUN_STARTED})


class RunState(enum.StrEnum):
    """The ``state`` of ``run.json`` / ``run.node<N>.json`` (docs/architecture.md section 3)."""

    STARTING = "starting"
    RUNNING = "running"
    CHECKPOINTING = "checkpointing"
    STOPPED = "stopped"
    COMPLETED = "completed"
    FAILED = "failed"


#: States of a run whose processes should be alive.
LIVE_STATES = (RunState.STARTING, RunState.RUNNING, RunState.CHECKPOINTING)
#: States a launcher writes only once its worker group has ended (it may still be exiting).
ENDED_STATES = (RunState.STOPPED, RunState.COMPLETED, RunState.FAILED)


def ended_well(exit_code: object) -> bool:
    """Whether an exit code is a good end: completed (0) or stopped after a complete checkpoint (75)."""
    return exit_code in (EXIT_COMPLETED, EXIT_STOPPED)


#: ``control/checkpoint``: checkpoint, then keep training (as SIGUSR1 does by default).
CONTROL_CHECKPOINT = "checkpoint"
#: ``control/checkpoint-and-exit``: checkpoint, then stop with exit code 75 (as SIGUSR2 does).
CONTROL_CHECKPOINT_AND_EXIT = "checkpoint-and-exit"
#: ``control/evaluate``: evaluate at the next step boundary, then go on.
CONTROL_EVALUATE = "evaluate"
#: The control file a watcher on another host writes for each request signal: it asks for what the
#: signal asks for (SIGUSR1 with the default ``--sigusr1-action``).
CONTROL_FILES = {signal.SIGUSR1: CONTROL_CHECKPOINT, signal.SIGUSR2: CONTROL_CHECKPOINT_AND_EXIT}

#: The job's id, shared by the launcher and every rank (also set by the generated SLURM script).
JOB_ID_ENV = "OSFT_JOB_ID"
#: The pid of the node's ``osft-train`` launcher, set for its ranks (unset: no launcher).
LAUNCHER_PID_ENV = "OSFT_LAUNCHER_PID"
#: The job's start time (unix s), set by the launcher for its ranks.
JOB_START_ENV = "OSFT_JOB_START"
#: The checkpoint the launcher verified with checksums before the ranks started (they skip that).
VERIFIED_CHECKPOINT_ENV = "OSFT_VERIFIED_CHECKPOINT"
#: Where ``osft.trainer.launch.agent`` writes the failures of the worker group (JSON) for the launcher.
AGENT_FAILURES_ENV = "OSFT_AGENT_FAILURES"


class JsonlBatch(NamedTuple):
    """Records read from metrics JSONL lines.

    Attributes:
        records: complete, well-formed records (JSON objects), in file order.
        problems: one message per malformed complete line, naming the file and line number.
    """

    records: list[dict]
    problems: list[str]


def parse_lines(lines: Sequence[bytes], path: str | Path, first_line: int = 1) -> JsonlBatch:
    """Parse complete lines (without their newlines) of a metrics JSONL file, as docs/architecture.md
    section 4 asks of readers: a blank line is skipped; a line that is not a JSON object is skipped
    and reported as ``<path>:<line number>: malformed record skipped (<why>)``.

    Args:
        lines: the lines, in file order; the caller holds back a partly written last line.
        path: the file, for the messages.
        first_line: the 1-based line number of ``lines[0]`` in the file.
    """
    batch = JsonlBatch([], [])
    for number, line in enumerate(lines, start=first_line):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
            batch.problems.append(f"{path}:{number}: malformed record skipped ({exc})")
            continue
        if not isinstance(record, dict):
            batch.problems.append(f"{path}:{number}: malformed record skipped (not a JSON object)")
            continue
        batch.records.append(record)
    return batch


def read_records(path: str | Path) -> tuple[list[dict], list[str]]:
    """Read a whole metrics JSONL file with :func:`parse_lines`; a partly written last line (no
    newline yet) is left out.

    Returns:
        ``(records in file order, one message per malformed line naming the file and line number)``.

    Raises:
        OSError: the file cannot be read.
    """
    lines = Path(path).read_bytes().split(b"\n")[:-1]  # the last piece is empty or still being written
    batch = parse_lines(lines, path)
    return batch.records, batch.problems
