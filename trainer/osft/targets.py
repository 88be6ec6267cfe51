"""Which weights OSFT decomposes: per-architecture module-name patterns.

Targets are the 2-D projection weights of attention and MLP blocks. Embeddings, norms and the
LM head are never targets unless the user's own patterns name them; they train normally.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from .experts import find_experts_modules, router_parameters

_LLAMA_STYLE = r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)$"

#: model_type (``config.model_type``) -> regular expression searched in each module's full name.
ARCHITECTURE_TARGET_PATTERNS: dict[str, str] = {
    "llama": _LLAMA_STYLE,
    "mistral": _LLAMA_STYLE,
    # Experts: transformers 4's per-expert w1/w2/w3 linear layers; transformers 5's fused tensors
    # as the banks gate_proj/up_proj/down_proj of :mod:`.experts` (matched by :func:`find_expert_banks`).
    "mixtral": r"\.(q_proj|k_proj|v_proj|o_proj|w1|w2|w3|gate_proj|up_proj|down_proj)$",
    "qwen3_moe": _LLAMA_STYLE,
    "gpt_oss": _LLAMA_STYLE,
    "qwen2": _LLAMA_STYLE,
    "qwen3": _LLAMA_STYLE,
    "gemma": _LLAMA_STYLE,
    "gemma2": _LLAMA_STYLE,
    "gemma3_text": _LLAMA_STYLE,
    "granite": _LLAMA_STYLE,
    "olmo2": _LLAMA_STYLE,
    "phi3": r"\.(qkv_proj|o_proj|gate_up_proj|down_proj)$",
    "gpt2": r"\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)$",
    "opt": r"\.(q_proj|k_proj|v_proj|out_proj|fc1|fc2)$",
}


def is_linear_like(module: nn.Module) -> bool:
    """True for ``nn.Linear`` and GPT-2's ``Conv1D`` (a linear layer with a transposed weight)."""
    return isinstance(module, (nn.Linear, Conv1D))


def weight_matrix(module: nn.Module) -> tuple[torch.Tensor, bool]:
    """``(W, transposed)``: the weight of a linear-like module as the N×M (out×in) matrix of
    y = x·Wᵀ + b (a view of the parameter, no copy), and whether the module stores it transposed
    (GPT-2 ``Conv1D`` stores Wᵀ, M×N; ``nn.Linear`` stores W)."""
    transposed = isinstance(module, Conv1D)
    return (module.weight.t() if transposed else module.weight), transposed


def compile_patterns(model_type: str, patterns: Sequence[str] | None) -> list[re.Pattern]:
    """The target patterns of a model: ``patterns`` (``--osft-target-patterns``), or the built-in one
    of ``model_type`` when None, compiled.

    Raises:
        ValueError: no built-in patterns for ``model_type`` and none given; an invalid regular
            expression.
    """
    if patterns is None:
        if model_type not in ARCHITECTURE_TARGET_PATTERNS:
            known = ", ".join(sorted(ARCHITECTURE_TARGET_PATTERNS))
            raise ValueError(
                f"OSFT has no built-in target patterns for model_type {model_type!r} (known: {known}); "
                "pass --osft-target-patterns REGEX [REGEX ...]"
            )
        patterns = [ARCHITECTURE_TARGET_PATTERNS[model_type]]
    compiled = []
    for pattern in patterns:
        try:
            compiled.append(re.compile(pattern))
        except re.error as exc:
            raise ValueError(f"--osft-target-patterns: invalid regular expression {pattern!r}: {exc}") from exc
    return compiled


def find_expert_banks(model: nn.Module, model_type: str, patterns: Sequence[str] | None = None) -> list[tuple[str, str]]:
    """``(experts module, bank)`` of every fused-experts bank OSFT decomposes (:mod:`.experts`): a
    bank is matched by its name ``<experts module>.<bank>`` (``model.layers.0.mlp.experts.gate_proj``),
    as a linear module would be. An experts module is decomposed whole or not at all.

    Raises:
        ValueError: from :func:`compile_patterns`; the patterns match some banks of an experts
            module but not all.
    """
    compiled = compile_patterns(model_type, patterns)
    found = []
    for name, _, layout in find_experts_modules(model):
        hit = [bank for bank in layout.bank_names() if any(rx.search(f"{name}.{bank}") for rx in compiled)]
        if hit and len(hit) != len(layout.bank_names()):
            raise ValueError(f"OSFT target patterns match {hit} of the experts {name} but not all of "
                             f"{list(layout.bank_names())}: an experts module is decomposed whole or not at all")
        found += [(name, bank) for bank in hit]
    return found


def find_target_modules(
    model: nn.Module, model_type: str, patterns: Sequence[str] | None = None
) -> list[str]:
    """Return the names of the linear modules OSFT decomposes, in ``named_modules`` order.

    Args:
        model: the causal LM.
        model_type: ``config.model_type``; selects the built-in pattern when ``patterns`` is None.
        patterns: regular expressions (``re.search`` on the full module name) overriding the
            built-in ones (``--osft-target-patterns``).

    Raises:
        ValueError: no built-in patterns for ``model_type`` and none given; an invalid regular
            expression; or no linear module matches (the message lists some module names).
    """
    compiled = compile_patterns(model_type, patterns)
    names = [
        name
        for name, module in model.named_modules()
        if is_linear_like(module) and any(rx.search(name) for rx in compiled)
    ]
    if not names:
        linear_names = [n for n, m in model.named_modules() if is_linear_like(m)][:8]
        raise ValueError(
            f"OSFT target patterns {list(patterns)} matched no linear module; "
            f"some linear modules of this model: {linear_names}"
        )
    return names


def decoder_block_names(model: nn.Module) -> list[str]:
    """Full names of the repeated decoder blocks (classes named in ``model._no_split_modules``), in
    ``named_modules`` order.

    Raises:
        ValueError: the model names no block class, or none is present.
    """
    classes = set(getattr(model, "_no_split_modules", None) or [])
    names = [name for name, module in model.named_modules() if type(module).__name__ in classes]
    if not names:
        raise ValueError(f"cannot find the decoder blocks of {type(model).__name__}: no module of a class in "
                         f"its _no_split_modules {sorted(classes)}")
    return names


def unconstrained_block_weights(model: nn.Module, targets: Sequence[str]) -> list[tuple[str, tuple[int, ...]]]:
    """Name and global shape of every trainable parameter of two or more dimensions inside the
    decoder blocks (:func:`decoder_block_names`) that is not part of an OSFT target in ``targets``:
    weights that train without OSFT's constraint, e.g. fused 3-D experts that the target patterns
    leave out. One-dimensional ones (norms, biases), MoE routers (:func:`.experts.router_parameters`)
    and everything outside the blocks (embeddings, LM head, final norm) train normally by design and
    are not listed. Empty when the model has no recognisable blocks."""
    try:
        blocks = tuple(f"{name}." for name in decoder_block_names(model))
    except ValueError:
        return []
    inside = tuple(f"{name}." for name in targets)
    routers = router_parameters(model)
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()
            if p.requires_grad and p.dim() >= 2 and name.startswith(blocks) and not name.startswith(inside)
            and name not in routers]


def describe_unconstrained(model: nn.Module, targets: Sequence[str]) -> tuple[str | None, str | None]:
    """``(warning, note)`` about what trains outside OSFT: the warning lists every
    :func:`unconstrained_block_weights` entry, grouped over the blocks (``model.layers.*.mlp.gate.weight
    [4, 32] in 2 blocks``); the note counts the parameters that train normally by design (outside the
    blocks, and one-dimensional ones inside them). Either is None when there is nothing to say."""
    weights = unconstrained_block_weights(model, targets)
    groups: dict[tuple[str, tuple[int, ...]], int] = {}
    for name, shape in weights:
        key = (re.sub(r"\.\d+\.", ".*.", name, count=1), shape)
        groups[key] = groups.get(key, 0) + 1
    warning = None
    if groups:
        shown = "; ".join(f"{name} {list(shape)} in {n} block{'s' if n > 1 else ''}" for (name, shape), n in groups.items())
        warning = (f"{len(weights)} weights inside the decoder blocks train without OSFT's constraint (no target "
                   f"pattern matches them): {shown}. Name them in --osft-target-patterns if they are linear layers, "
                   "or --freeze-non-target freezes them")
    listed = {name for name, _ in weights}
    inside = tuple(f"{name}." for name in targets)
    free = sum(p.numel() for name, p in model.named_parameters()
               if p.requires_grad and name not in listed and not name.startswith(inside))
    note = (f"trained normally by design (not under OSFT): {free:,} parameters of the embeddings, LM head, norms, "
            "biases and MoE routers") if free else None
    return warning, note
