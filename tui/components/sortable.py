"""Tables sorted by a click on a column's header (k9s, htop): ascending, then descending, then
back to the table's own order; the header marks the column with ▲ or ▼."""

from __future__ import annotations

import re

from rich.text import Text
from textual.widgets import DataTable

#: A cell's leading number (``12``, ``1,234.5``, ``2.85M``, ``0.41`` of ``41%``...) and its unit prefix.
_NUMBER = re.compile(r"^\s*(-?[\d,]*\.?\d+(?:e[-+]?\d+)?)\s*([kMGT]?)")
_SCALE = {"": 1.0, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}


def sort_key(cell: object) -> tuple:
    """How a cell sorts: numbers (with their unit prefix) before text, text without case; ``-``
    (nothing yet) last."""
    text = cell.plain if isinstance(cell, Text) else Text.from_markup(str(cell)).plain
    if text.strip() in ("", "-"):
        return (2, 0.0, "")
    m = _NUMBER.match(text)
    if m:
        return (0, float(m.group(1).replace(",", "")) * _SCALE[m.group(2)], text.lower())
    return (1, 0.0, text.lower())


class SortableTable(DataTable):
    """A :class:`~textual.widgets.DataTable` whose rows a click on a column header sorts
    (:meth:`sort_by`); :meth:`resort` applies the sort again after rows change.

    Attributes:
        sorted_by: ``(column key, descending)`` of the sort in force, or None (the table's order).
        home: ``(column key, descending)`` of the table's own order.
    """

    sorted_by: tuple[str, bool] | None = None
    home: tuple[str, bool] = ("", False)

    def on_data_table_header_selected(self, event: DataTable.HeaderSelected) -> None:
        event.stop()
        self.sort_by(str(event.column_key.value))

    def sort_by(self, column: str) -> None:
        """The next sort of ``column``: ascending, descending, then none."""
        if self.sorted_by is None or self.sorted_by[0] != column:
            self.sorted_by = (column, False)
        elif not self.sorted_by[1]:
            self.sorted_by = (column, True)
        else:
            self.sorted_by = None
        for key, col in self.columns.items():
            name = str(key.value)
            mark = "" if self.sorted_by is None or self.sorted_by[0] != name else " ▼" if self.sorted_by[1] else " ▲"
            col.label = Text(name + mark)
        self.resort()
        self.refresh()

    def resort(self) -> None:
        """Apply the sort in force, else the table's own order (after rows were added or changed)."""
        if self.sorted_by is not None or self.home[0] in {str(k.value) for k in self.columns}:
            column, descending = self.sorted_by or self.home
            self.sort(column, key=sort_key, reverse=descending)
