"""Load a causal LM and its tokenizer from a Hugging Face directory or a single ``.gguf`` file.

A GGUF file is de-quantized by transformers on load, so the model always comes back dense in the
requested dtype. Its config then still carries a ``quantization_config`` (transformers refuses
``save_pretrained`` on such a model); export with ``osft.trainer.checkpoint.hf_export.save_hf_model``,
which drops it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch


def resolve_model_path(path: str | os.PathLike) -> tuple[Path, str | None]:
    """Split a model path into ``(directory, gguf_file_name_or_None)`` for ``from_pretrained``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is a directory without ``config.json``, or a file that is not ``.gguf``.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"model path does not exist: {p}")
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ValueError(f"not a Hugging Face model directory (no config.json): {p}")
        return p, None
    if p.suffix.lower() != ".gguf":
        raise ValueError(f"model path must be a Hugging Face directory or a .gguf file: {p}")
    return p.parent, p.name


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, str(dtype), None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r} (use a torch dtype name such as 'float32' or 'bfloat16')")
    return resolved


def load_config(path: str | os.PathLike) -> Any:
    """The model's ``transformers`` config (``AutoConfig``) from a Hugging Face directory or a
    ``.gguf`` file; no weights are read.

    Raises:
        FileNotFoundError, ValueError: as :func:`resolve_model_path`, or from ``AutoConfig``.
    """
    from transformers import AutoConfig

    directory, gguf_file = resolve_model_path(path)
    return AutoConfig.from_pretrained(directory, gguf_file=gguf_file)


def model_vocab_size(path: str | os.PathLike) -> int:
    """Rows of the model's input embedding table, from its config (:func:`load_config`)."""
    return load_config(path).vocab_size


def load_tokenizer(path: str | os.PathLike, require_chat_template: bool = True,
                   chat_template: str | os.PathLike | None = None) -> Any:
    """Load the tokenizer of a Hugging Face model directory or a ``.gguf`` file.

    The tokenizer always has a pad token: the eos token is used when the source defines none.
    ``chat_template`` names a Jinja file whose text replaces the tokenizer's chat template
    (``--chat-template``; it is saved with every export).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is not a model directory or ``.gguf`` file, no tokenizer can be built
            from it, it has neither pad nor eos token, or it has no chat template while
            ``require_chat_template`` is true.
    """
    from transformers import AutoTokenizer

    directory, gguf_file = resolve_model_path(path)
    source = directory / gguf_file if gguf_file else directory
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"cannot load a tokenizer from {source}: {e}") from e
    if chat_template is not None:
        tokenizer.chat_template = Path(chat_template).read_text(encoding="utf-8")
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"tokenizer from {source} has neither a pad token nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    if require_chat_template and not tokenizer.chat_template:
        raise ValueError(f"tokenizer from {source} has no chat template")
    return tokenizer


def load_model(
    path: str | os.PathLike, dtype: torch.dtype | str = torch.float32, device: str | torch.device = "cpu"
) -> torch.nn.Module:
    """Load a causal LM (``AutoModelForCausalLM``) from a Hugging Face directory or a ``.gguf`` file.

    Args:
        path: a directory with ``config.json`` and weights, or a ``.gguf`` file (de-quantized on load).
        dtype: dtype of the floating point weights, a ``torch.dtype`` or its name (``"bfloat16"``).
        device: where the returned model lives.

    Returns:
        The model, in eval mode, on ``device``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is not a model directory or ``.gguf`` file, ``dtype`` is unknown, or
            transformers cannot build a model from it (unsupported architecture, missing weights).
    """
    from transformers import AutoModelForCausalLM

    torch_dtype = _as_dtype(dtype)
    directory, gguf_file = resolve_model_path(path)
    source = directory / gguf_file if gguf_file else directory
    try:
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf_file, dtype=torch_dtype)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"cannot load a causal LM from {source}: {e}") from e
    return model.to(device).eval()
