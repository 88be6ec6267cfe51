"""The retention benchmark's goals, console table, Markdown table, PNG plot and pilot table.

Goals (reported, never asserted) for every arm but the two references (full FT and OSFT at the
same URR without protection), the protected OSFT arms being the ones they are set for:

- forgetting of A and drift on R1 at most :data:`GOAL_FORGETTING` of full FT's and of the
  same-URR arm's (ratios of point estimates; undefined when the reference's is not positive);
- learning of B at least :data:`GOAL_LEARNING` of full FT's;
- the 95 % intervals of (arm - same-URR arm) for forgetting of A and drift on R1 below zero.
"""

from __future__ import annotations

from pathlib import Path

GOAL_FORGETTING = 0.5
GOAL_LEARNING = 0.9
REFERENCES = ("full_ft", "osft_same")
VERDICT = {None: "undefined", True: "met", False: "not met"}


def _ratio_check(row: dict, refs: dict, measure: str, ref: str, bound: float, at_most: bool) -> dict:
    key = "ratio_to_full" if ref == "full_ft" else "ratio_to_same"
    ratio = (row[key] or {}).get(measure, {}).get("value")
    ref_value = refs[ref]["measures"][measure]["value"] if ref in refs else None
    undefined = ratio is None or ref_value is None or ref_value <= 0
    met = None if undefined else (ratio <= bound if at_most else ratio >= bound)
    return {"check": f"{measure} {'<=' if at_most else '>='} {bound:.0%} of {ref}", "value": ratio, "met": met}


def goals(summary: list[dict]) -> list[dict]:
    """Per non-reference arm: each goal check ``{"check", "value", "met"}`` (met None: undefined)."""
    refs = {r["name"]: r for r in summary if r["name"] in REFERENCES}
    out = []
    for row in summary:
        if row["name"] in REFERENCES:
            continue
        checks = [_ratio_check(row, refs, m, ref, GOAL_FORGETTING, True)
                  for m in ("forgetting_a", "drift_r1") for ref in REFERENCES]
        checks.append(_ratio_check(row, refs, "learning_b", "full_ft", GOAL_LEARNING, False))
        for m in ("forgetting_a", "drift_r1"):
            diff = (row["minus_same"] or {}).get(m, {})
            met = None if diff.get("high") is None else diff["high"] < 0
            checks.append({"check": f"95 % interval of {m} - osft_same below 0", "value": diff.get("high"), "met": met})
        out.append({"name": row["name"], "checks": checks,
                    "all_met": all(c["met"] for c in checks) if all(c["met"] is not None for c in checks) else None})
    return out


def _ci(iv: dict | None, fmt: str = "{:+.3f}") -> str:
    if not iv or iv["value"] is None:
        return "–"
    return f"{fmt.format(iv['value'])} [{fmt.format(iv['low'])}, {fmt.format(iv['high'])}]"


def _pct(iv: dict | None) -> str:
    return "–" if not iv or iv["value"] is None else f"{100 * iv['value']:.0f} %"


COLUMNS = ("arm", "lr B", "A compliance after A → B (%)", "forgetting A (points)", "learning B (nats/token)",
           "drift R1 (nats/token)", "R2 accuracy change (points)", "drift R3", "forgetting / learning / R1 vs full FT",
           "forgetting A − same URR")


def _rows(result: dict) -> list[list[str]]:
    arms = {a["name"]: a for a in result["arms"]}
    rows = []
    for r in result["summary"]:
        m, arm = r["measures"], arms[r["name"]]
        full = r["ratio_to_full"] or {}
        rows.append([
            arm["label"], f"{arm['learning_rate_b']:g}",
            f"{m['compliance_after_a']['value']:.0f} → {m['compliance_after_b']['value']:.0f}",
            _ci(m["forgetting_a"], "{:+.1f}"), _ci(m["learning_b"]), _ci(m["drift_r1"]), _ci(m["r2_change"], "{:+.1f}"),
            _ci(m["drift_r3"]), " / ".join(_pct(full.get(k)) for k in ("forgetting_a", "learning_b", "drift_r1")),
            _ci((r["minus_same"] or {}).get("forgetting_a"), "{:+.1f}"),
        ])
    return rows


def _title(result: dict) -> str:
    s = result["settings"]
    return (f"{result['model']}, seeds {', '.join(result['seeds'])}: A = cued trivia ({s['steps_a']} steps × "
            f"{s['batch_a']}), then B = FOLDOC ({s['steps_b']} steps × {s['batch_b']}); "
            f"95 % paired bootstrap intervals; {result['wall_s'] / 60:.0f} min on "
            f"{result['machine']['cpu_count']} CPU cores")


def print_table(result: dict, console) -> None:
    """The summary as a rich table, then the goals, on ``console``."""
    from rich.table import Table

    table = Table(title=_title(result))
    for col in COLUMNS:
        table.add_column(col, justify="left" if col == "arm" else "right")
    for row in _rows(result):
        table.add_row(*row)
    console.print(table)
    for g in result["goals"]:
        console.print(f"goals for {g['name']}: {VERDICT[g['all_met']]}")
        for c in g["checks"]:
            value = "–" if c["value"] is None else f"{c['value']:.3f}"
            console.print(f"  {c['check']}: {value} ({VERDICT[c['met']]})")


def markdown_table(result: dict) -> str:
    """The summary as a Markdown table (for the README)."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row) + " |" for row in _rows(result)]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> Path:
    """Write the PNG: forgetting of A vs learning of B, and drift on R1 vs learning of B, one point
    per arm with its 95 % intervals as bars.

    Raises:
        ImportError: matplotlib is not installed (``pip install 'osft[bench]'``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {a["name"]: a["label"] for a in result["arms"]}
    fig, axes = plt.subplots(1, 2, figsize=(14, 5.5))
    panels = ((axes[0], "forgetting_a", "forgetting of A: compliance after A − after B (points)"),
              (axes[1], "drift_r1", "drift on R1: NLL of base replies, after B − base (nats/token)"))
    for ax, measure, ylabel in panels:
        for i, r in enumerate(result["summary"]):
            x, y = r["measures"]["learning_b"], r["measures"][measure]
            if x["value"] is None or y["value"] is None:
                continue
            ax.errorbar(x["value"], y["value"], xerr=[[x["value"] - x["low"]], [x["high"] - x["value"]]],
                        yerr=[[y["value"] - y["low"]], [y["high"] - y["value"]]], fmt="o", capsize=3,
                        color=f"C{i}", label=labels[r["name"]])
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_xlabel("learning of B: held-out FOLDOC NLL, base − after B (nats/token)")
        ax.set_ylabel(ylabel)
        ax.set_title("lower right is better")
        ax.legend(fontsize=8)
    fig.suptitle(_title(result), fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def print_pilot(result: dict, console) -> None:
    """The pilot's learning of B per arm and tried rate, and the rate chosen per arm."""
    from rich.table import Table

    table = Table(title=f"pilot: learning of B (nats/token) after {result['settings']['pilot_steps']} steps of B")
    table.add_column("arm")
    table.add_column("learning of B per learning rate", justify="right")
    table.add_column("chosen", justify="right")
    for arm, tried in result["pilot"].items():
        table.add_row(arm, ", ".join(f"{lr}: {v:+.3f}" for lr, v in tried.items()),
                      f"{result['chosen'].get(arm, float('nan')):g}")
    console.print(table)
