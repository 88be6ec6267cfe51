"""`--freeze-non-target`: only the OSFT targets train (one rank in-process, two ranks with FSDP2),
full-state checkpoints and bit-exact resume keep working."""

import json

import pytest
import torch
from helpers import QA, chat, dense_forgetting, save_tiny_model, write_jsonl
from safetensors.torch import load_file

from osft.trainer.launch.cli import main
from osft.trainer.osft.indicators import INDICATOR_FIELDS

#: Target projections of the tiny Llama (its default OSFT targets).
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("freeze") / "train.jsonl", [chat(q, a) for q, a in QA] * 4)


def run(model, data, out, *flags):
    return main(["--model-name-or-path", str(model), "--data-path", str(data), "--output-dir", str(out),
                 "--batch-size", "5", "--max-tokens-per-gpu", "96", "--max-seq-len", "64", "--learning-rate", "5e-3",
                 "--weight-decay", "0.1", "--save-dtype", "float32", "--freeze-non-target", *flags])


def steps(out):
    lines = (out / "metrics" / "node0.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if r["event"] == "step"}


def assert_only_targets_changed(model_dir, export_dir):
    before = load_file(model_dir / "model.safetensors")
    after = load_file(export_dir / "model.safetensors")
    assert set(after) == set(before)
    targets = [k for k in before if k.rsplit(".", 2)[-2] in TARGETS]
    others = [k for k in before if k not in targets]
    assert "model.embed_tokens.weight" in others and "model.norm.weight" in others
    for key in others:
        assert torch.equal(after[key], before[key]), key
    for key in targets:
        assert not torch.equal(after[key], before[key]), key


def test_freeze_trains_only_targets_and_resumes_bit_identically(tiny_model_dir, data, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OSFT_TEST_STATE_HASH", "1")
    ref = tmp_path / "ref"
    assert run(tiny_model_dir, data, ref, "--max-steps", "4", "--checkpoint-every-steps", "2") == 0
    assert_only_targets_changed(tiny_model_dir, ref / "hf_format" / "step_4")
    line = next(x for x in capsys.readouterr().err.splitlines() if x.startswith("parameters:"))
    trainable, total = (int(x.replace(",", "")) for x in line.split()[1:5:3])
    assert 0 < trainable < 0.5 * total, line
    # the total is the dense model's size, not the factors and bases OSFT stores
    assert total == sum(t.numel() for t in load_file(tiny_model_dir / "model.safetensors").values()), line

    resumed = tmp_path / "resumed"
    checkpoint = ref / "full_state_checkpoints" / "step_2"
    assert run(tiny_model_dir, data, resumed, "--max-steps", "4", "--resume-from-full-state-checkpoint", str(checkpoint)) == 0
    want, got = steps(ref), steps(resumed)
    assert sorted(got) == [3, 4]
    for step in (3, 4):
        assert (got[step]["loss"], got[step]["state_sha256"]) == (want[step]["loss"], want[step]["state_sha256"])
    a, b = load_file(ref / "hf_format" / "step_4" / "model.safetensors"), load_file(resumed / "hf_format" / "step_4" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_optimizer_gets_only_the_targets_trainable_factors(tiny_model_dir, data, tmp_path):
    from osft.trainer.config import TrainConfig
    from osft.trainer.run.loop import Trainer

    cfg = TrainConfig(str(tiny_model_dir), str(data), str(tmp_path / "r"), max_seq_len=64, max_tokens_per_gpu=96,
                      freeze_non_target=True, max_steps=1)
    trainer = Trainer(cfg)
    trainer.prepare()
    optimized = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    names = {n for n, p in trainer.model.named_parameters() if id(p) in optimized}
    assert names == {f"{name}.{k}" for name, _ in trainer.osft.modules for k in ("U_low", "S_low", "V_low")}
    assert all(p.requires_grad == (id(p) in optimized) for p in trainer.model.parameters())


@pytest.mark.torchrun
def test_freeze_on_two_ranks_with_tied_embeddings(data, tmp_path):
    """Also the forgetting indicators on FSDP2 shards: only on the checked steps, equal to the export's."""
    model = save_tiny_model(tmp_path / "tied", hidden_size=64, intermediate_size=128, tie_word_embeddings=True)
    out = tmp_path / "run"
    assert run(model, data, out, "--max-steps", "3", "--nproc-per-node", "2", "--ortho-check-every", "3") == 0
    records = steps(out)
    assert [r["world_size"] for r in records.values()] == [2, 2, 2]
    assert "lm_head.weight" not in load_file(model / "model.safetensors")  # tied: one tensor, frozen
    assert_only_targets_changed(model, out / "hf_format" / "step_3")
    # step 2, between the full checks of steps 1 and 3: no indicators, and the deviation bound on FSDP2
    # shards ruled out a violation without the full check
    assert all(records[2][k] is None for k in INDICATOR_FIELDS) and records[2]["ortho_max_dev_deg"] is None
    assert records[1]["osft_dw_rel_max"] is not None
    dense = dense_forgetting(model, out / "hf_format" / "step_3", 0.25, TARGETS)
    worst = max(dense, key=lambda name: dense[name][0])
    assert records[3]["osft_dw_rel_worst_module"] == worst
    assert records[3]["osft_dw_rel_max"] == pytest.approx(dense[worst][0], rel=1e-4)
    assert records[3]["osft_gap_max"] == pytest.approx(max(g for _, g in dense.values()), rel=1e-4)


def test_freeze_with_no_osft_is_an_input_error(tiny_model_dir, data, tmp_path, capsys):
    assert run(tiny_model_dir, data, tmp_path / "r", "--no-osft") == 2
    err = capsys.readouterr().err
    assert "--freeze-non-target with --no-osft would leave nothing to train" in err
    assert not (tmp_path / "r" / "metrics").exists()
