"""The learning-rate pilot of the sequence benchmark: the rates an arm tries, the one it takes, and
the learning–forgetting frontier they trace.

Every arm trains the first two tasks of the sequence at a few rates and is scored on each task's
validation items (rows of its training file that no stage trains on, never the test items). The
measure of learning is the **learning gain**: the drop of the reference replies' NLL (nats per
token) on a task right after its own stage, from the base model's, averaged over the two tasks;
the measure of forgetting is the BWT of the NLL matrix (the first task's change over stage 2,
nats per token; negative: forgotten). The NLL is used rather than exact match because every task
has it and it does not saturate (format compliance is near 100 % after one stage for every arm).

Rates tried: the arm's starting rate times :data:`FACTOR` to the powers −1, 0, 1, then one more rate
past an edge while the choice sits at that edge and a rate past it could come closer
(:func:`next_rate`), at most :data:`MAX_EXTENSIONS` times. Choice (:func:`choose`): sequential full
fine-tuning, the reference, takes the lowest rate whose gain is within :data:`MATCHED` of the best
gain it reached; every other arm the rate whose gain is closest to that one (the lower on a tie). An
arm whose chosen gain differs from full FT's by more than :data:`MATCHED` of it is unmatched.
"""

from __future__ import annotations

from pathlib import Path

#: Ratio of neighbouring rates in the grid.
FACTOR = 2 ** 0.5
#: Rates tried past the first grid's edges, at most.
MAX_EXTENSIONS = 2
#: Share of the reference gain within which two gains are matched.
MATCHED = 0.05


def _round(rate: float) -> float:
    return float(f"{rate:.3g}")


def first_grid(rate: float) -> list[float]:
    """The first three rates around ``rate``: rate/FACTOR, rate, rate·FACTOR (3 significant digits)."""
    return [_round(rate / FACTOR), _round(rate), _round(rate * FACTOR)]


def choose(gains: dict[float, float], target: float | None) -> float:
    """The rate taken from ``gains`` (rate -> learning gain): with ``target`` None (the reference
    arm) the lowest rate within :data:`MATCHED` of the best gain, else the rate whose gain is closest
    to ``target`` (the lower rate on a tie).

    Raises:
        ValueError: ``gains`` is empty.
    """
    if not gains:
        raise ValueError("no rate tried")
    if target is None:
        best = max(gains.values())
        return min(r for r, g in gains.items() if matched(g, best))
    return min(gains, key=lambda r: (abs(gains[r] - target), r))


def matched(gain: float, target: float) -> bool:
    """Whether ``gain`` is within :data:`MATCHED` of the reference gain ``target``."""
    return abs(gain - target) <= MATCHED * abs(target)


def next_rate(gains: dict[float, float], target: float | None) -> float | None:
    """One more rate past an edge of the rates tried, or None when the choice needs none: the
    reference takes one past the top when its top rate is the choice (its gain may still rise) and
    one below the bottom when the bottom is (a lower rate may learn as much); another arm one past
    the edge it is chosen at while it is not yet matched there, in the direction that closes the gap."""
    rates = sorted(gains)
    chosen = choose(gains, target)
    if target is not None and matched(gains[chosen], target):
        return None
    if chosen == rates[-1] and (target is None or gains[chosen] < target):
        return _round(chosen * FACTOR)
    if chosen == rates[0] and (target is None or gains[chosen] > target):
        return _round(chosen / FACTOR)
    return None


def markdown(result: dict) -> str:
    """The pilot's table, as benchmarks/README.md shows it: per arm each rate tried with its learning
    gain and BWT (nats/token), the rate chosen (bold) and whether it is matched to full FT's gain."""
    lines = [f"Validation items: {result['validation_items']} per task of {', '.join(t['name'] for t in result['tasks'])}; "
             f"seed {result['seed']}; {result['settings']['steps']} steps × {result['settings']['batch']} per stage.", "",
             "| arm | rate: learning gain / BWT (nats/token) | chosen | matched |", "| --- | --- | --- | --- |"]
    for arm, row in result["arms"].items():
        cells = [("**{}**" if t["learning_rate"] == row["chosen"] else "{}").format(
                 f"{t['learning_rate']:.3g}: {t['gain']:.3f} / {t['BWT']:+.3f}".replace("-", "−"))
                 for t in sorted(row["tried"], key=lambda t: t["learning_rate"])]
        lines.append(f"| {arm} | {'; '.join(cells)} | {row['chosen']:.3g} | {'yes' if row['matched'] else 'no'} |")
    return "\n".join(lines)


def plot_frontier(pilot: dict, out: Path) -> Path:
    """Draw each arm's tried rates as (learning gain, BWT) points joined in rate order, its chosen
    rate ringed, to ``out`` (PNG; matplotlib). ``pilot``: the ``arms`` of a pilot result."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for arm, row in pilot.items():
        tried = sorted(row["tried"], key=lambda t: t["learning_rate"])
        xs, ys = [t["gain"] for t in tried], [t["BWT"] for t in tried]
        (line,) = ax.plot(xs, ys, marker="o", label=f"{arm} (lr {row['chosen']:.2g})")
        for t in tried:
            ax.annotate(f"{t['learning_rate']:.2g}", (t["gain"], t["BWT"]), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
        pick = next(t for t in tried if t["learning_rate"] == row["chosen"])
        ax.scatter([pick["gain"]], [pick["BWT"]], s=160, facecolors="none", edgecolors=line.get_color())
    ax.axhline(0, color="grey", linewidth=0.5)
    ax.set_xlabel("learning gain, nats/token (higher: learns more)")
    ax.set_ylabel("BWT, nats/token (lower: forgets more)")
    ax.set_title("Learning-rate pilot: validation items of the first two tasks")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
