"""The Textual application: a thin shell around the :class:`~osft.tui.dashboard.Dashboard` screen
(and the :class:`~osft.tui.components.browser.RunBrowser` for a directory of runs).

Signals to the dashboard itself: SIGTERM and SIGHUP (terminal closed) end it the normal way, so
Textual restores the terminal (main screen, mouse reporting off, echo on); the run is left
running (detach: it is in its own process session) and the exit code is 128 + the signal number.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterable
from pathlib import Path

from osft.trainer.checkpoint.signals import take_held_signals
from textual.app import App, SystemCommand
from textual.screen import Screen

from . import settings
from .keys import QUIT, offered
from .dashboard import Dashboard
from .ending import ENDING_SIGNALS
from .launch import DEFAULT_LAUNCHER
from .runs import run_dirs


class OsftTui(App[int]):
    """``osft-tui``.

    Args:
        run_dir: a run directory to attach to (one without ``run.json`` is waited for), or a
            directory of run directories (:func:`~.runs.run_dirs`: the run browser opens first);
            None opens the new-run form.
        launcher: command that runs ``osft-train`` (default: this interpreter's).
        readonly: no control that signals a run.
        poll_s: seconds between polls (s).
    """

    CSS_PATH = "app.tcss"
    TITLE = "osft-tui"

    def __init__(self, run_dir: Path | None = None, launcher: list[str] | None = None, readonly: bool = False,
                 poll_s: float = 0.25) -> None:
        super().__init__()
        self.run_dir = run_dir
        self.launcher = list(launcher or DEFAULT_LAUNCHER)
        self.readonly = readonly
        self.poll_s = poll_s
        self.browse = run_dir if run_dir is not None and run_dirs(run_dir) else None
        self._keep_theme = False  # the theme set before on_mount is Textual's default, not a choice
        self.dashboard = Dashboard(None if self.browse else run_dir, self.launcher, readonly, poll_s, self.browse)

    def on_mount(self) -> None:
        theme = settings.load().get("theme")
        if isinstance(theme, str) and theme in self.available_themes:
            self.theme = theme  # the one chosen in an earlier session (palette: Theme)
        self._keep_theme = True
        loop = asyncio.get_running_loop()
        arrived = take_held_signals()  # during start-up (held by osft-tui's main)
        for signum in ENDING_SIGNALS:
            loop.add_signal_handler(signum, self.exit, 128 + signum)
        if arrived:
            self.exit(128 + arrived[0])
            return
        # Textual's Linux driver re-enters application mode on SIGCONT (resume after ctrl+z). A
        # closed terminal sends SIGHUP and SIGCONT; re-entering on the hung-up tty deadlocks the
        # shutdown (tests/test_tui_terminal.py). osft-tui never suspends itself: no handler needed.
        signal.signal(signal.SIGCONT, signal.SIG_DFL)
        self.push_screen(self.dashboard)
        if self.browse is not None:
            from .components.browser import RunBrowser  # only for a directory of runs

            self.push_screen(RunBrowser(self.browse), self.dashboard.attach)
        elif self.run_dir is None and not self.readonly:
            self.dashboard.controls.launches.new_run()

    def watch_theme(self, theme: str) -> None:
        """Keep the theme chosen for the next session (:mod:`.settings`)."""
        if self._keep_theme and settings.load().get("theme") != theme:
            settings.save(theme=theme)

    def action_quit(self) -> None:
        """ctrl+q goes through the dashboard's quit question too."""
        self.dashboard.action_control(QUIT.action)

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        """The command palette: every dashboard control (those that signal only without --readonly),
        after Textual's commands but its Quit and Keys (the controls' Quit and Help replace them)."""
        if screen is not self.dashboard:
            yield from super().get_system_commands(screen)
            return
        replaced = (self.action_quit, self.action_show_help_panel, self.action_hide_help_panel)
        yield from (c for c in super().get_system_commands(screen) if c.callback not in replaced)
        for c in offered(self.readonly, self.browse is not None):
            yield SystemCommand(c.title, c.help, lambda a=c.action: self.dashboard.action_control(a))
