"""A scrolling view of lines (the event pane, a rank's log) that follows new lines while the user
has left it at the bottom (also across a resize or a new filter), counts the lines that arrived
while scrolled up, filters by text (each match highlighted) and level ("no line matches"
rather than a blank view), and steps through the matches of a search one line at a time."""

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
#: How the line of the current match (:meth:`LineView.next_match`) is marked.
CURRENT_STYLE = "on dark_goldenrod"


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
        #: The current match: its index among the lines shown, or None before a next/previous match.
        self.current: int | None = None

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
        self.unseen, self.following, self.current = 0, True, None
        self._draw(scroll_end=True)

    def next_match(self, step: int) -> str:
        """Make the match ``step`` lines on (1: the next, -1: the previous, wrapping around) the
        current one and scroll it to the middle of the view; the first move goes to the first match
        below the top of the view (``step`` 1) or the last above its bottom (-1). Returns what the
        user is told: ``match 3/17``, or why there is none."""
        if not self.search:
            return "no search: / first"
        count = sum(1 for level, line in self.entries if self._matches(level, line))
        if not count:
            return "no line matches"
        if self.current is None:
            top = int(self.scroll_y)
            start = top if step > 0 else top + self.scrollable_content_region.height - 1
            self.current = min(max(start, 0), count - 1)
        else:
            self.current = (self.current + step) % count
        self._draw(scroll_end=False)
        self.scroll_to(y=max(0, self.current - self.scrollable_content_region.height // 2), animate=False,
                       immediate=True)
        return f"match {self.current + 1}/{count}"

    def next_level(self) -> str:
        """Switch to the next level filter of :data:`LEVELS`; returns its name."""
        self.set_filter(level=next_option(LEVELS, self.level))
        return self.level

    def forget(self) -> None:
        """Drop every entry (another run is shown); the filters stay."""
        self.entries.clear()
        self.clear()
        self.unseen, self.current = 0, None
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

    def _draw(self, scroll_end: bool) -> None:
        """Draw the entries the filters keep again (the current match marked), or the line that
        says none matches."""
        self.clear()
        shown = self._shown(self.entries)
        self._placeholder = not shown and bool(self.search or self.level != "all")
        if self.current is not None and self.current < len(shown):
            shown[self.current].stylize(CURRENT_STYLE)
        if shown:
            self.write(Text("\n").join(shown), scroll_end=scroll_end)
        elif self._placeholder:
            self.write(Text(f"no line matches ({', '.join(self._filters())})", "dim italic"))
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
        if self.current is not None:
            parts.append(f"match {self.current + 1}")
        if self.unseen:
            parts.append(f"{self.unseen} new lines below (end)")
        self.border_title = Content(" · ".join(parts))  # plain: paths and searches hold brackets
