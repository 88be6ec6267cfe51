"""The run browser: the run directories under a directory (state, step, last loss, age), sorted and
filtered (:class:`~..runs.Listing`); Enter opens one."""

from __future__ import annotations

from pathlib import Path

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import DataTable, Input, Label

from ..choices import next_option
from ..format import fmt_duration, fmt_num
from ..runs import AGE_WINDOWS, SORT_KEYS, STATE_FILTERS, Listing, RunSummary, run_dirs, summarize
from .header import STATE_STYLE
from .footer import KeyFooter

#: The browser's columns and their widths (each a :data:`~..runs.SORT_KEYS` column).
COLUMNS = (("run", 24), ("state", 13), ("step", 7), ("last loss", 9), ("age", 13))


class RunBrowser(Screen[Path]):
    """Lists the run directories under ``root`` (:func:`~..runs.run_dirs`); dismisses with the one
    chosen (Enter or a click on its row). A click on a column header sorts by it (again: the other
    way); ``s`` sorts by the next column, ``d`` turns the order round, ``f`` shows one group of
    states, ``a`` only the runs active lately, ``/`` the names holding a text. ``q`` quits osft-tui.

    Args:
        root: a directory holding run directories.

    Attributes:
        listing: the sort and filters in force.
        summaries: every run found at the last refresh, in :func:`~..runs.run_dirs` order.
    """

    BINDINGS = [Binding("q", "app.exit", "quit"), Binding("f5", "refresh", "refresh"),
                Binding("s", "sort", "sort"), Binding("d", "reverse", "order"), Binding("f", "states", "state"),
                Binding("a", "age", "age"), Binding("slash", "search", "search")]

    def __init__(self, root: Path) -> None:
        super().__init__(id="browser")
        self.root = root
        self.listing = Listing()
        self.summaries: list[RunSummary] = []

    def compose(self) -> ComposeResult:
        yield Label(f"runs in {self.root}: enter opens one", classes="pane-title", markup=False)
        yield Label("", id="run-listing", markup=False)
        yield Input(placeholder="names holding... (enter: keep, escape: clear)", id="run-filter")
        yield DataTable(id="runs", cursor_type="row")
        yield KeyFooter()

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        for name, width in COLUMNS:
            table.add_column(name, key=name, width=width)
        self.query_one("#run-filter", Input).display = False
        self.action_refresh()
        table.focus()

    def action_refresh(self) -> None:
        """Read the runs again (states, steps and ages as they are now)."""
        self.summaries = [summarize(path) for path in run_dirs(self.root)]
        self.show()

    def show(self) -> None:
        """Redraw the table from :attr:`summaries` with :attr:`listing`, the cursor kept on its run."""
        table = self.query_one(DataTable)
        keys = [str(r.key.value) for r in table.ordered_rows]
        selected = keys[table.cursor_row] if keys and 0 <= table.cursor_row < len(keys) else None
        shown = self.listing.apply(self.summaries)
        table.clear()
        for column, _width in COLUMNS:
            mark = (" ▼" if self.listing.descending else " ▲") if column == self.listing.sort else ""
            table.columns[column].label = Text(column + mark)
        for s in shown:
            table.add_row(Text(s.path.name), Text(s.state, STATE_STYLE.get(s.state, "")),
                          "-" if s.step is None else str(s.step), fmt_num(s.loss, ".4f"),
                          "-" if s.age_s is None else f"{fmt_duration(s.age_s)} ago", key=str(s.path))
        rows = [str(s.path) for s in shown]
        if selected in rows:
            table.move_cursor(row=rows.index(selected))
        count = f"{len(shown)} of {len(self.summaries)} runs" if len(shown) != len(self.summaries) else \
            f"{len(shown)} runs"
        empty = "; no run matches: f, a and / change the filters" if self.summaries and not shown else ""
        self.query_one("#run-listing", Label).update(f"{count}, {self.listing.describe()}{empty}")

    def _change(self, **fields) -> None:
        self.listing = self.listing._replace(**fields)
        self.show()

    def action_sort(self) -> None:
        """Sort by the next column (ascending)."""
        self._change(sort=next_option(SORT_KEYS, self.listing.sort), descending=False)

    def action_reverse(self) -> None:
        """Turn the order round."""
        self._change(descending=not self.listing.descending)

    def action_states(self) -> None:
        """Show the next group of states (all, live, failed, ended)."""
        self._change(states=next_option(STATE_FILTERS, self.listing.states))

    def action_age(self) -> None:
        """Show only the runs active within the next window (any age, 1 h, 1 day, 1 week)."""
        self._change(age=next_option(AGE_WINDOWS, self.listing.age))

    def action_search(self) -> None:
        """Open the name filter; each key filters at once."""
        box = self.query_one("#run-filter", Input)
        box.display = True
        box.focus()

    @on(Input.Changed, "#run-filter")
    def _filter_changed(self, event: Input.Changed) -> None:
        self._change(text=event.value.strip())

    @on(Input.Submitted, "#run-filter")
    def _filter_kept(self) -> None:
        self.query_one(DataTable).focus()

    def key_escape(self) -> None:
        """Escape in the name filter clears and closes it."""
        box = self.query_one("#run-filter", Input)
        if box.has_focus:
            box.value = ""
            box.display = False
            self.query_one(DataTable).focus()

    def on_data_table_header_selected(self, event: DataTable.HeaderSelected) -> None:
        event.stop()
        column = str(event.column_key.value)
        same = column == self.listing.sort
        self._change(sort=column, descending=not self.listing.descending if same else False)

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        self.dismiss(Path(str(event.row_key.value)))
