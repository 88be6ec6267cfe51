"""What the control flows tell the dashboard: Textual messages that the flows' widget
(:class:`~.controls.Controls`) posts and the :class:`~.dashboard.Dashboard` handles with ``@on``.
The flows never hold the dashboard; they read what it shows from a :class:`~.flow.Shown`."""

from __future__ import annotations

from pathlib import Path

from textual.message import Message
from textual.notifications import SeverityLevel


class Said(Message):
    """A line of the dashboard's own for the event pane (a request, a kill, a launch).

    Args:
        text: the line (plain text).
        style: its Rich style; one with ``red`` in it is an error line.
    """

    def __init__(self, text: str, style: str) -> None:
        super().__init__()
        self.text, self.style = text, style


class Told(Message):
    """A toast (plain text: paths and run output are not markup).

    Args:
        message: its text.
        title: its title.
        severity: ``information``, ``warning`` or ``error``.
        timeout: seconds shown (None: Textual's default).
    """

    def __init__(self, message: str, title: str = "", severity: SeverityLevel = "information",
                 timeout: float | None = None) -> None:
        super().__init__()
        self.message, self.title, self.severity, self.timeout = message, title, severity, timeout


class Watch(Message):
    """Show the run directory ``root`` from now on (a launch from the form): every pane forgets
    the run shown before."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root


class Offered(Message):
    """What the controls can do changed (a request is now pending): dim the buttons at once."""
