"""``--compile``: ``torch.compile`` of every decoder block's forward.

Only the blocks' ``forward`` is compiled (``torch.compile``, PyTorch API), not the modules'
``__call__``: FSDP2's all-gather and reshard hooks stay eager around it, and the OSFT projections
(``Projector``, run between backward and the optimizer step and after it) never enter the compiled
code. An ``OSFTLinear`` inside a block is traced like any linear layer (its forward is plain
tensor algebra on the factors), so it adds no graph break.

With ``--activation-checkpointing`` the checkpoint is traced inside the compiled block, and
TorchDynamo refuses (a graph break) a forward that mutates state outside the checkpointed region,
because eager checkpointing would replay the mutation when the backward recomputes the forward.
transformers' hub-kernel wrapper of the attention module (``kernels``, a transformers dependency
since 5.25) sets a module-level variable and resets it before it returns; nothing reads it in the
recomputation, so :func:`compile_blocks` lets the recomputation skip it
(``torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint``, a process-wide setting;
``tests/test_compile.py`` checks that the compiled loss and gradients equal the eager ones).
"""

from __future__ import annotations

import torch
from torch import nn

from ..osft.targets import decoder_block_names


def compile_blocks(model: nn.Module, backend: str = "inductor") -> int:
    """Replace each decoder block's ``forward`` by its ``torch.compile`` (``backend``: "inductor",
    or "eager" to check for graph breaks cheaply). Returns the number of blocks compiled."""
    names = decoder_block_names(model)
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    for name in names:
        block = model.get_submodule(name)
        block.forward = torch.compile(block.forward, backend=backend, dynamic=True)
    return len(names)
