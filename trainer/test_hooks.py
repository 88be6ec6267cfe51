"""Every test-only hook of the trainer: ``OSFT_TEST_*`` environment variables that make a rank do
something at an exact point, so a test can reach a path it could not time from outside. Unset, each
reader returns its "no hook" value; nothing else reads these variables. Standard library only (the
collective watch imports ``torch.distributed`` when it is asked for).
"""

from __future__ import annotations

import functools
import os
import threading
from pathlib import Path

#: "STEP:LOCAL_RANK": that local rank logs a warning after that step (tests/test_distributed.py,
#: local-rank-1 warnings).
WARN_AT_ENV = "OSFT_TEST_WARN_AT"
#: "1": each step record gets ``state_sha256`` (every parameter and optimizer tensor of every
#: rank), to compare runs bit for bit.
STATE_HASH_ENV = "OSFT_TEST_STATE_HASH"
#: "STEP" makes the loss of that step non-finite (its first micro-batch's loss is multiplied by NaN
#: before the backward, so the gradients are NaN too); "STEP:grad" leaves the loss finite and puts a
#: NaN into one gradient; "STEP:spike" multiplies the loss by 1000. Each fires once per process (a
#: rollback replays the step on another batch).
DIVERGE_AT_ENV = "OSFT_TEST_DIVERGE_AT"
#: "SECONDS" or "SECONDS@STEP": rank 0 sleeps that long after its part of a checkpoint is written
#: (its shards and files), so before the manifest (of every save, or of the save of that step; with
#: ``--async-checkpoint`` on its background thread; tests/test_resume.py, the grace-period test).
SAVE_DELAY_ENV = "OSFT_TEST_SAVE_DELAY_S"
#: A directory: each rank records there every collective a thread other than the training thread
#: issues (:func:`watch_collective_threads`; tests/test_resume.py, the asynchronous checkpoint test).
COLLECTIVE_THREADS_ENV = "OSFT_TEST_COLLECTIVE_THREADS"
#: "STEP:POINT:MICRO:SIGNAL[,...]": rank 0 sends SIGNAL (to $OSFT_LAUNCHER_PID when set, else to
#: itself) at that safe point of that step and micro-batch (0-based; ignored for after_step), and
#: waits until the request is recorded, so the request is served exactly there.
SIGNAL_AT_ENV = "OSFT_TEST_SIGNAL_AT"
#: "SECONDS@STEP": each micro-batch of the evaluations after that step sleeps that long (a slow
#: evaluation set: tests/test_evaluation.py, tests/test_resume.py).
EVAL_DELAY_ENV = "OSFT_TEST_EVAL_DELAY_S"
#: "SECONDS": the fold of each module's protected subspaces at every export sleeps that long first
#: (a slow fold: tests/test_long_pass_stops.py).
FOLD_DELAY_ENV = "OSFT_TEST_FOLD_DELAY_S"
#: "SECONDS": each target's SVD of the OSFT decomposition at start-up sleeps that long first (slow
#: start-up SVDs: tests/test_long_pass_stops.py).
SVD_DELAY_ENV = "OSFT_TEST_SVD_DELAY_S"
#: "SECONDS": each batch of ``make-retention-set``'s greedy replies sleeps that long first
#: (tests/test_retention_set.py, the stop test).
GENERATE_DELAY_ENV = "OSFT_TEST_GENERATE_DELAY_S"


def warns_at(step: int, local_rank: int) -> bool:
    """Whether :data:`WARN_AT_ENV` asks ``local_rank`` for a test warning after ``step``."""
    return os.environ.get(WARN_AT_ENV) == f"{step}:{local_rank}"


def hashes_state() -> bool:
    """Whether :data:`STATE_HASH_ENV` asks for ``state_sha256`` in the step records."""
    return os.environ.get(STATE_HASH_ENV) == "1"


def injected_divergence(step: int, fired: set[int]) -> str | None:
    """The kind of divergence :data:`DIVERGE_AT_ENV` injects at ``step`` ("loss", "grad",
    "spike"), once per process (``fired`` remembers the steps already served), else None."""
    spec = os.environ.get(DIVERGE_AT_ENV)
    if not spec or step in fired:
        return None
    at, _, kind = spec.partition(":")
    if int(at) != step:
        return None
    fired.add(step)
    return kind or "loss"


def save_delay(step: int) -> float:
    """Seconds :data:`SAVE_DELAY_ENV` makes rank 0's part of the save of ``step`` wait (0.0: none)."""
    seconds, _, at = (os.environ.get(SAVE_DELAY_ENV) or "0").partition("@")
    return float(seconds) if not at or int(at) == step else 0.0


def signals_at() -> list[list[str]]:
    """The ``[STEP, POINT, MICRO, SIGNAL]`` entries of :data:`SIGNAL_AT_ENV`, in order ([] when unset)."""
    return [spec.split(":") for spec in os.environ.get(SIGNAL_AT_ENV, "").split(",") if spec]


def eval_delay(step: int) -> float:
    """Seconds :data:`EVAL_DELAY_ENV` makes each micro-batch of the evaluations after ``step`` sleep (0.0: none)."""
    seconds, _, at = (os.environ.get(EVAL_DELAY_ENV) or "0@0").partition("@")
    return float(seconds) if int(at or 0) == step else 0.0


def fold_delay() -> float:
    """Seconds :data:`FOLD_DELAY_ENV` makes each module's fold at an export sleep (0.0: none)."""
    return float(os.environ.get(FOLD_DELAY_ENV) or 0)


def svd_delay() -> float:
    """Seconds :data:`SVD_DELAY_ENV` makes each target's start-up SVD sleep (0.0: none)."""
    return float(os.environ.get(SVD_DELAY_ENV) or 0)


def generate_delay() -> float:
    """Seconds :data:`GENERATE_DELAY_ENV` makes each batch of ``make-retention-set`` sleep (0.0: none)."""
    return float(os.environ.get(GENERATE_DELAY_ENV) or 0)


#: The ``torch.distributed`` collectives :func:`watch_collective_threads` wraps.
WATCHED_COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "all_to_all", "all_to_all_single",
    "barrier", "monitored_barrier", "broadcast", "broadcast_object_list", "gather", "gather_object", "reduce",
    "reduce_scatter", "reduce_scatter_tensor", "scatter", "scatter_object_list",
)
#: (log file, thread id of the watching thread) while :data:`COLLECTIVE_THREADS_ENV` is set
_watch: tuple[Path, int] | None = None


def watch_collective_threads(rank: int) -> None:
    """With :data:`COLLECTIVE_THREADS_ENV` set to a directory: from now on, every call of a
    ``torch.distributed`` collective (:data:`WATCHED_COLLECTIVES`, as ``torch.distributed.<name>``
    and ``torch.distributed.distributed_c10d.<name>``) made by a thread other than the calling one
    (the training thread) appends ``<name> <thread name>`` to ``collectives_rank<rank>.txt`` there,
    whose first line is ``watching``. Unset: any earlier watch of this process ends."""
    global _watch
    directory = os.environ.get(COLLECTIVE_THREADS_ENV)
    if not directory:
        _watch = None
        return
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    log = Path(directory) / f"collectives_rank{rank}.txt"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as f:
        f.write("watching\n")
    _watch = (log, threading.get_ident())
    for name in WATCHED_COLLECTIVES:
        fn = getattr(c10d, name, None)
        if fn is None or getattr(fn, "osft_watched", False):
            continue
        watched = _watched(name, fn)
        setattr(c10d, name, watched)
        if getattr(dist, name, None) is fn:
            setattr(dist, name, watched)


def _watched(name: str, fn):
    """``fn`` that first records a call from a thread other than the watching one (:data:`_watch`)."""

    @functools.wraps(fn)
    def watched(*args, **kwargs):
        if _watch is not None and threading.get_ident() != _watch[1]:
            with _watch[0].open("a") as f:
                f.write(f"{name} {threading.current_thread().name}\n")
        return fn(*args, **kwargs)

    watched.osft_watched = True
    return watched
