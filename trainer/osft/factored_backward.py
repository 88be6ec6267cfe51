"""The ``split`` and ``hybrid`` forward forms of an OSFT module: one autograd function whose
backward forms the gradients of U_low, S_low and V_low directly, never the N×M weight gradient.

W = W_high + U_low·diag(S_low)·V_low with W_high frozen (N×M, U_low N×k, S_low k, V_low k×M;
x T×M, y T×N):

- ``split``: y = x·W_highᵀ + ((x·V_lowᵀ)·diag(S_low))·U_lowᵀ + b, the low-rank product accumulated
  into the dense one in place (``Tensor.addmm_``, the BLAS beta = 1 form). Saves x and x·V_lowᵀ.
- ``hybrid``: W is rebuilt (``torch.addmm``, as the *dense* form does) and y = x·Wᵀ + b: one dense
  product forward. Saves x and the rebuilt W (N×M); x·V_lowᵀ is formed in the backward. With
  ``save_rebuilt=False`` the backward rebuilds W again instead (2·N·M·k more FLOPs, no N×M tensor
  kept between forward and backward): under FSDP2 with several ranks the rebuilt W is a whole,
  unsharded weight, and keeping one per module until its backward would cost the memory sharding
  saves (:func:`..sharding.shard_and_broadcast` sets it).

Backward, both forms (g = dy·U_low, h = g·diag(S_low), T×k):
dU_low = dyᵀ·((x·V_lowᵀ)·diag(S_low)) (N×k); dS_low = Σ_t g ∘ (x·V_lowᵀ) (k); dV_low = hᵀ·x (k×M);
db = Σ_t dy; dx = dy·W_high + h·V_low (split, one product accumulated into the other) or dy·W
(hybrid, W already holds the low part).

FLOPs for T tokens, forward + backward (see :func:`.plan.choose_forward_form`):
split 4·T·N·M + 6·T·k·(N + M); hybrid 4·T·N·M + 2·N·M·k + 4·T·k·(N + M). Neither computes the
2·T·N·M of a weight gradient; hybrid replaces split's two products with inner dimension k per
token by one rebuild per micro-batch, which is cheaper once T > N·M/(N + M). The gradients are
those of ``torch.autograd`` on the same expressions (the chain rule through W for hybrid), up to
the order of floating-point additions (``tests/test_osft_math.py``).
"""

from __future__ import annotations

from typing import Literal

import torch


class _FactoredLinear(torch.autograd.Function):
    """Forward and backward of :func:`factored_linear` on 2-D inputs (T×M)."""

    @staticmethod
    def forward(ctx, x, w_high, u_low, s_low, v_low, bias, rebuild, save_rebuilt):
        if rebuild:
            w = torch.addmm(w_high, u_low * s_low, v_low)
            y = torch.addmm(bias, x, w.t()) if bias is not None else x @ w.t()
            ctx.save_for_backward(x, w if save_rebuilt else w_high, u_low, s_low, v_low)
        else:
            xv = x @ v_low.t()
            y = torch.addmm(bias, x, w_high.t()) if bias is not None else x @ w_high.t()
            y.addmm_(xv * s_low, u_low.t())
            ctx.save_for_backward(x, xv, w_high, u_low, s_low, v_low)
        ctx.rebuild, ctx.save_rebuilt, ctx.has_bias = rebuild, save_rebuilt, bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        if ctx.rebuild:
            x, w, u_low, s_low, v_low = ctx.saved_tensors  # w: the rebuilt W, or W_high to rebuild it from
            xv = None
        else:
            x, xv, w_high, u_low, s_low, v_low = ctx.saved_tensors
        need_x, _, need_u, need_s, need_v, need_b, _, _ = ctx.needs_input_grad
        if xv is None and (need_u or need_s):
            xv = x @ v_low.t()
        dx = du = ds = dv = db = None
        if need_s or need_v or (need_x and not ctx.rebuild):
            g = dy @ u_low
            h = g * s_low
            if need_s:
                ds = (g * xv).sum(0)
            if need_v:
                dv = h.t() @ x
        if need_x and ctx.rebuild:
            dx = dy @ (w if ctx.save_rebuilt else torch.addmm(w, u_low * s_low, v_low))
        elif need_x:
            dx = (dy @ w_high).addmm_(h, v_low)
        if need_u:
            du = dy.t() @ (xv * s_low)
        if need_b and ctx.has_bias:
            db = dy.sum(0)
        return dx, None, du, ds, dv, db, None, None


def factored_linear(x: torch.Tensor, w_high: torch.Tensor, u_low: torch.Tensor, s_low: torch.Tensor,
                    v_low: torch.Tensor, bias: torch.Tensor | None, form: Literal["split", "hybrid"],
                    save_rebuilt: bool = True) -> torch.Tensor:
    """y = x·(W_high + U_low·diag(S_low)·V_low)ᵀ + b in the ``split`` or ``hybrid`` form (module
    docstring), differentiable in x, U_low, S_low, V_low and b (not W_high, which OSFT freezes).

    Args:
        x: (..., M). w_high: N×M. u_low: N×k. s_low: k. v_low: k×M. bias: N or None. One dtype and
            device for all. form: ``"split"`` or ``"hybrid"``. save_rebuilt: hybrid keeps the rebuilt
            W for the backward (True) or rebuilds it there (False); the gradients are the same.

    Returns:
        (..., N), in x's dtype.

    Raises:
        ValueError: another form.
    """
    if form not in ("split", "hybrid"):
        raise ValueError(f"factored_linear: form must be 'split' or 'hybrid', got {form!r}")
    lead = x.shape[:-1]
    y = _FactoredLinear.apply(x.reshape(-1, x.shape[-1]), w_high, u_low, s_low, v_low, bias, form == "hybrid",
                              save_rebuilt)
    return y.reshape(*lead, y.shape[-1])
