"""The run browser's data: the run directories directly under a directory, one summary each.

``osft-tui DIR`` on a directory without ``run.json`` that holds run directories (subdirectories
with a ``run.json``: a ``runs/`` folder) lists them instead of waiting for a run to appear there.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import NamedTuple

from osft.trainer.contract import LIVE_STATES, Event, RunState, parse_lines
from osft.trainer.rundir import LauncherRecord, RunDir, read_launcher_record

from .processes import ProcessView, this_host
from .run_state import RunModel

#: Bytes read from the end of a run's ``metrics/node0.jsonl`` to find its last step record.
TAIL_BYTES = 256 * 1024
#: Seconds without a sign of life after which a live run of another host is listed as :data:`STALE`.
STALE_S = 600.0
#: States the browser lists a run in that ``run.json`` calls live: its launcher is gone from this
#: host (``dead``, as the dashboard says), or a run of another host has been silent for :data:`STALE_S`.
DEAD, STALE = "dead", "stale"
#: The state the browser lists a run in whose ``run.json`` cannot be read.
UNREADABLE = "unreadable run.json"


class RunSummary(NamedTuple):
    """One run directory, as the browser lists it.

    Attributes:
        path: the run directory.
        state: ``run.json``'s state, ``unreadable run.json``, or :data:`DEAD` or :data:`STALE` for a
            live state that is no longer true.
        step: the last step record's step (None before the first).
        loss: its loss.
        age_s: seconds since the run's last sign of life (``run.json`` updated, last step record).
    """

    path: Path
    state: str
    step: int | None
    loss: float | None
    age_s: float | None


def run_dirs(root: Path) -> list[Path]:
    """The subdirectories of ``root`` that hold a ``run.json``, by name; [] when ``root`` has its
    own ``run.json`` (it is a run) or cannot be listed."""
    if RunDir(root).run_json.exists():
        return []
    try:
        return sorted(p for p in root.iterdir() if p.is_dir() and RunDir(p).run_json.is_file())
    except OSError:
        return []


def last_step_record(path: Path) -> dict | None:
    """The last complete ``step`` record in the JSONL file ``path`` (None if there is none in its
    last :data:`TAIL_BYTES` or the file cannot be read); lines parsed by the contract's one reader
    (:func:`osft.trainer.contract.parse_lines`)."""
    try:
        with open(path, "rb") as f:
            start = max(0, os.fstat(f.fileno()).st_size - TAIL_BYTES)
            f.seek(start)
            lines = f.read().split(b"\n")[:-1]  # the last piece is empty or still being written
    except OSError:
        return None
    if start:
        lines = lines[1:]  # cut by the seek
    steps = [r for r in parse_lines(lines, path).records if r.get("event") == Event.STEP]
    return steps[-1] if steps else None


def summarize(path: Path, now: float | None = None) -> RunSummary:
    """The browser's line for the run directory ``path`` (``now``: unix time, default the clock)."""
    run = RunDir(path)
    try:
        record = read_launcher_record(run.run_json)
        state = str(record.state or "unknown")
    except (OSError, ValueError):
        record, state = LauncherRecord(), UNREADABLE
    step = last_step_record(run.node_metrics(0)) or {}
    times = [t for t in (record.updated_at, step.get("ts")) if t]
    age = (time.time() if now is None else now) - max(times) if times else None
    loss = step.get("loss")
    if state in LIVE_STATES:
        state = _checked(path, record, age, state)
    return RunSummary(path, state, step.get("step"), None if loss is None else float(loss), age)


def _checked(path: Path, record: LauncherRecord, age: float | None, state: str) -> str:
    """A live ``state`` of ``run.json`` ``record`` as far as this host can check it: :data:`DEAD` when
    its launcher was started here and is gone, :data:`STALE` when it runs elsewhere and was silent
    for :data:`STALE_S` (``age``), else ``state``."""
    if this_host(record.hostname):
        model = RunModel(path)
        model.set_launcher(0, record)
        return state if ProcessView(model).launcher(0) is not None else DEAD
    return STALE if age is not None and age > STALE_S else state


#: The browser's state filters, in the order ``f`` steps through them: name -> states shown (None: all).
STATE_FILTERS: dict[str, frozenset[str] | None] = {
    "all": None,
    "live": frozenset(LIVE_STATES),
    "failed": frozenset({RunState.FAILED, DEAD, STALE, UNREADABLE, "launch failed"}),
    "ended": frozenset({RunState.COMPLETED, RunState.STOPPED}),
}
#: The browser's age windows, in the order ``a`` steps through them: name -> seconds (None: any age).
AGE_WINDOWS: dict[str, float | None] = {"any age": None, "1 h": 3600.0, "1 day": 86400.0, "1 week": 7 * 86400.0}
#: How the browser's states sort: live first, then the ones to look at, then the ended well.
STATE_ORDER = (RunState.STARTING, RunState.RUNNING, RunState.CHECKPOINTING, STALE, DEAD, RunState.FAILED, UNREADABLE,
               RunState.STOPPED, RunState.COMPLETED)
#: The browser's columns, each with how its rows sort (a missing step, loss or age sorts last).
SORT_KEYS = {
    "run": lambda s: (0, s.path.name.lower()),
    "state": lambda s: (0, STATE_ORDER.index(s.state) if s.state in STATE_ORDER else len(STATE_ORDER), s.state),
    "step": lambda s: (s.step is None, s.step or 0),
    "last loss": lambda s: (s.loss is None, s.loss or 0.0),
    "age": lambda s: (s.age_s is None, s.age_s or 0.0),
}


class Listing(NamedTuple):
    """What the browser shows of its runs: sorted by ``sort`` (a :data:`SORT_KEYS` column,
    ``descending`` or not), only the states of ``states`` (a :data:`STATE_FILTERS` name), only the
    runs whose last sign of life is within ``age`` (an :data:`AGE_WINDOWS` name), only names
    holding ``text`` (any case)."""

    sort: str = "run"
    descending: bool = False
    states: str = "all"
    age: str = "any age"
    text: str = ""

    def apply(self, summaries: list[RunSummary]) -> list[RunSummary]:
        """The rows shown, in order (runs without a step, loss or age last, whichever the direction)."""
        shown_states, window = STATE_FILTERS[self.states], AGE_WINDOWS[self.age]
        kept = [s for s in summaries
                if (shown_states is None or s.state in shown_states)
                and (window is None or (s.age_s is not None and s.age_s <= window))
                and self.text.lower() in s.path.name.lower()]
        key = SORT_KEYS[self.sort]
        known = sorted((s for s in kept if not key(s)[0]), key=key, reverse=self.descending)
        return known + [s for s in kept if key(s)[0]]

    def describe(self) -> str:
        """One line: the sort and every filter in force."""
        parts = [f"sorted by {self.sort} {'▼' if self.descending else '▲'}"]
        if self.states != "all":
            parts.append(f"state: {self.states}")
        if self.age != "any age":
            parts.append(f"active within {self.age}")
        if self.text:
            parts.append(f"name holds {self.text!r}")
        return " · ".join(parts)
