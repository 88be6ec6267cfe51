"""OSFT's settings for one run, made once from the run's config (:meth:`OSFTSettings.from_config`)
and passed to the surgery (:func:`.surgery.apply_osft`, :func:`.surgery.skeleton_osft`) and the
projector (:class:`.projection.Projector`).

Names: a config field carries its command-line flag's name (``max_tokens_per_gpu`` is
``--max-tokens-per-gpu``, written so in ``config.yaml`` and in checkpoints); from here on each
concept has one name: ``max_tokens_per_micro_batch`` (the token budget of one packed micro-batch, the
same name :func:`..data.packing.plan_micro_batches` uses), ``v_projection``, ``cache_v_basis``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from .plan import ForwardForm, FrozenRank, ModulePlan, plan_module

if TYPE_CHECKING:
    import torch

    from ..config import TrainConfig

#: How the V side is projected (``--osft-v-projection``), see :mod:`.projection`.
VProjection = Literal["factored", "gram"]


@dataclass(frozen=True)
class OSFTSettings:
    """What OSFT needs of a run's config.

    Fields: ``urr`` (unfreeze rank ratio in (0, 1], ``--osft-unfreeze-rank-ratio``; a per-module
    rank plan overrides it), ``max_tokens_per_micro_batch`` (tokens, ``--max-tokens-per-gpu``: the
    T of :func:`.plan.choose_forward_form`), ``forward_form`` (``auto``, ``dense``,
    ``hybrid`` or ``split``, ``--osft-forward``), ``target_patterns`` (regular expressions, None
    for the built-in ones, ``--osft-target-patterns``), ``v_projection`` (``--osft-v-projection``),
    ``cache_v_basis`` (``--osft-cache-v-high``; None: :meth:`caches_v_basis` decides by device) and
    ``frozen_rank`` (``--osft-frozen-rank``: how a module with protected subspaces splits its rank,
    :func:`.plan.split_protected_rank`).
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
        under these settings (:func:`.plan.plan_module`); ``urr`` overrides :attr:`urr` (a per-module
        rank plan).

        Raises:
            ValueError: from :func:`.plan.plan_module`.
        """
        return plan_module(n, m, self.urr if urr is None else urr, self.max_tokens_per_micro_batch, p_left, p_right,
                           self.forward_form, experts, self.frozen_rank)
