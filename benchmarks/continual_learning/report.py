"""Forgetting and learning per method: the summary numbers, the console table and the PNG plot.

Definitions (losses in nats per token on held-out data, lower is better):

- forgetting on A = loss on A after task B - loss on A after task A (> 0: task B undid some of A);
- learning on B = loss on B after task A - loss on B after task B (the improvement task B bought);
- exact match on B before/after = share of held-out trivia questions answered exactly, after A / after B;
- drift on C = loss on the untouched text set after both tasks - the base model's loss on it.

The goal reported against (never asserted): OSFT's forgetting on A at most :data:`GOAL_FORGETTING`
of full fine-tuning's, with at least :data:`GOAL_LEARNING` of its learning on B.
"""

from __future__ import annotations

from pathlib import Path

GOAL_FORGETTING = 0.5
GOAL_LEARNING = 0.9


def _ratio(x: float, ref: float) -> float | None:
    return x / ref if ref > 0 else None


def summarize(base: dict, methods: list[dict]) -> list[dict]:
    """One row per method from the raw results (``base`` eval, and per method its ``after_a`` /
    ``after_b`` evals); ratios are against the ``full_ft`` row when present."""
    rows = []
    for m in methods:
        a, b = m["after_a"], m["after_b"]
        rows.append(dict(
            name=m["name"], label=m["label"], kind=m["kind"],
            loss_a_after_a=a["loss_a"], loss_a_after_b=b["loss_a"], forgetting_a=b["loss_a"] - a["loss_a"],
            loss_b_before=a["loss_b"], loss_b_after=b["loss_b"], learning_b=a["loss_b"] - b["loss_b"],
            exact_match_before=a["exact_match_b"], exact_match_after=b["exact_match_b"],
            loss_c_after=b["loss_c"], drift_c=b["loss_c"] - base["loss_c"],
            seconds=sum(p["setup_s"] + p["train_s"] for p in m["phases"].values()),
        ))
    full = next((r for r in rows if r["kind"] == "full_ft"), None)
    for r in rows:
        r["forgetting_vs_full"] = _ratio(r["forgetting_a"], full["forgetting_a"]) if full else None
        r["learning_vs_full"] = _ratio(r["learning_b"], full["learning_b"]) if full else None
        fv, lv = r["forgetting_vs_full"], r["learning_vs_full"]
        r["goal_met"] = (None if r["kind"] not in ("osft", "peft_osf") or fv is None or lv is None
                         else fv <= GOAL_FORGETTING and lv >= GOAL_LEARNING)
    return rows


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.0f} %"


def print_table(rows: list[dict], base: dict, console) -> None:
    """The summary as a rich table on ``console``."""
    from rich.table import Table

    table = Table(title="Continual learning: task A (chit-chat) then task B (trivia)")
    for col in ("method", "A loss after A → after B", "forgetting A", "B loss before → after", "learning B",
                "B exact match", "C loss (base {:.3f})".format(base["loss_c"]), "vs full FT: forget / learn",
                "goal", "time"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for r in rows:
        goal = {None: "–", True: "met", False: "not met"}[r["goal_met"]]
        table.add_row(
            r["label"], f"{r['loss_a_after_a']:.3f} → {r['loss_a_after_b']:.3f}", f"{r['forgetting_a']:+.3f}",
            f"{r['loss_b_before']:.3f} → {r['loss_b_after']:.3f}", f"{r['learning_b']:+.3f}",
            f"{_pct(r['exact_match_before'])} → {_pct(r['exact_match_after'])}", f"{r['loss_c_after']:.3f}",
            f"{_pct(r['forgetting_vs_full'])} / {_pct(r['learning_vs_full'])}", goal, f"{r['seconds']:.0f} s",
        )
    console.print(table)


def markdown_table(rows: list[dict], base: dict) -> str:
    """The summary as a Markdown table (for the README)."""
    head = ("| method | loss A after A → after B | forgetting A | loss B before → after B | learning B "
            "| exact match B before → after | loss C after (base {:.3f}) | forgetting / learning vs full FT |"
            .format(base["loss_c"]))
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['loss_a_after_a']:.3f} → {r['loss_a_after_b']:.3f} | {r['forgetting_a']:+.3f} "
            f"| {r['loss_b_before']:.3f} → {r['loss_b_after']:.3f} | {r['learning_b']:+.3f} "
            f"| {_pct(r['exact_match_before'])} → {_pct(r['exact_match_after'])} | {r['loss_c_after']:.3f} "
            f"| {_pct(r['forgetting_vs_full'])} / {_pct(r['learning_vs_full'])} |")
    return "\n".join(lines)


def plot(rows: list[dict], base: dict, path: Path, title: str) -> Path:
    """Write the PNG: forgetting vs learning per method (with the goal region relative to full
    FT), exact match before/after B, and drift on C.

    Raises:
        ImportError: matplotlib is not installed (``pip install 'osft[bench]'``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"osft": "tab:blue", "full_ft": "tab:red", "lora": "tab:green", "peft_osf": "tab:purple"}
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 5), gridspec_kw={"width_ratios": [1.4, 1, 1]})
    full = next((r for r in rows if r["kind"] == "full_ft"), None)
    xs, ys = [r["learning_b"] for r in rows], [r["forgetting_a"] for r in rows]
    xlim = (min(0.0, *xs) * 1.15, max(0.0, *xs) * 1.15 or 1.0)
    ylim = (min(0.0, *ys) * 1.25, max(0.0, *ys) * 1.45 or 1.0)  # headroom for the legend
    if full and full["forgetting_a"] > 0 and full["learning_b"] > 0:
        ax1.fill_between([GOAL_LEARNING * full["learning_b"], xlim[1]], [ylim[0]] * 2,
                         [GOAL_FORGETTING * full["forgetting_a"]] * 2, color="tab:blue", alpha=0.08,
                         label="goal: ≥90 % of full FT's learning, ≤50 % of its forgetting")
    for i, r in enumerate(rows):
        ax1.scatter(r["learning_b"], r["forgetting_a"], color=colors[r["kind"]], s=60, zorder=3)
        # the baseline's label to the right, the others above left at alternating heights: fewer overlaps
        offset, ha = ((8, 2), "left") if r["kind"] == "full_ft" else ((-8, 8 + 10 * (i % 2)), "right")
        ax1.annotate(r["label"], (r["learning_b"], r["forgetting_a"]), textcoords="offset points", xytext=offset,
                     ha=ha, fontsize=8)
    ax1.set_xlim(*xlim)
    ax1.set_ylim(*ylim)
    ax1.axhline(0, color="grey", lw=0.8)
    ax1.set_xlabel("learning on B: held-out trivia loss decrease (nats/token)")
    ax1.set_ylabel("forgetting of A: held-out chit-chat loss increase (nats/token)")
    ax1.set_title("forgetting vs learning (lower right is better)")
    if ax1.get_legend_handles_labels()[0]:
        ax1.legend(fontsize=8, loc="upper left")

    names = [r["label"].replace(" (peft)", "").replace(" (ours)", "").replace(" (--no-osft)", "") for r in rows]
    y = range(len(rows))
    ax2.barh([i + 0.2 for i in y], [100 * r["exact_match_before"] for r in rows], height=0.4, color="lightgrey",
             label="before B (after A)")
    ax2.barh([i - 0.2 for i in y], [100 * r["exact_match_after"] for r in rows], height=0.4,
             color=[colors[r["kind"]] for r in rows], label="after B")
    ax2.set_yticks(list(y), names, fontsize=8)
    ax2.invert_yaxis()
    top = max(max(r["exact_match_before"], r["exact_match_after"]) for r in rows)
    ax2.set_xlim(0, max(1.0, 120 * top))
    if top == 0:
        ax2.text(0.5, 0.5, "no held-out question answered exactly,\nbefore or after B, by any method",
                 transform=ax2.transAxes, ha="center", va="center", fontsize=9, color="dimgrey")
    ax2.set_xlabel("held-out trivia exact match (%)")
    ax2.set_title("learning: exact match on B")
    ax2.legend(fontsize=8)

    ax3.barh(list(y), [r["drift_c"] for r in rows], color=[colors[r["kind"]] for r in rows])
    ax3.axvline(0, color="grey", lw=0.8)
    ax3.set_yticks(list(y), names, fontsize=8)
    ax3.invert_yaxis()
    ax3.set_xlabel(f"loss change vs base ({base['loss_c']:.3f}), nats/token")
    ax3.set_title("general text kept: WordNet definitions (C)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
