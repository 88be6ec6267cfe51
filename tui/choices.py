"""Options a dashboard key steps through (a chart's view, smoothing or step range, the event
level, the run browser's sort and filters): the next one, round."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

T = TypeVar("T")


def next_option(options: Iterable[T], current: T) -> T:
    """The option after ``current`` in ``options``, the first after the last (and the first when
    ``current`` is not among them)."""
    options = list(options)
    return options[(options.index(current) + 1) % len(options)] if current in options else options[0]
