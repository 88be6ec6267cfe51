"""Keep OSFT's trainable factors orthogonal to the frozen subspaces, on one rank or many.

Before the optimizer step the gradients of U_low and V_low are projected out of the frozen
subspaces; after it, U_low and V_low themselves are re-projected, because AdamW's element-wise
rescaling and decoupled weight decay move them back into those subspaces (tests/test_osft_math.py::test_violations_appear_without_post_step_reprojection).

U side (columns, N×k_low):  X ← X − U_high(U_highᵀ X)       or, in keep mode, X ← U_c(U_cᵀ X).
V side (rows, k_low×M), factored: X ← X − (X V_highᵀ) V_high   or X ← (X V_cᵀ) V_c.
V side, Gram form (``--osft-v-projection gram``): X ← X − X (V_highᵀ V_high), with the M×M Gram
matrix formed on every call (kept for comparison: O(M²) instead of O(k·M)).

Under FSDP2 every factor is a DTensor sharded by rows (``Shard(0)``), possibly unevenly:

- U side: U_basis and U_low are sharded along the same N rows, so Bᵀ X is a sum of per-rank
  partial products; the k_b×k_low partial coefficients of *all* modules go through one
  all-reduce, then every rank updates its own rows.
- V side, factored: each rank holds some rows of V_low (complete rows of length M) and needs the
  whole basis: V_basis (k_b×M) is all-gathered per module (``--osft-cache-v-high`` keeps the
  gathered copy after the first use; it is never part of a checkpoint).
- V side, Gram: the M×M Gram matrix is a sum of per-rank partial Gram matrices (one all-reduce
  of M² numbers per module).

Between full checks, :meth:`Projector.deviation_bound` bounds the orthogonality deviation from the
coefficient norms :meth:`Projector.project_parameters` kept (see :mod:`.orthogonality`): the
U-side column norms of all modules go through one all-reduce, the result through an all-reduce(MAX).

The forgetting indicators (:meth:`Projector.indicators`, see :mod:`.indicators`) use the same
pattern: the U-side Gram matrices of all modules go through one all-reduce, the V side is gathered.

Expert banks (:mod:`.experts`: every tensor E×…, one factorisation per expert) are projected by
the same formulas batched over the experts (``@`` on the leading dimension, ``.mT``). FSDP2 shards
their dim 0, the expert dimension, so each rank holds whole experts, bases included: their
projection, check and indicators need no communication beyond the final maximum over ranks.

All products are computed in float32, also for bf16 factors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..dtensor import full_tensor, is_sharded, local_tensor
from . import indicators
from .decomposition import OSFTLinear
from .indicators import IndicatorReport
from .orthogonality import OrthoReport, basis_error, fraction_to_degrees, projection_bound, unit_roundoff
from .plan import VProjection


def _max_or_zero(values: torch.Tensor) -> torch.Tensor:
    """The largest element of ``values``, 0 when it is empty (a rank without experts of a bank)."""
    return values.max() if values.numel() else torch.zeros(())


def _sum_across_ranks(flat: torch.Tensor, sharded: bool) -> torch.Tensor:
    """In-place all-reduce(SUM) of per-rank partial sums of sharded tensors; returns ``flat``
    (untouched for whole tensors, even inside a process group)."""
    if sharded and dist.get_world_size() > 1:
        dist.all_reduce(flat)
    return flat


class Projector:
    """Projection and orthogonality checks for a fixed list of OSFT modules.

    Args:
        modules: ``(name, module)`` pairs in the same order on every rank.
        v_projection: ``"factored"`` (default) or ``"gram"`` (:attr:`.plan.OSFTSettings.v_projection`).
        cache_v_basis: keep each all-gathered V basis after its first use
            (:attr:`.plan.OSFTSettings.cache_v_basis`, ``--osft-cache-v-high``).
    """

    def __init__(self, modules: Sequence[tuple[str, OSFTLinear]], v_projection: VProjection = "factored",
                 cache_v_basis: bool = False) -> None:
        self.names = [n for n, _ in modules]
        self.modules = [m for _, m in modules]
        self.v_projection = v_projection
        self.cache_v_basis = cache_v_basis
        self._v_cache: dict[int, torch.Tensor] = {}
        #: Modules sharded by rows (not expert banks): their U-side products are partial sums over ranks.
        self._rows = [i for i, m in enumerate(self.modules) if not m.plan.experts]
        #: Expert banks: each rank holds whole experts, so a bank's products are complete.
        self._banks = [i for i, m in enumerate(self.modules) if m.plan.experts]
        #: Whether the trainable factors are FSDP2 shards (set once the model is wrapped, before this).
        self._sharded = any(is_sharded(m.U_low) for m in self.modules)
        #: Coefficient norms of the last :meth:`project_parameters`, for :meth:`deviation_bound`.
        self._coef_norms: list[tuple[torch.Tensor | None, torch.Tensor | None]] | None = None
        #: (ε_U, ε_V) of every module's bases, formed at the first :meth:`deviation_bound`.
        self._basis_eps: list[tuple[float, float]] | None = None

    # -- pieces -----------------------------------------------------------------------------
    def _v_basis(self, i: int) -> torch.Tensor:
        """The whole V basis of module ``i`` (k_b×M, float32)."""
        if i in self._v_cache:
            return self._v_cache[i]
        basis = full_tensor(self.modules[i].V_basis).float()
        if self.cache_v_basis:
            self._v_cache[i] = basis
        return basis

    def _sum_row_parts(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """``parts`` (one per module) with those of row-sharded modules summed over ranks by one
        all-reduce; a bank's own part is already complete (its rank holds whole experts)."""
        rows = self._rows
        if not rows or not (is_sharded(self.modules[rows[0]].U_basis) and dist.get_world_size() > 1):
            return parts  # nothing to sum: skip the flattening copy
        flat = torch.cat([parts[i].reshape(-1) for i in rows])
        dist.all_reduce(flat)
        out = list(parts)
        for i, c in zip(rows, flat.split([parts[i].numel() for i in rows])):
            out[i] = c.view_as(parts[i])
        return out

    def _u_coefficients(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """U_basisᵀ X for every module (X = the local rows of U_low or its gradient; a bank's local
        experts), summed over ranks with one all-reduce for all row-sharded modules; float32,
        k_b×k_low each (E_local×k_b×k_low for a bank)."""
        return self._sum_row_parts([local_tensor(m.U_basis).float().mT @ x.float() for m, x in zip(self.modules, xs)])

    def _project_v(self, i: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Projected local rows of V_low (or its gradient) of module ``i`` (float32), and each row's
        coefficients in the basis (None in Gram form, which forms no coefficients)."""
        m, xf = self.modules[i], x.float()
        if self.v_projection == "gram":
            local = local_tensor(m.V_basis).float()
            gram = local.mT @ local
            if not m.plan.experts:
                gram = _sum_across_ranks(gram, is_sharded(m.V_basis))
            return (xf @ gram if m.v_keep else xf - xf @ gram), None
        basis = local_tensor(m.V_basis).float() if m.plan.experts else self._v_basis(i)
        coeff = xf @ basis.mT
        return (coeff @ basis if m.v_keep else xf - coeff @ basis), coeff

    @torch.no_grad()
    def _project(self, us: list[torch.Tensor], vs: list[torch.Tensor],
                 norms_wanted: bool = False) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
        """Project ``us`` (local rows of each module's U_low or its gradient) and ``vs`` (V_low's) in
        place. Returns per module the norms of the coefficients of every column of U and row of V in
        its basis, with ``norms_wanted`` only (the parameters, for :meth:`deviation_bound`); None
        for a side without a basis, the V side in Gram form, or without ``norms_wanted``."""
        coeffs = self._u_coefficients(us)
        norms = []
        for i, (m, u, v, c) in enumerate(zip(self.modules, us, vs, coeffs)):
            u_norm = v_norm = None
            if m.plan.u_basis_cols > 0:
                basis = local_tensor(m.U_basis).float()
                u.copy_(basis @ c if m.u_keep else u.float() - basis @ c)
                u_norm = c.norm(dim=-2) if norms_wanted else None
            if m.plan.v_basis_rows > 0:
                projected, v_coeff = self._project_v(i, v)
                v.copy_(projected)
                v_norm = v_coeff.norm(dim=-1) if norms_wanted and v_coeff is not None else None
            norms.append((u_norm, v_norm))
        return norms

    # -- public -----------------------------------------------------------------------------
    def project_gradients(self) -> None:
        """Project ``U_low.grad`` and ``V_low.grad`` out of the frozen subspaces, in place.

        Call after backward, before clipping and ``optimizer.step()``. Every rank must call it (it
        communicates). Raises RuntimeError if a module has no gradient (it was not used).
        """
        if any(m.U_low.grad is None or m.V_low.grad is None for m in self.modules):
            missing = [n for n, m in zip(self.names, self.modules) if m.U_low.grad is None or m.V_low.grad is None]
            raise RuntimeError(f"OSFT modules without gradients (not used in forward?): {missing[:5]}")
        self._project([local_tensor(m.U_low.grad) for m in self.modules], [local_tensor(m.V_low.grad) for m in self.modules])

    def project_parameters(self) -> None:
        """Re-project ``U_low`` and ``V_low`` in place; call after ``optimizer.step()``. Keeps the
        norms of the coefficients it computed for :meth:`deviation_bound`."""
        self._coef_norms = self._project([local_tensor(m.U_low) for m in self.modules], [local_tensor(m.V_low) for m in self.modules],
                                         norms_wanted=True)

    @torch.no_grad()
    def deviation_bound(self) -> float | None:
        """An upper bound (degrees) on every module's deviation from 90° (:meth:`check`'s measure)
        right after :meth:`project_parameters`, from the coefficient norms that call computed, the
        norms of the stored U_low columns and V_low rows, and each basis's distance from
        orthonormality (:func:`.orthogonality.projection_bound`, derivation in
        :mod:`.orthogonality`). Costs O(N·k_low + k_low·M) per module instead of the check's
        matrix products; the bases' k×k Gram matrices (float64) are formed once, at the first call.

        Call it right after :meth:`project_parameters` with the parameters untouched since; every
        rank must call it (one all-reduce of the U-side column norms, one all-reduce(MAX); the
        first call also all-reduces the Gram matrices and gathers uncached V bases).

        Returns:
            The bound in degrees (the same on every rank; 90 when a norm is NaN or infinite), or None
            where no bound is available: before the first :meth:`project_parameters`, or with
            ``v_projection="gram"``.
        """
        if self._coef_norms is None or self.v_projection == "gram":
            return None
        if self._basis_eps is None:
            self._basis_eps = self._basis_errors()
        stored_u = self._sum_row_parts([local_tensor(m.U_low).float().square().sum(-2) for m in self.modules])
        # Every vector of every module, both sides, bounded by one elementwise call: per side its
        # coefficient norms, its stored squared norms and (n, k, ε, keep, u_p) repeated per vector.
        coef, stored_sq, sides = [], [], []
        for m, (u_coef, v_coef), u_sq, (eps_u, eps_v) in zip(self.modules, self._coef_norms, stored_u, self._basis_eps):
            plan, dtype = m.plan, m.U_low.dtype
            u_p = 0.0 if dtype == torch.float32 else unit_roundoff(dtype)
            if u_coef is not None:
                coef.append(u_coef.reshape(-1))
                stored_sq.append(u_sq.reshape(-1))
                sides.append((u_coef.numel(), plan.n, plan.u_basis_cols, eps_u, m.u_keep, u_p))
            if v_coef is not None:
                coef.append(v_coef.reshape(-1))
                stored_sq.append(local_tensor(m.V_low).float().square().sum(-1).reshape(-1))
                sides.append((v_coef.numel(), plan.m, plan.v_basis_rows, eps_v, m.v_keep, u_p))
        if sides:
            device = coef[0].device
            per_side = torch.tensor([side[1:] for side in sides], dtype=torch.float64, device=device)
            per_vector = per_side.repeat_interleave(torch.tensor([side[0] for side in sides], device=device), dim=0)
            n, k, eps, keep, u_p = per_vector.unbind(1)
            bounds = projection_bound(torch.cat(coef), torch.cat(stored_sq).sqrt(), n, k, eps, keep > 0, u_p)
            worst_t = _max_or_zero(bounds).double()
        else:
            worst_t = torch.zeros((), dtype=torch.float64)
        if self._sharded and dist.get_world_size() > 1:
            dist.all_reduce(worst_t, op=dist.ReduceOp.MAX)
        value = float(worst_t)
        return fraction_to_degrees(1.0 if math.isnan(value) else value)  # a NaN parameter rules nothing out

    def _basis_errors(self) -> list[tuple[float, float]]:
        """(ε_U, ε_V) per module: :func:`.orthogonality.basis_error` of its U and V basis from
        float64 Gram matrices (the U side's summed over row shards; a bank's local experts, the
        largest over them). Collective under FSDP2."""
        grams = [local_tensor(m.U_basis).double().mT @ local_tensor(m.U_basis).double() for m in self.modules]
        grams = self._sum_row_parts(grams)
        out = []
        for i, (m, g_u) in enumerate(zip(self.modules, grams)):
            eps_v = 0.0
            if m.plan.v_basis_rows > 0:
                basis = (local_tensor(m.V_basis) if m.plan.experts else self._v_basis(i)).double()
                eps_v = basis_error(basis @ basis.mT, m.plan.m)
            out.append((basis_error(g_u, m.plan.n), eps_v))
        return out

    @torch.no_grad()
    def check(self, margin_deg: float) -> OrthoReport:
        """Measure every module's worst deviation from 90° (see :mod:`.orthogonality`).

        A module whose deviation is strictly above ``margin_deg`` is a violation. Identical result
        on every rank (three collectives for all modules together).
        """
        us = [local_tensor(m.U_low).float() for m in self.modules]
        coeffs = self._u_coefficients(us)
        # U side, per column: squared norm of the frozen component and of the whole column. In keep
        # mode the frozen component is the residual, a per-rank partial sum; in remove mode it is
        # the (already reduced) coefficient column.
        partial_frozen = [
            (u - local_tensor(m.U_basis).float() @ c).square().sum(-2) if m.u_keep else u.new_zeros(u.shape[:-2] + u.shape[-1:])
            for m, u, c in zip(self.modules, us, coeffs)
        ]
        partial_norm = [u.square().sum(-2) for u in us]
        summed = self._sum_row_parts(partial_frozen + partial_norm)
        frozen_sq, norm_sq = summed[:len(us)], summed[len(us):]
        worst = []
        for i, (m, c, f, n) in enumerate(zip(self.modules, coeffs, frozen_sq, norm_sq)):
            if not m.u_keep:
                f = f + c.square().sum(-2)
            u_frac = _max_or_zero(f.sqrt() / n.sqrt().clamp_min(1e-30))
            # V side: each rank holds complete rows of V_low (whole experts of a bank); the basis of
            # a row-sharded module is gathered.
            v = local_tensor(m.V_low).float()
            v_frac = torch.zeros(())
            if m.plan.v_basis_rows > 0:
                # collective for row-sharded modules: every rank gathers, even one without rows
                basis = local_tensor(m.V_basis).float() if m.plan.experts else self._v_basis(i)
                if v.numel() > 0:
                    coeff = v @ basis.mT
                    frozen = (v - coeff @ basis) if m.v_keep else coeff
                    v_frac = _max_or_zero(frozen.norm(dim=-1) / v.norm(dim=-1).clamp_min(1e-30))
            worst.append(torch.maximum(u_frac, v_frac))
        worst_t = torch.stack(worst) if worst else torch.zeros(0)
        sharded = self._sharded
        if sharded and dist.get_world_size() > 1 and worst_t.numel():
            dist.all_reduce(worst_t, op=dist.ReduceOp.MAX)
        degrees = [fraction_to_degrees(float(f)) for f in worst_t]
        violating = [n for n, d in zip(self.names, degrees) if d > margin_deg]
        return OrthoReport(violations=len(violating), max_dev_deg=max(degrees, default=0.0), violating=violating)

    @torch.no_grad()
    def indicators(self) -> IndicatorReport:
        """Every module's relative update ‖ΔW‖_F/‖W‖_F and spectral gap σ_max(low part)/σ_{k_high}
        since the start of the run (see :mod:`.indicators`), from ``U_start``, ``S_start``,
        ``V_start`` and ``sigma_frozen_min``.

        Identical result on every rank. Collectives: all-gathers of S_low, S_start, V_low, V_start
        and sigma_frozen_min per module, and one all-reduce of every module's U-side Gram matrix (k_low×2k_low)
        and ‖W_high‖_F² together. An expert bank reports its worst expert (each rank computes its own
        experts, then one all-reduce(MAX) for all banks).
        """
        rows = self._rows
        parts, s_start = [], {i: full_tensor(self.modules[i].S_start) for i in rows}
        for i in rows:
            m = self.modules[i]
            parts += [indicators.left_gram(local_tensor(m.U_low), full_tensor(m.S_low), local_tensor(m.U_start), s_start[i]),
                      local_tensor(m.W_high).float().square().sum().reshape(1)]
        sharded = self._sharded
        flat = _sum_across_ranks(torch.cat([p.reshape(-1) for p in parts]), sharded) if parts else torch.zeros(0)
        summed = [c.view_as(p) for c, p in zip(flat.split([p.numel() for p in parts]), parts)]
        values: dict[int, tuple[float, float | None]] = {}
        for i, g_u, w_high_sq in zip(rows, summed[0::2], summed[1::2]):
            m, s0 = self.modules[i], s_start[i]
            g_v = indicators.right_gram(full_tensor(m.V_low), full_tensor(m.V_start))
            update_sq, sigma_max = indicators.low_part_norms(g_u, g_v, s0)
            values[i] = (indicators.relative_update(update_sq, float(w_high_sq), s0),
                         indicators.spectral_gap(sigma_max, float(full_tensor(m.sigma_frozen_min))))
        banks = self._banks
        if banks:
            worst = torch.stack([self._bank_indicators(self.modules[i]) for i in banks])
            if sharded and dist.get_world_size() > 1:
                dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            for i, (d, g) in zip(banks, worst.tolist()):
                values[i] = (d, None if g < 0 else g)
        dw_rel = [values[i][0] for i in range(len(self.modules))]
        gap = [values[i][1] for i in range(len(self.modules))]
        return IndicatorReport(names=list(self.names), dw_rel=dw_rel, gap=gap)

    @staticmethod
    def _bank_indicators(m: OSFTLinear) -> torch.Tensor:
        """[largest ‖ΔW‖_F/‖W‖_F, largest spectral gap (−1: none)] over this rank's experts of a
        bank (float64; [0, −1] without any), each expert computed as a whole module."""
        names = ("U_low", "S_low", "U_start", "S_start", "V_low", "V_start", "W_high", "sigma_frozen_min")
        u, s, u0, s0, v, v0, w_high, sigma = (local_tensor(getattr(m, k)) for k in names)
        dw, gap = 0.0, -1.0
        w_high_sq = w_high.float().square().sum((-2, -1)).tolist()  # one host sync per bank, not per expert
        sigma_min = sigma.flatten().tolist()
        for e in range(u.shape[0]):
            g_u, g_v = indicators.left_gram(u[e], s[e], u0[e], s0[e]), indicators.right_gram(v[e], v0[e])
            update_sq, sigma_max = indicators.low_part_norms(g_u, g_v, s0[e])
            dw = max(dw, indicators.relative_update(update_sq, w_high_sq[e], s0[e]))
            g = indicators.spectral_gap(sigma_max, sigma_min[e])
            gap = max(gap, -1.0 if g is None else g)
        return torch.tensor([dw, gap], dtype=torch.float64)


def check_after_step(projector: Projector | None, step: int, every: int,
                     margin_deg: float) -> tuple[OrthoReport | None, dict]:
    """The orthogonality check after optimizer step ``step`` (collective): the full check
    (:meth:`Projector.check`) at step 1 and every ``every`` steps, and between them wherever
    :meth:`Projector.deviation_bound` fails to rule out a deviation above ``margin_deg`` (no bound
    with ``--osft-v-projection gram``). Returns the report (None: no check, or no OSFT) and the
    forgetting indicators of the step record (measured on the scheduled steps, else None values)."""
    forgetting = dict.fromkeys(indicators.INDICATOR_FIELDS)
    if projector is None:
        return None, forgetting
    scheduled = step == 1 or step % every == 0
    if not scheduled:
        bound = projector.deviation_bound()
        if bound is None or bound <= margin_deg:
            return None, forgetting
    report = projector.check(margin_deg)
    return report, projector.indicators().fields() if scheduled else forgetting
