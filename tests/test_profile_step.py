"""benchmarks/profile_step.py's accounting: a real ``torch.profiler`` trace of a linear layer, its
loss and an AdamW step, split into the categories the profile reports."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
pytest.importorskip("peft")  # bench_step's PEFT runner is imported with it

from profile_step import category, summarize  # noqa: E402


def test_a_profiled_step_is_split_into_matmul_loss_and_optimizer():
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 10)
    optimizer = torch.optim.AdamW(layer.parameters())
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            F.cross_entropy(layer(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    summary = summarize(prof.events(), steps=2, top=50)
    cats = summary["categories"]
    assert {"matmul", "loss", "optimizer"} <= set(cats)
    assert sum(c["share"] for c in cats.values()) == pytest.approx(1.0)
    assert sum(c["ms_per_step"] for c in cats.values()) == pytest.approx(summary["aten_self_cpu_ms_per_step"])
    ops = {op["op"]: op for op in summary["top_ops"]}
    assert ops["aten::addmm"]["category"] == "matmul" and ops["aten::addmm"]["calls_per_step"] == 1
    assert ops["aten::addcdiv_"]["category"] == "optimizer"  # inside Optimizer.step, though elementwise
    assert ops["aten::mm"]["category"] == "matmul"  # the weight gradient of the backward


def test_op_names_map_to_categories():
    assert category("aten::_scaled_dot_product_flash_attention_for_cpu_backward", False) == "attention"
    assert category("aten::_log_softmax_backward_data", False) == "loss"
    assert category("aten::mul", True) == "optimizer"
    assert category("aten::mul", False) == "elementwise"
    assert category("aten::copy_", False) == "copies"
    assert category("aten::mm", True) == "matmul"
