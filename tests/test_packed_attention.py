"""Per-sample causal attention of a packed row (osft.trainer.model.packed_attention) against transformers'
own SDPA with its block-diagonal mask: the same logits and gradients to fp32 rounding, and calls
without sample bounds handed to transformers unchanged (bit for bit)."""

import json

import pytest
import torch
from helpers import tiny_llama
from osft.trainer.data.collate import collate_packed
from osft.trainer.model.packed_attention import BOUNDS_KWARG, NAME, use_packed_attention

VOCAB = 97


def _row(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    samples = [dict(input_ids=torch.randint(0, VOCAB, (n,), generator=g), labels=torch.randint(0, VOCAB, (n,), generator=g))
               for n in lengths]
    return collate_packed(samples)


def _logits_and_grads(model, batch, **kwargs):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False, **kwargs).logits
    logits.float().pow(2).mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("kv_heads", [2, 4])  # grouped-query (heads repeated) and plain multi-head attention
def test_per_sample_attention_matches_the_block_mask(kv_heads):
    reference = tiny_llama(VOCAB, num_key_value_heads=kv_heads).train()
    packed = tiny_llama(VOCAB, num_key_value_heads=kv_heads).train()
    assert use_packed_attention(packed) and packed.config._attn_implementation == NAME
    batch = _row([9, 3, 16, 1])
    want_logits, want_grads = _logits_and_grads(reference, batch)
    got_logits, got_grads = _logits_and_grads(packed, batch, **{BOUNDS_KWARG: batch["sample_bounds"]})
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-5)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    # the samples really are separated: a sample's logits do not change when the sample before it does
    other = _row([9, 3, 16, 1], seed=1)
    other["input_ids"][0, 12:] = batch["input_ids"][0, 12:]
    shifted, _ = _logits_and_grads(packed, other, **{BOUNDS_KWARG: other["sample_bounds"]})
    torch.testing.assert_close(shifted[0, 12:], got_logits[0, 12:], rtol=0, atol=0)


def test_calls_without_bounds_and_sliding_windows_are_transformers_sdpa_bit_for_bit():
    batch = _row([6, 10])
    reference = tiny_llama(VOCAB).train()
    packed = tiny_llama(VOCAB).train()
    use_packed_attention(packed)
    want, _ = _logits_and_grads(reference, batch)
    got, _ = _logits_and_grads(packed, batch)  # no bounds: transformers' SDPA with its block mask
    assert torch.equal(got, want)
    # a padded batch (generation, evaluation of padded rows) goes through transformers too
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    assert torch.equal(packed(input_ids=ids, attention_mask=mask).logits, reference(input_ids=ids, attention_mask=mask).logits)

    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=4, attn_implementation="sdpa")
    torch.manual_seed(0)
    windowed = MistralForCausalLM(config).train()
    want, _ = _logits_and_grads(windowed, batch)
    assert use_packed_attention(windowed)
    got, _ = _logits_and_grads(windowed, batch, **{BOUNDS_KWARG: batch["sample_bounds"]})
    assert torch.equal(got, want)  # a sliding window keeps transformers' mask


def test_only_sdpa_models_switch_and_saved_configs_keep_sdpa(tmp_path):
    assert not use_packed_attention(tiny_llama(VOCAB, attn_implementation="eager"))
    model = tiny_llama(VOCAB)
    assert use_packed_attention(model)
    model.save_pretrained(tmp_path)
    assert NAME not in (tmp_path / "config.json").read_text()
    assert "attn_implementation" not in json.loads((tmp_path / "config.json").read_text())
