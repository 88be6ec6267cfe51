"""Every exit code ``osft-train`` (and its torchrun worker ``osft.trainer.worker``) ends with, and
what the generated SLURM script (:mod:`osft.trainer.cluster.slurm`) and Kubernetes Job (:mod:`osft.trainer.cluster.kubernetes`) do on it.

One table for code, README and the generated jobs; a new exit code is added here first.
"""

from __future__ import annotations

import signal
from typing import NamedTuple

#: Training completed: every step trained and the final HF export written; or the run ended itself
#: by a rule the user set (``--max-forgetting``, ``--early-stopping-patience``: ``run_finished``
#: says which), which is done too, so no scheduler runs it again.
EXIT_COMPLETED = 0
#: Training failed (a rank died or raised, the worker group could not start or was killed, or a
#: stop's checkpoint did not finish within ``--checkpoint-grace-seconds``); ``osft-train`` prints
#: what happened, the newest complete checkpoint and the command that resumes from it. Also a
#: divergence (``--on-divergence stop``, or rollback without a checkpoint or rollbacks left): the
#: last good step is checkpointed and ``run_finished`` has reason ``diverged``.
EXIT_FAILED = 1
#: Bad input (flags, config file, data, model path, checkpoint to resume from), reported before any
#: rank starts.
EXIT_BAD_INPUT = 2
#: Stopped on request after writing a complete full-state checkpoint (EX_TEMPFAIL, "try again
#: later": resume with ``--resume``).
EXIT_STOPPED = 75
#: 128 + N: stopped by signal N without a checkpoint (``--on-demand-checkpointing`` off).
EXIT_SIGNAL_BASE = 128


class ExitCode(NamedTuple):
    """One row of :data:`EXIT_CODES`: the code (a text for the 128 + N range), what it means, and
    what the generated SLURM script and Kubernetes Job do on it."""

    code: str
    meaning: str
    slurm: str
    kubernetes: str


EXIT_CODES = (
    ExitCode(str(EXIT_COMPLETED), "training completed, final export written; or ended by the forgetting budget "
             "(export: hf_format/best) or early stopping (run_finished reason forgetting_budget, early_stopping)",
             "exits 0: the job is done", "the pod succeeds; the Job completes when every pod has"),
    ExitCode(str(EXIT_FAILED), "training failed: a rank died or raised, the worker group failed or was killed, "
             "or a stop's checkpoint missed the grace period (the report names the newest complete checkpoint "
             "and the resume command); or the run diverged (run_finished reason diverged, last good step "
             "checkpointed)",
             "exits 1, no requeue", "counted against backoffLimit; a new pod resumes until the limit (after a "
             "divergence it likely diverges again: set --on-divergence rollback, or a small backoffLimit)"),
    ExitCode(str(EXIT_BAD_INPUT), "bad input (flags, config file, data, model, checkpoint), before any rank starts",
             "exits 2, no requeue", "FailJob: a retry cannot help"),
    ExitCode(str(EXIT_STOPPED), "stopped on request after a complete full-state checkpoint",
             "requeues the job (scontrol requeue), which resumes; not after a SIGTERM (scancel, preemption)",
             "Ignore: a new pod with the same index resumes"),
    ExitCode(f"{EXIT_SIGNAL_BASE} + N", "stopped by signal N without a checkpoint (--on-demand-checkpointing off)",
             "exits with it, no requeue", "counted against backoffLimit"),
)


def stopped_by_signal(signum: int) -> int:
    """The exit code of a run stopped by ``signum`` without a checkpoint: 128 + its number."""
    return EXIT_SIGNAL_BASE + int(signum)


def describe(code: int) -> str:
    """A short text for an exit code of a process: ``exit code 1``, ``SIGKILL`` for -9 (Python's
    way of reporting death by a signal) and for 128 + N."""
    if code < 0:
        return signal.Signals(-code).name
    if code > EXIT_SIGNAL_BASE and code - EXIT_SIGNAL_BASE in signal.Signals._value2member_map_:
        return f"exit code {code} ({signal.Signals(code - EXIT_SIGNAL_BASE).name})"
    return f"exit code {code}"
