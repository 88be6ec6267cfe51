"""Which lines of a long metrics file's history the dashboard parses: the whole run's charts from
a few hundred step records instead of every one.

A chart's curve keeps the steps divisible by its stride (a power of two that doubles whenever the
curve holds more than :data:`~.series.CURVE_POINTS` points; :class:`~.series.Curve`), so the step
records at other steps are parsed only to be dropped. Before the part of a file the dashboard
reads in full, a :class:`Thinning` keeps the step records whose step is a multiple of a power of
two no larger than the stride the whole run's curves will reach; the curves are then the ones a
full read gives. Kept too, so that the violation counters say what a full read says: every step
record with orthogonality violations, every one with a new largest deviation, and every record
that is not a step record. The lines are told apart by their bytes (the trainer's ``json.dumps``
layout); a line that does not look like a step record is kept and parsed.
"""

from __future__ import annotations

import re
from typing import BinaryIO

from .series import CURVE_POINTS

_STEP_EVENT = b'"event": "step"'
_STEP = re.compile(rb'"step": (\d+)')
_VIOLATIONS = re.compile(rb'"ortho_violations": [1-9]')
_MAX_DEV = re.compile(rb'"ortho_max_dev_deg": ([-+.\deE]+)')
#: Bytes of a file's start read to estimate its bytes per record.
SAMPLE_BYTES = 1 << 20


class Thinning:
    """The lines kept of the bytes of a metrics file before offset ``until``.

    Args:
        until: the byte offset from which every line is kept.
        every: step records are kept at multiples of it (a power of two, ≥ 1).
    """

    def __init__(self, until: int, every: int) -> None:
        self.until, self.every = until, every
        self.max_dev = float("-inf")

    @classmethod
    def for_file(cls, f: BinaryIO, size: int, keep_last: int) -> Thinning | None:
        """The thinning of an open file of ``size`` bytes whose last ``keep_last`` bytes are read in
        full (None when that is the whole file): ``every`` is the largest power of two at most the
        estimated step records before them over 2 × :data:`~.series.CURVE_POINTS` (an estimate
        off by up to 2× still keeps every point a curve keeps). Leaves ``f`` at its start."""
        until = size - keep_last
        if until <= 0:
            return None
        sample = f.read(SAMPLE_BYTES)
        f.seek(0)
        records = max(1.0, until * max(1, sample.count(b"\n")) / max(1, len(sample)))
        every = 1
        while every * 2 <= records / (2 * CURVE_POINTS):
            every *= 2
        return cls(until, every)

    def keep(self, line: bytes) -> bool:
        """Whether to parse ``line`` (a complete line before :attr:`until`)."""
        if _STEP_EVENT not in line:
            return True
        step = _STEP.search(line)
        if step is None or int(step.group(1)) % self.every == 0 or _VIOLATIONS.search(line):
            return True
        dev = _MAX_DEV.search(line)
        if dev is not None:
            try:
                value = float(dev.group(1))
            except ValueError:
                return True
            if value > self.max_dev:
                self.max_dev = value
                return True
        return False

    def apply(self, lines: list[bytes], start: int) -> list[bytes]:
        """``lines`` (complete lines read from byte offset ``start``) with the ones not kept made
        blank (a blank line is skipped by the parser, and the line numbers stay right)."""
        out, offset = [], start
        for line in lines:
            out.append(line if offset >= self.until or self.keep(line) else b"")
            offset += len(line) + 1
        return out
