"""The new-run form, prefilled with the demo job."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, VerticalScroll
from textual.screen import Screen
from textual.widgets import Button, Input, Label, Static

from ..launch import RunSpec
from .footer import KeyFooter

#: (field, label, input type) in form order.
FIELDS = (
    ("model", "model (HF dir or .gguf)", "text"),
    ("data", "data (messages jsonl)", "text"),
    ("output_dir", "output dir", "text"),
    ("nnodes", "nodes (extra nodes simulated here)", "integer"),
    ("nproc_per_node", "processes per node", "integer"),
    ("urr", "URR (unfreeze rank ratio)", "number"),
    ("learning_rate", "learning rate", "number"),
    ("max_steps", "max steps", "integer"),
    ("extra_args", "extra osft-train flags", "text"),
)


class NewRunScreen(Screen[RunSpec | None]):
    """Dismisses with the :class:`RunSpec` to launch, or None (Escape / cancel)."""

    BINDINGS = [Binding("escape", "cancel", "cancel"), Binding("ctrl+l", "launch", "launch", priority=True)]

    def __init__(self, spec: RunSpec) -> None:
        super().__init__()
        self.spec = spec

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="new-run"):  # scrolls to the focused field on small terminals
            yield Label("New OSFT run (on-demand checkpointing on: c/s on the dashboard)", classes="dialog-title")
            with Grid(id="new-run-grid"):
                for name, label, kind in FIELDS:
                    yield Label(label)
                    yield Input(str(getattr(self.spec, name)), type=kind, id=f"field-{name}")
            yield Static("", id="new-run-problems")
            with Horizontal(classes="dialog-buttons"):
                yield Button("launch", id="launch", variant="success")
                yield Button("cancel", id="cancel")
        yield KeyFooter()

    def on_mount(self) -> None:
        # Enter launches; the form stays scrolled to its top (title, first fields) on a small terminal
        self.query_one("#launch", Button).focus(scroll_visible=False)

    def read_spec(self) -> RunSpec | list[str]:
        """The spec in the form, or the problems with it (each naming its field)."""
        values, problems = {}, []
        for name, label, kind in FIELDS:
            raw = self.query_one(f"#field-{name}", Input).value.strip()
            try:
                values[name] = int(raw) if kind == "integer" else float(raw) if kind == "number" else raw
            except ValueError:
                problems.append(f"{label}: {raw!r} is not a {kind}")
        if problems:
            return problems
        spec = RunSpec(**values)
        return spec.check() or spec

    def action_launch(self) -> None:
        spec = self.read_spec()
        if isinstance(spec, list):
            self.query_one("#new-run-problems", Static).update(Text("\n".join(spec), "b red"))
            return
        self.dismiss(spec)

    def action_cancel(self) -> None:
        self.dismiss(None)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        if event.button.id == "launch":
            self.action_launch()
        else:
            self.action_cancel()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.action_launch()
