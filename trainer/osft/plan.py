"""The layout of one OSFT module: one place decides ranks, keep modes and forward form, from the
run's OSFT settings (:class:`OSFTSettings`, made once from the config by
:meth:`OSFTSettings.from_config` and passed to the surgery, :mod:`.surgery`, and the projector,
:class:`.projection.Projector`).

With protected subspaces (sequential OSFT, see :mod:`.protect`) a target W (N×M) carries
orthonormal bases P (N×p_L) and Q (M×p_R) of what earlier runs changed. This run decomposes
W′ = (I − PPᵀ) W (I − QQᵀ), whose rank is at most R = min(N − p_L, M − p_R), and splits R
(:func:`split_protected_rank`, ``--osft-frozen-rank``): ``reduced`` (the default) splits R by the
unfreeze rank ratio, k_high = floor(R·(1 − URR)), so k_low shrinks slowly but k_high does too (some
directions the first run froze become trainable); ``keep`` freezes as many of W′'s top directions as
a fresh run at the same URR, k_high = min(R − 1, floor(min(N, M)·(1 − URR))), so the pretrained
block stays frozen and each run's protected directions come out of k_low. k_low = R − k_high. The frozen bases are
L = [P, U′_{:, :k_high}] (N×(p_L + k_high)) and Rb = [Q, V′_{:, :k_high}] (M×(p_R + k_high)).
A fresh model has p_L = p_R = 0, which is the plain OSFT split (Nayak et al. 2025, section 3).

The plan is plain data (:meth:`ModulePlan.to_dict`), stored with every full-state checkpoint, so a
resumed skeleton is built with exactly the layout of the module it is loaded into.

Names: a config field carries its command-line flag's name (``max_tokens_per_gpu`` is
``--max-tokens-per-gpu``, written so in ``config.yaml`` and in checkpoints); from here on each
concept has one name: ``max_tokens_per_micro_batch`` (the token budget of one packed micro-batch, the
same name :func:`..data.packing.plan_micro_batches` uses), ``v_projection``, ``cache_v_basis``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

    from ..config import TrainConfig

ForwardForm = Literal["dense", "hybrid", "split"]
#: How a module with protected subspaces splits its rank R (``--osft-frozen-rank``, :func:`split_protected_rank`).
FrozenRank = Literal["keep", "reduced"]


@dataclass(frozen=True)
class ModulePlan:
    """Layout of one OSFT module of shape N×M (out×in).

    Fields: ``n``, ``m`` (shape), ``urr`` (unfreeze rank ratio), ``p_left``/``p_right`` (protected
    rank p_L, p_R), ``rank`` (R = min(N − p_L, M − p_R)), ``k_high``, ``k_low`` (R = k_high + k_low),
    ``u_keep``/``v_keep`` (the side stores the complement basis, see
    :class:`.decomposition.OSFTLinear`), ``forward_form`` (``dense``, ``hybrid`` or ``split``), ``experts``
    (0: one N×M weight; E ≥ 1: a bank of E expert weights of one fused MoE tensor, E×N×M, each
    expert decomposed on its own with this layout, every tensor of the module carrying a leading
    expert dimension, see :mod:`.experts`).
    """

    n: int
    m: int
    urr: float
    p_left: int
    p_right: int
    rank: int
    k_high: int
    k_low: int
    u_keep: bool
    v_keep: bool
    forward_form: ForwardForm
    experts: int = 0

    @property
    def copies(self) -> int:
        """Weights this plan lays out: E for an expert bank, else 1."""
        return max(self.experts, 1)

    @property
    def frozen(self) -> bool:
        """True when every direction is protected (R = 0): the module trains nothing."""
        return self.k_low == 0

    @property
    def u_frozen(self) -> int:
        """Columns of the left frozen basis L = [P, U′_{:, :k_high}]: p_L + k_high."""
        return self.p_left + self.k_high

    @property
    def v_frozen(self) -> int:
        """Rows of the right frozen basis (row form of Rb = [Q, V′_{:, :k_high}]): p_R + k_high."""
        return self.p_right + self.k_high

    @property
    def u_basis_cols(self) -> int:
        """Columns of the stored U basis: k_low in keep mode, else p_L + k_high."""
        return self.k_low if self.u_keep else self.u_frozen

    @property
    def v_basis_rows(self) -> int:
        """Rows of the stored V basis: k_low in keep mode, else p_R + k_high."""
        return self.k_low if self.v_keep else self.v_frozen

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of every tensor of the :class:`.decomposition.OSFTLinear` laid out by this plan
        (bias apart, N): ``W_high`` N×M; ``U_low``, ``U_start`` N×k_low; ``S_low``, ``S_start``
        k_low; ``V_low``, ``V_start`` k_low×M; ``U_basis`` N×:attr:`u_basis_cols`; ``V_basis``
        :attr:`v_basis_rows`×M; ``P`` N×p_L; ``Q`` M×p_R; ``sigma_frozen_min`` 1; each with a
        leading E for an expert bank (``bias`` then E×N). The one rule both a decomposed module and
        a skeleton are built by."""
        n, m, k = self.n, self.m, self.k_low
        lead = (self.experts,) if self.experts else ()
        shapes = {"W_high": (n, m), "U_low": (n, k), "S_low": (k,), "V_low": (k, m), "U_start": (n, k),
                  "S_start": (k,), "V_start": (k, m), "U_basis": (n, self.u_basis_cols),
                  "V_basis": (self.v_basis_rows, m), "P": (n, self.p_left), "Q": (m, self.p_right),
                  "sigma_frozen_min": (1,), "bias": (n,)}
        return {name: lead + shape for name, shape in shapes.items()}

    @property
    def trainable_params(self) -> int:
        """Trainable numbers of the factors: k_low·(N + M + 1) per weight (bias not counted)."""
        return self.k_low * (self.n + self.m + 1) * self.copies

    def to_dict(self) -> dict:
        """Plain data (JSON) for checkpoints."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ModulePlan":
        """Inverse of :meth:`to_dict`.

        A plan stored before expert banks existed has no ``experts`` field: 0.

        Raises:
            ValueError: a field is missing or unknown.
        """
        data = {"experts": 0, **data}
        names = {f.name for f in dataclasses.fields(cls)}
        if set(data) != names:
            raise ValueError(f"OSFT module plan {data!r}: expected the fields {sorted(names)}")
        return cls(**data)


def split_rank(rank: int, urr: float) -> tuple[int, int]:
    """``(k_high, k_low)`` of a rank: k_high = floor(rank·(1 − URR)), at most rank − 1, so k_low ≥ 1
    for every rank ≥ 1; both 0 for rank 0.

    Raises:
        ValueError: URR outside (0, 1] or not a finite number.
    """
    if not (isinstance(urr, (int, float)) and math.isfinite(urr) and 0.0 < urr <= 1.0):
        raise ValueError(f"unfreeze rank ratio (URR) must be in (0, 1], got {urr!r}")
    if rank <= 0:
        return 0, 0
    # The small epsilon keeps e.g. 576 * (1 - 0.25) = 432.0 from flooring to 431 through rounding.
    k_high = max(min(rank - 1, int(math.floor(rank * (1.0 - urr) + 1e-9))), 0)
    return k_high, rank - k_high


#: GEMMs whose inner dimension is the small rank k run far below peak on CPUs; the cost model counts
#: them as if k were this much larger (fitted to per-module timings of SmolLM2's shapes, 2 cores).
LOW_RANK_GEMM_PENALTY = 48

#: Fixed cost of one call of the hand-written autograd function of the *hybrid* and *split* forms
#: (Python dispatch, more and smaller kernels than *dense*), in FLOP-equivalents: about 70 µs per
#: forward + backward on this project's CPU at ~100 GFLOP/s. Decides only for tiny weights (a 32×32
#: layer: *dense* +40 µs over a plain linear layer, *hybrid* and *split* +100 µs); negligible
#: against SmolLM2's 0.1–6 GFLOP per module.
FACTORED_CALL_OVERHEAD = 7_000_000


def choose_forward_form(n: int, m: int, k_low: int, max_tokens_per_micro_batch: int) -> ForwardForm:
    """Pick the cheapest forward/backward formulation for one OSFT module.

    All three keep the frozen part as one dense N×M matrix W_high. FLOPs for T tokens, forward +
    backward, with the products whose inner dimension is k_low counted at k_low +
    :data:`LOW_RANK_GEMM_PENALTY` (k̃), and :data:`FACTORED_CALL_OVERHEAD` added to *hybrid* and
    *split*:

    - ``dense``: rebuild W = W_high + U_low·diag(S_low)·V_low once per micro-batch, one dense
      linear, autograd: 6·T·N·M (as full fine-tuning, weight gradient included) + 2·N·M·k̃ (the
      rebuild) + 4·N·M·k_low (turning dW into dU_low and dV_low).
    - ``hybrid`` (:func:`.factored_backward.factored_linear`): the same rebuild and dense forward,
      but the backward forms the factors' gradients from dy and x directly, without the N×M
      weight gradient: 4·T·N·M + 2·N·M·k̃ + 4·T·k_low·(N + M).
    - ``split`` (:func:`.factored_backward.factored_linear`): y = x·W_highᵀ +
      ((x·V_lowᵀ)·S_low)·U_lowᵀ, no rebuild: 4·T·N·M + 2·T·k̃·(N + M) + 4·T·k_low·(N + M). Cheaper
      than ``hybrid`` exactly when T < N·M/(N + M), i.e. for few tokens per micro-batch.

    Measured on SmolLM2-135M's shapes at URR 0.25 (``benchmarks/bench_forward_forms.py``, forward +
    backward relative to a dense linear layer with its weight gradient, 2 threads; dense / hybrid /
    split): at T = 1024, 576×576 1.17× / 1.12× / 1.23×; 192×576 1.11× / 1.03× / 1.10×; 1536×576
    1.15× / 0.98× / 1.04×; 576×1536 1.19× / 1.00× / 1.07×: ``hybrid`` fastest; at T = 128 ``split``
    fastest for all four. The model picks the measured fastest form in all eight cases.

    Args:
        n, m: weight shape (out, in). k_low: trainable rank. max_tokens_per_micro_batch: T, the
            token budget of one packed micro-batch (``--max-tokens-per-gpu``).

    Returns:
        ``"dense"``, ``"hybrid"`` or ``"split"`` (ties go to ``split``, which needs no N×M
        temporary, then to ``hybrid``).
    """
    t = max(int(max_tokens_per_micro_batch), 1)
    k_thin = k_low + LOW_RANK_GEMM_PENALTY
    costs = {
        "split": 4 * t * n * m + 2 * t * k_thin * (n + m) + 4 * t * k_low * (n + m) + FACTORED_CALL_OVERHEAD,
        "hybrid": 4 * t * n * m + 2 * n * m * k_thin + 4 * t * k_low * (n + m) + FACTORED_CALL_OVERHEAD,
        "dense": 6 * t * n * m + 2 * n * m * k_thin + 4 * n * m * k_low,
    }
    return min(costs, key=costs.get)


def split_protected_rank(n: int, m: int, urr: float, p_left: int = 0, p_right: int = 0,
                         frozen_rank: FrozenRank = "reduced") -> tuple[int, int, int]:
    """``(R, k_high, k_low)`` of an N×M weight with protected ranks (p_L, p_R): R = min(N − p_L, M − p_R);
    ``reduced``: :func:`split_rank` of R; ``keep``: k_high = min(R − 1, k_high of a fresh N×M split at
    ``urr``), k_low = R − k_high (the same as ``reduced`` when nothing is protected).

    Raises:
        ValueError: URR outside (0, 1]; an unknown rule.
    """
    rank = min(n - p_left, m - p_right)
    if frozen_rank == "reduced" or rank <= 0:
        return (rank, *split_rank(rank, urr))
    if frozen_rank != "keep":
        raise ValueError(f"frozen rank rule must be 'keep' or 'reduced', got {frozen_rank!r}")
    k_high = max(min(rank - 1, split_rank(min(n, m), urr)[0]), 0)
    return rank, k_high, rank - k_high


def plan_module(n: int, m: int, urr: float, max_tokens_per_micro_batch: int, p_left: int = 0, p_right: int = 0,
                forward_form: ForwardForm | Literal["auto"] = "auto", experts: int = 0,
                frozen_rank: FrozenRank = "reduced") -> ModulePlan:
    """The layout of an N×M target with protected ranks (p_L, p_R) at unfreeze rank ratio ``urr``
    (``experts`` = E ≥ 1: a bank of E such weights, always ``dense``: the bank is rebuilt into the
    fused tensor its experts module computes with, see :mod:`.experts`); ranks by
    :func:`split_protected_rank` under the rule ``frozen_rank``.

    Keep mode on a side needs [L, U_low] (or [Rb, V_lowᵀ]) to span that whole side, i.e.
    p + R equal to the side's dimension, so that keeping the complement's component equals removing
    L's; it is chosen when it is the smaller basis (k_low < p + k_high).
    ``forward_form="auto"`` uses :func:`choose_forward_form` with T =
    ``max_tokens_per_micro_batch`` (tokens).

    Raises:
        ValueError: URR outside (0, 1]; a protected rank below 0 or above the side's dimension.
    """
    if not (0 <= p_left <= n and 0 <= p_right <= m):
        raise ValueError(f"protected ranks (p_L={p_left}, p_R={p_right}) do not fit a {n}×{m} weight")
    rank, k_high, k_low = split_protected_rank(n, m, urr, p_left, p_right, frozen_rank)
    u_keep = p_left + rank == n and k_low < p_left + k_high
    v_keep = p_right + rank == m and k_low < p_right + k_high
    if experts:
        form = "dense"
    elif forward_form == "auto":
        form = choose_forward_form(n, m, k_low, max_tokens_per_micro_batch)
    else:
        form = forward_form
    return ModulePlan(n=n, m=m, urr=float(urr), p_left=p_left, p_right=p_right, rank=rank, k_high=k_high,
                      k_low=k_low, u_keep=u_keep, v_keep=v_keep, forward_form=form, experts=experts)


#: How the V side is projected (``--osft-v-projection``), see :mod:`.projection`.
VProjection = Literal["factored", "gram"]


@dataclass(frozen=True)
class OSFTSettings:
    """What OSFT needs of a run's config.

    Fields: ``urr`` (unfreeze rank ratio in (0, 1], ``--osft-unfreeze-rank-ratio``; a per-module
    rank plan overrides it), ``max_tokens_per_micro_batch`` (tokens, ``--max-tokens-per-gpu``: the
    T of :func:`choose_forward_form`), ``forward_form`` (``auto``, ``dense``,
    ``hybrid`` or ``split``, ``--osft-forward``), ``target_patterns`` (regular expressions, None
    for the built-in ones, ``--osft-target-patterns``), ``v_projection`` (``--osft-v-projection``),
    ``cache_v_basis`` (``--osft-cache-v-high``; None: :meth:`caches_v_basis` decides by device) and
    ``frozen_rank`` (``--osft-frozen-rank``: how a module with protected subspaces splits its rank,
    :func:`split_protected_rank`).
    """

    urr: float
    max_tokens_per_micro_batch: int
    forward_form: ForwardForm | Literal["auto"] = "auto"
    target_patterns: tuple[str, ...] | None = None
    v_projection: VProjection = "factored"
    cache_v_basis: bool | None = None
    frozen_rank: FrozenRank = "reduced"

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> OSFTSettings:
        """The OSFT settings of a :class:`..config.TrainConfig` (whether or not ``cfg.osft`` is on)."""
        patterns = cfg.osft_target_patterns
        return cls(urr=cfg.osft_unfreeze_rank_ratio, max_tokens_per_micro_batch=cfg.max_tokens_per_gpu,
                   forward_form=cfg.osft_forward, target_patterns=None if patterns is None else tuple(patterns),
                   v_projection=cfg.osft_v_projection, cache_v_basis=cfg.osft_cache_v_high,
                   frozen_rank=cfg.osft_frozen_rank)

    def caches_v_basis(self, device: torch.device) -> bool:
        """Whether the all-gathered V bases are kept (:class:`.projection.Projector`): as set, else
        on CPU ranks, whose gloo all-gathers of SmolLM2's V bases (220 MB per projection, two
        projections a step) took about 1 s of a 12 s two-rank step, and off under NCCL, where a
        gather is cheap and device memory is not."""
        return self.cache_v_basis if self.cache_v_basis is not None else device.type != "cuda"

    def plan(self, n: int, m: int, p_left: int = 0, p_right: int = 0, urr: float | None = None,
             experts: int = 0) -> ModulePlan:
        """The layout of an N×M target (``experts`` = E: a bank of E) with protected ranks (p_L, p_R)
        under these settings (:func:`plan_module`); ``urr`` overrides :attr:`urr` (a per-module
        rank plan).

        Raises:
            ValueError: from :func:`plan_module`.
        """
        return plan_module(n, m, self.urr if urr is None else urr, self.max_tokens_per_micro_batch, p_left, p_right,
                           self.forward_form, experts, self.frozen_rank)


#: A module name inside a numbered block: ``(model.layers.)(self_attn.q_proj)`` of ``model.layers.3.self_attn.q_proj``.
BLOCK_INDEX = re.compile(r"^(.*?\.)\d+\.(.+)$")


def plan_table(plans: Sequence[tuple[str, ModulePlan]]):
    """A compact ``rich`` table of the OSFT layout: one row per distinct (shape, URR, p_L, p_R,
    k_high, k_low), with the number of modules, their names (the part after the block index,
    ``self_attn.q_proj`` for ``model.layers.<i>.self_attn.q_proj``, the block prefixes in the
    caption; wrapped, never cut, on a narrow console) and their trainable parameters."""
    from rich import box
    from rich.table import Table

    groups: dict[tuple, list[tuple[str, ModulePlan]]] = {}
    for name, p in plans:
        groups.setdefault((f"{p.experts}×" if p.experts else "", p.n, p.m, p.urr, p.p_left, p.p_right, p.k_high, p.k_low), []).append((name, p))
    blocks = {}
    for name, _ in plans:
        if hit := BLOCK_INDEX.match(name):
            blocks[hit.group(1)] = None
    caption = "#: modules; " + (f"names: after {', '.join(f'{b}<i>.' for b in blocks)}; " if blocks else "") + \
        "E×N×M: a bank of E experts; p_L/p_R: protected rank, left/right; trainable: parameters of U_low, S_low, V_low"
    table = Table(title="OSFT plan", title_justify="left", caption=caption, caption_justify="left",
                  box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for column in ("#", "names", "N×M", "URR", "k_high", "p_L/p_R", "k_low", "trainable"):
        if column == "names":
            table.add_column(column, justify="left", overflow="fold")
        else:
            table.add_column(column, justify="right", no_wrap=True)
    for (bank, n, m, urr, pl, pr, kh, kl), members in groups.items():
        params = members[0][1].trainable_params * len(members)
        names = "\n".join(dict.fromkeys((hit.group(2) if (hit := BLOCK_INDEX.match(name)) else name) for name, _ in members))
        table.add_row(str(len(members)), names, f"{bank}{n}×{m}", f"{urr:g}", str(kh), f"{pl}/{pr}",
                      "frozen" if kl == 0 else str(kl), f"{params:,}")
    return table
