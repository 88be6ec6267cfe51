"""Modal screens: confirmation (listing the pids a signal goes to), quit choices, help, rank logs, search."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical, VerticalScroll
from textual.events import Key
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static

from ..tail import LogTail
from .lines import LineView

#: Lines of each stream the log screen keeps; seconds between its reads of the files.
LOG_SCREEN_LINES = 2000
LOG_POLL_S = 0.5
#: Style of each stream's lines in the log screen.
STREAM_STYLE = {"err": "yellow"}


#: Button variants of the answers that act (stop, kill, overwrite): never answered by a letter.
ACTING_VARIANTS = frozenset({"warning", "error"})
#: The key of a question's only acting answer.
YES = "y"


class Choice(ModalScreen[str]):
    """A question with one button per answer; dismisses with the answer's id (``cancel`` on
    Escape). The key of each answer that does not act is the first letter of its id (``d``
    answers ``detach``); an answer that acts (variant in :data:`ACTING_VARIANTS`) is never answered
    by the key that opened the question (``r r``, ``q k``) nor by another letter of the dashboard:
    the only one of a question answers :data:`YES`, several answer Enter on their button (Tab moves
    to it). The keys are shown on the buttons.

    Args:
        title: the question.
        body: lines under it (for example each pid a signal will go to).
        choices: ``(id, label, variant)`` per button, the default (one that does not act) first;
            the ids of the answers that do not act start with different letters, none with ``y``.
    """

    BINDINGS = [Binding("escape", "dismiss('cancel')", "cancel")]

    def __init__(self, title: str, body: list[str], choices: list[tuple[str, str, str]]) -> None:
        super().__init__(classes="modal")
        self.title_text, self.body, self.choices = title, body, choices
        acting = [cid for cid, _, variant in choices if variant in ACTING_VARIANTS]
        safe = [cid for cid, _, variant in choices if variant not in ACTING_VARIANTS]
        self.keys = {cid[0]: cid for cid in safe} | ({YES: acting[0]} if len(acting) == 1 else {})
        assert len(self.keys) == len(safe) + (len(acting) == 1), f"answers with the same key: {safe}"

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(self.title_text, classes="dialog-title", markup=False)
            with VerticalScroll(classes="dialog-body"):
                yield Static("\n".join(self.body), markup=False)
            with Horizontal(classes="dialog-buttons"):
                shown = {cid: key for key, cid in self.keys.items()}
                for cid, label, variant in self.choices:
                    yield Button(f"{label} ({shown[cid]})" if cid in shown else label, id=cid, variant=variant)

    def on_mount(self) -> None:
        self.query(Button).first().focus()

    def on_key(self, event: Key) -> None:
        if event.key in self.keys:
            event.stop()
            self.dismiss(self.keys[event.key])

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.dismiss(event.button.id or "cancel")


class HelpScreen(ModalScreen[None]):
    """The keys and what each does, then notes.

    Args:
        keys: ``(key, what it does)`` per line, keys by their Textual names (shown as the footer
            shows them).
        notes: paragraphs under the keys (the dialog wraps them to its width).
    """

    BINDINGS = [Binding("escape,q,question_mark", "dismiss(None)", "close")]

    def __init__(self, keys: list[tuple[str, str]], notes: list[str]) -> None:
        super().__init__()
        self.keys, self.notes = keys, notes

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog help"):
            yield Label("osft-tui keys", classes="dialog-title")
            with VerticalScroll(classes="dialog-body"):
                with Grid(classes="help-keys"):
                    for key, text in self.keys:
                        yield Label(self.app.get_key_display(Binding(key, "")), markup=False)
                        yield Static(text, markup=False)
                for paragraph in self.notes:
                    yield Static(paragraph, markup=False, classes="help-note")
            yield Button("close", id="close", variant="primary")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.dismiss(None)


class LogScreen(ModalScreen[None]):
    """A rank's stdout and stderr, full width and live: new lines are read every
    :data:`LOG_POLL_S` and followed while the view is at the bottom; ``/`` searches and ``n`` /
    ``N`` step through its lines. stderr lines are marked ``err│`` (yellow), stdout lines
    ``out│``. A crashed rank's exit code and error are in the title and the last line.

    Args:
        title: what the view shows (rank, node, exit code).
        paths: ``(stream name, file)`` per stream, e.g. ``[("out", stdout.log), ("err", stderr.log)]``.
        footer: a last line (the error of a crashed rank), or None.
    """

    BINDINGS = [Binding("escape,q,l", "dismiss(None)", "close"), Binding("slash", "search", "search"),
                Binding("n,right_square_bracket", "match(1)", "next match"),
                Binding("N,left_square_bracket", "match(-1)", "previous match")]

    def __init__(self, title: str, paths: list[tuple[str, Path]], footer: str | None = None) -> None:
        super().__init__()
        self.title_text, self.footer = title, footer
        self.tails = [(name, LogTail(path, LOG_SCREEN_LINES)) for name, path in paths]

    def compose(self) -> ComposeResult:
        with Vertical(classes="logs"):
            yield Label(self.title_text + "   (/ search, n/N next/previous match, esc close)", classes="dialog-title",
                        markup=False)
            yield LineView(" · ".join(str(t.path) for _, t in self.tails) or "no log", LOG_SCREEN_LINES,
                           id="rank-log")

    def on_mount(self) -> None:
        self.read()
        if self.footer:
            self.query_one(LineView).add([("error", Text(self.footer, "bold red"))])
        self.set_interval(LOG_POLL_S, self.read)

    def read(self) -> None:
        """Append the new lines of every stream."""
        view = self.query_one(LineView)
        for name, tail in self.tails:
            style = STREAM_STYLE.get(name, "")
            view.add([("log", Text(f"{name}│ {line}", style)) for line in tail.poll()])
        if not view.entries:
            view.add([("log", Text("(nothing written yet)", "dim"))])

    def action_search(self) -> None:
        """``/``: show only the lines holding a text."""
        ask_search(self.app, self.query_one(LineView))

    def action_match(self, step: int) -> None:
        """``n`` / ``N``: the next or previous line of the search (:meth:`LineView.next_match`)."""
        self.notify(self.query_one(LineView).next_match(step), timeout=2)


def ask_search(app, view: LineView) -> None:
    """Ask for a text (:class:`SearchPrompt`) and show only ``view``'s lines holding it, filtered
    as it is typed; Escape gives back the search that was in force."""
    before = view.search
    app.push_screen(SearchPrompt(before, lambda text: view.set_filter(search=text)),
                    lambda text: view.set_filter(search=before if text is None else text))


class SearchPrompt(ModalScreen[str | None]):
    """One line of text to search for, applied at each key (``live``); Enter dismisses with it
    (empty: no search), Escape with None (the search goes back to what it was).

    Args:
        current: the search in force, as the initial text.
        live: called with the text after each change.
    """

    BINDINGS = [Binding("escape", "dismiss(None)", "cancel")]

    def __init__(self, current: str = "", live: Callable[[str], None] | None = None) -> None:
        super().__init__(classes="modal")
        self.current = current
        self.live = live
        self._applied = current

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog search"):
            yield Label("search (enter: keep, empty: show all, esc: as before)", classes="dialog-title")
            yield Input(self.current, id="search-text")

    def on_input_changed(self, event: Input.Changed) -> None:
        event.stop()
        text = event.value.strip()
        if self.live is not None and text != self._applied:
            self._applied = text
            self.live(text)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.dismiss(event.value.strip())
