"""Orthogonality-violation measure between the frozen and trainable subspaces.

For every trainable singular vector x (a column of U_low, a row of V_low) the angle θ to the frozen
subspace satisfies cos θ = ‖P_high x‖ / ‖x‖, where P_high projects onto span(U_high) (or V_high).
OSFT wants θ = 90°; the deviation is 90° − θ = asin(‖P_high x‖/‖x‖), in degrees. A module's
deviation is the worst over all its trainable vectors on both sides; a module whose deviation
exceeds the margin (``--ortho-margin-deg``, default 1.0°) counts as one violation. The measurement
itself (distributed like the projection) is :meth:`.projection.Projector.check`.

Precision: in float32 a freshly projected vector measures about 1e-4° (a few ulps); bf16 factors
resolve only about 0.5° (8 significant bits), so keep the margin ≥ 1° for bf16.

Between full checks, :func:`projection_bound` (used by
:meth:`.projection.Projector.deviation_bound`) bounds the same deviation right after a parameter
projection from numbers that projection already computed: a rounding-error analysis of the
projection itself (derived in its docstring), no matrix product. On SmolLM2-135M's targets in
float32 it gives about 0.2°, below the default margin, so a step whose bound is under the margin
cannot hold a violation; above it, the trainer runs the full check.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


def fraction_to_degrees(fraction: float) -> float:
    """Deviation from 90° (degrees) of a vector whose frozen component is ``fraction`` of its norm."""
    return math.degrees(math.asin(min(1.0, max(0.0, fraction))))


@dataclass
class OrthoReport:
    """Result of one orthogonality check: ``violations`` = modules over the margin (count),
    ``max_dev_deg`` = worst deviation over all modules (degrees), ``violating`` = their names."""

    violations: int
    max_dev_deg: float
    violating: list[str] = field(default_factory=list)


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = eps/2 of a floating dtype (2⁻²⁴ for float32, 2⁻⁸ for bfloat16)."""
    return torch.finfo(dtype).eps / 2


def matmul_unit_roundoff() -> float:
    """Unit roundoff of float32 matrix products under ``torch.get_float32_matmul_precision()``:
    2⁻²⁴ at "highest" (the default), TF32's 2⁻¹¹ at "high", bfloat16's 2⁻⁸ at "medium"."""
    return {"highest": unit_roundoff(torch.float32), "high": 2.0 ** -11}.get(torch.get_float32_matmul_precision(),
                                                                               unit_roundoff(torch.bfloat16))


def gamma(j, u: float):
    """γ_j = j·u/(1 − j·u) (Higham 2002, Lemma 3.1); infinite when j·u ≥ 1. ``j`` a number (returns
    a float) or a float64 tensor (returns one of its shape, elementwise)."""
    if isinstance(j, torch.Tensor):
        return torch.where(j * u < 1, j * u / (1 - j * u), math.inf)
    return j * u / (1 - j * u) if j * u < 1 else math.inf


def basis_error(gram: torch.Tensor, n: int) -> float:
    """ε ≥ ‖BᵀB − I‖₂ of an n×k basis B from ``gram`` = BᵀB computed in float64 (k×k, or E×k×k:
    the largest over the leading dimension): ‖fl(G) − I‖_F plus the product's rounding
    γ_n·‖B‖_F² ≤ γ_n·k·(1 + ε), solved for ε."""
    k = gram.shape[-1]
    if k == 0 or gram.numel() == 0:
        return 0.0
    u64 = unit_roundoff(torch.float64)
    eye = torch.eye(k, dtype=torch.float64, device=gram.device)
    off = float((gram.double() - eye).square().sum((-2, -1)).max().sqrt()) * (1 + gamma(k * k + 2, u64))
    rounding = gamma(n, u64) * k
    return (off + rounding) / (1 - rounding) if rounding < 1 else math.inf


def projection_bound(coef_norm: torch.Tensor, stored_norm: torch.Tensor, n, k, eps, keep, param_roundoff) -> torch.Tensor:
    """Upper bound on the sine of every vector's deviation from 90° right after
    :meth:`.projection.Projector.project_parameters`, from numbers that projection computed,
    elementwise: the vectors of all modules and both sides are bounded in one call, each with its
    own side's n, k, ε, mode and parameter dtype.

    Derivation. One trainable vector x (a column of U_low or a row of V_low); B the stored basis of
    its side, n×k (n the side's dimension, N or M; k its vectors); u the unit roundoff of the
    float32 products (:func:`matmul_unit_roundoff`), u_p that of the parameter's dtype;
    γ_j = j·u/(1 − j·u) (Higham 2002, §3.1, §3.5: for any summation order
    |fl(AB) − AB| ≤ γ_j·|A|·|B| elementwise, j the inner dimension). ε ≥ ‖BᵀB − I‖₂
    (:func:`basis_error`), so ‖B‖₂ ≤ β = √(1 + ε), ‖B‖_F ≤ √k·β and σ_min(B) ≥ √(1 − ε). The
    projection computed c = fl(Bᵀx) = Bᵀx + f with ‖f‖ ≤ γ_n·√k·β·‖x‖, then

    - remove mode: x′ = fl(x − fl(B·c)) with fl(B·c) = B·c + g, ‖g‖ ≤ γ_k·√k·β·‖c‖, and
      x′ = x − B·c − g + h, ‖h‖ ≤ u/(1 − u)·‖x′‖. Then Bᵀx′ = (I − BᵀB)·c − f − Bᵀg + Bᵀh, so
      ‖Bᵀx′‖ ≤ ε‖c‖ + γ_n√kβ‖x‖ + β(‖g‖ + ‖h‖), with ‖x‖ ≤ ‖x′‖ + β‖c‖ + ‖g‖ + ‖h‖ (x itself
      is overwritten). The frozen component is P·x′, P the orthogonal projector on span(B):
      ‖P·x′‖ ≤ ‖Bᵀx′‖/√(1 − ε).
    - keep mode (B spans the complement of the frozen basis): x′ = B·c + g, so the frozen
      component (I − P)·x′ = (I − P)·g and ‖(I − P)·x′‖ ≤ ‖g‖.

    The stored x_s = fl_p(x′) adds ‖x_s − x′‖ ≤ u_p/(1 − u_p)·‖x_s‖ (u_p = 0 for float32
    parameters); the sine is ‖frozen component of x_s‖/‖x_s‖ (:func:`fraction_to_degrees`). ‖c‖ and
    ‖x_s‖ are computed in float32 (relative error ≤ γ_{j+2} for j terms) and widened by that;
    the rest is float64 arithmetic on these norms. Under FSDP2 the row-sharded sums are the same
    sums in another order, so the same γ_j hold.

    Args:
        coef_norm: ‖c‖ of each vector's coefficients in the basis, as computed (float32, any shape).
        stored_norm: ‖x_s‖ of each stored vector, as computed in float32 (same shape).
        n: the side's dimension (inner dimension of Bᵀx). k: basis vectors. eps: :func:`basis_error`.
        keep: the side stores the complement basis. param_roundoff: u_p, the unit roundoff of the
            parameter's dtype (:func:`unit_roundoff`; 0 for float32 parameters). Each a number or a
            tensor of ``coef_norm``'s shape (float64; ``keep`` bool), one value per vector.

    Returns:
        float64 bounds of ``coef_norm``'s shape; +inf where none holds (ε ≥ 1, a zero vector with a
        nonzero bound), NaN where a norm is NaN.
    """
    like = dict(dtype=torch.float64, device=coef_norm.device)
    n, k, eps, u_p = (torch.as_tensor(v, **like) for v in (n, k, eps, param_roundoff))
    keep = torch.as_tensor(keep, dtype=torch.bool, device=coef_norm.device)
    u = matmul_unit_roundoff()
    c_up = coef_norm.double() / (1 - gamma(k + 2, u))
    s = stored_norm.double()
    s_lo, s_up = s / (1 + gamma(n + 2, u)), s / (1 - gamma(n + 2, u))
    cast = u_p / (1 - u_p) * s_up
    beta = (1 + eps).sqrt()
    g = gamma(k, u) * k.sqrt() * beta * c_up
    x_prime = s_up + cast
    h = u / (1 - u) * x_prime
    x = x_prime + beta * c_up + g + h
    removed = (eps * c_up + gamma(n, u) * k.sqrt() * beta * x + beta * (g + h)) / (1 - eps).clamp_min(0).sqrt()
    frozen = torch.where(keep, g, removed)
    bound = (frozen + cast) / s_lo
    bound = torch.where(s_lo == 0, torch.where(frozen + cast == 0, 0.0, math.inf), bound)  # NaN stays NaN
    return torch.where(eps >= 1, math.inf, bound)
