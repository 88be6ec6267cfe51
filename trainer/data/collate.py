"""Packing several samples into one row for the model.

The samples are concatenated into a single row without padding; ``position_ids`` restart at 0 for
every sample. With ``attention_mask=None`` (and no KV cache: call the model with
``use_cache=False``), transformers detects the restarts in ``position_ids`` and builds a
block-diagonal causal mask (sdpa, eager; flash-attention uses the same position ids), so no sample
attends to another. The trainer goes further on SDPA models: :mod:`..packed_attention` runs each
sample's attention on its own, with no mask, from the row's ``sample_bounds``.

Labels come out already shifted for next-token prediction, within each sample: ``labels[j]`` is
token ``j+1`` of the same sample if that token is trained, else -100, and the last position of
every sample is -100. The loss is then, with no further shift::

    F.cross_entropy(logits.view(-1, V), labels.view(-1), reduction="sum", ignore_index=-100)
"""

from __future__ import annotations

import numpy as np
import torch

from .tokenize import IGNORE_INDEX


def collate_packed(samples: list[dict]) -> dict:
    """Concatenate samples into one packed row.

    Args:
        samples: dicts with ``input_ids`` and ``labels`` (unshifted, -100 = not trained) of equal
            length (lists, numpy arrays or 1-D tensors), as produced by ``tokenize_chat_file``.

    Returns:
        dict with ``input_ids``, ``position_ids``, ``labels`` (shifted): int64 tensors of shape
        [1, T] (T = total tokens); ``num_loss_tokens`` (int, positions with a label != -100),
        ``num_tokens`` (int, T), ``num_samples`` (int) and ``sample_bounds`` (each sample's
        ``(start, end)`` token offsets in the row, host ints). An empty ``samples`` list gives [1, 0]
        tensors and zeros (the trainer must not forward that as is).

    Raises:
        ValueError: a sample whose ``input_ids`` and ``labels`` differ in length, or an empty sample.
    """
    ids_parts, pos_parts, label_parts, bounds = [], [], [], []
    for k, sample in enumerate(samples):
        ids = np.asarray(sample["input_ids"], dtype=np.int64).reshape(-1)
        labels = np.asarray(sample["labels"], dtype=np.int64).reshape(-1)
        if ids.shape != labels.shape or ids.size == 0:
            raise ValueError(f"sample {k}: input_ids ({ids.size}) and labels ({labels.size}) "
                             "must have the same, non-zero length")
        shifted = np.empty_like(labels)
        shifted[:-1] = labels[1:]
        shifted[-1] = IGNORE_INDEX
        start = bounds[-1][1] if bounds else 0
        bounds.append((start, start + ids.size))
        ids_parts.append(ids)
        pos_parts.append(np.arange(ids.size, dtype=np.int64))
        label_parts.append(shifted)

    def row(parts):
        flat = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return torch.from_numpy(flat).unsqueeze(0)

    labels = row(label_parts)
    return {
        "input_ids": row(ids_parts),
        "position_ids": row(pos_parts),
        "labels": labels,
        "num_loss_tokens": int((labels != IGNORE_INDEX).sum()),
        "num_tokens": int(labels.shape[1]),
        "num_samples": len(samples),
        "sample_bounds": tuple(bounds),
    }
