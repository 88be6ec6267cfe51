"""The tested model matrix (tests/test_model_matrix.py): one tiny random configuration per architecture the
README lists, with the OSFT targets expected in each decoder block. Shared by
``test_model_matrix.py`` (one rank, in-process) and ``dist/model_matrix_run.py`` (two ranks)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

_LLAMA_TARGETS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_MOE_TARGETS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj")

#: Keys every Llama-like and MoE configuration reads (each reads those it knows): 2 layers, hidden
#: 32, 4 heads of 8, 2 KV heads; MoE: 4 experts, 2 per token.
TINY = dict(hidden_size=32, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts=4, num_experts_per_tok=2,
            max_position_embeddings=128)

#: model_type -> (config keys, the OSFT targets of each decoder block, relative to the block).
MATRIX: dict[str, tuple[dict, tuple[str, ...]]] = {
    **{t: (TINY, _LLAMA_TARGETS) for t in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text",
                                           "granite", "olmo2")},
    "phi3": (TINY, ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")),
    "gpt2": (dict(n_embd=32, n_head=4, n_layer=2, n_positions=128), ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")),
    "opt": (dict(hidden_size=32, ffn_dim=48, num_attention_heads=4, word_embed_proj_dim=32, num_hidden_layers=2,
                 max_position_embeddings=128),
            ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj", "fc1", "fc2")),
    **{t: (TINY, _MOE_TARGETS) for t in ("mixtral", "qwen3_moe", "gpt_oss")},
}

#: The two-rank subset (``test_model_matrix.py``'s torchrun test): one of each target layout
#: (Llama-style, fused qkv/gate_up, GPT-2 Conv1D, OPT) and every MoE model.
TWO_RANK_SUBSET = ("qwen3", "phi3", "gpt2", "opt", "mixtral", "qwen3_moe", "gpt_oss")


def block_targets(model_type: str, names: list[str]) -> list[list[str]]:
    """``names`` (full module or bank names) per decoder block 0 and 1, relative to the block."""
    prefixes = ("transformer.h.{}.", "model.decoder.layers.{}.", "model.layers.{}.")
    out = []
    for layer in (0, 1):
        block = [p.format(layer) for p in prefixes]
        out.append(sorted(n.removeprefix(next(b for b in block if n.startswith(b))) for n in names
                          if any(n.startswith(b) for b in block)))
    return out


def random_model(config) -> AutoModelForCausalLM:
    """A tiny random model of ``config`` (float32, seed 0, weights N(0, 0.1) so every target has a
    full spectrum), in eval mode."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).float()
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.1)
    return model.eval()


def save_model(model_type: str, path: Path) -> tuple[Path, AutoModelForCausalLM]:
    """Save a tiny :func:`random_model` of ``model_type`` with the tests' tiny chat tokenizer (its eos/pad ids in the configs) as an
    HF model directory; returns the directory and the model."""
    from helpers import tiny_chat_tokenizer

    tokenizer = tiny_chat_tokenizer()
    keys, _ = MATRIX[model_type]
    ids = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
               bos_token_id=tokenizer.eos_token_id)
    model = random_model(AutoConfig.for_model(model_type, vocab_size=len(tokenizer), **keys, **ids))
    for key, value in ids.items():
        setattr(model.generation_config, key, value)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return Path(path), model
