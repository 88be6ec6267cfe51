"""The DTensor helpers: what a rank holds of a tensor that FSDP2 may have sharded.

Under FSDP2 (:mod:`osft.trainer.model.sharding`) every parameter, gradient and AdamW moment is a
``torch.distributed.tensor.DTensor`` sharded by rows (``Shard(0)``); on one rank they are plain
tensors. These helpers take either, so the code that uses them runs unchanged on one rank and many.
"""

from __future__ import annotations

from typing import Any

import torch


def is_sharded(t: Any) -> bool:
    """True for a DTensor (FSDP2 parameter, gradient or optimizer moment)."""
    return hasattr(t, "to_local")


def local_tensor(t: Any) -> Any:
    """The rows of ``t`` held by this rank (``DTensor.to_local``; not collective); anything else unchanged."""
    return t.to_local() if is_sharded(t) else t


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """All rows of ``t``: ``DTensor.full_tensor`` (an all-gather, collective) for a DTensor, else ``t``."""
    return t.full_tensor() if is_sharded(t) else t
