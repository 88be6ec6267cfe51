"""Bounded readers of a metrics JSONL file (docs/architecture.md section 4), for files of any length.

Torch-free (standard library and :mod:`.contract` only), for every reader of a run's metrics: the
plot, ``outcome``, the run browser and the dashboard's history.

- :func:`iter_records`: every record in file order, read in blocks of :data:`BLOCK_BYTES` (memory
  is one block, not the file); malformed lines are reported with their line numbers as
  :func:`.contract.parse_lines` reports them.
- :func:`tail_records`: records from the last complete line backwards, read in blocks from the end,
  so a caller that needs the newest records stops after a few blocks whatever the file's length.
- :func:`decimate`: at most ``max_points`` points of a series for drawing, each bucket of
  consecutive points represented by its minimum and maximum (the envelope a line plot shows).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

from ..contract import parse_lines

#: Bytes read at a time.
BLOCK_BYTES = 1 << 20
#: Points a drawn series keeps at most (the plot is 1000 pixels wide).
MAX_POINTS = 4000


def iter_records(path: str | Path, problems: list[str] | None = None) -> Iterator[dict]:
    """The complete, well-formed records of ``path`` in file order; a partly written last line
    (no newline yet) is left out.

    Args:
        problems: when given, one message per malformed line (``<path>:<line>: malformed record skipped (...)``)
            is appended to it.

    Raises:
        OSError: the file cannot be read.
    """
    line_no, rest = 1, b""
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(BLOCK_BYTES), b""):
            lines = (rest + block).split(b"\n")
            rest = lines.pop()
            batch = parse_lines(lines, path, first_line=line_no)
            line_no += len(lines)
            if problems is not None:
                problems += batch.problems
            yield from batch.records


def tail_records(path: str | Path) -> Iterator[dict]:
    """The well-formed records of ``path`` from the last complete line backwards (malformed lines
    skipped); reads only as many blocks from the end as the caller consumes.

    Raises:
        OSError: the file cannot be read.
    """
    with open(path, "rb") as f:
        end = f.seek(0, 2)
        f.seek(max(0, end - BLOCK_BYTES))
        tail = f.read(end - f.tell())
        head_at = end - len(tail)
        # the part after the last newline is still being written
        tail = tail[:tail.rfind(b"\n")] if b"\n" in tail else b""
        while True:
            lines = tail.split(b"\n")
            if head_at > 0:
                first = lines.pop(0)  # may be cut by the block boundary: joined with the next block
            for line in reversed(lines):
                record = _record(line)
                if record is not None:
                    yield record
            if head_at == 0:
                return
            start = max(0, head_at - BLOCK_BYTES)
            f.seek(start)
            tail = f.read(head_at - start) + first
            head_at = start


def _record(line: bytes) -> dict | None:
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def decimate(steps: Sequence[int], values: Sequence[float], max_points: int = MAX_POINTS) -> tuple[list, list]:
    """``(steps, values)`` as they are when they have at most ``max_points`` points; otherwise cut
    into ``max_points // 2`` buckets of consecutive points, each kept as its minimum and maximum in
    step order (so every extreme of the series is drawn), and the first and last points."""
    n = len(steps)
    if n <= max_points:
        return list(steps), list(values)
    buckets = max(1, (max_points - 2) // 2)
    keep = {0, n - 1}
    for b in range(buckets):
        lo, hi = b * n // buckets, (b + 1) * n // buckets
        if lo < hi:
            window = range(lo, hi)
            keep.add(min(window, key=values.__getitem__))
            keep.add(max(window, key=values.__getitem__))
    order = sorted(keep)
    return [steps[i] for i in order], [values[i] for i in order]
