"""Modal screens: confirmation (listing the pids a signal goes to), quit choices, help, rank logs."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Label, Log, Static


class Choice(ModalScreen[str]):
    """A question with one button per answer; dismisses with the answer's id (``cancel`` on
    Escape).

    Args:
        title: the question.
        body: lines under it (for example each pid a signal will go to).
        choices: ``(id, label, variant)`` per button, the default first.
    """

    BINDINGS = [Binding("escape", "dismiss('cancel')", "cancel")]

    def __init__(self, title: str, body: list[str], choices: list[tuple[str, str, str]]) -> None:
        super().__init__(classes="modal")
        self.title_text, self.body, self.choices = title, body, choices

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(self.title_text, classes="dialog-title")
            with VerticalScroll(classes="dialog-body"):
                yield Static("\n".join(self.body), markup=False)
            with Horizontal(classes="dialog-buttons"):
                for cid, label, variant in self.choices:
                    yield Button(label, id=cid, variant=variant)

    def on_mount(self) -> None:
        self.query(Button).first().focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.dismiss(event.button.id or "cancel")


HELP = """\
c   checkpoint now: SIGUSR1 to the launcher; training continues
s   checkpoint and stop: SIGUSR2; the run exits 75 after a complete checkpoint
e   evaluate at the next step boundary (writes control/evaluate); training goes on
K   kill: SIGKILL to every process of the run (lists the pids first)
r   resume from the checkpoint selected in the checkpoint list
l   logs (stderr) of the rank selected in the rank table
n   new run
q   quit: detach (the run goes on), checkpoint and stop, or kill
?   this help        ctrl+p  command palette        tab  next panel

Signals go to the osft-train launcher (or to the ranks when no launcher runs), never to a
torchrun agent. When no process of the run is on this host, c and s write control/checkpoint
or control/checkpoint-and-exit in the run directory instead; rank 0 polls them.
With --readonly, c, s, e, K and r are not available.
"""


class HelpScreen(ModalScreen[None]):
    """The key bindings and what each sends."""

    BINDINGS = [Binding("escape,q,question_mark", "dismiss(None)", "close")]

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog help"):
            yield Label("osft-tui keys", classes="dialog-title")
            yield Static(HELP, markup=False)
            yield Button("close", id="close", variant="primary")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.dismiss(None)


class LogScreen(ModalScreen[None]):
    """A rank's stderr tail and, for a crashed rank, its
    exit code and error message."""

    BINDINGS = [Binding("escape,q,l", "dismiss(None)", "close")]

    def __init__(self, title: str, lines: list[str]) -> None:
        super().__init__()
        self.title_text, self.lines = title, lines

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog logs"):
            yield Label(self.title_text, classes="dialog-title")
            yield Log(max_lines=2000, id="rank-log")
            yield Button("close", id="close", variant="primary")

    def on_mount(self) -> None:
        self.query_one(Log).write_lines(self.lines)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.dismiss(None)
