"""What a training run ended with, as the Python API (:mod:`osft.trainer.launch.api`) returns it: the exit code and
what the run directory's metrics say about this job (docs/architecture.md sections 4 and 7)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..contract import EXIT_COMPLETED, EXIT_FAILED, EXIT_STOPPED, Event
from .metrics_file import tail_records
from ..rundir import RunDir

#: ``reason`` of each exit code; any other (128 + N: stopped by signal N without a checkpoint) is
#: ``interrupted``.
REASONS = {EXIT_COMPLETED: "completed", EXIT_STOPPED: "stopped", EXIT_FAILED: "failed"}
_WANTED = (Event.STEP, Event.CHECKPOINT_SAVED, Event.RUN_FINISHED)


@dataclass(frozen=True)
class TrainOutcome:
    """How a training run ended.

    Attributes:
        exit_code: what ``osft-train`` exits with (:mod:`.exit_codes`): 0 completed, 75 stopped on
            request after a complete checkpoint, 1 failed, 128 + N stopped by signal N without a
            checkpoint.
        reason: ``completed``, ``stopped``, ``failed`` or ``interrupted`` (128 + N).
        step: the step reached (the last step trained, or the step resumed at when none was left);
            None when the run reached no step.
        export_dir: the final HF export; None unless completed.
        checkpoint: the newest full-state checkpoint this run saved, or None.
        last_step: this run's last ``step`` record (loss, lr, grad_norm, tokens_per_s, ...:
            docs/architecture.md section 4), or None.
        run_dir: the run directory (``output_dir``).
        job_id: the job's id, which every record of this run carries.
    """

    exit_code: int
    reason: str
    step: int | None
    export_dir: str | None
    checkpoint: str | None
    last_step: dict[str, Any] | None
    run_dir: Path
    job_id: str


def read_outcome(run_dir: RunDir, job_id: str, exit_code: int, export_dir: str | None) -> TrainOutcome:
    """The outcome of job ``job_id``, which ended with ``exit_code`` and ``export_dir``, from the
    records it wrote to its node's metrics file (a missing file: a run that reached no step), read
    from the file's end back to the job's ``run_started`` at most.

    Raises:
        OSError: the metrics file exists but cannot be read.
    """
    path = run_dir.node_metrics()
    last: dict[str, dict] = {}
    for r in tail_records(path) if path.is_file() else ():  # newest first: a long file is read from its end
        if r.get("job_id") != job_id:
            continue
        if r.get("event") in _WANTED:
            last.setdefault(r["event"], r)
        if len(last) == len(_WANTED) or r.get("event") == Event.RUN_STARTED:  # nothing older is this job's
            break
    last_step, finished = last.get(Event.STEP), last.get(Event.RUN_FINISHED)
    step = finished["step"] if finished else last_step["step"] if last_step else None
    return TrainOutcome(exit_code=exit_code, reason=REASONS.get(exit_code, "interrupted"), step=step,
                        export_dir=export_dir, checkpoint=last[Event.CHECKPOINT_SAVED]["path"] if Event.CHECKPOINT_SAVED in last else None,
                        last_step=last_step, run_dir=run_dir.root, job_id=job_id)
