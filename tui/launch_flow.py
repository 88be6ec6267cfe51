"""The launch flows: the new-run form and its launch (``n``), resume from the selected checkpoint
(``r``: a live run is stopped first), and the launchers started here, reaped as they end.

Launchers start in process sessions of their own (:func:`~.launch.start`), so a run outlives the
dashboard; a relaunch is each node's ``argv`` from its state file with
``--resume-from-full-state-checkpoint``.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from pathlib import Path
from typing import NamedTuple

from osft.trainer.contract import LIVE_STATES, ended_well
from osft.trainer.rundir import RunDir

from . import launch as launching
from .components.modals import Choice
from .flow import Flow, Shown, gone
from .messages import Watch
from .processes import ProcessView, this_host
from .request_flow import RequestFlow
from .run_state import RunModel
from .status import FAILURE_LINES, LaunchFailure
from .tail import LogTail
from .watcher import RunWatcher

#: Seconds to wait for a stopped run's processes beyond its checkpoint grace period.
STOP_MARGIN_S = 30.0


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


def live_elsewhere(model: RunModel) -> str | None:
    """The host of a launcher on another host whose state file says it runs (None when there is
    none): a relaunch here would start a second job beside it."""
    return next((info.hostname for _, info in sorted(model.launchers.items())
                 if info.state in LIVE_STATES and not this_host(info.hostname)), None)


def wrote_state_file(started: Started) -> bool:
    """Whether the launcher ``started`` wrote its node's state file (``run.json`` or
    ``run.node<N>.json``), i.e. got past its input checks; read from the file, not the model (the
    reader may lag behind a launcher that ended at once)."""
    try:
        return json.loads(RunDir(started.root, started.node_rank).run_json.read_text()).get("launcher_pid") \
            == started.proc.pid
    except (OSError, ValueError, AttributeError):
        return False


class LaunchFlow(Flow):
    """Launching, resuming and reaping runs.

    Args:
        host: the widget the flows post from.
        launcher: the command that runs ``osft-train`` (the launcher).
        requests: the request flows (a resume first stops a live run).

    Attributes:
        started: launchers started here that may still run.
        failure: the last launcher of the run shown that failed (None when none did).
        form_spec: the values last launched from the new-run form (the form opens with them).
    """

    def __init__(self, host, launcher: list[str], requests: RequestFlow) -> None:
        super().__init__(host)
        self.launcher = launcher
        self.requests = requests
        self.started: list[Started] = []
        self.failure: LaunchFailure | None = None
        self.form_spec: launching.RunSpec | None = None

    def reap(self, shown: Shown) -> None:
        """Forget the started launchers that ended. One of the run shown that failed (an exit code
        other than 0 and 75; a signal's end is the dead run the status line shows) becomes
        :attr:`failure`, with a toast and the end of its log in the event pane; one started from
        the form that ended before it wrote its state file (a bad flag, a refused output dir) opens
        the form again with the same values, unless its directory is gone."""
        ended = [s for s in self.started if s.proc.poll() is not None]
        self.started = [s for s in self.started if s.proc.returncode is None]
        for s in ended:
            code = s.proc.returncode
            if ended_well(code) or code < 0 or shown.run is None or s.root != shown.run.root:
                continue
            log = RunDir(s.root).launcher_log(s.node_rank)
            lines = tuple(LogTail(log, FAILURE_LINES).poll())
            self.failure = LaunchFailure(s.proc.pid, s.node_rank, code, lines)
            self.say(f"launcher of node {s.node_rank} (pid {s.proc.pid}) exited with code {code}; "
                     f"the end of {log}:", "bold red")
            for line in lines:
                self.say(f"  {line}", "red")
            self.tell(lines[-1] if lines else f"no output in {log}", title=f"launcher exited with code {code}",
                      severity="error", timeout=15)
            if s.spec is not None and not wrote_state_file(s) and not self.form_open() and s.root.is_dir():
                self.new_run(shown, s.spec)

    def starting(self, run: RunModel | None) -> bool:
        """Whether a launcher started here for ``run`` runs and has not written its state file yet
        (the file is absent, or an earlier launcher's)."""
        if run is None:
            return False
        written = {info.pid for info in run.launchers.values()}
        return any(s.root == run.root and s.proc.poll() is None and s.proc.pid not in written for s in self.started)

    # ------------------------------------------------------------------ resume
    def resume(self, shown: Shown) -> None:
        """Resume from the selected checkpoint; a live run is first stopped (SIGUSR2, after
        confirmation) and waited for; a run live on another host is refused."""
        run, view, entry = shown.run, shown.view, shown.checkpoint
        if run is None or view is None:
            self.tell("no run", severity="warning")
            return
        if run.gone:
            self.tell(f"cannot resume: {gone(run.root)}", severity="error")
            return
        if run.run_json_error:
            self.tell(f"cannot resume: its command line is in {run.run_json_error}", severity="error")
            return
        host = live_elsewhere(run)
        if host is not None:
            self.tell(f"cannot resume: the run is live on {host}: stop it first (s asks it through control/)",
                      severity="warning")
            return
        if entry is None or not entry.complete:
            self.tell("select a complete checkpoint in the checkpoint list first", severity="warning")
            return
        argvs = [info.data.argv for _, info in sorted(run.launchers.items())]
        if not argvs or not all(argvs):
            self.tell("run.json has no command line to relaunch", severity="error")
            return
        newer = sorted(e.step for e in run.checkpoints if e.complete and e.step > entry.step)
        caveat = (f"Newer checkpoints stay (step {', '.join(map(str, newer))}, and the one the stop writes): "
                  "a later --resume picks the newest complete checkpoint, whichever run wrote it.") if newer else ""
        if view.any_alive():
            pids = [f"SIGUSR2 (checkpoint and stop) to pid {t.pid}: {t.role}" for t in view.request_targets()[:1]]
            pids += [caveat] if caveat else []

            def done(answer: str | None) -> None:
                if answer == "resume":
                    self.host.run_worker(self._stop_then_resume(shown, entry.path, argvs), exclusive=True,
                                         group="resume")

            self.host.app.push_screen(Choice(f"Stop the running job and resume from step {entry.step}?", pids,
                                             [("cancel", "cancel", "primary"),
                                              ("resume", "stop and resume", "warning")]), done)
        else:
            if caveat:
                self.tell(caveat, severity="warning")
            self.relaunch(run.root, entry.path, argvs)

    async def _stop_then_resume(self, shown: Shown, checkpoint: Path, argvs: list[list[str]]) -> None:
        assert shown.run is not None
        self.requests.stop(shown)
        if await self.wait_stopped(shown):
            self.relaunch(shown.run.root, checkpoint, argvs)

    async def wait_stopped(self, shown: Shown) -> bool:
        """Wait until no process of the run is alive here, nor a launcher started here (grace
        period + :data:`STOP_MARGIN_S`); False on timeout."""
        assert shown.run is not None and shown.view is not None
        grace = float((shown.run.run.config or {}).get("checkpoint_grace_seconds") or 300)
        deadline = time.monotonic() + grace + STOP_MARGIN_S
        while shown.view.any_alive() or any(s.proc.poll() is None for s in self.started):
            if time.monotonic() > deadline:
                self.tell("the run did not stop in time", severity="error")
                return False
            await asyncio.sleep(0.2)
        return True

    def relaunch(self, root: Path, checkpoint: Path, argvs: list[list[str]]) -> None:
        """Start each node's ``osft-train`` command line ``argvs`` again in ``root``, resuming from
        ``checkpoint``."""
        self.start([launching.resume_argv(argv[1:], checkpoint) for argv in argvs], root)
        self.tell(f"resuming from {checkpoint}", title="resume")

    def start(self, argvs: list[list[str]], root: Path, spec: launching.RunSpec | None = None) -> None:
        """Start one launcher per command line in ``argvs`` (``osft-train`` arguments), in ``root``;
        ``spec``: the form's values they come from."""
        try:
            procs = [launching.start(self.launcher, argv, root) for argv in argvs]
        except OSError as exc:
            self.tell(f"could not start {self.launcher[0]}: {exc}", severity="error")
            return
        self.failure = None
        self.started += [Started(p, root, launching.node_of(argv), spec) for p, argv in zip(procs, argvs)]
        self.say(f"launched {len(procs)} launcher(s): pid " + ", ".join(str(p.pid) for p in procs), "bold cyan")

    # ------------------------------------------------------------------ the new-run form
    def new_run(self, shown: Shown | None = None, spec: launching.RunSpec | None = None) -> None:
        """The new-run form, with ``spec``'s values (default: those last launched, else the demo
        job's); Launch starts the run and watches it."""
        from .components.new_run import NewRunScreen  # imported when first needed: start-up

        spec = spec or self.form_spec or launching.RunSpec.demo()
        self.host.app.push_screen(NewRunScreen(spec), self.launch)

    def form_open(self) -> bool:
        """Whether the new-run form is the screen on top."""
        from .components.new_run import NewRunScreen

        return isinstance(self.host.app.screen, NewRunScreen)

    def launch(self, spec: launching.RunSpec | None) -> None:
        """Start ``spec`` (one launcher per node, in sessions of their own) and watch its run
        directory. A directory of a live run is refused (the form opens again); one an earlier run
        left checkpoints or exports in (``osft-train`` would refuse it) asks first: resume it,
        overwrite it, or edit the form."""
        if spec is None:
            return
        self.form_spec = spec
        root = Path(spec.output_dir)
        there = RunWatcher(root)
        there.poll(checkpoints=False)
        busy = ProcessView(there.model).kill_targets()
        if busy:
            self.tell(f"{root} belongs to a live run (pid {busy[0].pid}): attach with osft-tui {root}, "
                      "or choose another output dir", severity="error")
            self.new_run(spec=spec)
            return
        from osft.trainer.launch.ownership import OutputDirInUse, check_output_dir  # imported when first needed: start-up

        try:
            check_output_dir(RunDir(root), spec.has_flag(*launching.RESUME_FLAGS), spec.has_flag(launching.OVERWRITE_FLAG))
        except OutputDirInUse as exc:
            self._ask_about_earlier_run(spec, str(exc))
            return
        root.mkdir(parents=True, exist_ok=True)
        self.host.post_message(Watch(root))  # before the launch's own event line
        self.start(spec.node_argvs(), root, spec)

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
                self.new_run(spec=spec)

        self.host.app.push_screen(
            Choice(f"{spec.output_dir} holds an earlier run", body,
                   [("edit", "edit", "primary"), ("resume", "resume", "warning"),
                    ("overwrite", "overwrite", "error"), ("cancel", "cancel", "default")]), done)
