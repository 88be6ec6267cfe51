"""How numbers look on the dashboard: bytes, rates, durations, clock times."""

from __future__ import annotations

import time


def fmt_bytes(n: float | None) -> str:
    """``1.5 GB`` (decimal units), ``-`` for None."""
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def fmt_rate(x: float | None, decimals: int = 0) -> str:
    """A rate per second with a fixed number of ``decimals`` and thousands separators (``12,345``),
    so a cell keeps its width from one step to the next; ``-`` for None."""
    return "-" if x is None else f"{x:,.{decimals}f}"


def fmt_num(x: float | None, spec: str) -> str:
    """``x`` in the format ``spec`` (``.2e``, ``.3f``), so a cell never changes its precision; ``-`` for None."""
    return "-" if x is None else format(x, spec)


def fmt_duration(s: float | None) -> str:
    """``1h02m03s`` / ``2m03s`` / ``3s``; ``-`` for None."""
    if s is None:
        return "-"
    s = int(round(s))
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    if h:
        return f"{h}h{m:02d}m{sec:02d}s"
    return f"{m}m{sec:02d}s" if m else f"{sec}s"


def fmt_clock(ts: float | None) -> str:
    """Local ``MM-DD HH:MM`` of a unix time (a checkpoint of yesterday is not taken for today's);
    ``-`` for None."""
    return time.strftime("%m-%d %H:%M", time.localtime(ts)) if ts else "-"


def fmt_compact(x: float | None) -> str:
    """A rate in at most 5 characters with a unit prefix and 3 significant digits (``450``,
    ``12.3k``, ``2.85M``), so that a narrow cell is never cut; ``-`` for None."""
    if x is None:
        return "-"
    for prefix, scale in (("", 1.0), ("k", 1e3), ("M", 1e6), ("G", 1e9)):
        v = x / scale
        if abs(v) < 999.5 or prefix == "G":
            if not prefix:
                return f"{v:.0f}"
            return (f"{v:.2f}" if abs(v) < 9.995 else f"{v:.1f}" if abs(v) < 99.95 else f"{v:.0f}") + prefix
    raise AssertionError("unreachable")


def fit_name(name: str, width: int) -> str:
    """A host name in ``width`` characters: whole if it fits, else its first label (``gpu-17`` of
    ``gpu-17.cluster.example``), else its end after ``…`` (the end tells similar names apart)."""
    if len(name) <= width:
        return name
    short = name.split(".", 1)[0]
    return short if len(short) <= width else "…" + short[-(width - 1):]
