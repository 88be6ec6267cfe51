"""A metric over a whole run's optimizer steps, in a bounded number of points, for the dashboard's charts."""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field

#: Points a curve keeps at most: a chart is at most a few hundred braille dots wide, so every
#: ``stride``-th step of a long run (the stride doubles whenever the curve is full) and the latest.
CURVE_POINTS = 256


@dataclass
class Curve:
    """Values of one metric by ascending optimizer step, over the whole run (plain data: it pickles).

    Resume-aware like ``osft-train plot`` (:class:`osft.trainer.observe.plot.NodeTimeline`): a resumed run
    appends to the same metrics files, so a step at or below the last one kept, or a resume from
    step K (:meth:`cut`), replaces the points after it instead of adding to them.

    Attributes:
        steps: optimizer steps of the points kept, ascending.
        values: the metric at each of them.
        stride: the points kept are the steps divisible by it, and the latest step.
        recent: ``(step, value)`` of the latest points at every step (at most 2 × :data:`CURVE_POINTS`,
            at least :data:`CURVE_POINTS` once there are that many), for :meth:`window`.
    """

    steps: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    stride: int = 1
    recent: list[tuple[int, float]] = field(default_factory=list)

    def add(self, step: int, value: float) -> None:
        """Take in ``value`` at ``step``: points at ``step`` and later are replaced (a replay)."""
        if self.steps and step <= self.steps[-1]:
            self.cut(step - 1)
        if self.steps and self.steps[-1] % self.stride:  # the latest point, kept off the stride
            self.steps.pop()
            self.values.pop()
        self.steps.append(step)
        self.values.append(value)
        self.recent.append((step, value))
        if len(self.recent) > 2 * CURVE_POINTS:
            del self.recent[:-CURVE_POINTS]
        if len(self.steps) > CURVE_POINTS:
            self.stride *= 2
            last = len(self.steps) - 1
            kept = [i for i, s in enumerate(self.steps) if s % self.stride == 0 or i == last]
            self.steps = [self.steps[i] for i in kept]
            self.values = [self.values[i] for i in kept]

    def cut(self, after: int) -> None:
        """Forget the points after step ``after`` (a resume from that step)."""
        i = bisect_right(self.steps, after)
        del self.steps[i:], self.values[i:]
        del self.recent[bisect_right(self.recent, (after, float("inf"))):]

    def window(self, last: int | None) -> Curve:
        """The points of the ``last`` steps up to the latest one (None: this whole curve): every
        step among the recent ones, the kept points before them."""
        if last is None or not self.steps:
            return self
        low = self.steps[-1] - last
        first_recent = self.recent[0][0] if self.recent else self.steps[-1] + 1
        points = [(s, v) for s, v in zip(self.steps, self.values) if low < s < first_recent]
        points += [(s, v) for s, v in self.recent if s > low]
        return Curve([s for s, _ in points], [v for _, v in points], self.stride if points[0][0] < first_recent else 1)

    def smoothed(self, weight: float) -> Curve:
        """This curve under an exponential moving average of ``weight`` (0: as it is; 0.9: each
        point 90 % the smoothed point before), debiased at the start (W&B's and TensorBoard's
        smoothing), over the points kept."""
        if not weight:
            return self
        out, avg = [], 0.0
        for i, value in enumerate(self.values, 1):
            avg = weight * avg + (1 - weight) * value
            out.append(avg / (1 - weight ** i))
        return Curve(list(self.steps), out, self.stride)
