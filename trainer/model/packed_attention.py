"""Causal attention over a packed row, one sample at a time.

A packed micro-batch is one row of T tokens holding samples of lengths L_1 .. L_n back to back
(:mod:`.data.collate`). transformers' SDPA path gives such a row a block-diagonal causal mask
(T x T), and a masked ``scaled_dot_product_attention`` computes all T² scores and cannot take the
kernels' causal fast path: on CPU with four 256-token samples a plain transformers step costs
1.21x the same tokens as padded rows. Here each sample's queries attend only to its own keys, with
``is_causal=True`` and no mask: Σ L_i² scores instead of T², which is what varlen flash attention
does on GPUs (``flash_attn_varlen_func``) built from ``torch.nn.functional.scaled_dot_product_attention``
(PyTorch's SDPA, any device).

It is registered with transformers' ``AttentionInterface`` (and the SDPA mask builder with
``AttentionMaskInterface``) under :data:`NAME`, and only a call that passes the row's sample bounds
(:data:`BOUNDS_KWARG`: the ``sample_bounds`` of :func:`.data.collate.collate_packed`) takes the
per-sample path. Every other call (a padded batch, generation with a KV cache, non-causal
attention, a sliding window, attention sinks, a soft cap) is handed to transformers' own
``sdpa_attention_forward`` unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: The attention implementation name the trainer's model gets (``config._attn_implementation``;
#: transformers does not save it with the config, so exports keep their SDPA default).
NAME = "osft_packed_sdpa"
#: The model-call keyword that carries a packed row's sample bounds down to the attention layers.
BOUNDS_KWARG = "osft_sample_bounds"


def packed_sdpa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                          **kwargs) -> tuple[torch.Tensor, None]:
    """Attention of one packed row, each sample causal within itself (an ``AttentionInterface`` function).

    Args:
        module: the attention layer (``num_key_value_groups``, ``sliding_window`` are read).
        query: [1, H, T, D]; key, value: [1, H_kv, T, D] (H = H_kv x groups).
        attention_mask: the mask transformers built; ignored on the per-sample path.
        dropout: attention dropout probability; scaling: softmax scale (None: 1/sqrt(D)).
        kwargs: :data:`BOUNDS_KWARG` (a tuple of ``(start, end)`` offsets covering ``[0, T)``), and
            whatever transformers passes; without the bounds the call goes to transformers' SDPA.

    Returns:
        ``(output, None)``: output [1, T, H, D], as transformers' ``sdpa_attention_forward``.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    bounds = kwargs.get(BOUNDS_KWARG)
    plain = (bounds is None or query.shape[0] != 1 or query.shape[2] != key.shape[2]
             or kwargs.get("is_causal", getattr(module, "is_causal", True)) is False
             or getattr(module, "sliding_window", None) is not None or kwargs.get("sliding_window") is not None
             or kwargs.get("s_aux") is not None or kwargs.get("softcap") is not None
             or kwargs.get("position_bias") is not None)
    if plain:
        kwargs.pop(BOUNDS_KWARG, None)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    groups = getattr(module, "num_key_value_groups", 1)
    # SDPA's own grouped-query path on GPUs (head dim <= 256, as transformers' use_gqa_in_sdpa); on
    # CPU repeating the key/value heads measured faster (55 vs 66 ms per SmolLM2 layer, forward + backward)
    gqa = groups > 1 and query.device.type != "cpu" and key.shape[-1] <= 256
    if groups > 1 and not gqa:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    outs = [F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], dropout_p=dropout,
                                           scale=scaling, is_causal=True, enable_gqa=gqa)
            for a, b in bounds]
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def use_packed_attention(model: torch.nn.Module) -> bool:
    """Switch ``model`` (a transformers ``PreTrainedModel``) to :func:`packed_sdpa_attention` when
    it runs transformers' SDPA attention; returns whether it did (eager, flash or flex attention,
    and models without ``set_attn_implementation``, are left as they are).

    Registers :data:`NAME` with ``AttentionInterface`` and ``AttentionMaskInterface`` (the SDPA mask
    builder: calls without sample bounds get exactly transformers' SDPA masks)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or not hasattr(model, "set_attn_implementation"):
        return False
    AttentionInterface.register(NAME, packed_sdpa_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
    return True
