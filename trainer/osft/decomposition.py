"""SVD rank split and the :class:`OSFTLinear` module that replaces each targeted linear layer.

Notation (Nayak et al. 2025, section 3): W = U diag(S) Vᵀ with W of shape N×M (out×in) and rank
r = min(N, M). The k_high largest singular directions (U_high: N×k_high, S_high, V_high: k_high×M)
are frozen; the remaining k_low = r − k_high directions (U_low: N×k_low, S_low: k_low,
V_low: k_low×M) are trainable. k_high = floor(r · (1 − URR)), URR = unfreeze rank ratio in (0, 1].
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

ForwardForm = Literal["dense", "split"]


@dataclass(frozen=True)
class RankSplit:
    """Rank split of one N×M weight: ``rank = k_high + k_low``."""

    rank: int
    k_high: int
    k_low: int


def rank_split(n: int, m: int, urr: float) -> RankSplit:
    """Split rank min(n, m) by the unfreeze rank ratio: k_high = floor(min(n, m)·(1 − URR)).

    URR = 1.0 makes every direction trainable (k_high = 0). k_low ≥ 1 for every URR > 0.

    Raises:
        ValueError: URR outside (0, 1] or not a finite number.
    """
    if not (isinstance(urr, (int, float)) and math.isfinite(urr) and 0.0 < urr <= 1.0):
        raise ValueError(f"unfreeze rank ratio (URR) must be in (0, 1], got {urr!r}")
    rank = min(n, m)
    # The small epsilon keeps e.g. 576 * (1 - 0.25) = 432.0 from flooring to 431 through rounding.
    k_high = min(rank - 1, int(math.floor(rank * (1.0 - urr) + 1e-9))) if rank > 0 else 0
    return RankSplit(rank=rank, k_high=max(k_high, 0), k_low=rank - max(k_high, 0))


#: Above this condition number σ_max/σ_min the Gram-matrix route loses accuracy (its eigenvalues,
#: σ², carry an error of about 1e-16·cond² relative to σ_max²): use LAPACK's SVD instead.
GRAM_EIGH_MAX_COND = 1e5


def thin_svd(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Thin SVD W = U·diag(S)·Vh of a 2-D weight, in float32 or better whatever its dtype.

    On CUDA: ``torch.linalg.svd`` in float32 (there is no half-precision SVD kernel, field case
    B21). On CPU: the eigendecomposition of the smaller Gram matrix (WᵀW or WWᵀ) in float64, then
    U = W·V/S (also float64); about 1.5× faster than LAPACK's float32 ``gesdd`` on SmolLM2's shapes
    with 2 cores, and more accurate. Weights with a condition number above
    :data:`GRAM_EIGH_MAX_COND` (rank-deficient ones included) fall back to float64
    ``torch.linalg.svd``.

    Args:
        weight: N×M tensor of any floating dtype.

    Returns:
        ``(U, S, Vh)``: N×r, r (descending, ≥ 0), r×M with r = min(N, M); float64 on CPU,
        float32 on CUDA.
    """
    w = weight.detach()
    if w.is_cuda:
        return torch.linalg.svd(w.float(), full_matrices=False)
    a = w.double()
    tall = a.shape[0] >= a.shape[1]
    if not tall:
        a = a.t()
    eigvals, v = torch.linalg.eigh(a.t() @ a)
    s = eigvals.flip(0).clamp_min(0).sqrt()
    if s.numel() == 0 or s[-1] * GRAM_EIGH_MAX_COND <= s[0]:
        return torch.linalg.svd(w.double(), full_matrices=False)
    v = v.flip(1)
    u = (a @ v) / s
    return (u, s, v.t()) if tall else (v, s, u.t())


#: Low-rank GEMMs with a small inner dimension k run far below peak on CPUs; the cost model counts
#: them as if k were this much larger (fitted to per-module timings of SmolLM2's shapes, 2 cores).
LOW_RANK_GEMM_PENALTY = 48


def choose_forward_form(n: int, m: int, k_low: int, tokens_per_micro_batch: int) -> ForwardForm:
    """Pick the cheaper forward/backward formulation for one OSFT module.

    Both keep the frozen part as one dense N×M matrix W_high:

    - ``dense``: rebuild W = W_high + U_low·diag(S_low)·V_low once per micro-batch, then one dense
      linear. FLOPs ≈ 6·T·N·M (as full fine-tuning) + 6·N·M·k_low (the rebuild, and the two
      products that turn dW into dU_low and dV_low): the overhead shrinks as tokens T grow.
    - ``split``: y = x·W_highᵀ + ((x·V_lowᵀ)·S_low)·U_lowᵀ. W_high needs no weight gradient, which
      saves 2·T·N·M; the low-rank path costs 6·T·k_low·(N + M), counted with k_low +
      :data:`LOW_RANK_GEMM_PENALTY` because thin GEMMs run below peak. Wins for non-square shapes.

    Measured on SmolLM2-135M's shapes at T = 1024 (forward + backward, relative to a dense
    linear): 576×576 dense 1.08× / split 1.22×; 192×576 1.05× / 1.33×; 1536×576 1.14× / 1.11×;
    576×1536 1.19× / 1.08×. The model picks the faster one for each.

    Args:
        n, m: weight shape (out, in). k_low: trainable rank. tokens_per_micro_batch: T.

    Returns:
        ``"dense"`` or ``"split"`` (ties go to ``split``, which needs no N×M temporary).
    """
    t = max(int(tokens_per_micro_batch), 1)
    dense = 6 * t * n * m + 6 * n * m * k_low
    split = 4 * t * n * m + 6 * t * (k_low + LOW_RANK_GEMM_PENALTY) * (n + m)
    return "dense" if dense < split else "split"


class OSFTLinear(nn.Module):
    """A linear layer y = x·Wᵀ + b whose weight is W = W_high + U_low·diag(S_low)·V_low.

    Parameters (trainable): ``U_low`` (N×k_low), ``S_low`` (k_low), ``V_low`` (k_low×M) and the
    original ``bias`` (N, if any). Frozen (``requires_grad=False`` parameters, so that FSDP2 shards
    them like every other parameter): ``W_high`` (N×M), ``U_basis`` and ``V_basis``.

    ``U_basis``/``V_basis`` hold, per side, whichever basis makes the projection cheaper:

    - *remove* mode: the frozen basis itself, U_high (N×k_high) or V_high (k_high×M); projection
      removes its component: dU −= U_high(U_highᵀ dU), dV −= (dV V_highᵀ) V_high.
    - *keep* mode (only when that side's dimension equals the rank, so the thin SVD spans the whole
      space, and k_low < k_high): the orthogonal complement of the frozen basis, which is the initial
      U_low (N×k_low) or V_low (k_low×M); projection keeps only its component: dU = U_c(U_cᵀ dU).
      Identical result since [U_high, U_c] is an orthonormal basis of the whole space, at
      k_low/k_high of the cost (one third at URR 0.25).

    ``u_keep``/``v_keep`` record the mode. ``transposed`` is True for GPT-2 ``Conv1D`` targets, whose
    stored weight is Wᵀ (M×N); the export writes that layout back.
    """

    def __init__(
        self,
        W_high: torch.Tensor,
        U_low: torch.Tensor,
        S_low: torch.Tensor,
        V_low: torch.Tensor,
        U_basis: torch.Tensor,
        V_basis: torch.Tensor,
        u_keep: bool,
        v_keep: bool,
        bias: torch.Tensor | None,
        forward_form: ForwardForm,
        transposed: bool = False,
    ) -> None:
        super().__init__()
        self.W_high = nn.Parameter(W_high, requires_grad=False)
        self.U_basis = nn.Parameter(U_basis, requires_grad=False)
        self.V_basis = nn.Parameter(V_basis, requires_grad=False)
        self.U_low = nn.Parameter(U_low)
        self.S_low = nn.Parameter(S_low)
        self.V_low = nn.Parameter(V_low)
        self.bias = nn.Parameter(bias) if bias is not None else None
        self.u_keep = u_keep
        self.v_keep = v_keep
        self.forward_form: ForwardForm = forward_form
        self.transposed = transposed
        self.out_features, self.in_features = W_high.shape

    @classmethod
    def from_weight(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        urr: float,
        tokens_per_micro_batch: int,
        forward_form: ForwardForm | Literal["auto"] = "auto",
        transposed: bool = False,
        svd: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> "OSFTLinear":
        """Decompose a dense weight (N×M, or M×N when ``transposed``) into an OSFT module.

        ``svd`` is the precomputed :func:`thin_svd` of the N×M weight (computed here when None).
        W_high is formed in the SVD's precision; every factor is then cast back to the weight's
        dtype and device. ``forward_form="auto"`` uses :func:`choose_forward_form`.

        Raises:
            ValueError: URR outside (0, 1], or a weight that is not 2-D.
        """
        if weight.dim() != 2:
            raise ValueError(f"OSFT needs a 2-D weight, got shape {tuple(weight.shape)}")
        w = weight.detach().t() if transposed else weight.detach()
        n, m = w.shape
        split = rank_split(n, m, urr)
        U, S, Vh = svd if svd is not None else thin_svd(w)
        kh = split.k_high
        # W − U_low·diag(S_low)·V_low equals U_high·diag(S_high)·V_high up to rounding, costs k_low
        # instead of k_high per element, and makes W_high + low part reproduce W to the last bit.
        W_high = w.to(U.dtype) - (U[:, kh:] * S[kh:]) @ Vh[kh:]
        u_keep = n == split.rank and split.k_low < kh
        v_keep = m == split.rank and split.k_low < kh
        U_basis = U[:, kh:] if u_keep else U[:, :kh]
        V_basis = Vh[kh:] if v_keep else Vh[:kh]
        form = choose_forward_form(n, m, split.k_low, tokens_per_micro_batch) if forward_form == "auto" else forward_form
        cast = dict(dtype=weight.dtype, device=weight.device)
        return cls(
            W_high=W_high.to(**cast).contiguous(),
            U_low=U[:, kh:].to(**cast).contiguous(),
            S_low=S[kh:].to(**cast).contiguous(),
            V_low=Vh[kh:].to(**cast).contiguous(),
            U_basis=U_basis.to(**cast).contiguous(),
            V_basis=V_basis.to(**cast).contiguous(),
            u_keep=u_keep,
            v_keep=v_keep,
            bias=None if bias is None else bias.detach().clone(),
            forward_form=form,
            transposed=transposed,
        )

    @classmethod
    def empty(
        cls,
        n: int,
        m: int,
        has_bias: bool,
        urr: float,
        tokens_per_micro_batch: int,
        forward_form: ForwardForm | Literal["auto"] = "auto",
        transposed: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "meta",
    ) -> "OSFTLinear":
        """A module of the same structure as :meth:`from_weight` would build for an N×M weight,
        with uninitialised tensors (on the meta device by default): the shapes, keep modes and
        forward form depend only on (N, M, URR, T). Ranks other than 0 build these and receive
        the values from rank 0.
        """
        split = rank_split(n, m, urr)
        kh, kl = split.k_high, split.k_low
        u_keep = n == split.rank and kl < kh
        v_keep = m == split.rank and kl < kh
        form = choose_forward_form(n, m, kl, tokens_per_micro_batch) if forward_form == "auto" else forward_form

        def new(*shape):
            return torch.empty(*shape, dtype=dtype, device=device)

        return cls(
            W_high=new(n, m), U_low=new(n, kl), S_low=new(kl), V_low=new(kl, m),
            U_basis=new(n, kl if u_keep else kh), V_basis=new(kl if v_keep else kh, m),
            u_keep=u_keep, v_keep=v_keep, bias=new(n) if has_bias else None,
            forward_form=form, transposed=transposed,
        )

    @property
    def k_low(self) -> int:
        """Trainable rank."""
        return self.S_low.shape[0]

    def dense_weight(self) -> torch.Tensor:
        """W = W_high + U_low·diag(S_low)·V_low, shape N×M (out×in), in the parameters' dtype."""
        return torch.addmm(self.W_high, self.U_low * self.S_low, self.V_low)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., M) → (..., N)."""
        if self.forward_form == "dense":
            return F.linear(x, self.dense_weight(), self.bias)
        low = F.linear(F.linear(x, self.V_low) * self.S_low, self.U_low)
        return F.linear(x, self.W_high, self.bias) + low

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, k_low={self.k_low}, "
            f"forward={self.forward_form}, u_basis={'complement' if self.u_keep else 'U_high'}, "
            f"v_basis={'complement' if self.v_keep else 'V_high'}"
        )
