"""``--osft-rank-schedule importance`` end to end: a real `osft-train` run of 2 gloo ranks on a tiny
3-block Llama (rank 0 scores the blocks, every rank builds the same plan), a stop with a full-state
checkpoint and a resume."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from helpers import QA, chat, save_tiny_model, write_jsonl
from osft.trainer.exit_codes import EXIT_STOPPED


def records(out, event):
    lines = (out / "metrics" / "node0.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == event]


def train(model, data, out, *flags, env=None):
    cmd = [sys.executable, "-m", "osft.trainer.launch.cli", "--model-name-or-path", str(model), "--data-path", str(data),
           "--output-dir", str(out), "--batch-size", "5", "--max-tokens-per-gpu", "64", "--max-seq-len", "64",
           "--max-steps", "4", "--nproc-per-node", "2", "--on-demand-checkpointing", "--save-dtype", "float32",
           "--osft-rank-schedule", "importance", "--osft-importance-samples", "12",
           "--osft-min-frozen-ratio", "0.25", "--osft-max-frozen-ratio", "0.75", *flags]
    proc = subprocess.run(cmd, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.torchrun
def test_importance_plan_differs_per_block_and_the_resume_rebuilds_its_layout(tmp_path):
    model = save_tiny_model(tmp_path / "model", hidden_size=64, intermediate_size=128, num_hidden_layers=3)
    data = write_jsonl(tmp_path / "train.jsonl", [chat(q, a) for q, a in QA] * 4)
    out = tmp_path / "run"

    code, output = train(model, data, out, env={"OSFT_TEST_SIGNAL_AT": "2:after_step:0:SIGTERM"})
    assert code == EXIT_STOPPED, output
    assert "OSFT rank plan" in output and "model.layers.2" in output
    [plan] = records(out, "osft_rank_plan")
    assert plan["blocks"] == ["model.layers.0", "model.layers.1", "model.layers.2"]
    low, mid, high = sorted(plan["frozen"])
    assert (low, high) == (0.25, 0.75) and low < mid < high
    assert 0 < plan["tokens"] <= 12 * 64
    k_high = plan["k_high_by_module"]
    q = [k_high[f"model.layers.{i}.self_attn.q_proj"] for i in range(3)]
    assert len(set(q)) == 3, q  # one 64×64 shape at three different frozen fractions
    for name, k in k_high.items():
        block = int(name.split(".")[2])
        rank = 32 if name.endswith(("k_proj", "v_proj")) else 64  # 2 of 4 heads for k and v
        assert plan["urr_by_module"][name] == 1 - plan["frozen"][block]
        assert k == min(rank - 1, math.floor(rank * plan["frozen"][block] + 1e-9)), name

    saved = json.loads((out / "full_state_checkpoints" / "step_2" / "trainer_state.json").read_text())
    assert {name: p["k_high"] for name, p in saved["osft_plan"].items()} == k_high

    code, output = train(model, data, out, "--resume")
    assert code == 0, output
    assert [r["from_step"] for r in records(out, "resumed")] == [2]
    assert len(records(out, "osft_rank_plan")) == 1  # the resume rebuilds the stored layout, no new plan
    assert "modules loaded from" in output and "OSFT rank plan" not in output
