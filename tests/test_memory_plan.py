"""``osft-train estimate-memory``: the estimator's arithmetic on a model small enough to count by
hand, and its estimate against one real CPU run."""

import json
from dataclasses import asdict

import pytest
from transformers import LlamaConfig

from osft.trainer.config import TrainConfig
from osft.trainer.launch.cli import main
from osft.trainer.tools.memory_plan import CPU_RUNTIME_BYTES, MemoryPlan, estimate


@pytest.fixture
def model_dir(tmp_path):
    """H 8, I 16, one layer, 2 heads of 4 (one KV head: kv width 4), vocabulary 32, tied embeddings.
    Parameters: embeddings 256, q 64, k 32, v 32, o 64, gate/up/down 128 each, norms 3 × 8: 856."""
    LlamaConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                vocab_size=32, tie_word_embeddings=True).save_pretrained(tmp_path)
    return str(tmp_path)


def test_full_fine_tuning_counts_every_parameter_three_float32_states_and_the_activations(model_dir):
    plan = estimate(model_dir, osft=False, tokens_per_gpu=10, device="cuda", dtype="float32")
    per_token = 7 * 8 + 2 * 4 + 4 * 16  # values a layer keeps per token for backward
    assert plan == MemoryPlan(trainable=4 * 856, frozen=0, gradients=4 * 856, adamw=8 * 856, gathered=0, v_cache=0,
                              activations=per_token * 10 * 4, logits=2 * 4 * 10 * 32, runtime=0,
                              export_weights=2 * 856)  # the export: a bfloat16 copy of the weights
    assert plan.phase == "training" and plan.total == plan.training == 16 * 856 + per_token * 10 * 4 + 2 * 4 * 10 * 32
    ckpt = estimate(model_dir, osft=False, tokens_per_gpu=10, device="cuda", dtype="bfloat16", activation_checkpointing=True)
    assert ckpt.activations == (1 * 8 + per_token) * 10 * 2


def test_osft_splits_a_target_into_trainable_factors_and_a_frozen_store_sharded_over_the_ranks(model_dir):
    """q_proj (8×8) at URR 0.25: k_high 6, k_low 2, both sides in keep mode (the 2 low vectors are the
    bases). Trainable: 856 − 64 + 2·(8 + 8 + 1) = 826. Frozen: W_high 64, bases 8·2 + 2·8, start
    copies 34 = 130. Two ranks: sharded by 2, the cached V basis (2×8) whole, two gathered blocks."""
    plan = estimate(model_dir, world_size=2, tokens_per_gpu=10, device="cpu", target_patterns=[r".*q_proj"])
    assert (plan.trainable, plan.frozen, plan.gradients, plan.adamw) == (4 * 826 // 2, 4 * 130 // 2, 4 * 826 // 2,
                                                                        8 * 826 // 2)
    assert (plan.v_cache, plan.gathered, plan.runtime) == (4 * 16, 2 * 592 * 4, CPU_RUNTIME_BYTES)
    assert plan.loaded == 4 * 856  # each CPU rank loaded the whole model before sharding
    assert plan.activations == (7 * 8 + 2 * 4 + 4 * 16) * 10 * 4 + 64 * 4  # the dense form's rebuilt q_proj weight
    # protected ranks p_L = p_R = 2: R 6, k_high 4, k_low 2; frozen adds P (8×2) and Q (8×2)
    protected = estimate(model_dir, world_size=1, tokens_per_gpu=10, device="cuda", target_patterns=[r".*q_proj"],
                         protected={"model.layers.0.self_attn.q_proj": (2, 2)})
    assert protected.frozen == 4 * (64 + 16 + 16 + 16 + 16 + 34) and protected.v_cache == 0


def test_the_export_of_an_osft_run_gathers_the_model_holds_input_grams_and_builds_dense_weights(model_dir):
    """Two ranks: rank 0 gathers the whole model (826 trainable + 130 frozen values), every rank
    holds q_proj's input Gram (8×8 float64), rank 0 builds the dense weights (856 float32) and their
    bfloat16 copy; the peak is the larger of the two phases."""
    plan = estimate(model_dir, world_size=2, tokens_per_gpu=1, device="cpu", target_patterns=[r".*q_proj"])
    assert (plan.export_state, plan.input_grams, plan.export_weights) == (4 * (826 + 130), 8 * 8 * 8, 6 * 856)
    assert plan.export == plan.resident + 4 * 956 + 512 + 6 * 856 > plan.training
    assert plan.total == plan.export and plan.phase == "export"
    update = estimate(model_dir, world_size=1, tokens_per_gpu=1, device="cpu", target_patterns=[r".*q_proj"],
                      protect_basis="update")
    assert (update.export_state, update.input_grams) == (0, 0)  # one rank exports its own tensors; no Grams
    assert estimate(model_dir, tokens_per_gpu=1, target_patterns=[r".*q_proj"], input_memory_gb=1e-7).input_grams == 0


def test_the_command_prints_the_parts_and_a_one_line_verdict(model_dir, capsys):
    assert main(["estimate-memory", model_dir, "--device", "cpu", "--device-memory-gb", "0.1"]) == 0
    err = capsys.readouterr().err
    assert "adamw" in err and "does not fit: peak per rank ≈ 0.54 GiB (training)" in err  # the CPU runtime alone
    assert main(["estimate-memory", model_dir, "--device", "cuda", "--device-memory-gb", "80"]) == 0
    assert "fits: peak per rank ≈ 0.00 GiB (training) of 74.5 GiB (0%)" in capsys.readouterr().err


def test_the_training_flags_default_as_a_training_run_does(model_dir, capsys):
    """The flags shared with ``osft-train`` come from its declarations: an estimate with none given is
    the estimate of a run with the training defaults (its micro-batch budget, OSFT on, URR 0.25)."""
    assert main(["estimate-memory", model_dir, "--device", "cuda", "--json"]) == 0
    plan = json.loads(capsys.readouterr().err)  # the console is stderr's
    expected = estimate(model_dir, tokens_per_gpu=TrainConfig.max_tokens_per_gpu, device="cuda", dtype="bfloat16")
    assert {k: plan[k] for k in asdict(expected)} == asdict(expected)
    assert main(["estimate-memory", model_dir, "--device", "cuda", "--json", "--no-osft"]) == 0
    assert json.loads(capsys.readouterr().err)["frozen"] == 0


@pytest.mark.torchrun
def test_the_estimate_is_within_15_percent_of_a_real_cpu_run(tiny_model_dir, tmp_path):
    """A real two-step OSFT run of the tiny model on one CPU rank (its own process): the largest RSS
    its step records report is within 15 % of the estimate of the training phase (the whole-run
    peaks of SmolLM2 on 1 and 2 ranks: benchmarks/bench_memory_plan.py)."""
    import json
    import subprocess
    import sys

    from helpers import QA, chat, write_jsonl

    data = write_jsonl(tmp_path / "d.jsonl", [chat(q, a) for q, a in QA] * 4)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "osft.trainer.launch.cli", "--model-name-or-path", str(tiny_model_dir),
           "--data-path", str(data), "--output-dir", str(out), "--max-steps", "2", "--batch-size", "4",
           "--max-seq-len", "128", "--max-tokens-per-gpu", "256", "--device", "cpu", "--no-data-cache"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics" / "node0.jsonl").read_text().splitlines()]
    measured = max(r["rss_bytes"] for r in records if r["event"] == "step")
    plan = estimate(str(tiny_model_dir), dtype="float32", tokens_per_gpu=256, device="cpu")
    assert abs(plan.training - measured) <= 0.15 * measured, (plan.training, measured)
