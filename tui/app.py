"""The Textual application: a thin shell around the :class:`~osft.tui.dashboard.Dashboard` screen.

Signals to the dashboard itself: SIGTERM and SIGHUP (terminal closed) end it the normal way, so
Textual restores the terminal (main screen, mouse reporting off, echo on); the run is left
running (detach: it is in its own process session) and the exit code is 128 + the signal number.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterable
from pathlib import Path

from textual.app import App, SystemCommand
from textual.screen import Screen

from .dashboard import CONTROLS, SIGNALLING, Dashboard
from .launch import DEFAULT_LAUNCHER

CSS = """
#header { height: 1; background: $panel; padding: 0 1; }
#violations { height: 1; padding: 0 1; background: $success-darken-3; }
#violations.alert { background: $error; color: $text; text-style: bold; }
#top { height: 8; }
#nodes { width: 3fr; }
#histories { width: 1fr; min-width: 24; padding: 0 1; }
.history-label { color: $text-muted; }
Sparkline { height: 1; margin-bottom: 0; }
#middle { height: 1fr; min-height: 6; }
#checkpoint-pane { width: 2fr; }
#rank-pane { width: 3fr; }
.pane-title { color: $text-muted; padding: 0 1; }
#events { height: 1fr; min-height: 4; border-top: solid $panel; }
#buttons { height: 1; }
#buttons Button { margin: 0 1 0 0; }
Choice, HelpScreen, LogScreen { align: center middle; }
.dialog { width: 90; max-width: 95%; height: auto; max-height: 90%; border: thick $primary; background: $surface; padding: 1 2; }
.dialog.logs { height: 90%; }
.dialog-title { text-style: bold; margin-bottom: 1; }
.dialog-body { height: auto; max-height: 16; }
.dialog-buttons { height: auto; margin-top: 1; }
.dialog-buttons Button { margin-right: 2; }
#rank-log { height: 1fr; }
#new-run { padding: 1 2; }
#new-run-grid { grid-size: 2; grid-columns: 36 1fr; grid-rows: 3; height: auto; }
#new-run-grid Label { padding: 1 0; }
#new-run-problems { height: auto; margin: 1 0; }
"""


class OsftTui(App[int]):
    """``osft-tui``.

    Args:
        run_dir: a run directory to attach to; None opens the new-run form.
        launcher: command that runs ``osft-train`` (default: this interpreter's).
        readonly: no control that signals a run.
        poll_s: seconds between polls (s).
    """

    CSS = CSS
    TITLE = "osft-tui"

    def __init__(self, run_dir: Path | None = None, launcher: list[str] | None = None, readonly: bool = False,
                 poll_s: float = 0.25) -> None:
        super().__init__()
        self.run_dir = run_dir
        self.launcher = list(launcher or DEFAULT_LAUNCHER)
        self.readonly = readonly
        self.poll_s = poll_s
        self.dashboard = Dashboard(run_dir, self.launcher, readonly, poll_s)

    def on_mount(self) -> None:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGHUP):
            loop.add_signal_handler(signum, self.exit, 128 + signum)
        # Textual's Linux driver re-enters application mode on SIGCONT (resume after ctrl+z). A
        # closed terminal sends SIGHUP and SIGCONT; re-entering on the hung-up tty deadlocks the
        # shutdown (tests/test_tui_terminal.py). osft-tui never suspends itself: no handler needed.
        signal.signal(signal.SIGCONT, signal.SIG_DFL)
        self.push_screen(self.dashboard)
        if self.run_dir is None:
            self.dashboard.action_new_run()

    def action_quit(self) -> None:
        """ctrl+q goes through the dashboard's quit question too."""
        self.dashboard.action_request_quit()

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        """The command palette: every dashboard control (those that signal only without --readonly)."""
        yield from super().get_system_commands(screen)
        if screen is not self.dashboard:
            return
        for key, action, label, text in CONTROLS:
            if self.readonly and action in SIGNALLING:
                continue
            title = text.rsplit(" (", 1)[0] if text else label.capitalize()
            doc = (getattr(Dashboard, f"action_{action}").__doc__ or "").strip().split("\n")[0]
            yield SystemCommand(title, doc or title, lambda a=action: self.dashboard.run_action(a))
