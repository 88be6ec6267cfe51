"""Paired bootstrap over items and seeds, and the benchmark's measures of forgetting and learning.

Every measure is a function of per-item results pooled over seeds: a mean of 0/1 outcomes (in
points, x 100), or a token-weighted mean NLL (sum of NLLs / sum of tokens, nats per token). One
bootstrap replicate draws, with replacement, the seeds and, independently for each item set
(task A's questions, task B's definitions, R1, R2, R3), the items; the *same* draw is used for
every arm, so differences and ratios between arms are paired (Efron & Tibshirani, "An
Introduction to the Bootstrap", 1993, ch. 13, percentile interval). A replicate's weights are
multinomial counts, so pooling is one ``einsum`` per measure.

Measures per arm (``A`` = after its task-A run, ``B`` = after task B, ``base`` = the base model):

- ``forgetting_a`` = compliance on A's held-out cued questions, A - B (points);
- ``forgetting_a_nll`` = NLL of A's marked answers, B - A (nats/token);
- ``learning_b`` = NLL on B's held-out definitions, base - B (nats/token);
- ``drift_r1`` = NLL on the retention set, B - base; ``drift_r3`` = NLL on WordNet texts, B - base;
- ``r2_change`` = WordNet multiple-choice accuracy, B - base (points);
- ``compliance_after_a`` / ``compliance_after_b`` (points).
"""

from __future__ import annotations

import numpy as np

#: Confidence level of the intervals.
LEVEL = 0.95


class Bootstrap:
    """Replicate weights for seeds and for each item set; row 0 of every weight matrix is all ones
    (the point estimate), rows 1..reps are the bootstrap replicates.

    Args:
        n_seeds: seeds run. sizes: items per item set, e.g. ``{"a": 96, "b": 96, ...}``.
        reps: bootstrap replicates. seed: numpy generator seed (the intervals are reproducible).
    """

    def __init__(self, n_seeds: int, sizes: dict[str, int], reps: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)

        def weights(n: int) -> np.ndarray:
            return np.vstack([np.ones(n), rng.multinomial(n, np.full(n, 1.0 / n), size=reps)])

        self.seeds = weights(n_seeds)
        self.items = {name: weights(n) for name, n in sizes.items()}

    def mean(self, item_set: str, values: np.ndarray, tokens: np.ndarray | None = None) -> np.ndarray:
        """Pooled mean per replicate: ``sum(w * values) / sum(w * tokens)`` (``tokens`` default 1).

        Args:
            values / tokens: arrays of shape [seeds, items] (a seed-independent result repeated).

        Returns:
            float array of shape [reps + 1] (index 0: the point estimate).
        """
        den = np.ones_like(values, dtype=float) if tokens is None else tokens
        w = self.items[item_set]
        num = np.einsum("rs,ri,si->r", self.seeds, w, values)
        return num / np.einsum("rs,ri,si->r", self.seeds, w, den)


def interval(replicates: np.ndarray) -> dict:
    """``{"value", "low", "high"}``: the point estimate (index 0) and the 95 % percentile interval of
    the finite replicates; all None when the point estimate is not finite."""
    value = float(replicates[0])
    rest = replicates[1:][np.isfinite(replicates[1:])]
    if not np.isfinite(value) or rest.size == 0:
        return {"value": None, "low": None, "high": None}
    low, high = np.percentile(rest, [50 * (1 - LEVEL), 100 - 50 * (1 - LEVEL)])
    return {"value": value, "low": float(low), "high": float(high)}


def _stack(evals: dict, seeds: list[str], key: str, name: str) -> tuple[np.ndarray, np.ndarray | None]:
    """[seeds, items] values (and tokens) of measurement ``name`` of model ``key`` (``"base"`` is shared)."""
    rows = [evals["base"] if key == "base" else evals[s][key] for s in seeds]
    if isinstance(rows[0][name], dict):
        return (np.array([r[name]["nll"] for r in rows], dtype=float),
                np.array([r[name]["tokens"] for r in rows], dtype=float))
    return np.array([r[name] for r in rows], dtype=float), None


def arm_measures(boot: Bootstrap, evals: dict, seeds: list[str], arm: str, a_run: str) -> dict[str, np.ndarray]:
    """Every measure of one arm (see the module docstring) as replicate arrays [reps + 1]."""
    def m(key, name, item_set):
        return boot.mean(item_set, *_stack(evals, seeds, key, name))

    a, b = f"A:{a_run}", f"B:{arm}"
    comply_a, comply_b = 100 * m(a, "a_comply", "a"), 100 * m(b, "a_comply", "a")
    return {
        "compliance_after_a": comply_a, "compliance_after_b": comply_b, "forgetting_a": comply_a - comply_b,
        "forgetting_a_nll": m(b, "a_nll", "a") - m(a, "a_nll", "a"),
        "learning_b": m("base", "b_nll", "b") - m(b, "b_nll", "b"),
        "drift_r1": m(b, "r1_nll", "r1") - m("base", "r1_nll", "r1"),
        "r2_change": 100 * (m(b, "r2_correct", "r2") - m("base", "r2_correct", "r2")),
        "drift_r3": m(b, "r3_nll", "r3") - m("base", "r3_nll", "r3"),
    }


#: Measures compared with another arm (ratios to full FT and to the same-URR arm, difference from the latter).
COMPARED = ("forgetting_a", "learning_b", "drift_r1")


def summarize(evals: dict, seeds: list[str], arms: list[dict], sizes: dict[str, int], reps: int,
              full: str = "full_ft", same: str = "osft_same") -> list[dict]:
    """One row per arm: ``measures`` (name -> interval), and for each :data:`COMPARED` measure
    ``ratio_to_full`` / ``ratio_to_same`` (its ratio to the ``full`` / ``same`` arm's, per
    replicate) and ``minus_same`` (its difference from the ``same`` arm's); None where that arm is
    absent.

    Args:
        evals: ``{"base": eval, seed: {"A:<run>": eval, "B:<arm>": eval}}`` (see ``evaluate.evaluate``).
        arms: dicts with ``name`` and ``a_run``.
    """
    boot = Bootstrap(len(seeds), sizes, reps)
    raw = {arm["name"]: arm_measures(boot, evals, seeds, arm["name"], arm["a_run"]) for arm in arms}
    rows = []
    for arm in arms:
        r = raw[arm["name"]]
        row = {"name": arm["name"], "measures": {k: interval(v) for k, v in r.items()}}
        with np.errstate(divide="ignore", invalid="ignore"):
            for key, ref in (("ratio_to_full", full), ("ratio_to_same", same)):
                row[key] = {k: interval(r[k] / raw[ref][k]) for k in COMPARED} if ref in raw else None
        row["minus_same"] = {k: interval(r[k] - raw[same][k]) for k in COMPARED} if same in raw else None
        rows.append(row)
    return rows
