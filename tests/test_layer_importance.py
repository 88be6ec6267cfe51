"""Layer importance and the per-block OSFT ranks of ``--osft-rank-schedule importance``, on tiny
random Llamas built here (trainer/osft/layer_importance.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_llama
from osft.trainer.data.collate import collate_packed
from osft.trainer.osft.layer_importance import (
    block_similarities,
    calibration_batches,
    frozen_ratios,
    importance_rank_plan,
)
from osft.trainer.osft.targets import decoder_block_names, find_target_modules

VOCAB = 50


def samples(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(3, VOCAB, (n,), generator=gen).tolist(), "labels": [-100] * n} for n in lengths]


def test_identity_block_gets_the_largest_frozen_ratio_and_the_map_is_linear():
    model = tiny_llama(VOCAB, num_hidden_layers=3)
    with torch.no_grad():  # block 1 becomes the identity: its residual branches add exactly zero
        model.model.layers[1].self_attn.o_proj.weight.zero_()
        model.model.layers[1].mlp.down_proj.weight.zero_()
    model.train()
    targets = find_target_modules(model, "llama")
    batch = collate_packed(samples([7, 12, 5]))
    plan = importance_rank_plan(model, [batch], targets, min_ratio=0.3, max_ratio=0.8)

    assert model.training  # restored after the eval-mode calibration pass
    assert plan.blocks == ["model.layers.0", "model.layers.1", "model.layers.2"]
    assert plan.tokens == 24
    assert plan.similarity[1] == pytest.approx(1.0, abs=1e-6)
    assert max(plan.similarity[0], plan.similarity[2]) < 0.999
    assert plan.frozen[1] == pytest.approx(0.8)
    assert min(plan.frozen) == pytest.approx(0.3)
    s, lo = np.array(plan.similarity), 0.3
    expected = lo + (s - s.min()) / (s.max() - s.min()) * (0.8 - lo)
    np.testing.assert_allclose(plan.frozen, expected, rtol=1e-12)
    np.testing.assert_allclose(plan.urr, 1 - expected, rtol=1e-12)
    # every target sits in a block and gets that block's URR
    assert set(plan.urr_by_module) == set(targets)
    assert plan.urr_by_module["model.layers.1.mlp.up_proj"] == pytest.approx(0.2)
    assert plan.urr_by_module["model.layers.0.self_attn.q_proj"] == plan.urr[0]


def test_similarity_is_the_token_mean_of_cosines_between_block_input_and_output():
    model = tiny_llama(VOCAB, num_hidden_layers=2)
    ids = torch.tensor([samples([9])[0]["input_ids"]])
    with torch.no_grad():
        hidden = model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
    sim, tokens = block_similarities(model, [{"input_ids": ids}])
    # hidden_states[0] is block 0's input and hidden_states[1] its output (the last entry is normed)
    assert tokens == 9
    assert sim[0] == pytest.approx(float(F.cosine_similarity(hidden[0], hidden[1], dim=-1).mean()), abs=1e-6)


def test_padding_is_masked_out():
    model = tiny_llama(VOCAB, num_hidden_layers=2)
    rows = samples([4, 11], seed=1)
    packed, _ = block_similarities(model, [collate_packed(rows)])  # packed row: every token is real
    ids = torch.zeros(2, 11, dtype=torch.long)
    mask = torch.zeros(2, 11, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r["input_ids"])] = torch.tensor(r["input_ids"])
        mask[i, : len(r["input_ids"])] = 1
    padded, tokens = block_similarities(model, [{"input_ids": ids, "attention_mask": mask}])
    assert tokens == 15
    np.testing.assert_allclose(padded, packed, atol=1e-5)
    # the padded positions would change the mean if they were counted
    counted, _ = block_similarities(model, [{"input_ids": ids, "attention_mask": torch.ones_like(mask)}])
    assert max(abs(a - b) for a, b in zip(counted, packed)) > 1e-4


def test_frozen_ratios_normalise_and_map_linearly():
    assert frozen_ratios([0.2, 0.6, 1.0], 0.5, 0.9) == pytest.approx([0.5, 0.7, 0.9])
    assert frozen_ratios([-0.5, 0.5], 0.0, 0.5) == pytest.approx([0.0, 0.5])
    assert frozen_ratios([0.7, 0.7, 0.7], 0.5, 0.9) == pytest.approx([0.7, 0.7, 0.7])  # no ranking: midpoint
    assert frozen_ratios([0.3], 0.6, 0.6) == pytest.approx([0.6])
    for lo, hi in [(0.6, 0.5), (-0.1, 0.5), (0.5, 1.0)]:
        with pytest.raises(ValueError, match="0 <= min <= max < 1"):
            frozen_ratios([0.1, 0.2], lo, hi)


def test_calibration_batches_pack_the_first_samples():
    rows = samples([30, 10, 25, 40, 5, 60])
    lengths = np.array([len(r["input_ids"]) for r in rows])
    batches = list(calibration_batches(rows, lengths, num_samples=4, max_tokens_per_micro_batch=48))
    assert sum(b["num_samples"] for b in batches) == 4
    assert sum(b["num_tokens"] for b in batches) == 105  # samples 0-3 only
    assert all(b["num_tokens"] <= 48 for b in batches)
    firsts = sorted(tuple(r["input_ids"][:3]) for r in rows[:4])
    starts = sorted(tuple(b["input_ids"][0, p : p + 3].tolist()) for b in batches
                    for p in torch.nonzero(b["position_ids"][0] == 0).flatten().tolist())
    assert starts == firsts
    assert sum(b["num_tokens"] for b in calibration_batches(rows, lengths, 100, 64)) == int(lengths.sum())


def test_model_without_block_classes_is_refused():
    model = tiny_llama(VOCAB)
    model._no_split_modules = []
    with pytest.raises(ValueError, match="decoder blocks of LlamaForCausalLM"):
        decoder_block_names(model)


def test_targets_outside_the_blocks_keep_the_global_urr():
    model = tiny_llama(VOCAB)
    targets = find_target_modules(model, "llama", [r"q_proj$", r"lm_head$"])
    plan = importance_rank_plan(model, [collate_packed(samples([6]))], targets, 0.5, 0.9)
    assert "lm_head" in targets and "lm_head" not in plan.urr_by_module
    assert sorted(plan.urr_by_module) == ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"]
    assert plan.block_of("model.layers.1.self_attn.q_proj") == 1 and plan.block_of("lm_head") is None
