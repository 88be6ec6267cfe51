"""``--compile``: the decoder blocks with OSFT modules compile without graph breaks, and a compiled
forward and backward give the eager model's loss and gradients (TorchDynamo with the cheap "eager"
backend: the graph capture is what is tested; inductor's code generation is left to the GPU check)."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_llama
from osft.trainer.model.activation_checkpointing import enable_activation_checkpointing
from osft.trainer.model.compile import compile_blocks
from osft.trainer.osft.plan import OSFTSettings
from osft.trainer.osft.surgery import apply_osft


@pytest.mark.parametrize("form,checkpointing", [("dense", False), ("hybrid", False), ("split", False), ("split", True)],
                         ids=["dense", "hybrid", "split", "split-activation-checkpointing"])
def test_osft_blocks_compile_without_graph_breaks(form, checkpointing):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = tiny_llama(100).train()
    apply_osft(model, OSFTSettings(urr=0.25, max_tokens_per_micro_batch=32, forward_form=form))
    ids = torch.randint(0, 100, (1, 32), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(20), torch.arange(12)]).unsqueeze(0)  # two packed samples

    def loss_and_grads() -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, position_ids=positions, labels=ids, use_cache=False).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    eager_loss, eager_grads = loss_and_grads()
    if checkpointing:  # --activation-checkpointing with --compile: the checkpoint is captured in the graph
        assert enable_activation_checkpointing(model) == 2
    assert compile_blocks(model, backend="eager") == 2
    loss, grads = loss_and_grads()
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] >= 1
    torch.testing.assert_close(loss, eager_loss, rtol=1e-6, atol=1e-6)
    for g, e in zip(grads, eager_grads):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
