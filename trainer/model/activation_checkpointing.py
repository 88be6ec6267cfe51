"""``--activation-checkpointing``: recompute each decoder block's activations in the backward pass
instead of keeping them from the forward.

It uses the model's own switch, ``PreTrainedModel.activation_checkpointing_enable``
(transformers 5; the older name is ``gradient_checkpointing_enable``): every decoder block
(``GradientCheckpointingLayer``) runs its ``forward`` under ``torch.utils.checkpoint.checkpoint``
with ``use_reentrant=False`` and ``preserve_rng_state=True``, so the forward keeps only each
block's inputs, and the backward recomputes the block before differentiating it.

- FSDP2: the checkpoint wraps the block's ``forward``, not its ``__call__``, so the all-gather and
  reshard hooks that ``fully_shard`` puts on the block run once, outside the recompute; the
  recompute runs inside FSDP2's pre-backward unshard of that block.
- OSFT: an ``OSFTLinear`` or ``OSFTExperts`` inside a block is recomputed like any layer (its
  forward is plain tensor algebra on the factors); the gradient and parameter projections run
  after the backward, outside the checkpoint.
- Exactness: the recompute runs the same operations on the same inputs with the random-number
  state the forward started with (``preserve_rng_state``: dropout draws the same mask), and the
  generators are left as the forward left them, so gradients equal those without checkpointing
  bit for bit on CPU and full-state checkpoints resume exactly.
"""

from __future__ import annotations

from torch import nn

#: Arguments of ``torch.utils.checkpoint.checkpoint`` for every block.
CHECKPOINT_KWARGS = {"use_reentrant": False, "preserve_rng_state": True}


def enable_activation_checkpointing(model: nn.Module) -> int:
    """Turn on activation checkpointing for every decoder block of ``model`` (a transformers
    ``PreTrainedModel``; before or after FSDP2's ``fully_shard``).

    Returns:
        The number of decoder blocks that now recompute their activations.

    Raises:
        ValueError: the model does not support activation checkpointing (names its class).
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"--activation-checkpointing: {type(model).__name__} does not support activation "
                         "checkpointing (its decoder blocks are not transformers GradientCheckpointingLayer modules)")
    model.activation_checkpointing_enable(activation_checkpointing_kwargs=dict(CHECKPOINT_KWARGS))
    return sum(1 for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing)
