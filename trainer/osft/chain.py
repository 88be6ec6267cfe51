"""The chain budget of sequential OSFT: how much of each module later runs can still train.

Every chained run protects what earlier runs changed (P: N×p_L, Q: M×p_R, :mod:`.protect`) and
splits the rest (:func:`.plan.split_protected_rank`): R = min(N − p_L, M − p_R) and, under
``--osft-frozen-rank reduced`` (the default), k_high = floor(R·(1 − URR)); under ``keep`` k_high
stays a fresh run's frozen count, so k_low shrinks by the protected rank each run. At every
export, per module, :func:`chain_budget` records this run's R, k_high, k_low, the bases after the
fold, and the split a next run at the same URR and rule would get, against a fresh run's k_low
(run 1's when the chain keeps its URR). The records go into ``osft_subspaces.json``; the console gets
one line, and a warning when a module's next k_low falls below :data:`K_LOW_WARN_RATIO` of a fresh run's.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .plan import FrozenRank, ModulePlan, split_protected_rank
from .protect import ModuleFold

#: A module whose next run's k_low is below this share of a fresh run's is named in a warning.
K_LOW_WARN_RATIO = 0.6


@dataclass(frozen=True)
class ModuleBudget:
    """One module's chain budget at an export.

    Fields: this run's ``rank`` (R), ``k_high``, ``k_low``; ``p_left``, ``p_right`` after the fold;
    ``next_rank``, ``next_k_high``, ``next_k_low`` of a next run at the same URR and rule;
    ``fresh_k_low``, a fresh run's k_low at that URR.
    """

    rank: int
    k_high: int
    k_low: int
    p_left: int
    p_right: int
    next_rank: int
    next_k_high: int
    next_k_low: int
    fresh_k_low: int

    @property
    def ratio(self) -> float:
        """next k_low / fresh k_low (1.0 for a module a fresh run would not train either)."""
        return self.next_k_low / self.fresh_k_low if self.fresh_k_low else 1.0

    def record(self) -> dict:
        """The JSON fields (``osft_subspaces.json``, per module)."""
        return {"rank": self.rank, "k_high": self.k_high, "k_low": self.k_low, "next_rank": self.next_rank,
                "next_k_high": self.next_k_high, "next_k_low": self.next_k_low, "fresh_k_low": self.fresh_k_low}


def module_budget(plan: ModulePlan, fold: ModuleFold, frozen_rank: FrozenRank) -> ModuleBudget:
    """The chain budget of one module laid out by ``plan`` whose bases after this run are ``fold``'s."""
    p_left, p_right = fold.P.shape[-1], fold.Q.shape[-1]
    nxt = split_protected_rank(plan.n, plan.m, plan.urr, p_left, p_right, frozen_rank)
    fresh = split_protected_rank(plan.n, plan.m, plan.urr, 0, 0, frozen_rank)
    return ModuleBudget(plan.rank, plan.k_high, plan.k_low, p_left, p_right, *nxt, fresh[2])


@dataclass(frozen=True)
class ChainBudget:
    """Every module's :class:`ModuleBudget` and its fold, with the console's words for them."""

    budgets: dict[str, ModuleBudget]
    folds: dict[str, ModuleFold]
    frozen_rank: FrozenRank

    def line(self) -> str:
        """One console line: ranges of p_L, p_R, R, k_high, the next k_low against a fresh run's,
        cap binding and the energy kept."""
        b = list(self.budgets.values())

        def span(values) -> str:
            values = list(values)
            return f"{min(values)}-{max(values)}" if min(values) != max(values) else str(values[0])

        ratios = [x.ratio for x in b]
        capped = [f for f in self.folds.values() if f.update.cap_bound or (f.inputs and f.inputs.cap_bound)]
        on_inputs = sum(bool(f.inputs and f.inputs.cap_bound) for f in self.folds.values())
        on_update = sum(f.update.cap_bound for f in self.folds.values())
        inputs = [f.inputs.energy for f in self.folds.values() if f.inputs is not None]
        kept = f"energy kept: update {min(f.update.energy for f in self.folds.values()):.3f} (lowest)"
        if inputs:
            kept += f", inputs {min(inputs):.3f} (lowest)"
        return (f"chain budget: p_L {span(x.p_left for x in b)}, p_R {span(x.p_right for x in b)}; this run R "
                f"{span(x.rank for x in b)}, k_high {span(x.k_high for x in b)}, k_low {span(x.k_low for x in b)}; "
                f"a next run (--osft-frozen-rank {self.frozen_rank}) k_low {span(x.next_k_low for x in b)}, median "
                f"{100 * statistics.median(ratios):.0f} % of a fresh run's (lowest {100 * min(ratios):.0f} %); cap bound in "
                f"{len(capped)} of {len(b)} modules (update side {on_update}, input side {on_inputs}); {kept}")

    def warning(self) -> str | None:
        """The modules whose next k_low is below :data:`K_LOW_WARN_RATIO` of a fresh run's, or None."""
        low = {name: x for name, x in self.budgets.items() if x.ratio < K_LOW_WARN_RATIO}
        if not low:
            return None
        name, worst = min(low.items(), key=lambda kv: kv[1].ratio)
        return (f"chain budget: in {len(low)} of {len(self.budgets)} modules a next chained run would train k_low below "
                f"{K_LOW_WARN_RATIO:.0%} of a fresh run's (lowest {name}: {worst.next_k_low} of {worst.fresh_k_low}); "
                "later tasks can learn less there. Fewer protected directions per run (--osft-protect-max-rank-ratio, "
                "--osft-protect-energy, --osft-protect-input-energy) or --osft-frozen-rank reduced leave more")


def chain_budget(plans: Sequence[tuple[str, ModulePlan]], folds: Mapping[str, ModuleFold],
                 frozen_rank: FrozenRank) -> ChainBudget:
    """The chain budget of every module; the returned folds carry their records (``ModuleFold.chain``)."""
    budgets = {name: module_budget(plan, folds[name], frozen_rank) for name, plan in plans}
    with_records = {name: dataclasses.replace(folds[name], chain=budgets[name].record()) for name, _ in plans}
    return ChainBudget(budgets, with_records, frozen_rank)
