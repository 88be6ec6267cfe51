"""Incremental readers for files that other processes append to (metrics JSONL, rank logs).

Each poll reads only the bytes added since the last one (the way ``tail -f`` and toolong do), at
most a fixed number of bytes per poll, so a file that grows by megabytes per second never blocks
the UI thread for long and never makes memory grow: what a poll did not reach is read by the next.
"""

from __future__ import annotations

import os
from collections import deque
from pathlib import Path

from osft.trainer.contract import JsonlBatch, parse_lines

from .thinning import Thinning

#: Bytes one poll reads from one file at most (4 MiB: tens of thousands of metrics records).
READ_CHUNK = 4 * 1024 * 1024


class _Tail:
    """Offset bookkeeping shared by the tails: bytes read so far and a held partial last line."""

    offset: int
    _held: bytes

    @property
    def consumed(self) -> int:
        """Bytes of the file taken in as complete lines (read or skipped)."""
        return self.offset - len(self._held)

    def _complete_lines(self, data: bytes) -> list[bytes]:
        """Account for ``data`` just read; return the lines it completes (without newlines) and
        hold back a trailing partial line for the next read."""
        self.offset += len(data)
        data = self._held + data
        end = data.rfind(b"\n")
        if end < 0:
            self._held = data
            return []
        self._held = data[end + 1 :]
        return data[:end].split(b"\n")


class JsonlTail(_Tail):
    """Reads the complete new lines of a JSONL file, one poll at a time.

    A partly written last line (no newline yet) is held back until its writer finishes it; the
    complete lines are parsed by :func:`osft.trainer.contract.parse_lines` (a line that is not a
    JSON object is reported once, with its 1-based line number, and skipped). A file that shrinks or is replaced (new inode) is read again from its start.

    Args:
        path: the file; it need not exist yet.
        chunk: bytes read per poll at most.
        last: read only the file's last ``last`` bytes as first found (from the first line that
            starts in them; line numbers then count from there), None: from its start.
        thin: parse every line only in the last ``thin`` bytes the file has as first found; before
            them, the lines a chart of the whole run needs (:class:`~.thinning.Thinning`). None:
            every line.
    """

    def __init__(self, path: Path, chunk: int = READ_CHUNK, last: int | None = None, thin: int | None = None) -> None:
        self.path = Path(path)
        self.chunk = chunk
        self.last = last
        self.thin = thin
        self.thinning: Thinning | None = None
        self.offset = 0
        self.line_no = 0
        self.records_read = 0
        self._held = b""
        self._inode: int | None = None

    def poll(self) -> JsonlBatch:
        """Read what was appended since the last poll (at most ``chunk`` bytes)."""
        lines = self._new_lines()
        batch = parse_lines(lines, self.path, first_line=self.line_no + 1)
        self.line_no += len(lines)
        self.records_read += len(batch.records)
        return batch

    def _new_lines(self) -> list[bytes]:
        try:
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())
                if st.st_ino != self._inode or st.st_size < self.offset:  # new or truncated file
                    first = self._inode is None
                    self._inode, self.offset, self.line_no, self._held = st.st_ino, 0, 0, b""
                    self.thinning = None
                    if first and self.thin is not None:
                        self.thinning = Thinning.for_file(f, st.st_size, self.thin)
                    if first and self.last is not None and st.st_size > self.last:
                        f.seek(st.st_size - self.last)
                        f.readline()  # the rest of a line cut by the seek
                        self.offset = f.tell()
                if st.st_size == self.offset:
                    return []
                f.seek(self.offset)
                data = f.read(self.chunk)
        except FileNotFoundError:
            return []
        start = self.consumed
        lines = self._complete_lines(data)
        return self.thinning.apply(lines, start) if self.thinning is not None and start < self.thinning.until else lines


class LogTail(_Tail):
    """Keeps the last ``max_lines`` lines of a growing text file (a rank's stderr or stdout).

    When more than ``chunk`` bytes arrived since the last poll, the older part is skipped (and
    counted in :attr:`skipped_bytes`): a flooding log costs one bounded read per poll, and memory
    is bounded by ``max_lines``.

    Args:
        path: the file; it need not exist yet.
        max_lines: lines kept.
        chunk: bytes read per poll at most.
    """

    def __init__(self, path: Path, max_lines: int = 200, chunk: int = 256 * 1024) -> None:
        self.path = Path(path)
        self.chunk = chunk
        self.lines: deque[str] = deque(maxlen=max_lines)
        self.offset = 0
        self.skipped_bytes = 0
        self._held = b""
        self._inode: int | None = None

    def poll(self) -> list[str]:
        """Read the new complete lines (the newest ``max_lines`` of them), keep and return them."""
        try:
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())
                if st.st_ino != self._inode or st.st_size < self.offset:
                    self._inode, self.offset, self._held = st.st_ino, 0, b""
                    self.lines.clear()
                if st.st_size - self.offset > self.chunk:
                    skip_to = st.st_size - self.chunk
                    self.skipped_bytes += skip_to - self.offset
                    self.offset, self._held = skip_to, b""
                    f.seek(self.offset)
                    f.readline()  # resynchronise on a line start
                    self.skipped_bytes += f.tell() - self.offset
                    self.offset = f.tell()
                f.seek(self.offset)
                data = f.read(self.chunk)
        except FileNotFoundError:
            return []
        complete = self._complete_lines(data)[-self.lines.maxlen :]
        new = [line.decode("utf-8", errors="replace") for line in complete]
        self.lines.extend(new)
        return new
