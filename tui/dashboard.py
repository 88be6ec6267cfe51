"""The dashboard screen: one run's state, violation counters, nodes, charts, checkpoints, ranks and events.

It polls the run (through a reader process) and redraws; the keys, buttons and palette commands
(:data:`~.keys.CONTROLS`) run the control flows of :mod:`.controls`, which report back by messages
(:mod:`.messages`, handled here with ``@on``).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import TYPE_CHECKING

from osft.trainer.contract import RunState
from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.content import Content
from textual.notifications import SeverityLevel
from textual.screen import Screen
from textual.widgets import Button, Label

from .components.checkpoints import CheckpointTable
from .components.header import STATE_STYLE, RunHeader
from .components.footer import KeyFooter
from .components.lines import LineView
from .components.modals import ask_search
from .components.nodes import NodeTable
from .components.ranks import RankTable
from .components.violations import ViolationCounters
from .controls import Controls
from .flow import Shown
from .keys import ACTING, BACK, CONTROL_BY_ACTION, CONTROLS, HELP, QUIT, Presses, offered
from .messages import Offered, Said, Told, Watch
from .processes import ProcessView, ProcStats, this_host
from .reader import Reader, Update
from .requests import CHECKPOINT, STOP
from .run_state import Event, RunModel, Violations
from .status import Status, judge, liveness, stalled_nodes

if TYPE_CHECKING:
    from .components.charts import MetricChart, ThroughputChart

#: Seconds between the costly redraws (charts, rank table, event pane) and psutil samples of
#: the run's processes (CPU % is measured over this interval). The run line, the node and
#: checkpoint tables and the violation counters follow every poll.
SAMPLE_S = 1.0
#: Warning lines written to the event pane per SAMPLE_S at most; the others are counted in a
#: "… not shown" line (a flooding run cannot make the UI slow to answer keys). Lifecycle lines
#: (starts, requests, saves, errors, ends) are never dropped. Rank output is not an event: the
#: log view (l) shows it.
EVENT_LINES = 20
#: Seconds an event line is not repeated: the same warning of every rank (or written again by
#: the same rank) within this time is one line naming the ranks.
REPEAT_S = 10.0
#: The "rank N: " start of a rank's event line (events of every rank that differ only in it are one).
_RANK_PREFIX = re.compile(r"^rank (\d+): ")

#: States the event pane reports in red.
ALARMS = frozenset(state for state, style in STATE_STYLE.items() if "red" in style)
#: States that ring the terminal bell when the run reaches them while watched (not on attaching).
BELL_STATES = ("completed", "failed", "dead", "launch failed")
LEVEL_STYLE = {"info": "", "warning": "yellow", "error": "bold red", "log": "dim"}


class Dashboard(Screen):
    """Watches the run in ``run_dir`` (None: none yet) and controls it.

    Args:
        run_dir: the run directory to watch.
        launcher: the command that runs ``osft-train`` (the launcher), e.g. ``[python, -m, osft.trainer.launch.cli]``.
        readonly: remove every control that signals a run.
        poll_s: seconds between polls of the run directory and the processes.
        runs: the directory of runs this dashboard's run was chosen from (``escape`` goes back to
            its run browser), or None.
    """

    #: Help and quit first: the footer cuts what does not fit on its right (80 columns).
    BINDINGS = sorted((c.binding for c in CONTROLS), key=lambda b: b.action not in (HELP.command, QUIT.command))

    def __init__(self, run_dir: Path | None, launcher: list[str], readonly: bool = False, poll_s: float = 0.25,
                 runs: Path | None = None) -> None:
        super().__init__(id="dashboard")
        self.controls = Controls(launcher, readonly, runs)
        self.presses = Presses()
        self.readonly = readonly
        self.poll_s = poll_s
        self.reader: Reader | None = None
        self.run: RunModel | None = None
        self.view: ProcessView | None = None
        self._stats: dict[int, ProcStats | None] = {}
        self._queued = Update(RunModel("."))
        self._live: bool | None = None
        self._live_of: tuple = ()
        self._gone_at: float | None = None  # the first sample in a row that found no process of the run
        self._read_at = float("-inf")  # when the reader's poll that read the model shown began
        self._sampled = float("-inf")
        self._stale = False  # a poll while another screen was on top drew nothing
        self._told: tuple[str, str] | None = None
        self._said: dict[str, float] = {}
        #: The metric chart and the tokens/s chart, once mounted (:meth:`_mount_charts`).
        self.charts: tuple[MetricChart, ThroughputChart] | tuple[()] = ()
        if run_dir is not None:
            self.attach(run_dir)

    # ------------------------------------------------------------------ layout
    def compose(self) -> ComposeResult:
        yield RunHeader(id="header")
        yield ViolationCounters(id="violations")
        yield NodeTable(id="nodes")
        yield Horizontal(id="charts")  # filled after the first frame: _mount_charts
        with Horizontal(id="middle"):
            with Vertical(id="checkpoint-pane"):
                yield Label("checkpoints (select, r resumes)", classes="pane-title")
                yield CheckpointTable(id="checkpoints")
            with Vertical(id="rank-pane"):
                yield Label("ranks (select, l for logs)", classes="pane-title")
                yield RankTable(id="ranks")
        yield LineView("events (/ search, v level)", 1000, id="events")
        with Horizontal(id="buttons"):
            for c in offered(self.readonly, self.controls.screens.runs is not None):
                key = self.app.get_key_display(c.binding)
                yield Button(f"{c.title} ({key})", id=f"button-{c.action}", compact=True)
        yield self.controls
        yield KeyFooter()

    def on_mount(self) -> None:
        self.poll()
        self.set_interval(self.poll_s, self.poll)
        self.call_after_refresh(self._mount_charts)

    async def _mount_charts(self) -> None:
        """Mount the metric and tokens/s charts once the first frame is on screen: their plotting
        library (textual-plotext, plotext) takes about 20 ms to import, which the first frame
        need not wait for."""
        from .components.charts import MetricChart, ThroughputChart

        self.charts = (MetricChart(id="metric-chart"), ThroughputChart(id="tokens-chart"))
        await self.query_one("#charts", Horizontal).mount_all(self.charts)
        if self.run is not None:
            for chart in self.charts:
                chart.show(self.run)

    def notify(self, message: str, *, title: str = "", severity: SeverityLevel = "information",
               timeout: float | None = None, markup: bool = False) -> None:
        """A toast, its message plain text by default: the dashboard's messages carry paths, job names
        and run output, whose square brackets are not markup."""
        super().notify(message, title=title, severity=severity, timeout=timeout, markup=markup)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """--readonly hides and disables every control that acts on a run or starts one; the way back
        to the run browser is there only for a run chosen in it."""
        if action != "control" or not parameters:
            return True
        if parameters[0] == BACK.action:
            return self.controls.screens.runs is not None
        return not (self.readonly and parameters[0] in ACTING)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.action_control((event.button.id or "").removeprefix("button-"))

    # ------------------------------------------------------------------ polling
    def attach(self, run_dir: Path) -> None:
        """Watch ``run_dir`` from now on (its history is read from the start, in a reader process);
        every pane forgets the run shown before."""
        if self.reader is not None:
            self.reader.close()
        self.reader = Reader(run_dir, self.poll_s)
        self.run = RunModel(run_dir)
        self.view = ProcessView(self.run)
        self.controls.requests.pending.clear()
        self.controls.launches.failure = None
        self._queued = Update(RunModel("."))
        self._stats, self._live, self._live_of, self._sampled, self._told, self._said = \
            {}, None, (), float("-inf"), None, {}
        self._gone_at, self._read_at = None, float("-inf")
        if self.is_mounted:
            self.query_one(LineView).forget()
            self.query_one(CheckpointTable).show([])
            self.query_one(NodeTable).clear()
            self.query_one(RankTable).clear()
            for chart in self.charts:
                chart.show(self.run)
            self.query_one(ViolationCounters).show(Violations())

    def on_unmount(self) -> None:
        if self.reader is not None:
            self.reader.close()

    def poll(self) -> None:
        """Take the reader's update, sample the processes (every :data:`SAMPLE_S`), redraw."""
        if self.controls.launches.started:
            self.controls.launches.reap(Shown(self.run, self.view, self._live))
        if self.reader is None or self.run is None or self.view is None:
            self.query_one(RunHeader).show(None, None, self.readonly)
            return
        try:
            update = self.reader.receive()
        except RuntimeError as exc:
            self.notify(f"{exc}; attaching again", severity="error")
            self.attach(self.run.root)
            return
        now = time.monotonic()
        if update is None and now - self._sampled < SAMPLE_S:
            return
        if update is not None:
            self.run = self.view.model = update.model
            self._read_at = update.read_at
            self._queue_events(update)
        slow = now - self._sampled >= SAMPLE_S  # the costly redraws: once per SAMPLE_S
        if slow:
            self._stats, self._sampled = self._sample(), now
        processes = self._processes()
        if slow or processes != self._live_of:  # at once when the run names other processes
            alive = self.view.any_alive() if any(processes) else None
            if alive is not False:
                self._gone_at = None
            elif self._gone_at is None or processes != self._live_of:  # the first sample to find none
                self._gone_at = time.time()
            self._live, self._live_of = alive, processes
        run, stats = self.run, self._stats
        here = any(this_host(i.hostname) for i in run.launchers.values()) or any(s is not None for s in stats.values())
        launches = self.controls.launches
        live = liveness(self._live, self._gone_at, self._read_at) if here else None
        status = judge(run, live, launches.starting(run), launches.failure, time.time())
        self._tell(status)
        if self.on_terminal():
            self._draw(status, slow)
        else:  # under the help, the log view or the new-run form: drawn in full once shown again (on_screen_resume)
            self._stale = True
        for record in update.checkpoint_records if update else []:
            self.controls.requests.answer(record, Shown(run, self.view, self._live))
        if slow:
            self.offer_controls()

    def on_terminal(self) -> bool:
        """Whether any of the dashboard is on the terminal: it is the top screen, or every screen
        above it lets it show through (a dialog's translucent background). Textual's
        ``Screen.is_current`` is true under an opaque screen too."""
        stack = self.app.screen_stack
        return self in stack and all(s.styles.background.a < 1 for s in stack[stack.index(self) + 1:])

    def _draw(self, status: Status, slow: bool) -> None:
        """Show the run: the run line, counters, node and checkpoint tables each poll; the event
        lines, charts and rank table when ``slow`` (once per :data:`SAMPLE_S`)."""
        run, stats = self.run, self._stats
        if slow:
            self._write_events()
        usage: dict[int, tuple[float | None, int | None]] = {}
        for rank, s in stats.items():
            if s is None or not s.alive or rank not in run.ranks:
                continue
            node = run.ranks[rank].node_rank
            cpu, rss = usage.get(node, (0.0, 0))
            usage[node] = ((cpu or 0.0) + (s.cpu_percent or 0.0), (rss or 0) + (s.rss_bytes or 0))
        self.query_one(RunHeader).show(run, status, self.readonly)
        self.query_one(ViolationCounters).show(run.violations)
        self.query_one(NodeTable).show(run, usage, stalled_nodes(run, time.time()))
        if slow:
            for chart in self.charts:
                chart.show(run)
        self.query_one(CheckpointTable).show(run.checkpoints)
        if slow:
            self.query_one(RankTable).show([r for _, r in sorted(run.ranks.items())], stats, run.node_exit_codes(),
                                            run.gpus_by_rank())

    def on_screen_resume(self) -> None:
        """Back on top: the first frame shows the panes as they were (their renders are kept, so
        it costs one composite); everything that changed meanwhile is drawn right after it."""
        if self._stale:
            self._stale, self._sampled = False, float("-inf")
            self.call_after_refresh(self.poll)

    def offer_controls(self) -> None:
        """Dim the buttons that cannot act now, with the reason as their tooltip: checkpoint and
        stop while a request of their kind waits for its checkpoint, checkpoint, stop and kill
        while no process of the run is alive here (the keys say why when pressed)."""
        requests = self.controls.requests
        why, pending = requests.unavailable(Shown(self.run, self.view, self._live)), requests.pending.steps
        for action, kind in (("checkpoint", CHECKPOINT), ("stop", STOP), ("kill", None)):
            reason = why
            if reason is None and kind in pending:
                reason = f"{kind} requested at step {pending[kind] or 0}; waiting for its checkpoint"
            for button in self.query(f"#button-{action}").results(Button):
                tip = None if reason is None else Content(reason)  # plain: run.json's state is the run's text
                if (button.disabled, button.tooltip) != (reason is not None, tip):
                    button.disabled, button.tooltip = reason is not None, tip

    def _tell(self, status: Status) -> None:
        """Put a state the run line gives a reason for (dead, launch failed, unreadable run.json) in
        the event pane once, in full (the run line may be cut). A run seen ending while watched
        (:data:`BELL_STATES`) rings the terminal bell; a completed one also says where its export is."""
        told = (status.state, status.detail)
        if told != self._told and status.detail and status.state != RunState.STARTING:
            self.log_event(f"{status.state}: {status.detail}", "bold red" if status.state in ALARMS else "yellow")
        was = self._told[0] if self._told is not None else None  # None: just attached
        if was is not None and was != status.state:
            if was not in BELL_STATES and status.state in BELL_STATES:
                self.app.bell()
            if status.state == "completed" and self.run is not None:
                where = f"export: {self.run.export_dir} (y copies it)" if self.run.export_dir else "no export recorded"
                self.notify(where, title="run completed", timeout=30)
        self._told = told

    def _queue_events(self, update: Update) -> None:
        """Keep the update's event lines for the next write (every lifecycle line and the newest
        :data:`EVENT_LINES` warnings; the others are counted); rank output is dropped (the log view
        reads it); its checkpoint records are answered by the poll that took it, not kept."""
        self._queued.merge(update).cap(EVENT_LINES, 0).checkpoint_records.clear()

    def _write_events(self) -> None:
        """Append the queued lines to the event pane in one write (one render, one scroll)."""
        q = self._queued
        lines = []
        if q.dropped_events:
            lines.append(("info", Text(f"… {q.dropped_events} events not shown (metrics/*.jsonl has them)",
                                       "dim italic")))
        lines += self._once(q.events)
        if lines:
            self.query_one(LineView).add(lines)
        q.events, q.dropped_events, q.dropped_logs = [], 0, 0

    def _once(self, events: list[Event]) -> list[tuple[str, Text]]:
        """``(level, line)`` of ``events`` without repeats: lines that differ only in their "rank N: "
        start are one line naming the ranks, and a line said in the last :data:`REPEAT_S` is not
        said again."""
        now, grouped = time.monotonic(), {}
        for e in events:
            m = _RANK_PREFIX.match(e.text)
            key = (e.level, e.text[m.end():] if m else e.text)
            grouped.setdefault(key, []).append(int(m.group(1)) if m else None)
        lines = []
        for (level, text), ranks in grouped.items():
            if now - self._said.get(text, float("-inf")) < REPEAT_S:
                continue
            self._said[text] = now
            named = sorted({r for r in ranks if r is not None})
            who = f"rank {named[0]}: " if len(named) == 1 else f"ranks {', '.join(map(str, named))}: " if named else ""
            lines.append((level, Text(who + text, LEVEL_STYLE[level])))
        self._said = {t: at for t, at in self._said.items() if now - at < REPEAT_S}
        return lines

    def _processes(self) -> tuple:
        """The launchers and ranks the run names (node or rank, pid): liveness is known only from a
        sample taken since they were read (before, a launch or attach looks like a dead run)."""
        assert self.run is not None
        return (tuple((n, i.pid) for n, i in sorted(self.run.launchers.items())),
                tuple((r, i.pid) for r, i in sorted(self.run.ranks.items())))

    def _sample(self) -> dict[int, ProcStats | None]:
        """psutil stats of each rank on this host (None for a rank on another host)."""
        assert self.run is not None and self.view is not None
        return {r: (self.view.sample(self.view.rank(r)) if this_host(info.hostname) else None)
                for r, info in self.run.ranks.items()}

    def log_event(self, message: str, style: str) -> None:
        """Append a line of the dashboard's own (a request, a kill, a launch) to the event pane."""
        self.query_one(LineView).add([("error" if "red" in style else "info", Text(message, style))])

    def shown(self) -> Shown:
        """What the dashboard shows now, for a control flow."""
        checkpoints = self.query_one(CheckpointTable)
        return Shown(self.run, self.view, self._live, checkpoints.selected(), checkpoints.has_focus,
                     self.query_one(RankTable).selected_rank())

    # ------------------------------------------------------------------ what the flows say
    @on(Said)
    def _said(self, message: Said) -> None:
        self.log_event(message.text, message.style)

    @on(Told)
    def _told_toast(self, message: Told) -> None:
        self.notify(message.message, title=message.title, severity=message.severity, timeout=message.timeout)

    @on(Watch)
    def _watch(self, message: Watch) -> None:
        self.attach(message.root)
        self.poll()

    @on(Offered)
    def _offered(self, _: Offered) -> None:
        self.offer_controls()

    # ------------------------------------------------------------------ controls (see .controls)
    def action_control(self, name: str) -> None:
        """Every key, button and palette command of :data:`~.keys.CONTROLS`: the control
        ``name``'s flow (:class:`.Controls`) or view (below). A press of an acting control within
        :data:`~.keys.REPEAT_S` of the one before (a held key's auto-repeat) does nothing."""
        control = CONTROL_BY_ACTION[name]
        if self.presses.repeated(control):
            return
        if control.flow == "view":
            getattr(self, name)()
        else:
            self.controls.run(control, self.shown())

    def search(self) -> None:
        """``/``: show only the event lines holding a text."""
        ask_search(self.app, self.query_one(LineView))

    def next_match(self) -> None:
        """``]``: the next line of the event search (:meth:`LineView.next_match`)."""
        self.notify(f"events: {self.query_one(LineView).next_match(1)}", timeout=2)

    def previous_match(self) -> None:
        """``[``: the line of the event search before the current one."""
        self.notify(f"events: {self.query_one(LineView).next_match(-1)}", timeout=2)

    def next_chart(self) -> None:
        """``g``: the metric chart's next view (loss, learning rate, grad norm, forgetting)."""
        if self.charts:
            self.notify(f"chart: {self.charts[0].next_view(self.run)}", timeout=2)

    def smooth(self) -> None:
        """``m``: the metric chart's next smoothing (none, 0.6, 0.9)."""
        if self.charts:
            self.notify(f"smoothing: {self.charts[0].next_smoothing(self.run):g}", timeout=2)

    def step_window(self) -> None:
        """``w``: the metric chart's next step range (all steps, the last 10,000, 1,000, 100)."""
        if self.charts:
            self.notify(f"chart: {self.charts[0].next_window(self.run)}", timeout=2)

    def level(self) -> None:
        """``v``: the next level filter of the event pane (all, warnings and errors, errors)."""
        self.notify(f"events: {self.query_one(LineView).next_level()}", timeout=2)

    def toggle_buttons(self) -> None:
        """``b``: show or hide the button row (the events get its line)."""
        row = self.query_one("#buttons")
        row.display = not row.display
