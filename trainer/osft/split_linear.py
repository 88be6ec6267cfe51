"""The ``split`` forward form of an OSFT module as one autograd function with hand-written backward.

y = x·W_highᵀ + ((x·V_lowᵀ)·diag(S_low))·U_lowᵀ + b, with W_high frozen. Autograd on those four
ops computes the same products, but it allocates the two T×N halves of y and adds them, and
multiplies by S_low as a separate pass in both directions. Here the low-rank product is
accumulated into the dense one in place (``Tensor.addmm_``, the BLAS beta = 1 form), and the
backward forms exactly the products the gradients need:

- g = dy·U_low (T×k), h = g·diag(S_low);
- dU_low = dyᵀ·(z) with z = (x·V_lowᵀ)·diag(S_low) recomputed from the saved x·V_lowᵀ (N×k);
- dS_low = Σ_t g ∘ (x·V_lowᵀ) (k); dV_low = hᵀ·x (k×M);
- dx = dy·W_high + h·V_low (T×M, again one product accumulated into the other); db = Σ_t dy.

FLOPs (T tokens): forward 2·T·N·M + 2·T·k·(N + M); backward 2·T·N·M + 4·T·k·(N + M); no weight
gradient for W_high, which is why the form exists (see
:func:`.decomposition.choose_forward_form`). Saved for backward: x (T×M) and x·V_lowᵀ (T×k), as
autograd would save them. Gradients are those of ``torch.autograd`` on the four-op expression, up
to the order of floating-point additions.
"""

from __future__ import annotations

import torch


class _SplitLinear(torch.autograd.Function):
    """Forward and backward of :func:`split_linear` on 2-D inputs (T×M)."""

    @staticmethod
    def forward(ctx, x, w_high, u_low, s_low, v_low, bias):
        xv = x @ v_low.t()
        y = torch.addmm(bias, x, w_high.t()) if bias is not None else x @ w_high.t()
        y.addmm_(xv * s_low, u_low.t())
        ctx.save_for_backward(x, xv, w_high, u_low, s_low, v_low)
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, xv, w_high, u_low, s_low, v_low = ctx.saved_tensors
        need_x, _, need_u, need_s, need_v, need_b = ctx.needs_input_grad
        dx = du = ds = dv = db = None
        if need_x or need_s or need_v:
            g = dy @ u_low
            h = g * s_low
            if need_x:
                dx = (dy @ w_high).addmm_(h, v_low)
            if need_s:
                ds = (g * xv).sum(0)
            if need_v:
                dv = h.t() @ x
        if need_u:
            du = dy.t() @ (xv * s_low)
        if need_b and ctx.has_bias:
            db = dy.sum(0)
        return dx, None, du, ds, dv, db


def split_linear(x: torch.Tensor, w_high: torch.Tensor, u_low: torch.Tensor, s_low: torch.Tensor,
                 v_low: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """y = x·W_highᵀ + ((x·V_lowᵀ)·diag(S_low))·U_lowᵀ + b, differentiable in x, U_low, S_low,
    V_low and b (not W_high, which OSFT freezes).

    Args:
        x: (..., M). w_high: N×M. u_low: N×k. s_low: k. v_low: k×M. bias: N or None. One dtype and
            device for all.

    Returns:
        (..., N), in x's dtype.
    """
    lead = x.shape[:-1]
    y = _SplitLinear.apply(x.reshape(-1, x.shape[-1]), w_high, u_low, s_low, v_low, bias)
    return y.reshape(*lead, y.shape[-1])
