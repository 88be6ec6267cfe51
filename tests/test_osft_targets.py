"""Target patterns per architecture, on tiny random models built from configs."""

import re

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    OPTConfig,
    Phi3Config,
    Qwen2Config,
)

from osft.trainer.osft.decomposition import OSFTLinear
from osft.trainer.osft.surgery import apply_osft, dense_state_dict
from osft.trainer.osft.targets import find_target_modules

COMMON = dict(vocab_size=97, num_hidden_layers=2)
LLAMA_LIKE = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, **COMMON)

CASES = {
    "llama": (LlamaConfig(**LLAMA_LIKE), ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "qwen2": (Qwen2Config(**LLAMA_LIKE), ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "mistral": (MistralConfig(**LLAMA_LIKE), ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "phi3": (Phi3Config(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=4, pad_token_id=0, **COMMON),
             ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
    "gpt2": (GPT2Config(n_embd=32, n_head=4, n_layer=2, vocab_size=97, n_positions=64),
             ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"]),
    "opt": (OPTConfig(hidden_size=32, ffn_dim=48, num_attention_heads=4, word_embed_proj_dim=32, max_position_embeddings=64, **COMMON),
            ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]),
}


def build(config):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).float().eval()


@pytest.mark.parametrize("arch", sorted(CASES))
def test_builtin_patterns_select_exactly_the_projections(arch):
    config, suffixes = CASES[arch]
    model = build(config)
    names = find_target_modules(model, config.model_type)
    assert len(names) == len(suffixes) * 2  # two layers
    for suffix in suffixes:
        assert sum(n.endswith("." + suffix) for n in names) == 2, suffix
    assert not any(re.search(r"embed|wte|wpe|lm_head|norm|ln_", n) for n in names)


@pytest.mark.parametrize("arch", sorted(CASES))
def test_osft_model_computes_the_same_function_and_exports_original_names(arch):
    config, _ = CASES[arch]
    model = build(config)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, 97, (2, 12))
    with torch.no_grad():
        before = model(ids).logits
    osft = apply_osft(model, config.model_type, urr=0.25, tokens_per_micro_batch=64)
    with torch.no_grad():
        after = model(ids).logits
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    # Only the low-rank factors, biases and the non-target parameters train.
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert not any(n.endswith(("W_high", "U_basis", "V_basis")) for n in trainable)
    assert any("embed" in n or "wte" in n for n in trainable)
    assert all(isinstance(m, OSFTLinear) for m in osft.osft_modules)
    exported = dense_state_dict(model.state_dict(), osft)
    assert set(exported) == set(original)
    for key, value in original.items():
        torch.testing.assert_close(exported[key], value, rtol=0, atol=5e-6, msg=key)


def test_user_patterns_override_and_bad_patterns_are_clear():
    config, _ = CASES["llama"]
    model = build(config)
    names = find_target_modules(model, "llama", [r"mlp\.down_proj$"])
    assert names == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    with pytest.raises(ValueError, match="matched no linear module"):
        find_target_modules(model, "llama", [r"nothing_like_this"])
    with pytest.raises(ValueError, match="invalid regular expression"):
        find_target_modules(model, "llama", [r"(unclosed"])
    with pytest.raises(ValueError, match="no built-in target patterns for model_type 'mamba'"):
        find_target_modules(model, "mamba")
