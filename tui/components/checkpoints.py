"""The checkpoint list of the run directory: step, time, size, complete or not."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import DataTable

from ..format import fmt_bytes, fmt_clock
from ..run_state import CheckpointEntry


class CheckpointTable(DataTable):
    """One row per directory under ``full_state_checkpoints/`` (key: its path), newest first. Step
    and status come first; at 80 columns the pane shows step, status, date and time, and size whole
    (42 columns with the cell padding); why one is incomplete is the last column."""

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
        if selected is not None:
            for i, e in enumerate(entries):
                if e.path == selected.path:
                    self.move_cursor(row=i)

    def selected(self) -> CheckpointEntry | None:
        """The checkpoint under the cursor, if any."""
        if not self._shown or not 0 <= self.cursor_row < len(self._shown):
            return None
        return self._shown[self.cursor_row]

    def select_step(self, step: int) -> bool:
        """Put the cursor on the complete checkpoint of ``step``; False when there is none."""
        for i, e in enumerate(self._shown):
            if e.step == step and e.complete:
                self.move_cursor(row=i)
                return True
        return False
