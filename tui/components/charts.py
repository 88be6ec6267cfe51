"""The run's charts (plotext, through Textual's textual-plotext widget): the metric chart (loss with
the evaluation losses, learning rate, grad norm, forgetting; ``g`` shows the next) and the tokens/s
of every node on one axis from zero. Each is labelled and covers the whole run, resume-aware
(:class:`~..series.Curve`)."""

from __future__ import annotations

import math

from textual.app import RenderResult
from textual.content import Content
from textual_plotext import PlotextPlot

from ..run_state import RunModel
from ..choices import next_option
from ..series import Curve

#: The metric chart's views: name, title, and the curves of :attr:`RunModel.curves` it draws (a
#: name ending in a space: every curve whose name starts with it, e.g. ``eval_loss chat``).
VIEWS = (("loss", "loss, nats/token", ("loss", "eval_loss ")), ("lr", "learning rate", ("lr",)),
         ("grad_norm", "grad norm (before clipping)", ("grad_norm",)),
         ("forgetting", "forgetting, nats/token", ("forgetting ",)))
#: Smoothing weights the metric chart cycles through (``m``): none, light, strong.
SMOOTHING = (0.0, 0.6, 0.9)
#: Step ranges the metric chart cycles through (``w``): the whole run, then its last N steps.
STEP_WINDOWS = (None, 10_000, 1_000, 100)
#: Tick marks per axis at most.
TICKS = 4
#: Colours of the curves, in order (names that both plotext and Rich know: the title's legend
#: shows each label in its curve's colour).
COLOURS = ("cyan", "magenta", "green", "yellow", "blue", "red")


def nice_ticks(lo: float, hi: float, most: int = TICKS, whole: bool = False) -> tuple[list[float], list[str]]:
    """Round values from ``lo`` to ``hi``, at most ``most`` + 1 of them (spaced by 1, 2, 2.5 or 5
    times a power of ten, by whole numbers with ``whole``; plotext's own ticks are fractions of the
    range), and their labels, all with the same number of decimals (``1,500``, ``2.50``, ``5.0e-05``)."""
    if not hi > lo:
        return [lo], [_label(lo, abs(lo) or 1.0)]
    raw = (hi - lo) / most
    mag = 10 ** math.floor(math.log10(raw))
    spacing = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw * (1 - 1e-9))
    if whole:
        spacing = max(1, round(spacing))
    ticks = [k * spacing for k in range(math.ceil(lo / spacing - 1e-9), math.floor(hi / spacing + 1e-9) + 1)]
    return ticks, [_label(t, spacing) for t in ticks]


def _label(value: float, spacing: float) -> str:
    """``value`` as a tick label on an axis whose ticks are ``spacing`` apart: as many decimals as
    the spacing needs (at most 4, else in powers of ten)."""
    decimals = next((d for d in range(5) if abs(round(spacing, d) - spacing) <= 1e-9 * spacing), None)
    if decimals is None:
        return f"{value:.1e}"
    return f"{value:,.{decimals}f}"


class Chart(PlotextPlot):
    """A line chart of labelled curves over the optimizer steps, its title and legend in its top
    border (in the curves' colours), only its step and value axes drawn. plotext builds the whole
    picture on every render, and Textual renders every widget of a screen again when the screen
    comes back (help closed, say): :meth:`render` builds it again only when the curves (as
    :meth:`draw` last got them), the size or the theme changed.

    Attributes:
        curves: ``(label, curve)`` of each curve drawn.
        value_range: the value axis drawn, ``(bottom, top)`` (None while there is no data).
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._drawn: object = None
        self.curves: list[tuple[str, Curve]] = []
        self.value_range: tuple[float, float] | None = None
        self._picture: tuple[object, RenderResult] | None = None

    def draw(self, title: str, curves: list[tuple[str, Curve]], zero_based: bool = False) -> None:
        """Show ``curves`` (``(label, curve)``) under ``title``; with ``zero_based`` the value axis
        starts at 0, so equal heights mean equal values across curves."""
        curves = [(label, c) for label, c in curves if c.steps]
        key = (title, zero_based, [(label, c.steps[-1], c.values[-1], len(c.steps), c.stride) for label, c in curves])
        if key == self._drawn:
            return
        self._drawn, self.curves, self.value_range = key, curves, None
        legend = [part for (label, _), colour in zip(curves, self._colours()) for part in ("  ", (f"━ {label}", colour))]
        self.border_title = Content.assemble(title, *legend) if curves else Content(f"{title}: no data yet")
        if curves:
            top = max(max(c.values) for _, c in curves)
            bottom = 0.0 if zero_based else min(min(c.values) for _, c in curves)
            if top <= bottom:  # one value: a band around it
                pad = abs(top) * 0.1 or 1.0
                bottom, top = (bottom if zero_based else bottom - pad), top + pad
            self.value_range = (bottom, top)
        self.refresh()

    def _colours(self) -> list[str]:
        return [COLOURS[i % len(COLOURS)] for i in range(len(self.curves))]

    def render(self) -> RenderResult:
        """The plot of :attr:`curves` at the widget's size: about one point per curve and column
        (plotext's time grows with the points; its braille line still joins them at 2 dots per
        column), as many value ticks as its rows hold apart (at most :data:`TICKS` + 1)."""
        key = (self._drawn, self.size, self.app.theme, self.theme)
        if self._picture is not None and self._picture[0] == key:
            return self._picture[1]
        plt = self.plt
        plt.clear_figure()
        plt.xaxes(True, False)
        plt.yaxes(True, False)
        if self.curves and self.value_range:
            for (_, c), colour in zip(self.curves, self._colours()):
                plt.plot(*_thinned(c, max(2, self.size.width)), marker="braille", color=colour)
            plt.xticks(*nice_ticks(min(c.steps[0] for _, c in self.curves), max(c.steps[-1] for _, c in self.curves),
                                   whole=True))
            plt.ylim(*self.value_range)
            rows = self.size.height - 2  # under them: the step axis and its labels
            plt.yticks(*nice_ticks(*self.value_range, most=max(1, min(TICKS, rows - 1))))
        self._picture = (key, super().render())
        return self._picture[1]


class MetricChart(Chart):
    """The metric chart: one of :data:`VIEWS` (those the run has data for); :meth:`next_view` moves on."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.view = VIEWS[0][0]
        self.smoothing = SMOOTHING[0]
        self.window = STEP_WINDOWS[0]

    def next_window(self, model: RunModel | None) -> str:
        """Show the next step range of :data:`STEP_WINDOWS`; returns its name."""
        self.window = next_option(STEP_WINDOWS, self.window)
        if model is not None:
            self.show(model)
        return self.window_name

    @property
    def window_name(self) -> str:
        """The step range shown: ``all steps`` or ``last N steps``."""
        return "all steps" if self.window is None else f"last {self.window:,} steps"

    def next_smoothing(self, model: RunModel | None) -> float:
        """Smooth the curves by the next weight of :data:`SMOOTHING`; returns it."""
        self.smoothing = next_option(SMOOTHING, self.smoothing)
        if model is not None:
            self.show(model)
        return self.smoothing

    def next_view(self, model: RunModel | None) -> str:
        """Show the next view the run has data for (the loss view always counts); returns its name."""
        names = [name for name, _, wanted in VIEWS if name == "loss" or (model and _curves(model, wanted))]
        self.view = next_option(names, self.view)
        if model is not None:
            self.show(model)
        return self.view

    def show(self, model: RunModel) -> None:
        """Draw the current view of ``model``."""
        _, title, wanted = next(v for v in VIEWS if v[0] == self.view)
        curves = [(label, c.window(self.window).smoothed(self.smoothing)) for label, c in _curves(model, wanted)]
        smooth = f", smoothed {self.smoothing:g}" if self.smoothing else ""
        window = f", {self.window_name}" if self.window else ""
        self.draw(f"{title}{smooth}{window} (g: next, m: smooth, w: steps)", curves)


class ThroughputChart(Chart):
    """Every node's tokens/s on one axis from zero: a node at half speed is half as high."""

    def show(self, model: RunModel) -> None:
        """Draw every node's tokens/s curve."""
        self.draw("tokens/s per node", [(f"node {n}", s.tokens) for n, s in sorted(model.nodes.items())], zero_based=True)


def _thinned(curve: Curve, most: int) -> tuple[list[int], list[float]]:
    """Steps and values of ``curve``: every k-th point, so that at most ``most`` + 1 remain, and the latest."""
    k = -(-len(curve.steps) // most)
    steps, values = curve.steps[::k], curve.values[::k]
    if steps[-1] != curve.steps[-1]:
        steps, values = [*steps, curve.steps[-1]], [*values, curve.values[-1]]
    return steps, values


def _curves(model: RunModel, wanted: tuple[str, ...]) -> list[tuple[str, Curve]]:
    """``(label, curve)`` of the curves of ``model`` named in ``wanted`` (see :data:`VIEWS`)."""
    out = []
    for want in wanted:
        if want.endswith(" "):
            out += [(name, c) for name, c in sorted(model.curves.items()) if name.startswith(want) and c.steps]
        elif model.curves.get(want) and model.curves[want].steps:
            out.append(("train" if want == "loss" else want, model.curves[want]))
    return out
