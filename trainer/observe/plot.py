"""``osft-train plot RUN_DIR [--out PNG]``: a PNG of a run's metrics over its optimizer steps.

Panels: loss (with the evaluation loss of each evaluation set, and a panel of the forgetting of each
retention set when the run evaluated them), learning rate, tokens/s of each node, and the worst
orthogonality deviation with the violating steps marked; every panel has vertical markers at the checkpoints saved and the steps
resumed from. A resumed run appends to the same ``metrics/node<N>.jsonl`` files, so a step can
appear in several segments: the latest segment wins, as a resume from step K supersedes whatever
an earlier segment logged after K (its steps, evaluations and checkpoints). :func:`run_series` returns exactly
what the picture draws: a long run's series decimated to each bucket's minimum and maximum
(:func:`osft.trainer.observe.metrics_file.decimate`), the files read in blocks (:func:`osft.trainer.observe.metrics_file.iter_records`). matplotlib is optional (``pip install 'osft[plot]'``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..contract import Event
from .metrics_file import decimate, iter_records
from ..rundir import NODE_METRICS

#: Figure size (inches) and resolution: the PNG is 1000 x 1000 pixels.
FIGSIZE_IN = (10.0, 10.0)
DPI = 100
#: A series with at most this many points is drawn with a marker on each point.
FEW_POINTS = 20
#: The fields of a step record the plot keeps (a long run's records are not held whole).
STEP_FIELDS = ("loss", "lr", "node_tokens_per_s", "ortho_max_dev_deg", "ortho_violations")


class PlotError(ValueError):
    """The run directory has no metrics to plot, or matplotlib is missing."""


@dataclass
class Series:
    """Values over optimizer steps (``steps[i]`` -> ``values[i]``), steps ascending."""

    steps: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)


@dataclass
class NodeTimeline:
    """One node's metrics file reduced to its latest segment: step records by step, the steps of
    the checkpoints saved and of the resumes, and the last ``run_started`` config."""

    steps: dict[int, dict] = field(default_factory=dict)
    evals: dict[tuple[str, int], dict] = field(default_factory=dict)
    checkpoints: list[int] = field(default_factory=list)
    resumes: list[int] = field(default_factory=list)
    config: dict = field(default_factory=dict)
    last: int | None = None

    def _supersede(self, after: int) -> None:
        """Forget what an earlier segment logged for steps after ``after``."""
        self.steps = {s: r for s, r in self.steps.items() if s <= after}
        self.last = max(self.steps, default=None)
        self.evals = {k: r for k, r in self.evals.items() if k[1] <= after}
        self.checkpoints = [s for s in self.checkpoints if s <= after]
        self.resumes = [s for s in self.resumes if s <= after]

    def add(self, record: dict) -> None:
        """Take in the next record of the file: a ``resumed`` from step K supersedes the steps
        after K; a ``step`` at or below the last step kept (a fresh restart) supersedes those from it on."""
        event = record.get("event")
        if event == Event.RUN_STARTED:
            self.config = record.get("config") or {}
        elif event == Event.RESUMED:
            self._supersede(int(record["from_step"]))
            self.resumes.append(int(record["from_step"]))
        elif event == Event.STEP:
            step = int(record["step"])
            if self.last is not None and step <= self.last:
                self._supersede(step - 1)
            self.steps[step] = {key: record.get(key) for key in STEP_FIELDS}
            self.last = step if self.last is None else max(self.last, step)
        elif event == Event.EVAL:
            self.evals[(str(record["set"]), int(record["step"]))] = record
        elif event == Event.CHECKPOINT_SAVED and int(record["step"]) not in self.checkpoints:
            self.checkpoints.append(int(record["step"]))


@dataclass
class RunSeries:
    """Everything the plot draws.

    Attributes:
        loss, lr: token-mean loss and learning rate (from the lowest node's file; the same on every node).
        node_tokens_per_s: node rank -> that node's tokens/s.
        ortho_max_dev_deg: worst deviation from 90 degrees, degrees (steps with a check only).
        violation_steps: steps with at least one orthogonality violation.
        eval_loss: evaluation set -> its loss (nats per token) at each evaluation.
        forgetting: retention set -> its forgetting (loss minus its step-0 loss, nats per token).
        checkpoints, resumes: steps of the checkpoints saved and of the steps resumed from.
        ortho_margin_deg: the run's violation threshold, degrees (None when unknown).
        max_forgetting: the run's forgetting budget, nats per token (None: none or unknown).
        problems: malformed lines skipped while reading.
    """

    loss: Series
    lr: Series
    node_tokens_per_s: dict[int, Series]
    ortho_max_dev_deg: Series
    violation_steps: list[int]
    eval_loss: dict[str, Series]
    forgetting: dict[str, Series]
    checkpoints: list[int]
    resumes: list[int]
    ortho_margin_deg: float | None
    max_forgetting: float | None
    problems: list[str]


def _series(steps: dict[int, dict], key: str) -> Series:
    """The non-null values of ``key`` in the step records, by ascending step, decimated to at most
    :data:`osft.trainer.observe.metrics_file.MAX_POINTS` points (each bucket's minimum and maximum)."""
    xs, ys = [], []
    for step in sorted(steps):
        value = steps[step].get(key)
        if value is not None:
            xs.append(step)
            ys.append(float(value))
    return Series(*decimate(xs, ys))


def _eval_series(evals: dict[tuple[str, int], dict], kind: str, key: str) -> dict[str, Series]:
    """Per set of ``kind``, the non-null values of ``key`` in its ``eval`` records, by ascending step."""
    out: dict[str, Series] = {}
    for (name, step), record in sorted(evals.items()):
        if record.get("kind") == kind and record.get(key) is not None:
            series = out.setdefault(name, Series())
            series.steps.append(step)
            series.values.append(float(record[key]))
    return out


def run_series(run_dir: str | Path) -> RunSeries:
    """Read ``RUN_DIR/metrics/node<N>.jsonl`` and return the series the plot draws.

    Raises:
        PlotError: ``run_dir`` is not a directory, or it has no node metrics file with a step record.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise PlotError(f"{run_dir}: not a directory (expected a run directory, the --output-dir of a run)")
    files = {int(m.group(1)): p for p in (run_dir / "metrics").glob("node*.jsonl") if (m := NODE_METRICS.match(p.name))}
    nodes: dict[int, NodeTimeline] = {}
    problems: list[str] = []
    for node in sorted(files):
        timeline = NodeTimeline()
        for record in iter_records(files[node], problems):
            timeline.add(record)
        if timeline.steps:
            nodes[node] = timeline
    if not nodes:
        raise PlotError(f"{run_dir}: no step records in {run_dir / 'metrics'}/node<N>.jsonl (no metrics to plot)")
    first = nodes[min(nodes)]
    dev = _series(first.steps, "ortho_max_dev_deg")
    margin = first.config.get("ortho_margin_deg")
    return RunSeries(
        loss=_series(first.steps, "loss"),
        lr=_series(first.steps, "lr"),
        node_tokens_per_s={node: _series(t.steps, "node_tokens_per_s") for node, t in nodes.items()},
        ortho_max_dev_deg=dev,
        violation_steps=[s for s in sorted(first.steps) if (first.steps[s].get("ortho_violations") or 0) > 0],
        eval_loss=_eval_series(first.evals, "eval", "eval_loss"),
        forgetting=_eval_series(first.evals, "retention", "forgetting"),
        checkpoints=sorted(first.checkpoints),
        resumes=sorted(first.resumes),
        ortho_margin_deg=float(margin) if margin is not None else None,
        max_forgetting=first.config.get("max_forgetting"),
        problems=problems,
    )


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> tuple[Path, RunSeries]:
    """Draw the run's metrics into a PNG of 1000 x 1000 pixels.

    Args:
        run_dir: the run directory (``--output-dir`` of a run).
        out: the PNG to write (default ``RUN_DIR/plot.png``); its directory is created.

    Returns:
        ``(path of the PNG, the series drawn)``.

    Raises:
        PlotError: matplotlib is not installed, or see :func:`run_series`.
    """
    data = run_series(run_dir)
    out = Path(out) if out is not None else Path(run_dir) / "plot.png"
    fig = draw_run(data, f"osft run {Path(run_dir).resolve().name}")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=DPI)
    return out, data


def _marker(series: Series) -> dict:
    """Line style keywords: a marker on every point when a series has few points, so that a run
    of one step (a single point, which a line alone does not show) is visible."""
    return {"marker": "o", "markersize": 4} if len(series.steps) <= FEW_POINTS else {}


def draw_run(data: RunSeries, title: str):
    """The matplotlib ``Figure`` of :func:`plot_run`, not saved.

    Raises:
        PlotError: matplotlib is not installed.
    """
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError as exc:
        raise PlotError("osft-train plot needs matplotlib; install it with: pip install 'osft[plot]'") from exc
    fig = Figure(figsize=FIGSIZE_IN, dpi=DPI, layout="constrained")
    axes = list(fig.subplots(5 if data.forgetting else 4, 1, sharex=True))
    ax_loss, ax_lr, ax_tps, ax_dev = axes[0], *axes[-3:]
    fig.suptitle(title)
    ax_loss.plot(data.loss.steps, data.loss.values, color="tab:blue", label="training loss" if data.eval_loss else None,
                 **_marker(data.loss))
    for i, (name, series) in enumerate(data.eval_loss.items()):
        ax_loss.plot(series.steps, series.values, "o-", color=f"C{i + 1}", label=f"evaluation loss ({name})")
    ax_loss.set_ylabel("loss, nats/token")
    if data.forgetting:
        ax_forget = axes[1]
        for name, series in data.forgetting.items():
            ax_forget.plot(series.steps, series.values, "o-", label=name)
        if data.max_forgetting is not None:
            ax_forget.axhline(data.max_forgetting, color="tab:red", linestyle="--", linewidth=1, label="--max-forgetting")
        ax_forget.axhline(0.0, color="black", linewidth=0.5)
        ax_forget.set_ylabel("forgetting, nats/token")
        ax_forget.legend(loc="best", fontsize="small")
    ax_lr.plot(data.lr.steps, data.lr.values, color="tab:purple", **_marker(data.lr))
    ax_lr.set_ylabel("learning rate")
    for node, series in data.node_tokens_per_s.items():
        ax_tps.plot(series.steps, series.values, label=f"node {node}", **_marker(series))
    ax_tps.set_ylabel("tokens/s per node")
    ax_tps.set_ylim(bottom=0)
    ax_tps.legend(loc="lower right", fontsize="small")
    _draw_orthogonality(ax_dev, data)
    ax_dev.set_xlabel("optimizer step")
    ax_dev.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in axes:
        for i, step in enumerate(data.checkpoints):
            ax.axvline(step, color="tab:green", linestyle=":", label="checkpoint saved" if i == 0 and ax is ax_loss else None)
        for i, step in enumerate(data.resumes):
            ax.axvline(step, color="tab:orange", linestyle="--", label="resumed from" if i == 0 and ax is ax_loss else None)
        ax.grid(alpha=0.3)
    if data.checkpoints or data.resumes or data.eval_loss:
        ax_loss.legend(loc="best", fontsize="small")
    return fig


def _draw_orthogonality(ax, data: RunSeries) -> None:
    """Worst deviation from 90 degrees (log scale), the margin, and the violating steps as red crosses."""
    ax.set_ylabel("orthogonality: max dev., deg")
    if not data.ortho_max_dev_deg.steps:
        ax.text(0.5, 0.5, "no orthogonality checks (--no-osft)", transform=ax.transAxes, ha="center", va="center")
        return
    ax.plot(data.ortho_max_dev_deg.steps, data.ortho_max_dev_deg.values, color="tab:gray", label="max deviation",
            **_marker(data.ortho_max_dev_deg))
    ax.set_yscale("log", nonpositive="clip")
    if data.ortho_margin_deg is not None:
        ax.axhline(data.ortho_margin_deg, color="tab:red", linestyle="--", linewidth=1, label="margin")
    dev = dict(zip(data.ortho_max_dev_deg.steps, data.ortho_max_dev_deg.values))
    marked = [s for s in data.violation_steps if s in dev]
    if marked:
        ax.plot(marked, [dev[s] for s in marked], "x", color="tab:red", markersize=8,
                label=f"steps with violations: {len(data.violation_steps)}")
    ax.legend(loc="best", fontsize="small")
