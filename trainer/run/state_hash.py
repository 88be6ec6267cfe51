"""A digest of a run's whole training state, to compare two runs bit for bit (the step records'
``state_sha256`` under the test hook ``OSFT_TEST_STATE_HASH``, tests/test_resume.py)."""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from ..dtensor import local_tensor


def _tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of a tensor of any dtype (bfloat16 included)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def state_sha256(model: nn.Module, optimizer: torch.optim.Optimizer, world_size: int) -> str:
    """SHA-256 over every rank's local parameter shards and optimizer state, in a fixed order
    (collective with ``world_size`` > 1: an ``all_gather_object`` of the ranks' digests). Equal
    digests mean bit-identical training states."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(_tensor_bytes(local_tensor(p.detach())))
    for i, state in sorted(optimizer.state_dict()["state"].items()):
        for key, value in sorted(state.items()):
            h.update(f"{i}.{key}".encode())
            h.update(_tensor_bytes(local_tensor(value)))
    digests = [h.hexdigest()]
    if world_size > 1:
        digests = [None] * world_size
        torch.distributed.all_gather_object(digests, h.hexdigest())
    return hashlib.sha256("".join(digests).encode()).hexdigest()
