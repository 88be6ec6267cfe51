"""The checkpoint list of the run directory: step, time, size, complete or not."""

from __future__ import annotations

from rich.text import Text
from textual.coordinate import Coordinate

from ..format import fmt_bytes, fmt_clock
from .sortable import SortableTable
from ..run_state import CheckpointEntry


class CheckpointTable(SortableTable):
    """One row per directory under ``full_state_checkpoints/`` (key: its path), newest first. Step
    and status come first; at 80 columns the pane shows step, status, date and time, and size whole
    (42 columns with the cell padding); why one is incomplete is the last column. A click on a
    column's header sorts by it."""

    home = ("step", True)

    def on_mount(self) -> None:
        self.cursor_type = "row"
        for name, width in (("step", 5), ("status", 10), ("time", 11), ("size", 8), ("note", 30)):
            self.add_column(name, key=name, width=width)  # fixed: the header never lags the rows
        self._shown: list[CheckpointEntry] = []

    def show(self, entries: list[CheckpointEntry]) -> None:
        """Redraw when the list changed, keeping the selected checkpoint selected."""
        if entries == self._shown:
            return
        selected = self.selected()
        self.clear()
        for e in entries:
            status = "complete" if e.complete else "[yellow]incomplete[/]"
            self.add_row(str(e.step), status, fmt_clock(e.mtime), fmt_bytes(e.bytes), Text(e.note), key=str(e.path))
        self._shown = list(entries)
        self.resort()
        if selected is not None and str(selected.path) in self.rows:
            self.move_cursor(row=self.get_row_index(str(selected.path)))

    def selected(self) -> CheckpointEntry | None:
        """The checkpoint under the cursor, if any."""
        if not 0 <= self.cursor_row < self.row_count:
            return None
        key = str(self.coordinate_to_cell_key(Coordinate(self.cursor_row, 0)).row_key.value)
        return next((e for e in self._shown if str(e.path) == key), None)

    def select_step(self, step: int) -> bool:
        """Put the cursor on the complete checkpoint of ``step``; False when there is none."""
        for e in self._shown:
            if e.step == step and e.complete:
                self.move_cursor(row=self.get_row_index(str(e.path)))
                return True
        return False
