"""What the run line tells the user: the run's state as far as this dashboard can check it (the
file's word, the processes, a launch that failed), its clock and whether its steps stall.

``run.json`` alone can lie: a killed run never writes its end, a launch that fails on a bad flag
never writes the file at all. :func:`judge` weighs the file against what the dashboard sees.
"""

from __future__ import annotations

import statistics
from typing import NamedTuple

from osft.trainer.contract import LIVE_STATES, RunState

from .run_state import NodeStats, RunModel

#: A running run whose last step is older than this many median step times is stalling...
STALL_FACTOR = 5.0
#: ... and older than this many seconds (short steps jitter with the polls).
STALL_MIN_S = 10.0
#: Lines of a failed launcher's log shown in the event pane.
FAILURE_LINES = 8
#: Characters of a failed rank's error on the run line at most.
ERROR_CHARS = 120
#: The state shown once the run directory is deleted.
GONE = "directory gone"


class LaunchFailure(NamedTuple):
    """A launcher started by this dashboard that ended with an error before the run ended.

    Attributes:
        pid: its pid.
        node_rank: its node.
        exit_code: its exit code.
        lines: the last lines of its output (``logs/launcher.node<N>.log``).
    """

    pid: int
    node_rank: int
    exit_code: int
    lines: tuple[str, ...]


class Status(NamedTuple):
    """The run line's facts.

    Attributes:
        state: the state shown (run.json's, or ``starting``, ``dead``, ``launch failed``,
            ``unreadable run.json``, ``no run.json``, :data:`GONE`).
        detail: why, when the state is not simply run.json's (a JSON error, an exit code).
        elapsed_s: seconds since the start, up to the last sign of life once it ended or died.
        eta_s: seconds to ``max_steps`` (None unless it runs).
        last_step_age_s: seconds since node 0's last step record (None before the first).
        stalled: it runs, but its last step is older than :data:`STALL_FACTOR` median step times.
        step: the step shown (None before the first step of the job run.json names).
    """

    state: str
    detail: str = ""
    elapsed_s: float | None = None
    eta_s: float | None = None
    last_step_age_s: float | None = None
    stalled: bool = False
    step: int | None = None


def judge(model: RunModel, live: bool | None, starting: bool, failure: LaunchFailure | None, now: float) -> Status:
    """The run's status.

    Args:
        model: the run as read.
        live: whether a process of the run is alive on this host (None: not known, from a sample
            taken before the run's launchers were read, or the run is on another host).
        starting: a launcher started here runs and has not written its ``run.json`` yet (the file
            is absent or an earlier launcher's).
        failure: a launcher started here that failed, if any: it is the run's state when no node's
            state file is its own and none of them says the run is live (a relaunch refused beside
            a live run, or a node that failed mid-training, leaves the run's own state).
        now: unix time.
    """
    if model.gone:
        return Status(GONE, f"run directory {model.root} no longer exists")
    files_live = any(info.state in LIVE_STATES for info in model.launchers.values())
    own = {info.pid for info in model.launchers.values()}
    if failure is not None and not starting and failure.pid not in own and not files_live:
        return Status("launch failed", f"launcher of node {failure.node_rank} exited with code {failure.exit_code}")
    if starting:
        return Status(RunState.STARTING, "launcher started; waiting for its run.json")
    if not model.launchers:
        if model.run_json_error:
            return Status("unreadable run.json", model.run_json_error)
        return Status("no run.json")
    state, detail = model.state, ""
    if model.run_json_error:
        detail = f"run.json unreadable now ({model.run_json_error}); showing the last one read"
    if live is False and state in LIVE_STATES:
        state, detail = "dead", f"run.json says {model.state}, but no process of the run is left on this host"
    if state == RunState.FAILED:
        detail = failed_at(model)
    running = state in LIVE_STATES
    start = model.run.start_time
    end = now if running else model.last_activity()
    elapsed = None if start is None or end is None else max(0.0, end - start)
    node = model.nodes.get(0)
    if running and node is not None and not current(model, node):
        return Status(state, f"loading: no step of this job yet (step {node.step} was an earlier job's)", elapsed)
    age = None if node is None or not node.last_ts else max(0.0, now - node.last_ts)
    stalled = state == RunState.RUNNING and node is not None and stalling(node, now)
    return Status(state, detail, elapsed, model.eta_s() if running else None, age, stalled, model.step)


def liveness(alive: bool | None, gone_at: float | None, read_at: float) -> bool | None:
    """The liveness :func:`judge` may go by: ``alive`` as sampled, except that "no process left"
    stays unknown (None) until the run directory has been read after the sample that first found
    none (``gone_at``, unix time): a run writes its last word (``stopped``, ``completed``) before
    its processes exit, and the reader may not have delivered that word yet.

    Args:
        alive: the latest process sample (None: not known).
        gone_at: unix time of the first sample in a row that found no process of the run.
        read_at: unix time the poll that read the model shown began.
    """
    if alive is False and (gone_at is None or read_at < gone_at):
        return None
    return alive


def current(model: RunModel, node: NodeStats) -> bool:
    """Whether ``node``'s latest step record is of the job ``run.json`` names (not of the job a
    resume replaces, while the new one loads its model)."""
    return node.job_id is None or model.job_id is None or node.job_id == model.job_id


def stalling(node: NodeStats, now: float) -> bool:
    """Whether ``node``'s last step record is older than :data:`STALL_FACTOR` median step times and
    :data:`STALL_MIN_S` at unix time ``now``."""
    return bool(node.step_times and node.last_ts) and \
        now - node.last_ts > max(STALL_FACTOR * statistics.median(node.step_times), STALL_MIN_S)


def stalled_nodes(model: RunModel, now: float) -> set[int]:
    """Nodes whose state file says they run (node 0's when a node has none) but whose steps stall:
    a node hung in a collective after another node failed, say."""
    fallback = model.launchers.get(0)
    out = set()
    for n, node in model.nodes.items():
        info = model.launchers.get(n, fallback)
        if info is not None and info.state in LIVE_STATES and current(model, node) and stalling(node, now):
            out.add(n)
    return out


def failed_at(model: RunModel) -> str:
    """``at step N (rank R: error)`` for a failed run: R is the lowest rank that recorded an error
    (its message, at most :data:`ERROR_CHARS` characters), N the step it was in, one after its node's
    last step record (the slowest node's without an error record; ``after step N`` once that
    reached max steps, ``before the first step`` without one)."""
    errors = sorted((r.rank, r.node_rank, r.error) for r in model.ranks.values() if r.error and r.job_id == model.job_id)
    nodes = [n for n in model.nodes.values() if n.step is not None and current(model, n)]
    if errors:
        nodes = [n for n in nodes if n.node_rank == errors[0][1]]
    last = min((n.step for n in nodes), default=None)
    if last is None:
        where = "before the first step"
    elif model.max_steps and last >= model.max_steps:
        where = f"after step {last}"
    else:
        where = f"at step {last + 1}"
    if not errors:
        return where
    rank, _, error = errors[0]
    error = error if len(error) <= ERROR_CHARS else error[: ERROR_CHARS - 1] + "…"
    return f"{where} (rank {rank}: {error})"
