"""The dashboard screen: one run's state, nodes, violation counters, checkpoints, ranks and events,
and the controls that act on the run (checkpoint, stop, kill, resume, logs, quit).
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from pathlib import Path

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Button, Footer, Label, RichLog

from . import launch as launching
from .components.checkpoints import CheckpointTable
from .components.header import RunHeader
from .components.modals import Choice, HelpScreen, LogScreen
from .components.new_run import NewRunScreen
from .components.nodes import Histories, NodeTable
from .components.ranks import RankTable
from .components.violations import ViolationCounters
from .processes import ProcessView, ProcStats, kill, request_evaluation, send_request, this_host
from .reader import Reader, Update
from .run_state import RunModel, RunWatcher
from .tail import LogTail

#: Seconds between the costly redraws (sparklines, rank table, event pane) and psutil samples of
#: the run's processes (CPU % is measured over this interval). The run line, the node and
#: checkpoint tables and the violation counters follow every poll.
SAMPLE_S = 1.0
#: Event lines and rank log lines written to the event pane per SAMPLE_S at most; the others are
#: counted in a "… not shown" line (a flooding run cannot make the UI slow to answer keys).
EVENT_LINES = 20
LOG_LINES = 12
#: Actions that signal a run; --readonly removes them.
SIGNALLING = frozenset({"checkpoint", "stop", "kill", "resume", "evaluate"})
#: Seconds to wait for a stopped run's processes beyond its checkpoint grace period.
STOP_MARGIN_S = 30.0

#: (key, action, footer label, button label) of every dashboard control (None: a key without a
#: button, where the row of buttons has no room left at 140 columns).
CONTROLS = (
    ("c", "checkpoint", "checkpoint", "Checkpoint (c)"),
    ("s", "stop", "ckpt+stop", "Checkpoint & stop (s)"),
    ("e", "evaluate", "evaluate", None),
    ("K", "kill", "kill", "Kill (K)"),
    ("r", "resume", "resume", "Resume selected (r)"),
    ("l", "logs", "logs", "Rank logs (l)"),
    ("n", "new_run", "new run", "New run (n)"),
    ("question_mark", "help", "help", "Help (?)"),
    ("q", "request_quit", "quit", "Quit (q)"),
)

LEVEL_STYLE = {"info": "", "warning": "yellow", "error": "bold red", "log": "dim"}


class Dashboard(Screen):
    """Watches the run in ``run_dir`` (None: none yet) and controls it.

    Args:
        run_dir: the run directory to watch.
        launcher: the command that runs ``osft-train`` (the launcher), e.g. ``[python, -m, osft.trainer.cli]``.
        readonly: remove every control that signals a run.
        poll_s: seconds between polls of the run directory and the processes.
    """

    BINDINGS = [Binding(key, action, label, priority=True, key_display="?" if key == "question_mark" else None)
                for key, action, label, _ in CONTROLS]

    def __init__(self, run_dir: Path | None, launcher: list[str], readonly: bool = False, poll_s: float = 0.25) -> None:
        super().__init__(id="dashboard")
        self.launcher = launcher
        self.readonly = readonly
        self.poll_s = poll_s
        self.reader: Reader | None = None
        self.run: RunModel | None = None
        self.view: ProcessView | None = None
        self._stats: dict[int, ProcStats | None] = {}
        self._queued = Update(RunModel("."))
        self._live = False
        self._sampled = float("-inf")
        self.started: list[subprocess.Popen] = []
        self.pending: list[tuple[str, int | None]] = []
        if run_dir is not None:
            self.attach(run_dir)

    # ------------------------------------------------------------------ layout
    def compose(self) -> ComposeResult:
        yield RunHeader(id="header")
        yield ViolationCounters(id="violations")
        with Horizontal(id="top"):
            yield NodeTable(id="nodes")
            yield Histories(id="histories")
        with Horizontal(id="middle"):
            with Vertical(id="checkpoint-pane"):
                yield Label("checkpoints (select, then r to resume)", classes="pane-title")
                yield CheckpointTable(id="checkpoints")
            with Vertical(id="rank-pane"):
                yield Label("ranks (select, then l for logs)", classes="pane-title")
                yield RankTable(id="ranks")
        yield RichLog(id="events", max_lines=1000, wrap=False, markup=False)
        with Horizontal(id="buttons"):
            for _key, action, _label, text in CONTROLS:
                if text and not (self.readonly and action in SIGNALLING):
                    yield Button(text, id=f"button-{action}", compact=True)
        yield Footer()

    def on_mount(self) -> None:
        self.poll()
        self.set_interval(self.poll_s, self.poll)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """--readonly hides and disables every control that signals."""
        return not (self.readonly and action in SIGNALLING)

    async def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        await self.run_action((event.button.id or "").removeprefix("button-"))

    # ------------------------------------------------------------------ polling
    def attach(self, run_dir: Path) -> None:
        """Watch ``run_dir`` from now on (its history is read from the start, in a reader process)."""
        if self.reader is not None:
            self.reader.close()
        self.reader = Reader(run_dir, self.poll_s)
        self.run = RunModel(run_dir)
        self.view = ProcessView(self.run)
        self.pending.clear()

    def on_unmount(self) -> None:
        if self.reader is not None:
            self.reader.close()

    def poll(self) -> None:
        """Take the reader's update, sample the processes (every :data:`SAMPLE_S`), redraw."""
        self.started = [p for p in self.started if p.poll() is None]  # reap launchers that ended
        if self.reader is None or self.run is None or self.view is None:
            self.query_one(RunHeader).show(None, None)
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
            self._queue_events(update)
        slow = now - self._sampled >= SAMPLE_S  # the costly redraws: once per SAMPLE_S
        if slow:
            self._stats, self._sampled = self._sample(), now
            self._live = self.view.any_alive()
            self._write_events()
        run, stats = self.run, self._stats
        usage: dict[int, tuple[float | None, int | None]] = {}
        for rank, s in stats.items():
            if s is None or not s.alive or rank not in run.ranks:
                continue
            node = run.ranks[rank].node_rank
            cpu, rss = usage.get(node, (0.0, 0))
            usage[node] = ((cpu or 0.0) + (s.cpu_percent or 0.0), (rss or 0) + (s.rss_bytes or 0))
        here = any(this_host(i.hostname) for i in run.launchers.values()) or any(s is not None for s in stats.values())
        self.query_one(RunHeader).show(run, self._live if here else None)
        self.query_one(ViolationCounters).show(run.violations)
        self.query_one(NodeTable).show(run, usage)
        if slow:
            self.query_one(Histories).show(run)
        self.query_one(CheckpointTable).show(run.checkpoints)
        if slow:
            self.query_one(RankTable).show([r for _, r in sorted(run.ranks.items())], stats)
        for record in update.saved if update else []:
            self._confirm_saved(record)

    def _queue_events(self, update: Update) -> None:
        """Keep the update's lines for the next write (the newest :data:`EVENT_LINES` event lines
        and :data:`LOG_LINES` log lines; the others are counted)."""
        self._queued.merge(update).cap(EVENT_LINES, LOG_LINES)

    def _write_events(self) -> None:
        """Append the queued lines to the event pane in one write (one render, one scroll)."""
        q = self._queued
        lines = []
        if q.dropped_events:
            lines.append(Text(f"… {q.dropped_events} events not shown (metrics/*.jsonl has them)", "dim italic"))
        if q.dropped_logs:
            lines.append(Text(f"… {q.dropped_logs} log lines not shown (l: rank logs)", "dim italic"))
        lines += [Text(e.text, LEVEL_STYLE[e.level]) for e in q.events]
        if lines:
            self.query_one("#events", RichLog).write(Text("\n").join(lines))
        q.events, q.dropped_events, q.dropped_logs, q.saved = [], 0, 0, []  # saves are answered per poll

    def _sample(self) -> dict[int, ProcStats | None]:
        """psutil stats of each rank on this host (None for a rank on another host)."""
        assert self.run is not None and self.view is not None
        return {r: (self.view.sample(self.view.rank(r)) if this_host(info.hostname) else None)
                for r, info in self.run.ranks.items()}

    def _confirm_saved(self, record: dict) -> None:
        """A ``checkpoint_saved`` record arrived: answer the pending request and select it in the list."""
        step, path = record.get("step"), record.get("path")
        if self.pending:
            kind, _ = self.pending.pop(0)
            self.notify(f"checkpoint of step {step} written to {path}", title=kind)
        if isinstance(step, int):
            self.query_one(CheckpointTable).select_step(step)

    # ------------------------------------------------------------------ controls
    def _request(self, signum: int, kind: str) -> None:
        if self.run is None or self.view is None:
            self.notify("no run to signal", severity="warning")
            return
        try:
            what = send_request(self.view, signum)
        except OSError as exc:
            self.notify(f"could not request a checkpoint: {exc}", severity="error")
            return
        step = self.run.step
        self.pending.append((kind, step))
        message = f"{kind} requested at step {step if step is not None else 0}: {what}"
        self.query_one("#events", RichLog).write(Text(message, "bold cyan"))
        self.notify(message, title=kind)

    def action_checkpoint(self) -> None:
        """``c``: checkpoint now (SIGUSR1); training continues."""
        self._request(signal.SIGUSR1, "checkpoint")

    def action_stop(self) -> None:
        """``s``: checkpoint and stop (SIGUSR2); the launcher exits 75 after a complete checkpoint."""
        self._request(signal.SIGUSR2, "checkpoint and stop")

    def action_evaluate(self) -> None:
        """``e``: evaluate at the next step boundary (``control/evaluate``); training goes on."""
        if self.run is None:
            self.notify("no run to evaluate", severity="warning")
            return
        try:
            path = request_evaluation(self.run.root)
        except OSError as exc:
            self.notify(f"could not request an evaluation: {exc}", severity="error")
            return
        step = self.run.step
        message = f"evaluation requested at step {step if step is not None else 0}: wrote {path}"
        self.query_one("#events", RichLog).write(Text(message, "bold cyan"))
        self.notify(message, title="evaluate")

    def action_kill(self) -> None:
        """``K``: SIGKILL every process of the run on this host, after a confirmation listing the pids."""
        if self.view is None:
            self.notify("no run", severity="warning")
            return
        targets = self.view.kill_targets()
        if not targets:
            self.notify("no process of this run runs on this host", severity="warning")
            return
        body = [f"SIGKILL to pid {t.pid}: {t.role}" for t in targets]
        body.append("No checkpoint is written: training since the last checkpoint is lost.")

        def done(answer: str | None) -> None:
            if answer == "kill":
                left = kill(targets)
                msg = f"killed {len(targets) - len(left)} processes" + (f"; still alive: {left}" if left else "")
                self.notify(msg, severity="error" if left else "information")
                self.query_one("#events", RichLog).write(Text(msg, "bold red"))

        self.app.push_screen(Choice(f"Kill {len(targets)} processes?", body,
                                    [("cancel", "cancel", "primary"), ("kill", "kill", "error")]), done)

    def action_resume(self) -> None:
        """``r``: resume from the selected checkpoint; a live run is first stopped (SIGUSR2, after
        confirmation) and waited for."""
        if self.run is None or self.view is None:
            self.notify("no run", severity="warning")
            return
        entry = self.query_one(CheckpointTable).selected()
        if entry is None or not entry.complete:
            self.notify("select a complete checkpoint in the checkpoint list first", severity="warning")
            return
        argvs = [info.data.get("argv") for _, info in sorted(self.run.launchers.items())]
        if not argvs or not all(argvs):
            self.notify("run.json has no command line to relaunch", severity="error")
            return
        newer = sorted(e.step for e in self.run.checkpoints if e.complete and e.step > entry.step)
        caveat = (f"Newer checkpoints stay (step {', '.join(map(str, newer))}, and the one the stop writes): "
                  "a later --resume picks the newest complete checkpoint, whichever run wrote it.") if newer else ""
        if self.view.any_alive():
            pids = [f"SIGUSR2 (checkpoint and stop) to pid {t.pid}: {t.role}" for t in self.view.request_targets()]
            pids += [caveat] if caveat else []

            def done(answer: str | None) -> None:
                if answer == "resume":
                    self.run_worker(self._stop_then_resume(entry.path, argvs), exclusive=True, group="resume")

            self.app.push_screen(Choice(f"Stop the running job and resume from step {entry.step}?", pids,
                                        [("cancel", "cancel", "primary"), ("resume", "stop and resume", "warning")]),
                                 done)
        else:
            if caveat:
                self.notify(caveat, severity="warning")
            self._relaunch(entry.path, argvs)

    async def _stop_then_resume(self, checkpoint: Path, argvs: list[list[str]]) -> None:
        self._request(signal.SIGUSR2, "checkpoint and stop")
        if await self._wait_stopped():
            self._relaunch(checkpoint, argvs)

    async def _wait_stopped(self) -> bool:
        """Wait until no process of the run is alive here (grace period + margin); False on timeout."""
        assert self.run is not None and self.view is not None
        grace = float((self.run.run.get("config") or {}).get("checkpoint_grace_seconds") or 300)
        deadline = time.monotonic() + grace + STOP_MARGIN_S
        while self.view.any_alive() or any(p.poll() is None for p in self.started):
            if time.monotonic() > deadline:
                self.notify("the run did not stop in time", severity="error")
                return False
            await asyncio.sleep(0.2)
        return True

    def _relaunch(self, checkpoint: Path, argvs: list[list[str]]) -> None:
        assert self.run is not None
        self._start([launching.resume_argv(argv[1:], checkpoint) for argv in argvs], self.run.root)
        self.notify(f"resuming from {checkpoint}", title="resume")

    def _start(self, argvs: list[list[str]], root: Path) -> None:
        try:
            procs = [launching.start(self.launcher, argv, root) for argv in argvs]
        except OSError as exc:
            self.notify(f"could not start {self.launcher[0]}: {exc}", severity="error")
            return
        self.started.extend(procs)
        message = f"launched {len(procs)} launcher(s): pid " + ", ".join(str(p.pid) for p in procs)
        self.query_one("#events", RichLog).write(Text(message, "bold cyan"))

    def action_logs(self) -> None:
        """``l``: the selected rank's stderr tail, with its exit code and error when it crashed."""
        if self.run is None:
            return
        rank = self.query_one(RankTable).selected_rank()
        if rank is None:
            rank = 0
        info = self.run.ranks.get(rank)
        node, local = (info.node_rank, info.local_rank) if info else (0, rank)
        path = self.run.log_paths.get((node, local))
        lines = LogTail(path).poll() if path else []
        lines = lines or ["(no stderr.log yet)"]
        title = f"rank {rank} (node {node}, local rank {local}) stderr"
        if info and (info.error or info.exit_code is not None):
            title += f": exit code {info.exit_code if info.exit_code is not None else '?'}"
            if info.error:
                lines.append(f"error: {info.error}")
        self.app.push_screen(LogScreen(title, lines))

    def action_new_run(self) -> None:
        """``n``: the new-run form; Launch starts the run and watches it."""
        self.app.push_screen(NewRunScreen(launching.RunSpec.demo()), self.launch)

    def launch(self, spec: launching.RunSpec | None) -> None:
        """Start ``spec`` (one launcher per node, in sessions of their own) and watch its run directory."""
        if spec is None:
            return
        root = Path(spec.output_dir)
        there = RunWatcher(root)
        there.poll(checkpoints=False)
        busy = ProcessView(there.model).kill_targets()
        if busy:
            self.notify(f"{root} belongs to a live run (pid {busy[0].pid}): attach with osft-tui {root}, "
                        "or choose another output dir", severity="error")
            return
        root.mkdir(parents=True, exist_ok=True)
        self.attach(root)
        self.query_one("#events", RichLog).clear()
        self.query_one(CheckpointTable).show([])
        self._start(spec.node_argvs(), root)
        self.poll()

    def action_help(self) -> None:
        self.app.push_screen(HelpScreen())

    def action_request_quit(self) -> None:
        """``q``: quit; with a live run, ask whether to detach, checkpoint and stop, or kill."""
        if self.readonly or self.view is None or not self.view.any_alive():
            self.app.exit(0)
            return
        body = ["detach: the run goes on (it runs in its own session); `osft-tui RUN_DIR` attaches again",
                "checkpoint and stop: SIGUSR2, wait for the complete checkpoint, then quit",
                "kill: SIGKILL to " + ", ".join(str(t.pid) for t in self.view.kill_targets())]

        def done(answer: str | None) -> None:
            if answer == "detach":
                self.app.exit(0)
            elif answer == "stop":
                self.run_worker(self._stop_then_quit(), exclusive=True, group="quit")
            elif answer == "kill" and self.view is not None:
                kill(self.view.kill_targets())
                self.app.exit(0)

        self.app.push_screen(Choice("The run is still running. Quit how?", body,
                                    [("detach", "detach", "primary"), ("stop", "checkpoint and stop", "warning"),
                                     ("kill", "kill", "error"), ("cancel", "cancel", "default")]), done)

    async def _stop_then_quit(self) -> None:
        self._request(signal.SIGUSR2, "checkpoint and stop")
        if await self._wait_stopped():
            self.app.exit(0)
