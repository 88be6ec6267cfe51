"""What the run line tells the user: the run's state as far as this dashboard can check it (the
file's word, the processes, a launch that failed), its clock and whether its steps stall.

``run.json`` alone can lie: a killed run never writes its end, a launch that fails on a bad flag
never writes the file at all. :func:`judge` weighs the file against what the dashboard sees.
"""

from __future__ import annotations

import statistics
from typing import NamedTuple

from osft.trainer.contract import LIVE_STATES, RunState

from .run_state import RunModel

#: A running run whose last step is older than this many median step times is stalling...
STALL_FACTOR = 5.0
#: ... and older than this many seconds (short steps jitter with the polls).
STALL_MIN_S = 10.0
#: Lines of a failed launcher's log shown in the event pane.
FAILURE_LINES = 8


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
            ``unreadable run.json``, ``no run.json``).
        detail: why, when the state is not simply run.json's (a JSON error, an exit code).
        elapsed_s: seconds since the start, up to the last sign of life once it ended or died.
        eta_s: seconds to ``max_steps`` (None unless it runs).
        last_step_age_s: seconds since node 0's last step record (None before the first).
        stalled: it runs, but its last step is older than :data:`STALL_FACTOR` median step times.
    """

    state: str
    detail: str = ""
    elapsed_s: float | None = None
    eta_s: float | None = None
    last_step_age_s: float | None = None
    stalled: bool = False


def judge(model: RunModel, live: bool | None, starting: bool, failure: LaunchFailure | None, now: float) -> Status:
    """The run's status.

    Args:
        model: the run as read.
        live: whether a process of the run is alive on this host (None: the run is on another
            host, nothing to check).
        starting: a launcher started here runs and has not written its ``run.json`` yet (the file
            is absent or an earlier launcher's).
        failure: a launcher started here that failed, if any: it is the run's state unless the
            launcher wrote ``run.json`` itself.
        now: unix time.
    """
    if failure is not None and not starting and failure.pid != model.run.launcher_pid:
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
    running = state in LIVE_STATES
    start = model.run.start_time
    end = now if running else model.last_activity()
    elapsed = None if start is None or end is None else max(0.0, end - start)
    node = model.nodes.get(0)
    age = None if node is None or not node.last_ts else max(0.0, now - node.last_ts)
    stalled = (state == RunState.RUNNING and age is not None and bool(node.step_times)
               and age > max(STALL_FACTOR * statistics.median(node.step_times), STALL_MIN_S))
    return Status(state, detail, elapsed, model.eta_s() if running else None, age, stalled)
