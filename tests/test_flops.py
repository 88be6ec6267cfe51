"""Model FLOPs (PaLM appendix B) and MFU: the parameter count, the formula, the per-node split."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_llama
from osft.trainer.observe.flops import FlopModel, Utilization, flop_model, mfu
from osft.trainer.observe.matmul_peak import measure_matmul_peak


@pytest.mark.parametrize("tied", [False, True])
def test_matmul_params_count_every_linear_and_the_head_tied_or_not(tied):
    h, inter, layers, heads, kv, vocab = 32, 64, 2, 4, 2, 100
    config = tiny_llama(vocab, tie_word_embeddings=tied).config
    head_dim = h // heads
    per_layer = h * h * 2 + 2 * h * kv * head_dim + 3 * h * inter  # q, o; k, v; gate, up, down
    fm = flop_model(config)
    assert fm.matmul_params == layers * per_layer + vocab * h
    assert fm.attention_width == layers * heads * head_dim
    assert flop_model(config, vocab_size=vocab + 28).matmul_params == fm.matmul_params + 28 * h


def test_step_flops_use_each_samples_own_length():
    fm = FlopModel(matmul_params=1000, attention_width=10)
    assert fm.step_flops([3, 5]) == 6 * 1000 * 8 + 12 * 10 * (9 + 25)
    assert fm.step_flops([8]) > fm.step_flops([3, 5])  # one packed row of 8 would count more attention


def test_utilization_splits_job_and_node():
    util = Utilization(FlopModel(100, 0), peaks=(1e3, 1e3, 2e3), node_of_rank=(0, 0, 1), node_rank=1)
    fields = util.fields([[1], [1], [2]], seconds=2.0)
    assert fields["model_flops"] == 6 * 100 * 4
    assert fields["mfu"] == pytest.approx(2400 / 2 / 4e3)
    assert fields["node_mfu"] == pytest.approx(1200 / 2 / 2e3)
    assert mfu(1.0, 0.0, 1.0) is None and mfu(1.0, 1.0, 0.0) is None
    assert not util.peak_exceeded


def test_a_step_faster_than_a_disturbed_peak_measurement_caps_mfu_at_one():
    util = Utilization(FlopModel(100, 0), peaks=(1e3, 1e3), node_of_rank=(0, 0), node_rank=0)
    fast = util.fields([[4], [4]], seconds=2.0)  # 4800 FLOPs in 2 s = 2400 FLOP/s > the measured 2000
    assert fast["flops_per_s"] == 2400 and fast["mfu"] == 1.0 and fast["node_mfu"] == 1.0 and util.peak_exceeded
    slower = util.fields([[4], [4]], seconds=4.0)  # then measured against the fastest step
    assert slower["mfu"] == pytest.approx(0.5) and slower["node_mfu"] == pytest.approx(0.5)


def test_matmul_peak_is_a_positive_rate():
    peak = measure_matmul_peak(torch.device("cpu"), torch.float32, repeats=1, side=128)
    assert 1e6 < peak < 1e15
