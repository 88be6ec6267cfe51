"""What every control flow shares: the :class:`Shown` snapshot of the dashboard it acts on, and
:class:`Flow`, which reports through the messages of :mod:`.messages`."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from textual.notifications import SeverityLevel
from textual.widget import Widget

from .messages import Said, Told
from .processes import ProcessView
from .run_state import CheckpointEntry, RunModel


class Shown(NamedTuple):
    """What the dashboard shows when a control is used.

    Attributes:
        run: the run as last read (None: no run).
        view: its processes (the dashboard keeps it up to date: a flow that waits may hold it).
        live: whether a process of the run was alive on this host at the last sample (None: not known).
        checkpoint: the checkpoint under the cursor of the checkpoint list.
        checkpoints_focused: the checkpoint list has the focus.
        rank: the rank under the cursor of the rank table.
    """

    run: RunModel | None = None
    view: ProcessView | None = None
    live: bool | None = None
    checkpoint: CheckpointEntry | None = None
    checkpoints_focused: bool = False
    rank: int | None = None


def gone(root: Path) -> str:
    """Why a key that needs the run directory ``root`` does nothing: it was deleted or moved."""
    return f"run directory {root} no longer exists"


class Flow:
    """A family of control flows. It reports by messages that ``host`` (the
    :class:`~.controls.Controls` widget) posts to the dashboard, and opens screens and runs workers
    through it.

    Args:
        host: the widget the flows post from.
    """

    def __init__(self, host: Widget) -> None:
        self.host = host

    def say(self, text: str, style: str) -> None:
        """A line in the event pane."""
        self.host.post_message(Said(text, style))

    def tell(self, message: str, title: str = "", severity: SeverityLevel = "information",
             timeout: float | None = None) -> None:
        """A toast."""
        self.host.post_message(Told(message, title, severity, timeout))
