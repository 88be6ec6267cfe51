"""The dashboard's controls: the key table and the flows behind the keys (request a checkpoint, stop,
kill, resume, relaunch, start, logs, new run, help, quit).

The controls act on a run only through signals and ``control/`` files (:mod:`.processes`) and by
starting ``osft-train`` launchers (:mod:`.launch`); :class:`~.dashboard.Dashboard` shows the run
and turns keys, buttons and palette commands into these flows.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from osft.trainer.contract import EXIT_STOPPED, ended_well
from osft.trainer.rundir import RunDir
from textual.binding import Binding

from . import launch as launching
from .components.checkpoints import CheckpointTable
from .components.modals import Choice, HelpScreen, LogScreen
from .components.ranks import RankTable
from .processes import ProcessView, request_evaluation, send_request, this_host
from .processes import kill as kill_processes
from .requests import CHECKPOINT, STOP, PendingRequests
from .status import FAILURE_LINES, LaunchFailure
from .tail import LogTail
from .watcher import RunWatcher

if TYPE_CHECKING:
    from .dashboard import Dashboard

#: Seconds to wait for a stopped run's processes beyond its checkpoint grace period.
STOP_MARGIN_S = 30.0


class Control(NamedTuple):
    """One dashboard control.

    Attributes:
        key: its key (Textual's name for it).
        action: the dashboard action it runs (``Dashboard.action_<action>``).
        label: its footer label.
        title: its button (followed by the key) and its command-palette entry.
        help: what it does, on the help screen and in the command palette.
        acts: it acts on a run (signal, kill, relaunch) or starts one; ``--readonly`` removes it.
    """

    key: str
    action: str
    label: str
    title: str
    help: str
    acts: bool = False

    @property
    def binding(self) -> Binding:
        """Its key binding: a priority binding, so the key works whatever has the focus."""
        return Binding(self.key, self.action, self.label, priority=True)


#: Every dashboard control, in footer and button order.
CONTROLS = (
    Control("c", "checkpoint", "checkpoint", "Checkpoint",
            "checkpoint now: SIGUSR1 to the launcher; training continues", acts=True),
    Control("s", "stop", "ckpt+stop", "Checkpoint & stop",
            f"checkpoint and stop: SIGUSR2; the run exits {EXIT_STOPPED} after a complete checkpoint", acts=True),
    Control("e", "evaluate", "evaluate", "Evaluate",
            "evaluate at the next step boundary (writes control/evaluate); training goes on", acts=True),
    Control("K", "kill", "kill", "Kill",
            "kill: SIGKILL to every process of the run (lists the pids first)", acts=True),
    Control("r", "resume", "resume", "Resume selected",
            "resume from the checkpoint selected in the checkpoint list", acts=True),
    Control("l", "logs", "logs", "Rank logs",
            "stdout and stderr of the rank selected in the rank table, live (/ searches)"),
    Control("n", "new_run", "new run", "New run", "new run: the form, then launch", acts=True),
    Control("y", "copy", "copy path", "Copy path",
            "copy the selected checkpoint's path (checkpoint list focused), else the export of a completed run"),
    Control("g", "next_chart", "chart", "Next chart",
            "the metric chart: loss (and evaluation losses), learning rate, grad norm, forgetting"),
    Control("slash", "search", "search", "Search events", "events: show only the lines holding a text"),
    Control("v", "level", "level", "Event level", "events: all, warnings and errors, or errors only"),
    Control("question_mark", "help", "help", "Help", "the keys and what each does (this screen)"),
    Control("q", "request_quit", "quit", "Quit", "quit: detach (the run goes on), checkpoint and stop, or kill"),
    Control("b", "toggle_buttons", "buttons", "Button row", "show or hide the button row (the footer has every key)"),
)
#: Actions that act on a run or start one (removed by ``--readonly``).
ACTING = frozenset(c.action for c in CONTROLS if c.acts)
#: Textual's own keys, listed on the help screen after the controls.
TEXTUAL_KEYS = (("ctrl+p", "command palette"), ("tab", "next panel"))


def offered(readonly: bool) -> list[Control]:
    """The controls a dashboard offers: all of them, or with ``readonly`` those that do not act."""
    return [c for c in CONTROLS if not (readonly and c.acts)]


#: The name the help screen is installed under (:meth:`Controls.help`).
HELP_SCREEN = "osft-help"


def help_screen() -> HelpScreen:
    """The help screen: one line per control and Textual key, then how requests reach a run."""
    acting = [c.key for c in CONTROLS if c.acts]
    notes = ["Signals go to the osft-train launcher (or to the ranks when no launcher runs), never to a "
             "torchrun agent. When no process of the run is on this host, c and s write control/checkpoint "
             "or control/checkpoint-and-exit in the run directory instead; rank 0 polls them.",
             f"With --readonly, {', '.join(acting[:-1])} and {acting[-1]} are not available."]
    return HelpScreen([(c.key, c.help) for c in CONTROLS] + list(TEXTUAL_KEYS), notes)


class Started(NamedTuple):
    """A launcher this dashboard started.

    Attributes:
        proc: its process.
        root: the run directory it writes.
        node_rank: its node.
        spec: the new-run form's values it was started from (None for a relaunch).
    """

    proc: subprocess.Popen
    root: Path
    node_rank: int
    spec: launching.RunSpec | None = None


def wrote_state_file(started: Started) -> bool:
    """Whether the launcher ``started`` wrote its node's state file (``run.json`` or
    ``run.node<N>.json``), i.e. got past its input checks; read from the file, not the model (the
    reader may lag behind a launcher that ended at once)."""
    try:
        return json.loads(RunDir(started.root, started.node_rank).run_json.read_text()).get("launcher_pid") \
            == started.proc.pid
    except (OSError, ValueError, AttributeError):
        return False


class Controls:
    """The control flows of a :class:`~.dashboard.Dashboard`.

    Args:
        dashboard: the screen; the flows read its run model, process view and table selections,
            and report in its event pane and notifications.
        launcher: the command that runs ``osft-train`` (the launcher).

    Attributes:
        started: launchers started here that may still run.
        pending: requests waiting for their checkpoint, one per kind.
        failure: the last launcher of the run shown that failed (None when none did).
        form_spec: the values last launched from the new-run form (the form opens with them).
    """

    def __init__(self, dashboard: Dashboard, launcher: list[str]) -> None:
        self.dashboard = dashboard
        self.launcher = launcher
        self.started: list[Started] = []
        self.pending = PendingRequests()
        self.failure: LaunchFailure | None = None
        self.form_spec: launching.RunSpec | None = None

    def reap(self) -> None:
        """Forget the started launchers that ended. One of the run shown that failed (an exit code
        other than 0 and 75; a signal's end is the dead run the status line shows) becomes
        :attr:`failure`, with a toast and the end of its log in the event pane; one started from
        the form that ended before it wrote its state file (a bad flag, a refused output dir) opens
        the form again with the same values."""
        ended = [s for s in self.started if s.proc.poll() is not None]
        self.started = [s for s in self.started if s.proc.returncode is None]
        d = self.dashboard
        for s in ended:
            code = s.proc.returncode
            if ended_well(code) or code < 0 or d.run is None or s.root != d.run.root:
                continue
            log = RunDir(s.root).launcher_log(s.node_rank)
            lines = tuple(LogTail(log, FAILURE_LINES).poll())
            self.failure = LaunchFailure(s.proc.pid, s.node_rank, code, lines)
            d.log_event(f"launcher of node {s.node_rank} (pid {s.proc.pid}) exited with code {code}; "
                        f"the end of {log}:", "bold red")
            for line in lines:
                d.log_event(f"  {line}", "red")
            d.notify(lines[-1] if lines else f"no output in {log}", title=f"launcher exited with code {code}",
                     severity="error", timeout=15)
            if s.spec is not None and not wrote_state_file(s) and not self.form_open():
                self.new_run(s.spec)

    def starting(self) -> bool:
        """Whether a launcher started here for the run shown runs and has not written its state file
        yet (the file is absent, or an earlier launcher's)."""
        d = self.dashboard
        if d.run is None:
            return False
        written = {info.pid for info in d.run.launchers.values()}
        return any(s.root == d.run.root and s.proc.poll() is None and s.proc.pid not in written for s in self.started)

    def answer(self, record: dict) -> None:
        """A ``checkpoint_requested`` or ``checkpoint_saved`` record arrived: a save that serves a
        pending request of ours answers it, in one notification titled with the request's kind."""
        d = self.dashboard
        action = (d.run.run.config or {}).get("sigusr1_action") if d.run else None
        kind = self.pending.take(record, action)
        if kind is not None:
            d.notify(f"checkpoint of step {record.get('step')} written to {record.get('path')}", title=kind)

    def unavailable(self, live: bool) -> str | None:
        """Why ``c``, ``s`` and ``K`` cannot act now (None when they can): no run, or no process of
        the run alive on this host (``live``) while its run.json names this host (a run on another
        host is asked through ``control/``)."""
        d = self.dashboard
        if d.run is None:
            return "no run"
        remote = bool(d.run.launchers) and not any(this_host(i.hostname) for i in d.run.launchers.values())
        if live or remote:
            return None
        return f"no process of the run is alive on this host (run.json: {d.run.state})"

    # ------------------------------------------------------------------ requests
    def request(self, signum: int, kind: str) -> None:
        """Send the run a checkpoint request (``signum``: SIGUSR1 or SIGUSR2) and wait for its save."""
        d = self.dashboard
        why = self.unavailable(d.view is not None and d.view.any_alive())
        if why is not None or d.run is None or d.view is None:
            d.notify(f"{kind}: nothing sent: {why}", severity="warning")
            return
        if kind in self.pending.steps:
            at = self.pending.steps[kind]
            d.notify(f"{kind} already requested at step {at if at is not None else 0}; waiting for its checkpoint",
                     title=kind)
            return
        try:
            what = send_request(d.view, signum)
        except OSError as exc:
            d.notify(f"could not request a checkpoint: {exc}", severity="error")
            return
        step = d.run.step
        self.pending.steps[kind] = step
        d.offer_controls()  # dimmed at once, not at the next once-a-second redraw
        message = f"{kind} requested at step {step if step is not None else 0}: {what}"
        d.log_event(message, "bold cyan")
        d.notify(message, title=kind)

    def checkpoint(self) -> None:
        """Checkpoint now (SIGUSR1); training continues."""
        self.request(signal.SIGUSR1, CHECKPOINT)

    def stop(self) -> None:
        """Checkpoint and stop (SIGUSR2); the launcher exits with :data:`EXIT_STOPPED` after a complete
        checkpoint."""
        self.request(signal.SIGUSR2, STOP)

    def evaluate(self) -> None:
        """Ask the run to evaluate its evaluation and retention sets at the next step boundary
        (``control/evaluate``, read by rank 0 wherever it runs); training goes on."""
        d = self.dashboard
        why = self.unavailable(d.view is not None and d.view.any_alive())
        if why is not None or d.run is None:
            d.notify(f"evaluate: nothing requested: {why}", severity="warning")
            return
        try:
            path = request_evaluation(d.run.root)
        except OSError as exc:
            d.notify(f"could not request an evaluation: {exc}", severity="error")
            return
        step = d.run.step
        message = f"evaluation requested at step {step if step is not None else 0}: wrote {path}"
        d.log_event(message, "bold cyan")
        d.notify(message, title="evaluate")

    def kill(self) -> None:
        """SIGKILL every process of the run on this host, after a confirmation listing the pids."""
        d = self.dashboard
        if d.view is None:
            d.notify("no run", severity="warning")
            return
        targets = d.view.kill_targets()
        if not targets:
            d.notify("no process of this run runs on this host", severity="warning")
            return
        body = [f"SIGKILL to pid {t.pid}: {t.role}" for t in targets]
        body.append("No checkpoint is written: training since the last checkpoint is lost.")

        def done(answer: str | None) -> None:
            if answer == "kill":
                left = kill_processes(targets)
                msg = f"killed {len(targets) - len(left)} processes" + (f"; still alive: {left}" if left else "")
                d.notify(msg, severity="error" if left else "information")
                d.log_event(msg, "bold red")

        d.app.push_screen(Choice(f"Kill {len(targets)} processes?", body,
                                 [("cancel", "cancel", "primary"), ("kill", "kill", "error")]), done)

    # ------------------------------------------------------------------ resume and launch
    def resume(self) -> None:
        """Resume from the selected checkpoint; a live run is first stopped (SIGUSR2, after
        confirmation) and waited for."""
        d = self.dashboard
        if d.run is None or d.view is None:
            d.notify("no run", severity="warning")
            return
        if d.run.run_json_error:
            d.notify(f"cannot resume: its command line is in {d.run.run_json_error}", severity="error")
            return
        entry = d.query_one(CheckpointTable).selected()
        if entry is None or not entry.complete:
            d.notify("select a complete checkpoint in the checkpoint list first", severity="warning")
            return
        argvs = [info.data.argv for _, info in sorted(d.run.launchers.items())]
        if not argvs or not all(argvs):
            d.notify("run.json has no command line to relaunch", severity="error")
            return
        newer = sorted(e.step for e in d.run.checkpoints if e.complete and e.step > entry.step)
        caveat = (f"Newer checkpoints stay (step {', '.join(map(str, newer))}, and the one the stop writes): "
                  "a later --resume picks the newest complete checkpoint, whichever run wrote it.") if newer else ""
        if d.view.any_alive():
            pids = [f"SIGUSR2 (checkpoint and stop) to pid {t.pid}: {t.role}" for t in d.view.request_targets()]
            pids += [caveat] if caveat else []

            def done(answer: str | None) -> None:
                if answer == "resume":
                    d.run_worker(self._stop_then_resume(entry.path, argvs), exclusive=True, group="resume")

            d.app.push_screen(Choice(f"Stop the running job and resume from step {entry.step}?", pids,
                                     [("cancel", "cancel", "primary"), ("resume", "stop and resume", "warning")]),
                              done)
        else:
            if caveat:
                d.notify(caveat, severity="warning")
            self.relaunch(entry.path, argvs)

    async def _stop_then_resume(self, checkpoint: Path, argvs: list[list[str]]) -> None:
        self.stop()
        if await self._wait_stopped():
            self.relaunch(checkpoint, argvs)

    async def _wait_stopped(self) -> bool:
        """Wait until no process of the run is alive here (grace period + margin); False on timeout."""
        d = self.dashboard
        assert d.run is not None and d.view is not None
        grace = float((d.run.run.config or {}).get("checkpoint_grace_seconds") or 300)
        deadline = time.monotonic() + grace + STOP_MARGIN_S
        while d.view.any_alive() or any(s.proc.poll() is None for s in self.started):
            if time.monotonic() > deadline:
                d.notify("the run did not stop in time", severity="error")
                return False
            await asyncio.sleep(0.2)
        return True

    def relaunch(self, checkpoint: Path, argvs: list[list[str]]) -> None:
        """Start each node's ``osft-train`` command line ``argvs`` again, resuming from ``checkpoint``."""
        d = self.dashboard
        assert d.run is not None
        self.start([launching.resume_argv(argv[1:], checkpoint) for argv in argvs], d.run.root)
        d.notify(f"resuming from {checkpoint}", title="resume")

    def start(self, argvs: list[list[str]], root: Path, spec: launching.RunSpec | None = None) -> None:
        """Start one launcher per command line in ``argvs`` (``osft-train`` arguments), in ``root``;
        ``spec``: the form's values they come from."""
        d = self.dashboard
        try:
            procs = [launching.start(self.launcher, argv, root) for argv in argvs]
        except OSError as exc:
            d.notify(f"could not start {self.launcher[0]}: {exc}", severity="error")
            return
        self.failure = None
        self.started += [Started(p, root, launching.node_of(argv), spec) for p, argv in zip(procs, argvs)]
        d.log_event(f"launched {len(procs)} launcher(s): pid " + ", ".join(str(p.pid) for p in procs), "bold cyan")

    def new_run(self, spec: launching.RunSpec | None = None) -> None:
        """The new-run form, with ``spec``'s values (default: those last launched, else the demo
        job's); Launch starts the run and watches it."""
        from .components.new_run import NewRunScreen  # imported when first needed: start-up

        spec = spec or self.form_spec or launching.RunSpec.demo()
        self.dashboard.app.push_screen(NewRunScreen(spec), self.launch)

    def form_open(self) -> bool:
        """Whether the new-run form is the screen on top."""
        from .components.new_run import NewRunScreen

        return isinstance(self.dashboard.app.screen, NewRunScreen)

    def launch(self, spec: launching.RunSpec | None) -> None:
        """Start ``spec`` (one launcher per node, in sessions of their own) and watch its run
        directory. A directory of a live run is refused (the form opens again); one an earlier run
        left checkpoints or exports in (``osft-train`` would refuse it) asks first: resume it,
        overwrite it, or edit the form."""
        if spec is None:
            return
        d = self.dashboard
        self.form_spec = spec
        root = Path(spec.output_dir)
        there = RunWatcher(root)
        there.poll(checkpoints=False)
        busy = ProcessView(there.model).kill_targets()
        if busy:
            d.notify(f"{root} belongs to a live run (pid {busy[0].pid}): attach with osft-tui {root}, "
                     "or choose another output dir", severity="error")
            self.new_run(spec)
            return
        from osft.trainer.ownership import OutputDirInUse, check_output_dir  # imported when first needed: start-up

        try:
            check_output_dir(RunDir(root), spec.has_flag(*launching.RESUME_FLAGS), spec.has_flag(launching.OVERWRITE_FLAG))
        except OutputDirInUse as exc:
            self._ask_about_earlier_run(spec, str(exc))
            return
        root.mkdir(parents=True, exist_ok=True)
        d.attach(root)
        self.start(spec.node_argvs(), root, spec)
        d.poll()

    def _ask_about_earlier_run(self, spec: launching.RunSpec, why: str) -> None:
        """``osft-train`` would refuse ``spec`` (``why``): resume, overwrite, or back to the form."""
        body = [why, "", "resume: continue that run (--resume: from its newest complete checkpoint)",
                f"overwrite: start over ({launching.OVERWRITE_FLAG} removes its checkpoints, exports and metrics)",
                "edit: back to the form (choose another output dir)"]

        def done(answer: str | None) -> None:
            if answer == "resume":
                self.launch(spec.with_flag("--resume"))
            elif answer == "overwrite":
                self.launch(spec.with_flag(launching.OVERWRITE_FLAG))
            elif answer == "edit":
                self.new_run(spec)

        self.dashboard.app.push_screen(
            Choice(f"{spec.output_dir} holds an earlier run", body,
                   [("edit", "edit", "primary"), ("resume", "resume", "warning"),
                    ("overwrite", "overwrite", "error"), ("cancel", "cancel", "default")]), done)

    # ------------------------------------------------------------------ screens
    def logs(self) -> None:
        """The selected rank's stdout and stderr, live, with its exit code and error when it crashed."""
        d = self.dashboard
        if d.run is None:
            return
        rank = d.query_one(RankTable).selected_rank()
        if rank is None:
            rank = 0
        info = d.run.ranks.get(rank)
        node, local = (info.node_rank, info.local_rank) if info else (0, rank)
        stderr = d.run.log_paths.get((node, local))
        paths = [("out", stderr.with_name("stdout.log")), ("err", stderr)] if stderr else []
        title = f"rank {rank} (node {node}, local rank {local}) stdout and stderr"
        if info and (info.error or info.exit_code is not None):
            title += f": exit code {info.exit_code if info.exit_code is not None else '?'}"
        d.app.push_screen(LogScreen(title, paths, f"error: {info.error}" if info and info.error else None))

    def copy_path(self) -> None:
        """Copy a path to the clipboard (``App.copy_to_clipboard``: OSC 52, which the terminal
        passes on): the checkpoint selected in the list when the list has the focus or the run has
        no export, else the export of the completed run."""
        d = self.dashboard
        table = d.query_one(CheckpointTable)
        entry = table.selected()
        export = d.run.export_dir if d.run else None
        if export and not (table.has_focus and entry):
            path, what = export, "export"
        elif entry is not None:
            path, what = str(entry.path), f"checkpoint of step {entry.step}"
        else:
            d.notify("nothing to copy: no checkpoint and no export", severity="warning")
            return
        d.app.copy_to_clipboard(path)
        d.notify(path, title=f"copied the {what} path")

    def help(self) -> None:
        """The keys: one help screen per app, built at its first opening and installed
        (``App.install_screen``), so that later openings only lay it out again (under a flood of
        records the building was most of a ``?`` press's latency)."""
        app = self.dashboard.app
        if not app.is_screen_installed(HELP_SCREEN):
            app.install_screen(help_screen(), HELP_SCREEN)
        app.push_screen(HELP_SCREEN)

    def request_quit(self) -> None:
        """Quit; with a live run, ask whether to detach, checkpoint and stop, or kill."""
        d = self.dashboard
        if d.readonly or d.view is None or not d.view.any_alive():
            d.app.exit(0)
            return
        body = ["detach: the run goes on (it runs in its own session); `osft-tui RUN_DIR` attaches again",
                "checkpoint and stop: SIGUSR2, wait for the complete checkpoint, then quit",
                "kill: SIGKILL to " + ", ".join(str(t.pid) for t in d.view.kill_targets())]

        def done(answer: str | None) -> None:
            if answer == "detach":
                d.app.exit(0)
            elif answer == "stop":
                d.run_worker(self._stop_then_quit(), exclusive=True, group="quit")
            elif answer == "kill" and d.view is not None:
                kill_processes(d.view.kill_targets())
                d.app.exit(0)

        d.app.push_screen(Choice("The run is still running. Quit how?", body,
                                 [("detach", "detach", "primary"), ("stop", "checkpoint and stop", "warning"),
                                  ("kill", "kill", "error"), ("cancel", "cancel", "default")]), done)

    async def _stop_then_quit(self) -> None:
        self.stop()
        if await self._wait_stopped():
            self.dashboard.app.exit(0)
