"""A scrolling view of lines (the event pane, a rank's log) that follows new lines while the user
has left it at the bottom (also across a resize or a new filter), counts the lines that arrived
while scrolled up, and filters by text (each match highlighted) and level ("no line matches"
rather than a blank view)."""

from __future__ import annotations

from collections import deque

from rich.text import Text
from textual.content import Content
from textual.widgets import RichLog

from ..choices import next_option

#: Level filters, in the order a key cycles through them: the levels each one shows.
LEVELS = {"all": None, "warnings": frozenset({"warning", "error"}), "errors": frozenset({"error"})}
#: How a search's matches are marked in the lines shown.
MATCH_STYLE = "reverse bold"


class LineView(RichLog):
    """A :class:`~textual.widgets.RichLog` of ``(level, line)`` entries; its top border names it and
    says how many new lines wait below and which filter is on.

    Args:
        title: the title on its top border.
        max_lines: entries kept (the oldest are dropped).
    """

    def __init__(self, title: str, max_lines: int = 1000, **kwargs) -> None:
        super().__init__(max_lines=max_lines, wrap=False, markup=False, auto_scroll=False, **kwargs)
        self.title = title
        self.entries: deque[tuple[str, Text]] = deque(maxlen=max_lines)
        self.search = ""
        self.level = "all"
        self.unseen = 0
        #: The user left the view at the bottom: new lines scroll it (a scroll up clears it, the end sets it).
        self.following = True
        self._placeholder = False

    def on_mount(self) -> None:
        self._retitle()

    def on_resize(self) -> None:
        """A view that followed stays at the bottom when its size changes."""
        if self.following:
            self.scroll_end(animate=False, immediate=True)

    def add(self, entries: list[tuple[str, Text]]) -> None:
        """Append ``(level, line)`` entries; scroll with them only when the view was at the bottom,
        else count the shown ones as new lines."""
        self.entries.extend(entries)
        shown = self._shown(entries)
        if not shown:
            return
        if self._placeholder:
            self.clear()
            self._placeholder = False
        follow = self.following or self.max_scroll_y == 0
        self.write(Text("\n").join(shown), scroll_end=follow)
        if not follow:
            self.unseen += len(shown)
            self._retitle()

    def set_filter(self, search: str | None = None, level: str | None = None) -> None:
        """Show only the entries that contain ``search`` (case-insensitive) at ``level`` (a key of
        :data:`LEVELS`); None keeps the current one. The view is drawn again, at the bottom."""
        self.search = self.search if search is None else search
        self.level = self.level if level is None else level
        self.clear()
        self.unseen = 0
        self.following = True
        shown = self._shown(self.entries)
        self._placeholder = not shown and bool(self.search or self.level != "all")
        if shown:
            self.write(Text("\n").join(shown), scroll_end=True)
        elif self._placeholder:
            self.write(Text(f"no line matches ({', '.join(self._filters())})", "dim italic"))
        self._retitle()

    def next_level(self) -> str:
        """Switch to the next level filter of :data:`LEVELS`; returns its name."""
        self.set_filter(level=next_option(LEVELS, self.level))
        return self.level

    def forget(self) -> None:
        """Drop every entry (another run is shown); the filters stay."""
        self.entries.clear()
        self.clear()
        self.unseen = 0
        self.following, self._placeholder = True, False
        self._retitle()

    def watch_scroll_y(self, old: float, new: float) -> None:
        super().watch_scroll_y(old, new)
        if self.is_vertical_scroll_end:
            self.following = True
        elif new < old:
            self.following = False
        if self.unseen and self.is_vertical_scroll_end:
            self.unseen = 0
            self._retitle()

    def _shown(self, entries) -> list[Text]:
        """The lines of ``entries`` that the filters keep, each match of the search highlighted
        (:data:`MATCH_STYLE`, any case; the entries themselves stay as they are)."""
        shown = [line for level, line in entries if self._matches(level, line)]
        if not self.search:
            return shown
        marked = []
        for line in shown:
            line = line.copy()
            line.highlight_words([self.search], MATCH_STYLE, case_sensitive=False)
            marked.append(line)
        return marked

    def _matches(self, level: str, line: Text) -> bool:
        levels = LEVELS[self.level]
        return (levels is None or level in levels) and (not self.search or self.search.lower() in line.plain.lower())

    def _filters(self) -> list[str]:
        """The filters in force, as the title says them."""
        return ([f"{self.level} only"] if self.level != "all" else []) + \
            ([f"matching {self.search!r}"] if self.search else [])

    def _retitle(self) -> None:
        parts = [self.title, *self._filters()]
        if self.unseen:
            parts.append(f"{self.unseen} new lines below (end)")
        self.border_title = Content(" · ".join(parts))  # plain: paths and searches hold brackets
