"""User target patterns and the warning about weights outside OSFT; the built-in patterns of every
architecture are checked in test_model_matrix.py."""

import json
import re

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from osft.trainer.osft.targets import find_target_modules


def build_llama():
    """A tiny random Llama (2 layers, hidden 32)."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, num_hidden_layers=2, hidden_size=32, intermediate_size=48,
                         num_attention_heads=4, num_key_value_heads=2)
    return AutoModelForCausalLM.from_config(config).float().eval()


def test_user_patterns_override_and_bad_patterns_are_clear():
    model = build_llama()
    names = find_target_modules(model, "llama", [r"mlp\.down_proj$"])
    assert names == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    with pytest.raises(ValueError, match="matched no linear module"):
        find_target_modules(model, "llama", [r"nothing_like_this"])
    with pytest.raises(ValueError, match="invalid regular expression"):
        find_target_modules(model, "llama", [r"(unclosed"])
    with pytest.raises(ValueError, match="no built-in target patterns for model_type 'mamba'"):
        find_target_modules(model, "mamba")


def test_weights_outside_osft_inside_the_blocks_are_warned_before_training(tmp_path, capsys):
    """Kind 12: with target patterns that leave Mixtral's experts (fused 3-D parameters on
    transformers 5) out, they train without OSFT; a run warns about each of them before step 1 (not
    about the router, a normal parameter by design), and says once what trains by design. With the
    built-in patterns the experts are OSFT banks (tests/test_osft_experts.py) and nothing is listed."""
    from transformers import MixtralConfig

    from helpers import QA, chat, tiny_chat_tokenizer, write_jsonl
    from osft.trainer.launch.cli import main

    tokenizer = tiny_chat_tokenizer()
    config = MixtralConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=128, eos_token_id=tokenizer.eos_token_id,
                           pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
    free = {n: list(p.shape) for n, p in model.named_parameters()
            if p.dim() >= 2 and ".layers." in n and not re.search(r"\.(q|k|v|o)_proj\.|mlp\.gate\.", n)}
    assert len(free) == 4  # per layer: the experts' two fused weights
    model.save_pretrained(tmp_path / "mixtral")
    tokenizer.save_pretrained(tmp_path / "mixtral")
    data = write_jsonl(tmp_path / "train.jsonl", [chat(q, a) for q, a in QA[:4]])
    out = tmp_path / "run"
    assert main(["--model-name-or-path", str(tmp_path / "mixtral"), "--data-path", str(data), "--output-dir", str(out),
                 "--batch-size", "2", "--max-tokens-per-gpu", "128", "--max-seq-len", "64", "--max-steps", "1",
                 "--osft-target-patterns", r"\.(q|k|v|o)_proj$"]) == 0
    text = "".join(capsys.readouterr()).replace("\n", "")
    records = [json.loads(line) for line in (out / "metrics" / "node0.jsonl").read_text().splitlines()]
    (warning,) = [r["message"] for r in records if r["event"] == "warning" and "OSFT's constraint" in r["message"]]
    assert warning.startswith("4 weights inside the decoder blocks train without OSFT's constraint")
    for name, shape in free.items():
        grouped = re.sub(r"layers\.\d+\.", "layers.*.", name)
        assert f"{grouped} {shape} in 2 blocks" in warning
    assert not any(word in warning for word in ("norm", "embed", "lm_head", "q_proj", "mlp.gate."))
    assert text.count("trained normally by design (not under OSFT)") == 1
    first_step = next(i for i, r in enumerate(records) if r["event"] == "step")
    assert records.index(next(r for r in records if r.get("message") == warning)) < first_step

    # a Llama's blocks hold only targets and norms: no warning, the note only
    llama = tmp_path / "llama"
    from helpers import save_tiny_model
    save_tiny_model(llama)
    assert main(["--model-name-or-path", str(llama), "--data-path", str(data), "--output-dir", str(tmp_path / "r2"),
                 "--batch-size", "2", "--max-tokens-per-gpu", "128", "--max-seq-len", "64", "--max-steps", "1"]) == 0
    out2 = "".join(capsys.readouterr()).replace("\n", "")
    assert "OSFT's constraint" not in out2 and out2.count("trained normally by design") == 1
