"""Orthogonality-violation measure between the frozen and trainable subspaces.

For every trainable singular vector x (a column of U_low, a row of V_low) the angle θ to the frozen
subspace satisfies cos θ = ‖P_high x‖ / ‖x‖, where P_high projects onto span(U_high) (or V_high).
OSFT wants θ = 90°; the deviation is 90° − θ = asin(‖P_high x‖/‖x‖), in degrees. A module's
deviation is the worst over all its trainable vectors on both sides; a module whose deviation
exceeds the margin (``--ortho-margin-deg``, default 1.0°) counts as one violation.

Precision: in float32 a freshly projected vector measures about 1e-5° (a few ulps); bf16 factors
resolve only about 0.5° (8 significant bits), so keep the margin ≥ 1° for bf16.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .decomposition import OSFTLinear


def _frozen_fraction_columns(x: torch.Tensor, basis: torch.Tensor, keep: bool) -> torch.Tensor:
    """Per column of x (N×k): ‖P_high x‖/‖x‖ for the frozen basis (remove mode) or its complement."""
    xf, bf = x.float(), basis.float()
    coeff = bf.t() @ xf
    frozen = (xf - bf @ coeff) if keep else coeff
    return frozen.norm(dim=0) / xf.norm(dim=0).clamp_min(torch.finfo(torch.float32).tiny)


def module_deviation_deg(module: OSFTLinear) -> float:
    """Worst deviation from 90° (degrees, ≥ 0) between ``module``'s trainable and frozen subspaces."""
    worst = 0.0
    with torch.no_grad():
        if module.U_basis.shape[1] > 0:
            worst = max(worst, _frozen_fraction_columns(module.U_low, module.U_basis, module.u_keep).max().item())
        if module.V_basis.shape[0] > 0:
            frac = _frozen_fraction_columns(module.V_low.t(), module.V_basis.t(), module.v_keep)
            worst = max(worst, frac.max().item())
    return math.degrees(math.asin(min(1.0, worst)))


@dataclass
class OrthoReport:
    """Result of one orthogonality check: ``violations`` = modules over the margin (count),
    ``max_dev_deg`` = worst deviation over all modules (degrees), ``violating`` = their names."""

    violations: int
    max_dev_deg: float
    violating: list[str] = field(default_factory=list)


def check_orthogonality(named_modules: Sequence[tuple[str, OSFTLinear]], margin_deg: float) -> OrthoReport:
    """Measure every OSFT module; a deviation strictly above ``margin_deg`` is a violation."""
    violating, worst = [], 0.0
    for name, module in named_modules:
        dev = module_deviation_deg(module)
        worst = max(worst, dev)
        if dev > margin_deg:
            violating.append(name)
    return OrthoReport(violations=len(violating), max_dev_deg=worst, violating=violating)
