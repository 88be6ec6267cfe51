"""``--compile``: ``torch.compile`` of every decoder block's forward.

Only the blocks' ``forward`` is compiled (``torch.compile``, PyTorch API), not the modules'
``__call__``: FSDP2's all-gather and reshard hooks stay eager around it, and the OSFT projections
(``Projector``, run between backward and the optimizer step and after it) never enter the compiled
code. An ``OSFTLinear`` inside a block is traced like any linear layer (its forward is plain
tensor algebra on the factors), so it adds no graph break.
"""

from __future__ import annotations

import torch
from torch import nn

from ..osft.targets import decoder_block_names


def compile_blocks(model: nn.Module, backend: str = "inductor") -> int:
    """Replace each decoder block's ``forward`` by its ``torch.compile`` (``backend``: "inductor",
    or "eager" to check for graph breaks cheaply). Returns the number of blocks compiled."""
    names = decoder_block_names(model)
    for name in names:
        block = model.get_submodule(name)
        block.forward = torch.compile(block.forward, backend=backend, dynamic=True)
    return len(names)
