"""Samples against the model's position limit, before any rank starts (docs/data.md, "The model's position limit")."""

import json

import pytest
import torch
from rich.console import Console
from transformers import AutoModelForCausalLM, GPT2Config

from helpers import QA, chat, save_tiny_model, tiny_chat_tokenizer, write_jsonl
from osft.trainer.launch.cli import main
from osft.trainer.config import TrainConfig
from osft.trainer.data.positions import PositionLimit, position_limit
from osft.trainer.data.validate import DataValidationError
from osft.trainer.launch.launcher import preflight

LONG = " ".join(["The capital of France is Paris."] * 60)  # about 400 tokens of the tiny tokenizer
FLAGS = ["--batch-size", "2", "--max-tokens-per-gpu", "8192", "--max-seq-len", "8192", "--max-steps", "1",
         "--no-data-cache"]


@pytest.fixture()
def long_file(tmp_path):
    return write_jsonl(tmp_path / "train.jsonl", [chat(q, a) for q, a in QA[:3]] + [chat("Repeat it.", LONG)])


def tiny_gpt2(path, positions):
    tokenizer = tiny_chat_tokenizer()
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_head=4, n_layer=2, n_positions=positions,
                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_absolute_positions_refuse_longer_samples_by_line_before_any_rank(tmp_path, long_file, capsys):
    model = tiny_gpt2(tmp_path / "gpt2", 128)
    assert position_limit(model) == PositionLimit(128, absolute=True)
    out = tmp_path / "run"
    assert main(["--model-name-or-path", str(model), "--data-path", str(long_file), "--output-dir", str(out),
                 *FLAGS]) == 2
    err = capsys.readouterr().err.replace("\n", "")
    assert "1 sample(s) longer than the model's position limit 128 (max_position_embeddings); " \
           "--max-seq-len 128 applies --overlong to them" in err
    assert f"{long_file}:4: sample has " in err and "more than the model's 128 positions" in err
    assert "IndexError" not in err and not (out / "hf_format").exists()
    # the launcher of a worker group checks it before any rank starts
    cfg = TrainConfig(str(model), str(long_file), str(tmp_path / "r2"), max_seq_len=8192, max_tokens_per_gpu=8192,
                      batch_size=2, nproc_per_node=2, data_cache=False)
    with pytest.raises(DataValidationError) as info:
        preflight(cfg, Console(file=None, quiet=True))
    assert [(p.line, p.rule) for p in info.value.problems] == [(4, "beyond_position_limit")]
    # --max-seq-len at the limit applies the overlong policy instead
    assert main(["--model-name-or-path", str(model), "--data-path", str(long_file), "--output-dir", str(out),
                 *FLAGS[:-3], "--max-seq-len", "128", "--max-steps", "1"]) == 0


def test_rotary_positions_warn_about_samples_beyond_the_limit(tmp_path, long_file, capsys):
    model = save_tiny_model(tmp_path / "llama", max_position_embeddings=128)
    assert position_limit(model) == PositionLimit(128, absolute=False)
    out = tmp_path / "run"
    assert main(["--model-name-or-path", str(model), "--data-path", str(long_file), "--output-dir", str(out),
                 *FLAGS]) == 0
    records = [json.loads(line) for line in (out / "metrics" / "node0.jsonl").read_text().splitlines()]
    (warning,) = [r["message"] for r in records if r["event"] == "warning" and "max_position_embeddings" in r["message"]]
    assert warning.startswith(f"1 sample(s) of {long_file} are longer than the model's max_position_embeddings 128")
    assert "line 4 (" in warning and warning.endswith("--max-seq-len 128 applies --overlong to them")
