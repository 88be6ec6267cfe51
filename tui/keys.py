"""The dashboard's key table: one :class:`Control` per key, feeding the bindings, buttons, command
palette and help screen; each runs through ``Dashboard.action_control(name)``."""

from __future__ import annotations

import time
from typing import NamedTuple

from osft.trainer.contract import EXIT_STOPPED
from textual.binding import Binding

from .components.modals import HelpScreen


class Control(NamedTuple):
    """One dashboard control.

    Attributes:
        key: its key (Textual's name for it).
        action: its name: the :class:`Controls` flow it runs, or the dashboard's view method with
            ``view`` (both through ``Dashboard.action_control(action)``).
        label: its footer label.
        title: its button (followed by the key) and its command-palette entry.
        help: what it does, on the help screen and in the command palette.
        acts: it acts on a run (signal, kill, relaunch) or starts one; ``--readonly`` removes it, and
            a press within :data:`REPEAT_S` of the one before does nothing (a held key).
        flow: who runs it: the :class:`~.controls.Controls` flow (``requests``, ``launches``,
            ``screens``) with a method of its name, or ``view``: a method of the dashboard that
            changes only what it shows.
    """

    key: str
    action: str
    label: str
    title: str
    help: str
    flow: str
    acts: bool = False

    @property
    def command(self) -> str:
        """The Textual action string that runs it: ``control('<action>')``."""
        return f"control({self.action!r})"

    @property
    def binding(self) -> Binding:
        """Its key binding: a priority binding, so the key works whatever has the focus."""
        return Binding(self.key, self.command, self.label, priority=True)


#: Every dashboard control, in footer and button order.
CONTROLS = (
    Control("c", "checkpoint", "checkpoint", "Checkpoint",
            "checkpoint now: SIGUSR1 to the launcher; training continues", "requests", acts=True),
    Control("s", "stop", "ckpt+stop", "Checkpoint & stop",
            f"checkpoint and stop: SIGUSR2; the run exits {EXIT_STOPPED} after a complete checkpoint", "requests",
            acts=True),
    Control("e", "evaluate", "evaluate", "Evaluate",
            "evaluate at the next step boundary (writes control/evaluate); training goes on", "requests", acts=True),
    Control("K", "kill", "kill", "Kill",
            "kill: SIGKILL to every process of the run (lists the pids first)", "requests", acts=True),
    Control("r", "resume", "resume", "Resume selected",
            "resume from the checkpoint selected in the checkpoint list", "launches", acts=True),
    Control("l", "logs", "logs", "Rank logs",
            "stdout and stderr of the rank selected in the rank table, live (/ searches)", "screens"),
    Control("n", "new_run", "new run", "New run", "new run: the form, then launch", "launches", acts=True),
    Control("y", "copy", "copy path", "Copy path",
            "copy the selected checkpoint's absolute path (checkpoint list focused), else the export of a completed run",
            "screens"),
    Control("g", "next_chart", "chart", "Next chart",
            "the metric chart: loss (and evaluation losses), learning rate, grad norm, forgetting", "view"),
    Control("m", "smooth", "smooth", "Smooth chart",
            "the metric chart's smoothing: none, 0.6, 0.9 (an exponential moving average)", "view"),
    Control("w", "step_window", "steps", "Step range",
            "the metric chart's step range: all steps, the last 10,000, 1,000 or 100", "view"),
    Control("slash", "search", "search", "Search events", "events: show only the lines holding a text", "view"),
    Control("right_square_bracket", "next_match", "next", "Next match",
            "events: the next line of the search, marked and scrolled into view (n in a rank's log)", "view"),
    Control("left_square_bracket", "previous_match", "prev", "Previous match",
            "events: the line of the search before (N in a rank's log)", "view"),
    Control("v", "level", "level", "Event level", "events: all, warnings and errors, or errors only", "view"),
    Control("question_mark", "help", "help", "Help", "the keys and what each does (this screen)", "screens"),
    Control("q", "request_quit", "quit", "Quit", "quit: detach (the run goes on), checkpoint and stop, or kill",
            "screens"),
    Control("b", "toggle_buttons", "buttons", "Button row", "show or hide the button row (the footer has every key)",
            "view"),
    Control("escape", "browse", "runs", "Back to runs", "back to the run browser (osft-tui DIR on a directory of runs)",
            "screens"),
)
#: Each control by its action name.
CONTROL_BY_ACTION = {c.action: c for c in CONTROLS}
HELP, QUIT, BACK = CONTROL_BY_ACTION["help"], CONTROL_BY_ACTION["request_quit"], CONTROL_BY_ACTION["browse"]
#: Actions that act on a run or start one (removed by ``--readonly``).
ACTING = frozenset(c.action for c in CONTROLS if c.acts)
#: Seconds within which a press of an acting control repeats the one before (a terminal repeats a
#: held key about 30 times a second after about half a second): it is ignored.
REPEAT_S = 0.5
#: Textual's own keys, listed on the help screen after the controls.
TEXTUAL_KEYS = (("ctrl+p", "command palette"), ("tab", "next panel"))


def offered(readonly: bool, browsing: bool = False) -> list[Control]:
    """The controls a dashboard offers: all of them, or with ``readonly`` those that do not act;
    the way back to the run browser only when ``browsing`` (its run was chosen in one)."""
    return [c for c in CONTROLS if not (readonly and c.acts) and (browsing or c.action != "browse")]


class Presses:
    """When each acting control was last pressed, to tell a held key's auto-repeat from a press."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def repeated(self, control: Control, now: float | None = None) -> bool:
        """Record a press of ``control`` (at monotonic ``now``); True when it acts and the press
        before came less than :data:`REPEAT_S` earlier (also an ignored one: a hold is ignored whole)."""
        if not control.acts:
            return False
        now = time.monotonic() if now is None else now
        last, self._last[control.action] = self._last.get(control.action), now
        return last is not None and now - last < REPEAT_S


#: The name the help screen is installed under (:meth:`~.screen_flow.ScreenFlow.help`).
HELP_SCREEN = "osft-help"


def help_screen() -> HelpScreen:
    """The help screen: one line per control and Textual key, then how requests reach a run."""
    acting = [c.key for c in CONTROLS if c.acts]
    notes = ["Signals go to the osft-train launcher (or to the ranks when no launcher runs), never to a "
             "torchrun agent. When no process of the run is on this host, c and s write control/checkpoint "
             "or control/checkpoint-and-exit in the run directory instead; rank 0 polls them.",
             f"With --readonly, {', '.join(acting[:-1])} and {acting[-1]} are not available."]
    return HelpScreen([(c.key, c.help) for c in CONTROLS] + list(TEXTUAL_KEYS), notes)


