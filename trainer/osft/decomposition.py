"""SVD rank split and the :class:`OSFTLinear` module that replaces each targeted linear layer.

Notation (Nayak et al. 2025, section 3): W = U diag(S) Vᵀ with W of shape N×M (out×in) and rank
r = min(N, M). The k_high largest singular directions (U_high: N×k_high, S_high, V_high: k_high×M)
are frozen; the remaining k_low = r − k_high directions (U_low: N×k_low, S_low: k_low,
V_low: k_low×M) are trainable. k_high = floor(r · (1 − URR)), URR = unfreeze rank ratio in (0, 1].

V_high and V_low are stored as rows, not columns: they are rows of Vᵀ, which is what
``torch.linalg.svd`` returns as ``Vh`` (V_high = ``Vh[:k_high]``, k_high×M; V_low =
``Vh[k_high:]``, k_low×M). The paper's V_high and V_low are the corresponding columns of V (M×k);
here they are stored transposed, so the low part is U_low·diag(S_low)·V_low with no further
transpose.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from .factored_backward import factored_linear
from .plan import ForwardForm, ModulePlan, plan_module
from .protect import no_bases


#: Above this condition number σ_max/σ_min the Gram-matrix route loses accuracy (its eigenvalues,
#: σ², carry an error of about 1e-16·cond² relative to σ_max²): use LAPACK's SVD instead.
GRAM_EIGH_MAX_COND = 1e5


def thin_svd(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Thin SVD W = U·diag(S)·Vh of a 2-D weight, or of each matrix of a batch (E×N×M: the experts
    of a fused MoE tensor, decomposed together by batched LAPACK calls), in float32 or better
    whatever its dtype.

    On CUDA: ``torch.linalg.svd`` in float32 (there is no half-precision SVD kernel). On CPU: the
    eigendecomposition of the smaller Gram matrix (WᵀW or WWᵀ) in float64 (``torch.linalg.eigh``,
    batched over leading dimensions), then U = W·V/S (also float64); about 1.5× faster than LAPACK's
    float32 ``gesdd`` on SmolLM2's shapes with 2 cores, and more accurate. Weights with a condition
    number above :data:`GRAM_EIGH_MAX_COND` (rank-deficient ones included; in a batch, any one of
    them) fall back to float64 ``torch.linalg.svd``.

    Args:
        weight: N×M or E×N×M tensor of any floating dtype.

    Returns:
        ``(U, S, Vh)``: N×r, r (descending, ≥ 0), r×M with r = min(N, M), each with the leading E of
        a batch; float64 on CPU, float32 on CUDA.
    """
    w = weight.detach()
    if w.is_cuda:
        return torch.linalg.svd(w.float(), full_matrices=False)
    a = w.double()
    tall = a.shape[-2] >= a.shape[-1]
    if not tall:
        a = a.mT
    eigvals, v = torch.linalg.eigh(a.mT @ a)
    s = eigvals.flip(-1).clamp_min(0).sqrt()
    if s.numel() == 0 or bool((s[..., -1] * GRAM_EIGH_MAX_COND <= s[..., 0]).any()):
        return torch.linalg.svd(w.double(), full_matrices=False)
    v = v.flip(-1)
    u = (a @ v) / s.unsqueeze(-2)
    return (u, s, v.mT) if tall else (v, s, u.mT)


def _orthonormal_against(x: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """Columns of ``x`` with their ``basis`` component removed, re-orthonormalised (thin QR with
    the signs of ``x`` kept)."""
    q, r = torch.linalg.qr(x - basis @ (basis.t() @ x))
    return q * torch.where(r.diagonal() < 0, -1.0, 1.0).to(q.dtype)


def protected_svd(weight: torch.Tensor, P: torch.Tensor, Q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Thin SVD of W′ = (I − PPᵀ) W (I − QQᵀ), keeping its top R = min(N − p_L, M − p_R) triplets.

    W′ is formed as W − P(PᵀW), then minus (W′Q)Qᵀ: no N×N or M×M projector. W′ has at least
    min(N, M) − R exact zero singular values. On CPU (float64) the eigendecomposition of the smaller
    Gram matrix gives the top R eigenpairs, which are well separated from those zeros; the Gram
    side's vectors get their (rounding-sized) P or Q component removed and the other side's are
    W′V/σ, orthogonal to the other basis by construction. When those R values span a condition
    number above :data:`GRAM_EIGH_MAX_COND`, and on CUDA (float32), LAPACK's SVD is used and its top R
    vectors are re-orthonormalised against P and Q. Without protected directions this is
    :func:`thin_svd`.

    A bank of experts (E×N×M with bases E×N×p_L, E×M×p_R, one protected rank per bank, see
    :func:`.protect.fold_bank`) is decomposed expert by expert and the factors stacked.

    Args:
        weight: N×M (or E×N×M). P: N×p_L, Q: M×p_R, orthonormal columns (any floating dtype; with
            the bank's leading E).

    Returns:
        ``(U, S, Vh)``: N×R, R (descending), R×M; U ⊥ P, Vhᵀ ⊥ Q (each with a bank's leading E).
        float64 on CPU, float32 on CUDA.
    """
    if P.shape[-1] == 0 and Q.shape[-1] == 0:
        return thin_svd(weight)
    if weight.dim() == 3:
        experts = [protected_svd(w, p, q) for w, p, q in zip(weight, P, Q)]
        return tuple(torch.stack(parts) for parts in zip(*experts))
    dt = torch.float32 if weight.is_cuda else torch.float64
    a, p, q = weight.detach().to(dt), P.to(device=weight.device, dtype=dt), Q.to(device=weight.device, dtype=dt)
    a = a - p @ (p.t() @ a)
    a = a - (a @ q) @ q.t()
    n, m = a.shape
    rank = min(n - p.shape[1], m - q.shape[1])
    tall = n >= m
    left, right = (p, q) if tall else (q, p)
    if not tall:
        a = a.t()
    if rank == 0:
        return a.new_zeros(n, 0), a.new_zeros(0), a.new_zeros(0, m)
    s = None
    if not a.is_cuda:
        eigvals, v = torch.linalg.eigh(a.t() @ a)
        s = eigvals.flip(0)[:rank].clamp_min(0).sqrt()
    if s is None or s[-1] * GRAM_EIGH_MAX_COND <= s[0]:
        u, s, vh = torch.linalg.svd(a, full_matrices=False)
        u, s = _orthonormal_against(u[:, :rank], left), s[:rank]
        v = _orthonormal_against(vh[:rank].t(), right)
    else:
        v = v.flip(1)[:, :rank]
        v = v - right @ (right.t() @ v)
        u = (a @ v) / s
    return (u, s, v.t()) if tall else (v, s, u.t())


def dense_from_factors(w_high: torch.Tensor, u_low: torch.Tensor, s_low: torch.Tensor,
                       v_low: torch.Tensor) -> torch.Tensor:
    """W_high + U_low·diag(S_low)·V_low: N×M from N×M, N×k, k, k×M (``torch.addmm``), or E×N×M
    from the same with a leading E (``torch.baddbmm``, one product per expert)."""
    if w_high.dim() == 2:
        return torch.addmm(w_high, u_low * s_low, v_low)
    return torch.baddbmm(w_high, u_low * s_low.unsqueeze(-2), v_low)


def module_layout(n: int, m: int, protected_rank: tuple[int, int] | None, plan: ModulePlan | None, urr: float | None,
                  max_tokens_per_micro_batch: int | None, forward_form: ForwardForm | Literal["auto"]) -> ModulePlan:
    """The layout of an OSFT module of an N×M weight: ``plan`` when given, checked to fit (N, M) and
    the protected ranks ``protected_rank`` = (p_L, p_R) (None: any); else :func:`.plan.plan_module`
    of (N, M, ``urr``, ``max_tokens_per_micro_batch``, p_L, p_R, ``forward_form``) with
    (p_L, p_R) = (0, 0) for None. The one layout rule of :meth:`OSFTLinear.from_weight` and
    :meth:`OSFTLinear.empty`.

    Raises:
        ValueError: a plan that does not fit; neither a plan nor ``urr`` and
            ``max_tokens_per_micro_batch``; or from :func:`.plan.plan_module`.
    """
    if plan is None:
        if urr is None or max_tokens_per_micro_batch is None:
            raise ValueError("an OSFT module needs a plan, or urr and max_tokens_per_micro_batch")
        return plan_module(n, m, urr, max_tokens_per_micro_batch, *(protected_rank or (0, 0)), forward_form)
    if (plan.n, plan.m) != (n, m) or protected_rank not in (None, (plan.p_left, plan.p_right)):
        raise ValueError(f"OSFT plan of a {plan.n}×{plan.m} weight with protected ranks ({plan.p_left}, {plan.p_right}) "
                         f"does not fit a {n}×{m} weight with protected ranks {protected_rank}")
    return plan


class OSFTLinear(nn.Module):
    """A linear layer y = x·Wᵀ + b whose weight is W = W_high + U_low·diag(S_low)·V_low.

    Its layout (ranks, keep modes, forward form) is a :class:`.plan.ModulePlan` (``self.plan``).
    Parameters (trainable): ``U_low`` (N×k_low), ``S_low`` (k_low), ``V_low`` (k_low×M) and the
    original ``bias`` (N, if any); a module whose every direction is protected (``plan.frozen``)
    trains only its bias. Frozen (``requires_grad=False`` parameters, so that FSDP2 shards them
    like every other parameter, dim 0): ``W_high`` (N×M), ``U_basis``, ``V_basis``, the protected
    bases ``P`` (N×p_L) and ``Q`` (M×p_R) of earlier runs (see :mod:`.protect`; None where p = 0), the trainable
    factors at the start of this run ``U_start`` (N×k_low), ``S_start`` (k_low), ``V_start``
    (k_low×M), and ``sigma_frozen_min`` (1 element: the smallest frozen singular value of this
    run's split, σ_{k_high} of W′, 0 when k_high = 0).

    ``U_basis``/``V_basis`` hold, per side, whichever basis makes the projection cheaper:

    - *remove* mode: the frozen basis itself, L = [P, U_high] (N×(p_L + k_high)) or the row form
      of Rb = [Q, V_highᵀ] ((p_R + k_high)×M); projection removes its component:
      dU −= L(Lᵀ dU), dV −= (dV Rb) Rbᵀ.
    - *keep* mode (only when p + R equals that side's dimension, so [L, U_low] spans the whole
      space, and k_low < p + k_high): the orthogonal complement of the frozen basis, which is the
      initial U_low (N×k_low) or V_low (k_low×M); projection keeps only its component:
      dU = U_c(U_cᵀ dU). Identical result at k_low/(p + k_high) of the cost.

    ``transposed`` is True for GPT-2 ``Conv1D`` targets, whose stored weight is Wᵀ (M×N); the
    export writes that layout back.

    Raises:
        ValueError: a tensor whose shape is not the plan's (:meth:`.plan.ModulePlan.tensor_shapes`).
    """

    def __init__(self, plan: ModulePlan, W_high: torch.Tensor, U_low: torch.Tensor, S_low: torch.Tensor,
                 V_low: torch.Tensor, U_basis: torch.Tensor, V_basis: torch.Tensor, P: torch.Tensor, Q: torch.Tensor,
                 sigma_frozen_min: torch.Tensor, bias: torch.Tensor | None, transposed: bool = False) -> None:
        super().__init__()
        given = dict(W_high=W_high, U_low=U_low, S_low=S_low, V_low=V_low, U_basis=U_basis, V_basis=V_basis, P=P, Q=Q,
                     sigma_frozen_min=sigma_frozen_min)
        shapes = plan.tensor_shapes()
        wrong = [f"{k} {tuple(t.shape)} (plan: {shapes[k]})" for k, t in given.items() if tuple(t.shape) != shapes[k]]
        if bias is not None and tuple(bias.shape) != shapes["bias"]:
            wrong.append(f"bias {tuple(bias.shape)} (plan: {shapes['bias']})")
        if wrong:
            raise ValueError(f"OSFT tensors do not fit their plan: {', '.join(wrong)}")
        self.plan = plan
        self.W_high = nn.Parameter(W_high, requires_grad=False)
        self.U_basis = nn.Parameter(U_basis, requires_grad=False)
        self.V_basis = nn.Parameter(V_basis, requires_grad=False)
        # A side without protected directions has no P (or Q) parameter: FSDP2's broadcast of the
        # full state cannot shard zero-size tensors.
        self.P = nn.Parameter(P, requires_grad=False) if P.shape[-1] else None
        self.Q = nn.Parameter(Q, requires_grad=False) if Q.shape[-1] else None
        self.U_start = nn.Parameter(U_low.detach().clone(), requires_grad=False)
        self.S_start = nn.Parameter(S_low.detach().clone(), requires_grad=False)
        self.V_start = nn.Parameter(V_low.detach().clone(), requires_grad=False)
        self.sigma_frozen_min = nn.Parameter(sigma_frozen_min, requires_grad=False)
        self.U_low = nn.Parameter(U_low, requires_grad=not plan.frozen)
        self.S_low = nn.Parameter(S_low, requires_grad=not plan.frozen)
        self.V_low = nn.Parameter(V_low, requires_grad=not plan.frozen)
        self.bias = nn.Parameter(bias) if bias is not None else None
        self.transposed = transposed
        self.out_features, self.in_features = plan.n, plan.m
        #: The *hybrid* form keeps its rebuilt W (N×M) for the backward; False rebuilds it there
        #: instead (:func:`.factored_backward.factored_linear`; set under FSDP2 with several ranks).
        self.save_rebuilt_weight = True

    @property
    def u_keep(self) -> bool:
        """U side stores the complement basis (keep mode)."""
        return self.plan.u_keep

    @property
    def v_keep(self) -> bool:
        """V side stores the complement basis (keep mode)."""
        return self.plan.v_keep

    @property
    def forward_form(self) -> ForwardForm:
        """``dense``, ``hybrid`` or ``split`` (see :func:`.plan.choose_forward_form`)."""
        return self.plan.forward_form

    @classmethod
    def from_weight(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        urr: float | None = None,
        max_tokens_per_micro_batch: int | None = None,
        forward_form: ForwardForm | Literal["auto"] = "auto",
        transposed: bool = False,
        svd: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        protected: tuple[torch.Tensor, torch.Tensor] | None = None,
        plan: ModulePlan | None = None,
    ) -> "OSFTLinear":
        """Decompose a dense weight (N×M, or M×N when ``transposed``) into an OSFT module, or a bank
        of expert weights (E×N×M, out×in, with a plan of ``experts`` = E; bias E×N) into one module
        whose every tensor has a leading expert dimension: each expert is split by the same plan.

        ``protected`` = (P, Q): orthonormal bases (N×p_L, M×p_R; a bank's E×N×p, E×M×p, one per
        expert) of earlier runs' updates, frozen in addition to this run's high part (None:
        p_L = p_R = 0). The layout is :func:`module_layout` (``plan``, or the plan of ``urr``,
        ``max_tokens_per_micro_batch`` and ``forward_form``). ``svd`` is the precomputed
        :func:`protected_svd` of the weight (computed here when None). W_high is formed in the
        SVD's precision; every factor is then cast back to the weight's dtype and device.

        Raises:
            ValueError: a weight that is not 2-D (3-D for a bank plan), bases of the wrong shape, or
                from :func:`module_layout`.
        """
        bank = plan is not None and plan.experts > 0
        if weight.dim() != (3 if bank else 2) or (bank and transposed):
            raise ValueError(f"OSFT needs a 2-D weight, or a 3-D bank of experts without transposition; "
                             f"got shape {tuple(weight.shape)}")
        w = weight.detach().t() if transposed else weight.detach()
        n, m = w.shape[-2:]
        P, Q = protected if protected is not None else no_bases(n, m, like=w, experts=w.shape[0] if bank else 0)
        if P.shape[:-1] != w.shape[:-1] or Q.shape[:-1] != w.shape[:-2] + (m,):
            raise ValueError(f"protected bases of shapes {tuple(P.shape)}, {tuple(Q.shape)} do not fit a "
                             f"{'×'.join(map(str, w.shape))} weight")
        plan = module_layout(n, m, (P.shape[-1], Q.shape[-1]), plan, urr, max_tokens_per_micro_batch, forward_form)
        U, S, Vh = svd if svd is not None else protected_svd(w, P, Q)
        kh = plan.k_high
        # W − U_low·diag(S_low)·V_low equals the frozen part up to rounding, costs k_low instead of
        # p + k_high per element, and makes W_high + low part reproduce W to the last bit.
        W_high = w.to(U.dtype) - (U[..., kh:] * S[..., None, kh:]) @ Vh[..., kh:, :]
        lead = U.shape[:-2]
        P, Q = P.to(U.dtype).expand(*lead, n, -1), Q.to(U.dtype).expand(*lead, m, -1)
        U_basis = U[..., kh:] if plan.u_keep else torch.cat([P, U[..., :kh]], dim=-1)
        V_basis = Vh[..., kh:, :] if plan.v_keep else torch.cat([Q.mT, Vh[..., :kh, :]], dim=-2)
        sigma = S[..., kh - 1 : kh] if kh > 0 else S.new_zeros(*lead, 1)
        cast = dict(dtype=weight.dtype, device=weight.device)
        return cls(
            plan,
            W_high=W_high.to(**cast).contiguous(),
            U_low=U[..., kh:].to(**cast).contiguous(),
            S_low=S[..., kh:].to(**cast).contiguous(),
            V_low=Vh[..., kh:, :].to(**cast).contiguous(),
            U_basis=U_basis.to(**cast).contiguous(),
            V_basis=V_basis.to(**cast).contiguous(),
            P=P.to(**cast).contiguous(),
            Q=Q.to(**cast).contiguous(),
            sigma_frozen_min=sigma.to(**cast).contiguous(),
            bias=None if bias is None else bias.detach().clone(),
            transposed=transposed,
        )

    @classmethod
    def empty(
        cls,
        n: int,
        m: int,
        has_bias: bool,
        urr: float | None = None,
        max_tokens_per_micro_batch: int | None = None,
        forward_form: ForwardForm | Literal["auto"] = "auto",
        transposed: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "meta",
        protected_rank: tuple[int, int] | None = None,
        plan: ModulePlan | None = None,
    ) -> "OSFTLinear":
        """A module of the same structure as :meth:`from_weight` builds for an N×M weight with
        protected ranks ``protected_rank`` = (p_L, p_R) (None: the plan's, or (0, 0) without one),
        with uninitialised tensors (on the meta device by default). The layout is
        :func:`module_layout`, the tensors' shapes :meth:`.plan.ModulePlan.tensor_shapes`: the rules
        :meth:`from_weight` follows. Ranks other than 0 build these and receive the values from
        rank 0; a resumed run builds them from the plans its checkpoint stored.

        Raises:
            ValueError: from :func:`module_layout`.
        """
        plan = module_layout(n, m, protected_rank, plan, urr, max_tokens_per_micro_batch, forward_form)
        shapes = plan.tensor_shapes()
        tensors = {name: torch.empty(shapes[name], dtype=dtype, device=device) for name in
                   ("W_high", "U_low", "S_low", "V_low", "U_basis", "V_basis", "P", "Q", "sigma_frozen_min")}
        bias = torch.empty(shapes["bias"], dtype=dtype, device=device) if has_bias else None
        return cls(plan, bias=bias, transposed=transposed, **tensors)

    @property
    def k_low(self) -> int:
        """Trainable rank."""
        return self.plan.k_low

    def dense_weight(self) -> torch.Tensor:
        """W = W_high + U_low·diag(S_low)·V_low, shape N×M (out×in), in the parameters' dtype; for a
        bank E×N×M, every expert's at once (``torch.baddbmm``)."""
        return dense_from_factors(self.W_high, self.U_low, self.S_low, self.V_low)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., M) → (..., N), by :attr:`forward_form` (see :func:`.plan.choose_forward_form`)."""
        if self.forward_form == "dense":
            return F.linear(x, self.dense_weight(), self.bias)
        return factored_linear(x, self.W_high, self.U_low, self.S_low, self.V_low, self.bias, self.forward_form,
                               self.save_rebuilt_weight)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, k_low={self.k_low}, "
            f"forward={self.forward_form}, u_basis={'complement' if self.u_keep else 'U_high'}, "
            f"v_basis={'complement' if self.v_keep else 'V_high'}"
        )
