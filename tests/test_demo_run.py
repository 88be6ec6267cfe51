"""The real demo job on SmolLM2-135M-Instruct and chit-chat: a short OSFT run whose export reloads
and answers a chat prompt."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from osft.trainer.cli import main

pytestmark = pytest.mark.demo


def test_demo_osft_run_exports_a_model_that_chats(demo_assets, tmp_path, capsys):
    out = tmp_path / "demo"
    demo_dir = demo_assets.model_dir.parent
    code = main(["demo", "--dir", str(demo_dir), "--output-dir", str(out), "--max-steps", "2", "--batch-size", "2", "--max-seq-len", "256"])
    assert code == 0
    records = [json.loads(line) for line in (out / "metrics" / "node0.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["event"] == "step"]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(0.5 < r["loss"] < 10 and r["ortho_violations"] == 0 for r in steps)
    assert all(r["ortho_max_dev_deg"] < 0.01 for r in steps)
    report = json.loads((out / "data_report.json").read_text())
    assert report["kept"] > 10000 and report["kept"] + len(report["dropped_overlong"]) == report["rows"]

    export = out / "hf_format" / "step_2"
    tokenizer = AutoTokenizer.from_pretrained(export)
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    assert model.config.model_type == "llama" and model.dtype == torch.float32
    assert json.loads((export / "config.json").read_text())["dtype"] == "bfloat16"  # --save-dtype default
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True,
        return_tensors="pt", return_dict=True,
    )
    reply = model.generate(**prompt, max_new_tokens=12, do_sample=False)[0, prompt["input_ids"].shape[1]:]
    text = tokenizer.decode(reply, skip_special_tokens=True)
    assert "Paris" in text
    assert "fine-tuned model:" in capsys.readouterr().err


def test_demo_model_on_two_ranks_matches_one_rank(demo_assets, tmp_path):
    """The issue's bar for distributed training: SmolLM2 with --nproc-per-node 2 on CPU gives the
    losses of one rank."""
    base = ["--model-name-or-path", str(demo_assets.model_dir), "--data-path", str(demo_assets.train_path),
            "--max-steps", "2", "--batch-size", "4", "--max-seq-len", "128", "--max-tokens-per-gpu", "512",
            "--learning-rate", "1e-4"]
    assert main([*base, "--output-dir", str(tmp_path / "one")]) == 0
    assert main([*base, "--output-dir", str(tmp_path / "two"), "--nproc-per-node", "2"]) == 0
    losses = {}
    for name in ("one", "two"):
        records = [json.loads(line) for line in (tmp_path / name / "metrics" / "node0.jsonl").read_text().splitlines()]
        losses[name] = [(r["loss"], r["num_tokens"]) for r in records if r["event"] == "step"]
    assert len(losses["two"]) == 2
    for (a, ta), (b, tb) in zip(losses["one"], losses["two"]):
        assert tb == ta and b == pytest.approx(a, rel=1e-5)
