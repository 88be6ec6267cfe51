"""The screen flows: a rank's logs (``l``), copying a path (``y``), the help (``?``), back to the
run browser (``escape``) and quitting (``q``: with a live run, detach, checkpoint and stop, or kill)."""

from __future__ import annotations

import os
from pathlib import Path

from .components.modals import Choice, LogScreen
from .flow import Flow, Shown, gone
from .keys import HELP_SCREEN, help_screen
from .launch_flow import LaunchFlow
from .messages import Watch
from .processes import kill as kill_processes
from .request_flow import RequestFlow


class ScreenFlow(Flow):
    """Screens over the dashboard, and quitting it.

    Args:
        host: the widget the flows post from.
        requests: the request flows (quit can checkpoint and stop first).
        launches: the launch flows (quit waits for the launchers started here too).
        readonly: quit at once (nothing here may stop or kill a run).
        runs: the directory of runs the run was chosen from, or None.
    """

    def __init__(self, host, requests: RequestFlow, launches: LaunchFlow, readonly: bool,
                 runs: Path | None = None) -> None:
        super().__init__(host)
        self.requests, self.launches, self.readonly, self.runs = requests, launches, readonly, runs

    def runs_again(self, chosen: Path | None) -> None:
        """The run browser was dismissed with ``chosen``: watch it (None: stay)."""
        if chosen is not None:
            self.host.post_message(Watch(chosen))

    def logs(self, shown: Shown) -> None:
        """The selected rank's stdout and stderr, live, with its exit code and error when it crashed."""
        run = shown.run
        if run is None:
            return
        if run.gone:
            self.tell(f"no logs: {gone(run.root)}", severity="warning")
            return
        rank = 0 if shown.rank is None else shown.rank
        info = run.ranks.get(rank)
        node, local = (info.node_rank, info.local_rank) if info else (0, rank)
        stderr = run.log_paths.get((node, local))
        paths = [("out", stderr.with_name("stdout.log")), ("err", stderr)] if stderr else []
        title = f"rank {rank} (node {node}, local rank {local}) stdout and stderr"
        if info and (info.error or info.exit_code is not None):
            title += f": exit code {info.exit_code if info.exit_code is not None else '?'}"
        self.host.app.push_screen(LogScreen(title, paths, f"error: {info.error}" if info and info.error else None))

    def copy(self, shown: Shown) -> None:
        """Copy an absolute path to the clipboard (``App.copy_to_clipboard``: OSC 52, which the
        terminal passes on): the checkpoint selected in the list when the list has the focus or the
        run has no export, else the export of the completed run."""
        run, entry = shown.run, shown.checkpoint
        if run is not None and run.gone:
            self.tell(f"nothing to copy: {gone(run.root)}", severity="warning")
            return
        export = run.export_dir if run else None
        if export and not (shown.checkpoints_focused and entry):
            path, what = export, "export"
        elif entry is not None:
            path, what = str(entry.path), f"checkpoint of step {entry.step}"
        else:
            self.tell("nothing to copy: no checkpoint and no export", severity="warning")
            return
        path = os.path.abspath(path)  # relative to where the dashboard started (a relative --output-dir)
        self.host.app.copy_to_clipboard(path)
        self.tell(path, title=f"copied the {what} path")

    def help(self, shown: Shown) -> None:
        """The keys: one help screen per app, built at its first opening and installed
        (``App.install_screen``), so that later openings only lay it out again (under a flood of
        records the building was most of a ``?`` press's latency)."""
        app = self.host.app
        if not app.is_screen_installed(HELP_SCREEN):
            app.install_screen(help_screen(), HELP_SCREEN)
        app.push_screen(HELP_SCREEN)

    def browse(self, shown: Shown) -> None:
        """Back to the run browser of :attr:`runs` (the run shown goes on); Enter watches the one chosen."""
        if self.runs is None:
            return
        from .components.browser import RunBrowser  # only for a directory of runs

        self.host.app.push_screen(RunBrowser(self.runs), self.runs_again)

    def request_quit(self, shown: Shown) -> None:

        """Quit; with a live run, ask whether to detach, checkpoint and stop, or kill."""
        app, view = self.host.app, shown.view
        if self.readonly or view is None or not view.any_alive():
            app.exit(0)
            return
        body = ["detach: the run goes on (it runs in its own session); `osft-tui RUN_DIR` attaches again",
                "checkpoint and stop: SIGUSR2, wait for the complete checkpoint, then quit",
                "kill: SIGKILL to " + ", ".join(str(t.pid) for t in view.kill_targets())]

        def done(answer: str | None) -> None:
            if answer == "detach":
                app.exit(0)
            elif answer == "stop":
                self.host.run_worker(self._stop_then_quit(shown), exclusive=True, group="quit")
            elif answer == "kill":
                kill_processes(view.kill_targets())
                app.exit(0)

        app.push_screen(Choice("The run is still running. Quit how?", body,
                               [("detach", "detach", "primary"), ("stop", "checkpoint and stop", "warning"),
                                ("kill", "kill", "error"), ("cancel", "cancel", "default")]), done)

    async def _stop_then_quit(self, shown: Shown) -> None:
        self.requests.stop(shown)
        if await self.launches.wait_stopped(shown):
            self.host.app.exit(0)
