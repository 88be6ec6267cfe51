"""Keep OSFT's trainable factors orthogonal to the frozen subspaces (single process).

Before the optimizer step the gradients of U_low and V_low are projected out of the frozen
subspaces; after it, U_low and V_low themselves are re-projected, because AdamW's element-wise
rescaling and decoupled weight decay move them back into those subspaces (field case B20).

U side (columns, N×k_low):  X ← X − U_high(U_highᵀ X)      or, in keep mode, X ← U_c(U_cᵀ X).
V side (rows, k_low×M), factored: X ← X − (X V_highᵀ) V_high  or X ← (X V_cᵀ) V_c.
V side, Gram form (``--osft-v-projection gram``): X ← X − X (V_highᵀ V_high), with the M×M Gram
matrix formed on every call; it exists for comparison with the factored form (same result,
O(M²) memory and FLOPs instead of O(k·M)).

All products are computed in float32, also for bf16 factors.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import torch

from .decomposition import OSFTLinear

VProjection = Literal["factored", "gram"]


def _project_columns(x: torch.Tensor, basis: torch.Tensor, keep: bool) -> torch.Tensor:
    """x: N×k, basis: N×b with orthonormal columns → the projected N×k tensor (float32)."""
    xf, bf = x.float(), basis.float()
    coeff = bf.t() @ xf  # b×k
    return bf @ coeff if keep else xf - bf @ coeff


def _project_rows(x: torch.Tensor, basis: torch.Tensor, keep: bool, form: VProjection) -> torch.Tensor:
    """x: k×M, basis: b×M with orthonormal rows → the projected k×M tensor (float32)."""
    xf, bf = x.float(), basis.float()
    if form == "gram":
        gram = bf.t() @ bf  # M×M
        return xf @ gram if keep else xf - xf @ gram
    coeff = xf @ bf.t()  # k×b
    return coeff @ bf if keep else xf - coeff @ bf


def _project_pair(
    module: OSFTLinear, u: torch.Tensor, v: torch.Tensor, v_form: VProjection
) -> None:
    if module.U_basis.shape[1] > 0:
        u.copy_(_project_columns(u, module.U_basis, module.u_keep))
    if module.V_basis.shape[0] > 0:
        v.copy_(_project_rows(v, module.V_basis, module.v_keep, v_form))


@torch.no_grad()
def project_gradients(modules: Iterable[OSFTLinear], v_form: VProjection = "factored") -> None:
    """Project ``U_low.grad`` and ``V_low.grad`` out of the frozen subspaces, in place.

    Call after backward (and gradient clipping is done on the projected gradients), before
    ``optimizer.step()``. Modules whose gradients are None are skipped.
    """
    for module in modules:
        if module.U_low.grad is not None and module.V_low.grad is not None:
            _project_pair(module, module.U_low.grad, module.V_low.grad, v_form)


@torch.no_grad()
def project_parameters(modules: Iterable[OSFTLinear], v_form: VProjection = "factored") -> None:
    """Re-project ``U_low`` and ``V_low`` out of the frozen subspaces, in place; call after
    ``optimizer.step()``."""
    for module in modules:
        _project_pair(module, module.U_low, module.V_low, v_form)
