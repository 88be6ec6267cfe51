"""What the dashboard knows about a run: plain data built from its run directory (docs/architecture.md
sections 3-5).

:class:`RunModel` holds the launchers, ranks, nodes, violation counters and checkpoints of a run;
:class:`~.watcher.RunWatcher` fills it from the files. Plain data (it pickles), so the reading runs
in a process of its own (:mod:`.reader`) and the UI only draws it.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from osft.trainer.contract import ENDED_STATES, RunState, ended_well
from osft.trainer.contract import Event as MetricsEvent
from osft.trainer.rundir import LauncherRecord

from .format import fmt_bytes
from .series import Curve

#: A node whose tokens/s is below this fraction of the other nodes' mean is a straggler.
STRAGGLER_FRACTION = 0.8
#: Steps after a violation during which the violation counters stay in their alert state.
RECENT_STEPS = 20


@dataclass
class LauncherInfo:
    """One node's launcher, from ``run.json`` / ``run.node<N>.json``."""

    node_rank: int
    data: LauncherRecord

    @property
    def pid(self) -> int | None:
        return self.data.launcher_pid

    @property
    def hostname(self) -> str | None:
        return self.data.hostname

    @property
    def state(self) -> str:
        return self.data.state or "unknown"


@dataclass
class RankInfo:
    """One rank, from its ``run_started`` record (and its ``error``/``run_finished`` records)."""

    rank: int
    node_rank: int
    local_rank: int
    pid: int | None
    hostname: str
    job_id: str
    started: float
    error: str | None = None
    exit_code: int | None = None


@dataclass
class NodeStats:
    """One node's latest step record and its tokens/s over the run.

    Attributes:
        tokens_per_s: this node's ranks' tokens/s in the latest step (``node_tokens_per_s``).
        mfu: this node's model FLOPs utilisation in the latest step (``node_mfu``, a fraction).
        samples_per_s: the job's samples/s in the latest step (the schema has no per-node value: the
            run line shows it once).
        step_time_s: the latest step's wall time (s).
        lr: the latest step's learning rate.
        grad_norm: the latest step's gradient norm before clipping.
        rss_bytes: the reporting rank's resident memory (bytes), from the record.
        gpu_mem_bytes: its GPU memory (bytes), None on CPU.
        gpus: every GPU of the node in the latest step record (``gpus``: ``rank``, ``local_rank``,
            ``mem_bytes``, ``util_pct``), None on CPU.
        tokens: ``tokens_per_s`` over the whole run (resume-aware).
        job_id: the job of the latest step record.
    """

    node_rank: int
    hostname: str = "?"
    step: int | None = None
    loss: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    samples_per_s: float | None = None
    step_time_s: float | None = None
    lr: float | None = None
    grad_norm: float | None = None
    rss_bytes: int | None = None
    gpu_mem_bytes: int | None = None
    gpus: list[dict] | None = None
    step_times: deque = field(default_factory=lambda: deque(maxlen=10))
    last_ts: float = 0.0
    steps_seen: int = 0
    tokens: Curve = field(default_factory=Curve)
    job_id: str | None = None


@dataclass
class Violations:
    """Orthogonality-violation counters (docs/architecture.md section 4).

    Attributes:
        this_step: violations found in the latest checked step.
        total: the run's total (carried across resume by the trainer).
        worst_dev_deg: the worst deviation from 90° seen in any step read (degrees).
        records_sum: sum of ``ortho_violations`` over every step record read (a consistency check:
            equals ``total`` for a run read from its start).
        step: the latest step checked.
        last_at: the latest step with violations (None: none read).
    """

    this_step: int = 0
    total: int = 0
    worst_dev_deg: float | None = None
    records_sum: int = 0
    step: int | None = None
    last_at: int | None = None

    @property
    def alert(self) -> bool:
        """Violations in one of the last :data:`RECENT_STEPS` steps (the total alone stays non-zero
        for the rest of a run after one violation)."""
        return self.this_step > 0 or (self.last_at is not None and self.step is not None
                                      and self.step - self.last_at < RECENT_STEPS)


@dataclass
class CheckpointEntry:
    """A directory under ``full_state_checkpoints/``.

    Attributes:
        complete: it has a manifest whose files are all there with their recorded sizes (checksums
            are verified by the trainer when it resumes, not here).
        note: why it is not complete.
        bytes: size of the files it lists (its own files, not the shared frozen store).
        mtime: time of its manifest (or of the directory), unix s.
    """

    step: int
    path: Path
    complete: bool
    bytes: int
    mtime: float
    note: str = ""


@dataclass
class Event:
    """A line for the event pane: unix time, level (info, warning, error, log) and text."""

    ts: float
    level: str
    text: str

    @property
    def lifecycle(self) -> bool:
        """A line of the run's life (start, request, save, resume, error, end): never dropped by a cap,
        unlike warnings and rank output, which a run can write without bound."""
        return self.level in ("info", "error")


def describe(record: dict) -> Event | None:
    """The event-pane line of a metrics record other than ``step`` (None for ``step``)."""
    ev = record.get("event")
    ts = float(record.get("ts") or time.time())
    who = f"rank {record.get('rank')}"
    if ev == MetricsEvent.STEP:
        return None
    if ev == MetricsEvent.RUN_STARTED:
        return Event(ts, "info", f"{who} started (pid {record.get('pid')} on {record.get('hostname')}, node {record.get('node_rank')})")
    if ev == MetricsEvent.CHECKPOINT_REQUESTED:
        return Event(ts, "info", f"checkpoint requested at step {record.get('step')} ({record.get('signal')}, {record.get('point', 'safe point')})")
    if ev == MetricsEvent.CHECKPOINT_SAVED:
        seconds, blocking = float(record.get("seconds") or 0), record.get("blocking_s")
        blocked = f", training blocked {float(blocking):.1f} s" if blocking is not None and blocking < seconds else ""
        return Event(ts, "info", f"checkpoint of step {record.get('step')} written to {record.get('path')} "
                                 f"({fmt_bytes(record.get('bytes'))} in {seconds:.1f} s{blocked})")
    if ev == MetricsEvent.RESUMED:
        return Event(ts, "info", f"resumed from step {record.get('from_step')} ({record.get('path')})")
    if ev in (MetricsEvent.WARNING, MetricsEvent.ERROR):
        return Event(ts, ev, f"{who}: {ev}: {record.get('message')}")
    if ev == MetricsEvent.RUN_FINISHED:
        level = "info" if ended_well(record.get("exit_code")) else "error"
        export = f", export {record['export_dir']}" if record.get("export_dir") else ""
        return Event(ts, level, f"node {record.get('node_rank')}: run {record.get('reason')} at step {record.get('step')} "
                                f"(exit code {record.get('exit_code')}){export}")
    return Event(ts, "info", f"{who}: {ev}")


@dataclass
class PollResult:
    """What changed in one :meth:`RunWatcher.poll`: event lines, and ``checkpoint_requested`` and
    ``checkpoint_saved`` records in the order read."""

    events: list[Event] = field(default_factory=list)
    checkpoint_records: list[dict] = field(default_factory=list)


class RunModel:
    """What is known about a run: built by :class:`RunWatcher` from its files, read by the UI.

    Plain data (it pickles), so the reading can run in another process (:mod:`.reader`).

    Attributes:
        launchers: node rank -> its launcher's ``run.json`` / ``run.node<N>.json``.
        ranks: global rank -> its latest ``run_started`` (and error/exit records).
        nodes: node rank -> its latest step record and histories.
        records_read: metrics file name -> records read from it so far.
        log_paths: ``(node rank, local rank)`` -> the rank's ``stderr.log``.
        consumed_bytes: path of each file read -> bytes taken in so far (the rest is backlog).
        event_counts: event lines produced so far, by level (before the UI's caps).
        log_buffers: ``node<N>/local<L>`` -> lines kept, their cap, and bytes skipped by a flood.
        run_json_error: why ``run.json`` cannot be read now (None when it can, or is absent).
        gone: the run directory was there and is no longer (deleted or moved).
        curves: the run's metrics over its steps (node 0's records, resume-aware, see
            :class:`~.series.Curve`): ``loss``, ``lr``, ``grad_norm``, ``eval_loss <set>`` (nats per
            token) and ``forgetting <set>`` (retention sets: loss minus the step-0 loss, nats per token).
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.launchers: dict[int, LauncherInfo] = {}
        self.ranks: dict[int, RankInfo] = {}
        self.nodes: dict[int, NodeStats] = {}
        self.violations = Violations()
        self.checkpoints: list[CheckpointEntry] = []
        self.curves: dict[str, Curve] = {}
        self.max_steps: int | None = None
        self.step: int | None = None
        self.problems: list[str] = []
        self.run_json_error: str | None = None
        self.gone = False
        self.records_read: dict[str, int] = {}
        self.log_paths: dict[tuple[int, int], Path] = {}
        self.consumed_bytes: dict[str, int] = {}
        self.event_counts: dict[str, int] = {}
        self.log_buffers: dict[str, dict[str, int]] = {}

    @property
    def run(self) -> LauncherRecord:
        """``run.json`` (node 0's launcher), or an empty record before it exists."""
        node0 = self.launchers.get(0)
        return node0.data if node0 else LauncherRecord()

    @property
    def job_id(self) -> str | None:
        return self.run.job_id

    @property
    def state(self) -> str:
        """The run's state: node 0's, unless another node failed."""
        states = [info.state for info in self.launchers.values()]
        if not states:
            return "no run.json"
        return RunState.FAILED if RunState.FAILED in states else self.run.state or states[0]

    @property
    def export_dir(self) -> str | None:
        """The final export of a completed run (``run.json``'s ``export_dir``), else None."""
        return self.run.export_dir

    @property
    def finished(self) -> bool:
        return bool(self.launchers) and all(info.state in ENDED_STATES for info in self.launchers.values())

    def last_activity(self) -> float | None:
        """Unix time of the run's last sign of life: run.json's last update or the newest step
        record, whichever is later (None before either)."""
        times = [t for t in [self.run.updated_at, *(n.last_ts for n in self.nodes.values())] if t]
        return max(times) if times else None

    def node_exit_codes(self) -> dict[int, int]:
        """Node rank -> its launcher's exit code, for the nodes whose launcher ended."""
        return {n: info.data.exit_code for n, info in self.launchers.items()
                if info.state in ENDED_STATES and info.data.exit_code is not None}

    def gpus_by_rank(self) -> dict[int, dict]:
        """Global rank -> its GPU in its node's latest step record (``mem_bytes``, ``util_pct``);
        empty for a CPU run."""
        return {int(g["rank"]): g for node in self.nodes.values() for g in node.gpus or ()}

    def eta_s(self) -> float | None:
        """Seconds to ``max_steps`` at the mean step time of the last 10 steps."""
        node = self.nodes.get(0)
        if node is None or self.step is None or not self.max_steps or not node.step_times:
            return None
        return max(0, self.max_steps - self.step) * statistics.fmean(node.step_times)

    def rank_of(self, node_rank: int, local_rank: int) -> int:
        """Global rank of a node's local rank (``nproc_per_node`` from run.json)."""
        nproc = int(self.run.nproc_per_node or 1)
        return node_rank * nproc + local_rank

    def stragglers(self) -> set[int]:
        """Nodes whose latest tokens/s is more than 20% below the mean of the other nodes'."""
        rates = {n: s.tokens_per_s for n, s in self.nodes.items() if s.tokens_per_s}
        slow = set()
        for n, rate in rates.items():
            others = [r for m, r in rates.items() if m != n]
            if others and rate < STRAGGLER_FRACTION * statistics.fmean(others):
                slow.add(n)
        return slow

    def set_launcher(self, node_rank: int, data: LauncherRecord) -> None:
        """A new ``run.json`` (node 0) or ``run.node<N>.json``."""
        self.launchers[node_rank] = LauncherInfo(node_rank, data)
        steps = (data.config or {}).get("max_steps")
        if node_rank == 0 and steps:
            self.max_steps = int(steps)

    def apply(self, record: dict, result: PollResult) -> None:
        """Take in one metrics record; its event line and checkpoint saves go to ``result``."""
        ev = record.get("event")
        rank = record.get("rank")
        if ev == MetricsEvent.STEP:
            self._apply_step(record)
            return
        if ev == MetricsEvent.EVAL and int(record.get("node_rank", 0)) == 0:
            for name, key in ((f"eval_loss {record.get('set')}", "eval_loss"), (f"forgetting {record.get('set')}", "forgetting")):
                if record.get(key) is not None:
                    self.curves.setdefault(name, Curve()).add(int(record["step"]), float(record[key]))
        if ev == MetricsEvent.RESUMED and record.get("from_step") is not None:
            self._cut(int(record.get("node_rank", 0)), int(record["from_step"]))
        if ev == MetricsEvent.RUN_STARTED and isinstance(rank, int):
            self.ranks[rank] = RankInfo(rank, int(record.get("node_rank", 0)), int(record.get("local_rank", 0)),
                                        record.get("pid"), str(record.get("hostname")), str(record.get("job_id")),
                                        float(record.get("ts", 0)))
            cfg = record.get("config") or {}
            if not self.max_steps and cfg.get("max_steps"):
                self.max_steps = int(cfg["max_steps"])
        elif ev == MetricsEvent.ERROR and rank in self.ranks:
            self.ranks[rank].error = str(record.get("message"))
            if record.get("exit_code") is not None:
                self.ranks[rank].exit_code = record["exit_code"]
        elif ev == MetricsEvent.RUN_FINISHED and rank in self.ranks:
            self.ranks[rank].exit_code = record.get("exit_code")
        if ev in (MetricsEvent.CHECKPOINT_REQUESTED, MetricsEvent.CHECKPOINT_SAVED):
            result.checkpoint_records.append(record)
        event = describe(record)
        if event:
            result.events.append(event)

    def _cut(self, node_rank: int, after: int) -> None:
        """A resume from step ``after`` on ``node_rank``: its later points are replaced."""
        if node_rank in self.nodes:
            self.nodes[node_rank].tokens.cut(after)
        if node_rank == 0:
            for curve in self.curves.values():
                curve.cut(after)

    def _apply_step(self, record: dict) -> None:
        node_rank = int(record.get("node_rank", 0))
        node = self.nodes.setdefault(node_rank, NodeStats(node_rank))
        step = int(record.get("step") or 0)
        if node.tokens.steps and step <= node.tokens.steps[-1]:  # replayed after a resume
            self._cut(node_rank, step - 1)
        node.hostname = str(record.get("hostname", node.hostname))
        node.job_id = record.get("job_id")
        node.step = record.get("step")
        node.loss = record.get("loss")
        node.tokens_per_s = record.get("node_tokens_per_s", record.get("tokens_per_s"))
        node.mfu = record.get("node_mfu")
        node.samples_per_s = record.get("samples_per_s")
        node.step_time_s = record.get("step_time_s")
        node.lr = record.get("lr")
        node.grad_norm = record.get("grad_norm")
        node.rss_bytes = record.get("rss_bytes")
        node.gpu_mem_bytes = record.get("gpu_mem_bytes")
        node.gpus = record.get("gpus")
        if record.get("step_time_s"):
            node.step_times.append(float(record["step_time_s"]))
        node.last_ts = float(record.get("ts", 0))
        node.steps_seen += 1
        if node.tokens_per_s is not None:
            node.tokens.add(step, float(node.tokens_per_s))
        if node_rank == 0:
            self.step = node.step
            for key in ("loss", "lr", "grad_norm"):
                if record.get(key) is not None:
                    self.curves.setdefault(key, Curve()).add(step, float(record[key]))
            this = int(record.get("ortho_violations") or 0)
            v = self.violations
            v.this_step = this
            v.records_sum += this
            v.step = step
            if this:
                v.last_at = step
            v.total = int(record.get("ortho_violations_total") or 0)
            dev = record.get("ortho_max_dev_deg")
            if dev is not None and (v.worst_dev_deg is None or dev > v.worst_dev_deg):
                v.worst_dev_deg = float(dev)
