"""The run browser: the run directories under a directory (state, step, last loss, age); Enter opens one."""

from __future__ import annotations

from pathlib import Path

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Label

from ..format import fmt_duration, fmt_num
from ..runs import run_dirs, summarize
from .header import STATE_STYLE


class RunBrowser(Screen[Path]):
    """Lists the run directories under ``root`` (:func:`~..runs.run_dirs`); dismisses with the one
    chosen (Enter or a click on its row). ``q`` quits osft-tui.

    Args:
        root: a directory holding run directories.
    """

    BINDINGS = [Binding("q", "app.exit", "quit"), Binding("f5", "refresh", "refresh")]

    def __init__(self, root: Path) -> None:
        super().__init__(id="browser")
        self.root = root
        self.paths: list[Path] = []

    def compose(self) -> ComposeResult:
        yield Label(f"runs in {self.root}: enter opens one", classes="pane-title", markup=False)
        yield DataTable(id="runs", cursor_type="row")
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        for name, width in (("run", 24), ("state", 13), ("step", 7), ("last loss", 9), ("age", 13)):
            table.add_column(name, key=name, width=width)
        self.action_refresh()
        table.focus()

    def action_refresh(self) -> None:
        """List the runs again (states, steps and ages as they are now)."""
        table = self.query_one(DataTable)
        table.clear()
        self.paths = run_dirs(self.root)
        for path in self.paths:
            s = summarize(path)
            table.add_row(Text(path.name), Text(s.state, STATE_STYLE.get(s.state, "")), "-" if s.step is None else str(s.step), fmt_num(s.loss, ".4f"),
                          "-" if s.age_s is None else f"{fmt_duration(s.age_s)} ago", key=str(path))

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        self.dismiss(Path(str(event.row_key.value)))
