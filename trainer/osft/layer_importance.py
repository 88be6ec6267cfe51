"""Per-layer OSFT ranks from a layer-importance score (``--osft-rank-schedule importance``).

Nayak et al. 2025 (*Sculpting Subspaces*, arXiv 2504.07097, section 3, "layer importance" and
"adaptive rank selection") do not freeze the same share of every layer: they run calibration
samples through the dense model, score each layer by the cosine similarity between its input and
output activations, and map the scores linearly onto the layer's retention ratio (our frozen
fraction, 1 − URR) between a minimum and a maximum.

Direction of the map, as the paper states it: a layer whose output stays close to its input
(similarity near 1) is taken as one that *preserves* the pre-trained representation, so it gets
the **larger** frozen fraction, and a layer that transforms its input strongly gets more trainable
rank. (Layer-pruning work reads the same similarity the other way round: there a layer that
barely changes its input is redundant. OSFT asks what to protect, not what to remove, and follows
the paper's reading.) An identity block (output = input, similarity 1) therefore gets
``--osft-max-frozen-ratio`` whenever any other block scores lower.

Here the layers are the decoder blocks (the classes in ``model._no_split_modules``, as FSDP2
sharding finds them); every OSFT target inside block i gets URR_i = 1 − frozen_i, targets outside
the blocks keep the global ``--osft-unfreeze-rank-ratio``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..data.micro_batches import micro_batches
from .targets import decoder_block_names

#: Keys of a calibration batch passed to the model's decoder (``attention_mask`` marks padding).
MODEL_INPUTS = ("input_ids", "position_ids", "attention_mask")


@dataclass(frozen=True)
class RankPlan:
    """The importance schedule of one model.

    Fields (one entry per decoder block, in model order): ``blocks`` (module names), ``similarity``
    (mean cosine similarity of the block's input and output over the calibration tokens, in
    [−1, 1]), ``frozen`` (frozen fraction, between the minimum and maximum ratio) and ``urr``
    (1 − frozen); ``tokens`` (calibration tokens counted) and ``urr_by_module`` (OSFT target full
    name → its block's URR; targets outside every block are absent and keep the global URR).
    """

    blocks: list[str]
    similarity: list[float]
    frozen: list[float]
    urr: list[float]
    tokens: int
    urr_by_module: dict[str, float]

    def block_of(self, name: str) -> int | None:
        """Index of the block that holds the module ``name`` (a full module name), or None."""
        return next((i for i, block in enumerate(self.blocks) if name.startswith(block + ".")), None)

    def to_json(self) -> dict:
        """Plain data for the ``osft_rank_plan`` metrics record."""
        return {"blocks": self.blocks, "similarity": self.similarity, "frozen": self.frozen, "urr": self.urr,
                "tokens": self.tokens, "urr_by_module": self.urr_by_module}


def calibration_batches(dataset, lengths: np.ndarray, num_samples: int, max_tokens_per_micro_batch: int) -> Iterator[dict]:
    """The first ``num_samples`` samples of the tokenized training data as packed micro-batches of at
    most ``max_tokens_per_micro_batch`` tokens (:func:`.data.packing.plan_micro_batches` on one rank, then
    :func:`.data.collate.collate_packed`): packed rows, no padding, position ids restart per sample.

    Args:
        dataset: indexable rows with ``input_ids`` and ``labels`` (``TokenizedChat.dataset``).
        lengths: int array [len(dataset)], tokens of each row.
    """
    n = min(int(num_samples), len(lengths))
    yield from micro_batches(lambda i: dataset[int(i)], lengths[:n], max_tokens_per_micro_batch)


@torch.no_grad()
def block_similarities(model: nn.Module, batches: Iterable[dict]) -> tuple[list[float], int]:
    """Mean cosine similarity between each decoder block's input and output hidden states.

    A forward hook on every block takes its input x and output y (both [B, T, hidden]) and adds up
    cos(x_t, y_t) over the real tokens t: all of them in packed rows, those with
    ``attention_mask`` 1 in padded ones. Runs the decoder only (``model.base_model``, no LM head) in
    eval mode (no dropout), in float32 accumulation; the training mode is restored afterwards.

    Args:
        model: a dense causal LM (before OSFT surgery), on any device.
        batches: dicts with ``input_ids`` [B, T] and optionally ``position_ids`` and
            ``attention_mask`` [B, T] (1 = real token); other keys are ignored.

    Returns:
        ``(similarity, tokens)``: one mean per block (in :func:`decoder_block_names` order), and the
        number of tokens averaged over.

    Raises:
        ValueError: no block found, or the batches hold no real token.
    """
    names = decoder_block_names(model)
    blocks = [model.get_submodule(n) for n in names]
    sums = torch.zeros(len(blocks), dtype=torch.float64)
    current: dict[str, torch.Tensor] = {}

    def hook(index: int):
        def accumulate(module, args, kwargs, output):
            x = args[0] if args else kwargs["hidden_states"]
            y = output[0] if isinstance(output, tuple) else output
            cos = F.cosine_similarity(x.float(), y.float(), dim=-1)  # [B, T]
            sums[index] += cos[current["mask"]].double().sum().cpu()
        return accumulate

    device = next(model.parameters()).device
    handles = [b.register_forward_hook(hook(i), with_kwargs=True) for i, b in enumerate(blocks)]
    was_training = model.training
    model.eval()
    tokens = 0
    try:
        for batch in batches:
            inputs = {k: batch[k].to(device) for k in MODEL_INPUTS if k in batch}
            mask = inputs.get("attention_mask")
            current["mask"] = mask.bool() if mask is not None else torch.ones_like(inputs["input_ids"], dtype=torch.bool)
            tokens += int(current["mask"].sum())
            model.base_model(**inputs, use_cache=False)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    if tokens == 0:
        raise ValueError("layer importance: the calibration batches hold no real token")
    return (sums / tokens).tolist(), tokens


def frozen_ratios(similarity: Sequence[float], min_ratio: float, max_ratio: float) -> list[float]:
    """Map block scores linearly onto frozen fractions (Nayak et al. 2025, adaptive rank selection).

    The scores are min-max normalised over the blocks, ŝ_i = (s_i − min s)/(max s − min s) ∈ [0, 1],
    and frozen_i = min_ratio + ŝ_i·(max_ratio − min_ratio): the most similar block gets
    ``max_ratio``, the least similar ``min_ratio``. When every score is equal (or there is one
    block) nothing ranks the blocks and each gets the midpoint (min_ratio + max_ratio)/2.

    Raises:
        ValueError: not 0 ≤ min_ratio ≤ max_ratio < 1, or no score.
    """
    if not 0.0 <= min_ratio <= max_ratio < 1.0:
        raise ValueError(f"frozen ratios must satisfy 0 <= min <= max < 1, got min {min_ratio}, max {max_ratio}")
    s = np.asarray(similarity, dtype=np.float64)
    if s.size == 0:
        raise ValueError("layer importance: no block scores")
    span = s.max() - s.min()
    normalised = (s - s.min()) / span if span > 0 else np.full_like(s, 0.5)
    return (min_ratio + normalised * (max_ratio - min_ratio)).tolist()


def importance_rank_plan(model: nn.Module, batches: Iterable[dict], targets: Sequence[str], min_ratio: float,
                         max_ratio: float) -> RankPlan:
    """Score the blocks of a dense ``model`` on ``batches`` and give each OSFT target its block's URR.

    Args:
        targets: full names of the OSFT target modules (:func:`.targets.find_target_modules`).

    Raises:
        ValueError: see :func:`block_similarities` and :func:`frozen_ratios`.
    """
    blocks = decoder_block_names(model)
    similarity, tokens = block_similarities(model, batches)
    frozen = frozen_ratios(similarity, min_ratio, max_ratio)
    urr = [1.0 - f for f in frozen]
    plan = RankPlan(blocks=blocks, similarity=similarity, frozen=frozen, urr=urr, tokens=tokens, urr_by_module={})
    for name in targets:
        if (i := plan.block_of(name)) is not None:
            plan.urr_by_module[name] = urr[i]
    return plan

