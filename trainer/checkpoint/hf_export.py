"""Dense Hugging Face exports: a config plus a plain state dict become a loadable model directory."""

from __future__ import annotations

import copy
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable, Mapping

import torch


def _partial_sibling(out_dir: Path, tag: str) -> Path:
    """A hidden sibling path of ``out_dir`` that no reader mistakes for a finished export."""
    return out_dir.parent / f".{out_dir.name}.{tag}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _resolve_tied(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fill in tied weights that the state dict holds under only one of their names.

    Raises:
        ValueError: both names of a tied pair are present but hold different values.
    """
    resolved = dict(state_dict)
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})
    for target, source in tied.items():
        if target in resolved and source in resolved:
            if not torch.equal(resolved[target], resolved[source]):
                raise ValueError(
                    f"state dict holds different values for the tied weights {target!r} and {source!r}"
                )
        elif source in resolved:
            resolved[target] = resolved[source]
        elif target in resolved:
            resolved[source] = resolved[target]
    return resolved


def _check_keys(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Raise a ValueError listing missing/unexpected keys and shape mismatches, if any."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    wrong_shape = [
        f"{k}: expected {tuple(expected[k].shape)}, got {tuple(state_dict[k].shape)}"
        for k in sorted(set(expected) & set(state_dict))
        if tuple(expected[k].shape) != tuple(state_dict[k].shape)
    ]
    if not (missing or unexpected or wrong_shape):
        return

    def listing(title: str, items: list[str]) -> str:
        shown = ", ".join(items[:10]) + (f", ... ({len(items) - 10} more)" if len(items) > 10 else "")
        return f"{len(items)} {title}: {shown}"

    parts = [
        listing(title, items)
        for title, items in (("missing keys", missing), ("unexpected keys", unexpected), ("shape mismatches", wrong_shape))
        if items
    ]
    raise ValueError("state dict does not match the model config; " + "; ".join(parts))


def source_generation_config(model_path: str | os.PathLike) -> Any:
    """The ``GenerationConfig`` of the model a run started from (its ``generation_config.json``: all
    stop ids, sampling defaults), for :func:`save_hf_model`; None when it has none (a directory
    without the file, or a ``.gguf`` file), so the export derives one from the model config, as
    ``from_pretrained`` does for such a source."""
    from transformers import GenerationConfig

    from ..model.loading import resolve_model_path

    directory, gguf_file = resolve_model_path(model_path)
    if gguf_file is not None or not (directory / "generation_config.json").is_file():
        return None
    return GenerationConfig.from_pretrained(directory)


def save_hf_model(
    config: Any,
    state_dict: Mapping[str, torch.Tensor],
    tokenizer: Any,
    out_dir: str | os.PathLike,
    dtype: torch.dtype,
    *,
    generation_config: Any = None,
    overwrite: bool = False,
    extra: Callable[[Path], None] | None = None,
) -> Path:
    """Write a dense Hugging Face model directory from a config and a full state dict.

    The model is built with ``AutoModelForCausalLM.from_config(config)`` with its parameters on the
    meta device (no memory, no random init), the state dict is assigned to it (strictly), floating
    point weights are cast to ``dtype`` and the model is saved as safetensors together with its config,
    its generation config and ``tokenizer`` (including its chat template). A ``quantization_config`` on
    ``config`` (for example from a GGUF source) is dropped: the export is always dense.

    Tied weights (``tie_word_embeddings``, e.g. SmolLM2's ``lm_head`` and ``embed_tokens``) may appear in
    ``state_dict`` under one name or under both (then with equal values); they are stored once.

    Everything is written to a hidden temporary sibling directory that is renamed to ``out_dir`` only
    when complete, so a crash never leaves a directory that looks like a finished export.

    Args:
        config: a transformers ``PretrainedConfig`` of a causal LM (not modified).
        state_dict: parameter name -> tensor, names as in ``model.state_dict()``; tensors of any
            device/dtype (they are used as is when already CPU and ``dtype``, not copied).
        tokenizer: a transformers tokenizer saved alongside, or ``None`` to save none.
        out_dir: the directory to create; its parent is created if needed.
        dtype: dtype of the saved floating point weights, e.g. ``torch.bfloat16``.
        generation_config: a ``GenerationConfig`` to save instead of the one derived from ``config``.
        overwrite: replace an existing ``out_dir`` (the old one is removed only after the new one is
            complete).
        extra: called with the (temporary) directory to write further files into it before it is
            renamed, e.g. the protected subspaces (:func:`.subspaces.write_subspaces`).

    Returns:
        ``out_dir`` as a ``Path``.

    Raises:
        FileExistsError: ``out_dir`` exists and ``overwrite`` is false.
        ValueError: the state dict has missing or unexpected keys, wrong shapes, or tied weights
            with different values (the message lists them).
    """
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"export directory already exists: {out_dir}")

    config = copy.deepcopy(config)
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config
    config.dtype = dtype

    with init_empty_weights():  # parameters on meta, buffers (rotary tables) real
        model = AutoModelForCausalLM.from_config(config)
    full = _resolve_tied(model, state_dict)
    _check_keys(model, full)
    model.load_state_dict({k: v.detach().cpu() for k, v in full.items()}, strict=True, assign=True)
    model.tie_weights()
    model.to(dtype)
    if generation_config is not None:
        model.generation_config = copy.deepcopy(generation_config)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    partial = _partial_sibling(out_dir, "partial")
    partial.mkdir()
    try:
        model.save_pretrained(partial)
        if tokenizer is not None:
            tokenizer.save_pretrained(partial)
        if extra is not None:
            extra(partial)
        file_mode = partial.stat().st_mode & 0o666  # mkdir honoured the umask; safetensors writes 0600
        for f in partial.iterdir():
            os.chmod(f, file_mode)
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if out_dir.exists():  # overwrite: swap in the new export, then drop the old one
            old = _partial_sibling(out_dir, "old")
            out_dir.rename(old)
            partial.rename(out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            partial.rename(out_dir)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return out_dir
