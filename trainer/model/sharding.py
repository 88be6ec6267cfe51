"""FSDP2 sharding of a built model over the ranks, and the broadcast of rank 0's values.

``fully_shard`` (``torch.distributed.fsdp``) wraps every decoder block and then the root, so every
parameter, OSFT factors included, is sharded along dim 0; rank 0's full state dict is broadcast and
sharded with ``set_model_state_dict(..., broadcast_from_rank0=True)``
(``torch.distributed.checkpoint.state_dict``); buffers that are not in the state dict (rotary
frequencies) are broadcast from rank 0. With several ranks, OSFT modules in the *hybrid* form
rebuild their whole W again in the backward rather than keep it (``save_rebuilt_weight``). On GPU
the sharded parameters are float32 and FSDP2 computes in bfloat16 with float32 gradient reduction
(``MixedPrecisionPolicy``); on CPU everything is float32.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..distributed import DistEnv
from ..osft.decomposition import OSFTLinear
from ..osft.targets import decoder_block_names


def shard_and_broadcast(model: nn.Module, env: DistEnv, device: torch.device, dtype: torch.dtype,
                        full_state: dict[str, torch.Tensor] | None) -> None:
    """Shard ``model`` in place with FSDP2 and give every rank rank 0's values.

    Every rank must call it (collective). Rank 0 holds the real model (on CPU), the others the same
    architecture on the meta device; afterwards every parameter is a DTensor on ``device``.

    Args:
        dtype: the compute dtype; on CUDA FSDP2 computes in it with float32 gradient reduction.
        full_state: rank 0's complete state dict (``model.state_dict()`` taken before sharding; an
            empty dict on the other ranks), broadcast into the shards; None: the parameters stay
            uninitialised (a full-state checkpoint is loaded into them next). Non-persistent buffers
            are broadcast from rank 0 either way.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    buffers_before = {n: b for n, b in model.named_buffers()}
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if device.type == "cuda" else MixedPrecisionPolicy()
    for name in decoder_block_names(model):
        fully_shard(model.get_submodule(name), mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    model.to_empty(device=device)
    if full_state is not None:
        set_model_state_dict(model, full_state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    # Non-persistent buffers (e.g. rotary inv_freq) are not in the state dict: copy rank 0's.
    for name, buf in model.named_buffers():
        if env.rank == 0:
            buf.copy_(buffers_before[name].to(device))
        dist.broadcast(buf, src=0)
    if env.world_size > 1:  # a rebuilt W is whole on every rank: not kept from forward to backward
        for module in model.modules():
            if isinstance(module, OSFTLinear):
                module.save_rebuilt_weight = False
