"""Shared test helpers: a tiny chat tokenizer and a tiny random Llama, both built in code.

Nothing here touches the network or the model hub, so every test runs offline.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# ChatML without a default system message: `<|im_start|>role\ncontent<|im_end|>\n` per message,
# and `<|im_start|>assistant\n` as the generation prompt.
PLAIN_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# The same in the style of SmolLM2-Instruct: a default system message when the conversation has none.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# ChatML with a reasoning block in the style of Qwen3: an assistant turn after the last user turn
# opens with `<think>\n{reasoning_content}\n</think>\n\n` (empty when the message has none); earlier
# assistant turns have no block, so a prefix of a multi-turn conversation renders differently.
REASONING_CHATML_TEMPLATE = (
    "{% set ns = namespace(last_user=-1) %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\n' }}"
    "{% if m['role'] == 'assistant' and loop.index0 > ns.last_user %}"
    "{{ '<think>\n' + (m['reasoning_content'] if m['reasoning_content'] is defined else '') + '\n</think>\n\n' }}"
    "{% endif %}"
    "{{ m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# REASONING_CHATML_TEMPLATE with tools in the style of Qwen3: the row's `tools` in a system turn,
# assistant `tool_calls` as `<tool_call>` JSON after the content, tool results in a user turn inside
# `<tool_response>`; a tool result does not end the current query, so the assistant turns of one
# tool-calling exchange all keep their reasoning.
TOOL_REASONING_TEMPLATE = (
    "{% set ns = namespace(last_user=-1) %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% if tools %}{{ '<|im_start|>system\n# Tools\n' }}{% for t in tools %}{{ t | tojson }}{{ '\n' }}{% endfor %}"
    "{{ '<|im_end|>\n' }}{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + m['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + m['role'] + '\n' }}"
    "{% if m['role'] == 'assistant' and loop.index0 > ns.last_user %}"
    "{{ '<think>\n' + (m['reasoning_content'] if m['reasoning_content'] is defined else '') + '\n</think>\n\n' }}"
    "{% endif %}"
    "{{ m['content'] }}"
    "{% for c in m['tool_calls'] or [] %}{% set f = c['function'] if c['function'] is defined else c %}"
    "{{ '<tool_call>\n{\"name\": \"' + f['name'] + '\", \"arguments\": ' + (f['arguments'] | tojson) + '}\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Prepended to a template, refuses conversations whose roles do not alternate user/assistant
# after an optional leading system message (as Llama-2 and Mistral templates do).
ALTERNATION_CHECK = (
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set offset = 1 %}{% else %}{% set offset = 0 %}{% endif %}"
    "{% for message in messages[offset:] %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% endfor %}"
)

#: Question/answer pairs for small end-to-end runs (their words are in the tiny tokenizer's corpus).
QA = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("Tell me a joke about numbers.", "Why was six afraid of seven? Because seven ate nine."),
    ("hello", "hello world thanks"),
    ("Explain gradient descent in one sentence.", "It walks downhill on the loss surface."),
    ("Say something short.", "ok"),
]

_CORPUS = [
    "You are a helpful assistant.",
    "What is the capital of France? The capital of France is Paris.",
    "Tell me a joke about numbers. Why was six afraid of seven? Because seven ate nine.",
    "Explain gradient descent in one sentence: it walks downhill on the loss surface.",
    "system user assistant hello world thanks sure here is the answer",
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ .,;:!?'\"()[]{}<>-_/\\",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n"
    "<|im_start|>assistant\nhello world<|im_end|>\n",
]


def tiny_chat_tokenizer(require_alternation: bool = False, default_system: bool = True,
                        chat_template: str | None = None, vocab_size: int = 400):
    """Build a small byte-level BPE fast tokenizer (about 400 tokens) with a ChatML chat template.

    Special tokens: ``<|endoftext|>`` (id 0, also pad), ``<|im_start|>`` (1), ``<|im_end|>`` (2,
    the eos and end-of-turn token). Any text can be encoded (byte-level), and decoding a run of
    tokens gives back its exact text; "system", "user", "assistant" are single tokens.
    The template is SmolLM2-like (``CHATML_TEMPLATE``, with a default system message), or
    ``PLAIN_CHATML_TEMPLATE`` without ``default_system``; with ``require_alternation`` it raises a
    Jinja TemplateError when roles do not alternate user/assistant. ``chat_template`` overrides all.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=["<|im_start|>"],
        chat_template=chat_template or _template(require_alternation, default_system),
    )


def _template(require_alternation: bool, default_system: bool) -> str:
    base = CHATML_TEMPLATE if default_system else PLAIN_CHATML_TEMPLATE
    return ALTERNATION_CHECK + base if require_alternation else base


def tiny_llama(vocab_size: int, attn_implementation: str = "sdpa", seed: int = 0, **overrides):
    """Build a tiny randomly initialised ``LlamaForCausalLM`` (fp32, eval mode, seeded by ``seed``).

    Defaults: hidden 32, 2 layers, 4 heads (2 KV heads), intermediate 64, 512 positions, untied
    embeddings; ``attn_implementation`` "sdpa" or "eager". ``overrides`` go to ``LlamaConfig``.
    For packed rows call the model with ``use_cache=False`` (see trainer/data/collate.py).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(
        vocab_size=vocab_size,
        attn_implementation=attn_implementation,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    cfg.update(overrides)
    config = LlamaConfig(**cfg)
    with torch.random.fork_rng(devices=[]):  # seeded, without touching the caller's RNG state
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32)
    model.eval()
    return model


def write_jsonl(path: Path, rows) -> Path:
    """Write ``rows`` to ``path``: dicts/lists are JSON-encoded, strings are written verbatim."""
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return Path(path)


def chat(*turns, system: str | None = None) -> dict:
    """Build a row ``{"messages": [...]}`` from alternating user/assistant contents."""
    msgs = [{"role": "system", "content": system}] if system is not None else []
    for i, content in enumerate(turns):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": content})
    return {"messages": msgs}


def _interleave_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF q/k rows (per head: all first halves, then second halves) -> llama.cpp's pairwise order."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path, model, tokenizer) -> None:
    """Write ``model`` (an untied-or-tied tiny Llama) and ``tokenizer`` as an all-F32 GGUF file."""
    import gguf

    cfg = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)

    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = tokenizer.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    specials = set(tokenizer.all_special_tokens)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in specials else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_eos_token_id(tokenizer.eos_token_id)
    w.add_pad_token_id(tokenizer.pad_token_id)
    w.add_chat_template(tokenizer.chat_template)

    names = {
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    }  # fmt: skip
    for key, t in model.state_dict().items():
        a = t.detach().numpy().astype(np.float32)
        if key == "model.embed_tokens.weight":
            w.add_tensor("token_embd.weight", a)
        elif key == "model.norm.weight":
            w.add_tensor("output_norm.weight", a)
        elif key == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                w.add_tensor("output.weight", a)
        else:
            _, _, layer, *rest = key.split(".")
            module = ".".join(rest[:-1])
            if module == "self_attn.q_proj":
                a = _interleave_rotary(a, cfg.num_attention_heads)
            elif module == "self_attn.k_proj":
                a = _interleave_rotary(a, cfg.num_key_value_heads)
            w.add_tensor(f"blk.{layer}.{names[module]}.weight", np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def save_tiny_model(path: Path, seed: int = 0, generation_ids: bool = False, **overrides) -> Path:
    """Save :func:`tiny_llama` (``overrides`` go to its config) with :func:`tiny_chat_tokenizer` as
    an HF model directory at ``path``; the model config gets the tokenizer's eos and pad ids, and with
    ``generation_ids`` its generation config too (so ``generate`` stops at ``<|im_end|>``)."""
    tokenizer = tiny_chat_tokenizer()
    model = tiny_llama(len(tokenizer), seed=seed, **overrides)
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    if generation_ids:
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return Path(path)


def dense_forgetting(model_dir: Path, export_dir: Path, urr: float, targets: tuple[str, ...]) -> dict[str, tuple[float, float]]:
    """Per target weight of a float32 export, (‖W_export − W_input‖_F / ‖W_input‖_F,
    σ_max(W_export − W_high) / σ_{k_high}(W_input)) computed densely in float64, where W_high is the
    input's top-k_high SVD part (what OSFT froze). Keys: module names (``...q_proj``)."""
    import torch
    from safetensors.torch import load_file

    from osft.trainer.osft.plan import split_rank

    before, after = load_file(Path(model_dir) / "model.safetensors"), load_file(Path(export_dir) / "model.safetensors")
    out = {}
    for key, w in before.items():
        name = key.removesuffix(".weight")
        if name.rsplit(".", 1)[-1] not in targets or not key.endswith(".weight"):
            continue
        w, w_new = w.double(), after[key].double()
        k_high, _ = split_rank(min(w.shape), urr)
        u, s, vh = torch.linalg.svd(w, full_matrices=False)
        w_high = (u[:, :k_high] * s[:k_high]) @ vh[:k_high]
        out[name] = (float(torch.linalg.matrix_norm(w_new - w) / torch.linalg.matrix_norm(w)),
                     float(torch.linalg.svdvals(w_new - w_high)[0] / s[k_high - 1]))
    return out


def float64_grad_norm(trainer, indices) -> float:
    """The gradient-norm reference (tests/test_grad_norm.py): the global gradient norm of one
    optimizer step of ``trainer`` (a prepared one-rank :class:`osft.trainer.run.loop.Trainer`,
    before the step) on the samples ``indices``, computed in float64 in this process, independently
    of the trainer's step.

    A float64 copy of the model runs each sample alone (no packing); the loss is the sum of the
    token losses over the number of loss tokens of the batch, as the trainer normalises it. OSFT
    factor gradients are projected in float64 as the trainer projects them (U side
    ``g − B(Bᵀg)``, or ``B(Bᵀg)`` for a stored complement basis; V side likewise on rows); the norm
    is that of every gradient, clipped or not."""
    import copy

    import torch
    import torch.nn.functional as F
    from osft.trainer.data.tokenize import IGNORE_INDEX
    from osft.trainer.osft.decomposition import OSFTLinear

    model = copy.deepcopy(trainer.model).double().train()
    loss = torch.zeros((), dtype=torch.float64)
    for i in indices:
        sample = trainer.data[int(i)]
        logits = model(input_ids=torch.tensor([sample["input_ids"]]), use_cache=False).logits[0, :-1]
        loss = loss + F.cross_entropy(logits, torch.tensor(sample["labels"][1:]), ignore_index=IGNORE_INDEX,
                                      reduction="sum")
    (loss / int(trainer.loss_tokens[np.asarray(indices)].sum())).backward()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, OSFTLinear) and m.U_low.grad is not None:
                u, v = m.U_low.grad, m.V_low.grad
                if m.U_basis.shape[1]:
                    c = m.U_basis @ (m.U_basis.t() @ u)
                    u.copy_(c if m.u_keep else u - c)
                if m.V_basis.shape[0]:
                    c = (v @ m.V_basis.t()) @ m.V_basis
                    v.copy_(c if m.v_keep else v - c)
    grads = [p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.cat(grads)))


def weight_updates(bases: dict, before: dict, after: dict):
    """(P, Q, ΔW) of every protected weight, float64: a linear module's ``<name>.weight``, and each
    expert of a bank ``<experts>.<proj>`` (P: E×N×p) under its on-disk name ``<experts>.<e>.<proj>.weight``."""
    for name in sorted({k.rpartition(".")[0] for k in bases}):
        P, Q = bases[f"{name}.P"].double(), bases[f"{name}.Q"].double()
        experts, _, proj = name.rpartition(".")
        keys = [f"{experts}.{e}.{proj}.weight" for e in range(P.shape[0])] if P.dim() == 3 else [f"{name}.weight"]
        for i, key in enumerate(keys):
            pq = (P[i], Q[i]) if P.dim() == 3 else (P, Q)
            yield key, *pq, after[key].double() - before[key].double()
