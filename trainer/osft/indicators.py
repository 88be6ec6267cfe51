"""Per-module forgetting indicators of an OSFT run: how far each target has moved, and whether its
trainable part now competes with the frozen directions.

For one module with the trainable factors X = U_low·diag(S_low) (N×k_low), V = V_low (k_low×M),
their values at the start of the run X₀ = U_start·diag(S_start), V₀ = V_start (U_start and
V_start are the SVD's orthonormal vectors, so X₀ᵀX₀ = diag(S_start²) and V₀V₀ᵀ = I), and the
frozen part W_high:

- **Relative update** ‖ΔW‖_F / ‖W‖_F with ΔW = X·V − X₀·V₀ (the frozen part does not change) and
  W = W_high + X₀·V₀ the dense weight at the start. Computed without an N×M matrix, from the
  differences D = X − X₀ and E = V − V₀: ΔW = [D, X₀]·[V; E], so with A = [D, X₀] (N×2k) and
  B = [V; E] (2k×M), ‖ΔW‖_F² = trace((AᵀA)(BBᵀ)) =
  tr(DᵀD·VVᵀ) + 2·tr(DᵀX₀·E·Vᵀ) + tr(diag(S_start²)·E·Eᵀ). Every block comes from the two k×2k
  Gram matrices Dᵀ[D, X₀] and E[E; V₀]ᵀ (VVᵀ = I + EV₀ᵀ + V₀Eᵀ + EEᵀ, EVᵀ = EV₀ᵀ + EEᵀ), half
  the products of the full 2k×2k ones. Written with differences rather than as
  [X, −X₀]·[V; V₀], the large terms ‖X·V‖² and ‖X₀·V₀‖² never cancel, so float32 Gram matrices
  resolve small updates (‖ΔW‖ ≪ ‖X₀·V₀‖) to float32 accuracy.
  ‖W‖_F² = ‖W_high‖_F² + ‖S_start‖², since ⟨W_high, X₀·V₀⟩ = 0 (W_high = W − X₀·V₀ and X₀·V₀ is
  W's projection on U_start, V_start).
- **Spectral gap** σ_max(X·V) / σ_{k_high}: the true largest singular value of the trainable
  part (U_low and V_low drift from orthonormal under AdamW, so S_low alone is not it) over the
  smallest frozen singular value of the split at the start. With thin QR factorisations
  X = Q_X·R_X and Vᵀ = Q_V·R_V, σ(X·V) = σ(R_X·R_Vᵀ); here R_Vᵀ is the Cholesky factor F of
  V·Vᵀ = F·Fᵀ (Cholesky-QR: the rows are sharded, so only Gram matrices are available) and
  σ_max² = λ_max(Fᵀ·(XᵀX)·F) with XᵀX = DᵀD + DᵀX₀ + X₀ᵀD + diag(S_start²). A gap ≥ 1 means the
  trainable part now has a direction stronger than the weakest frozen one: a fresh SVD of W would
  re-order them (Nayak et al. 2025, section 3, the split by singular value).

Only the Gram matrices cross ranks: Dᵀ[D, X₀] is a sum over row shards
(:meth:`.projection.Projector.indicators` all-reduces it), E[E; V₀]ᵀ is formed from gathered rows.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

#: ``step`` record fields written on the steps with an orthogonality check (null on the others).
INDICATOR_FIELDS = ("osft_dw_rel_max", "osft_dw_rel_median", "osft_dw_rel_worst_module",
                    "osft_gap_max", "osft_gap_median", "osft_gap_worst_module")


def left_gram(u: torch.Tensor, s: torch.Tensor, u0: torch.Tensor, s0: torch.Tensor) -> torch.Tensor:
    """Dᵀ[D, X₀] with D = U·diag(S) − U₀·diag(S₀), X₀ = U₀·diag(S₀), float32.

    Args:
        u, u0: rows of U_low and U_start (n×k, any n: this rank's shard or all N rows).
        s, s0: all of S_low and S_start (k).

    Returns:
        k×2k; summed over all row shards it is the matrix of the whole factors.
    """
    x0 = u0.float() * s0.float()
    d = u.float() * s.float() - x0
    return d.t() @ torch.cat([d, x0], dim=1)


def right_gram(v: torch.Tensor, v0: torch.Tensor) -> torch.Tensor:
    """E[E; V₀]ᵀ with E = V − V₀ (k×2k, float32), from all rows of V_low and V_start (k×M each)."""
    v0 = v0.float()
    e = v.float() - v0
    return e @ torch.cat([e, v0], dim=0).t()


def _gram_root(gram: torch.Tensor) -> torch.Tensor:
    """F with F·Fᵀ = ``gram`` (k×k, symmetric positive semi-definite, float64): the Cholesky factor,
    or Q·diag(√λ) from ``torch.linalg.eigh`` when ``gram`` is singular (rows of V_low that became
    linearly dependent)."""
    factor, info = torch.linalg.cholesky_ex(gram)
    if int(info) == 0:
        return factor
    eigvals, vecs = torch.linalg.eigh(gram)
    return vecs * eigvals.clamp_min(0).sqrt()


def low_part_norms(g_u: torch.Tensor, g_v: torch.Tensor, s0: torch.Tensor) -> tuple[float, float]:
    """(‖ΔW‖_F², σ_max(U_low·diag(S_low)·V_low)) of one module, in float64.

    Args:
        g_u: :func:`left_gram` (k×2k), summed over all row shards.
        g_v: :func:`right_gram` (k×2k).
        s0: all of S_start (k).

    ‖ΔW‖_F² is clamped at 0 against rounding; σ_max² = λ_max(Fᵀ·XᵀX·F) with F·Fᵀ = V·Vᵀ
    (``torch.linalg.eigvalsh``); both are 0.0 when k = 0.
    """
    k = g_u.shape[0]
    if k == 0:
        return 0.0, 0.0
    g_u, g_v, s0_sq = g_u.double(), g_v.double(), s0.double().square()
    dd, dx0 = g_u[:, :k], g_u[:, k:]  # DᵀD, DᵀX₀
    ee, ev0 = g_v[:, :k], g_v[:, k:]  # EEᵀ, EV₀ᵀ
    vvt = torch.eye(k, dtype=torch.float64) + ev0 + ev0.t() + ee
    update_sq = (dd * vvt).sum() + 2 * (dx0 * (ev0 + ee).t()).sum() + (s0_sq * ee.diagonal()).sum()
    f = _gram_root(vvt)
    core = f.t() @ (dd + dx0 + dx0.t() + torch.diag(s0_sq)) @ f
    sigma_max = torch.linalg.eigvalsh((core + core.t()) / 2)[-1].clamp_min(0).sqrt()
    return max(0.0, float(update_sq)), float(sigma_max)


def relative_update(update_sq: float, w_high_sq: float, s_start: torch.Tensor) -> float:
    """‖ΔW‖_F / ‖W‖_F from ‖ΔW‖_F² (:func:`low_part_norms`), ‖W_high‖_F² and all of S_start (k),
    with ‖W‖_F² = ‖W_high‖_F² + ‖S_start‖² (see the module docstring); 0.0 for a zero weight."""
    w_sq = w_high_sq + float(s_start.double().square().sum())
    return (update_sq / w_sq) ** 0.5 if w_sq > 0 else 0.0


def spectral_gap(sigma_max: float, sigma_frozen_min: float) -> float | None:
    """σ_max of the trainable part over the smallest frozen singular value at the start; None when
    there is no frozen direction (σ_{k_high} stored as 0)."""
    return sigma_max / sigma_frozen_min if sigma_frozen_min > 0 else None


@dataclass
class IndicatorReport:
    """Indicators of every checked module, in the Projector's module order.

    ``dw_rel``: ‖ΔW‖_F / ‖W‖_F (dimensionless). ``gap``: σ_max(low part) / σ_{k_high}, None for a
    module without frozen directions (k_high = 0, σ_{k_high} stored as 0).
    """

    names: list[str]
    dw_rel: list[float]
    gap: list[float | None]

    def fields(self) -> dict[str, float | str | None]:
        """The :data:`INDICATOR_FIELDS` of a ``step`` record: worst module (its value and name) and
        median over the modules, for both indicators (None when no module has the indicator)."""
        out: dict[str, float | str | None] = {}
        for key, values in (("osft_dw_rel", self.dw_rel), ("osft_gap", self.gap)):
            named = [(v, n) for v, n in zip(values, self.names) if v is not None]
            worst = max(named, default=(None, None))
            out.update({f"{key}_max": worst[0], f"{key}_median": statistics.median([v for v, _ in named]) if named else None,
                        f"{key}_worst_module": worst[1]})
        return out
