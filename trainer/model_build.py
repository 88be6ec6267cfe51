"""Build the model a run trains, on one rank or many: load the weights, resize the vocabulary,
build the OSFT modules (:mod:`.osft.surgery`) and, with more than one rank, shard it
(:mod:`.sharding`).

With several ranks, rank 0 reads the weights and the other ranks build the same architecture on the
meta device (host memory does not grow with the ranks of a node); the SVDs are spread over the
ranks (:func:`.osft.surgery.apply_osft`) and rank 0's values reach the others with the FSDP2
broadcast (:func:`.sharding.shard_and_broadcast`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import nn

from .checkpoint.subspaces import read_bases, subspaces_file
from .config import TrainConfig
from .distributed import DistEnv
from .model_loading import load_config, load_model
from .osft.plan import ModulePlan
from .osft.settings import OSFTSettings
from .osft.surgery import Bases, OSFTModel, apply_osft, skeleton_osft, target_weights
from .sharding import shard_and_broadcast


def meta_model(path: str) -> nn.Module:
    """The architecture of the model at ``path`` built from its config alone on the meta device
    (no weights read, no memory for them): for checks before any rank starts."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(load_config(path))


def target_shapes(path: str, patterns: list[str] | None) -> dict[str, tuple[int, ...]]:
    """(N, M) of every OSFT target of the model at ``path`` and (E, N, M) of every expert bank, by
    module name, from its config alone (:func:`meta_model`, :func:`.osft.surgery.target_weights`)."""
    return {name: tuple(matrix.shape) for name, matrix, *_ in target_weights(meta_model(path), patterns)}


def _resize_vocab(model: nn.Module, vocab_size: int | None, materialised: bool) -> None:
    """Resize the input (and tied or separate output) embeddings to ``vocab_size`` rows when it
    differs; new rows get the mean of the old ones (``mean_resizing``) where the weights are real."""
    if vocab_size and vocab_size != model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(vocab_size, mean_resizing=materialised)


def build_model(cfg: TrainConfig, env: DistEnv, device: torch.device, dtype: torch.dtype, osft: OSFTSettings | None,
                vocab_size: int | None = None, from_checkpoint: bool = False,
                plan_ranks: Callable[[nn.Module], Mapping[str, float] | None] | None = None,
                bases: Bases | None = None, plans: Mapping[str, ModulePlan] | None = None
                ) -> tuple[nn.Module, OSFTModel | None]:
    """Load the model, build its OSFT modules (with ``osft`` settings; None: ``--no-osft``) and, with
    more than one rank, shard it with FSDP2.

    Args:
        dtype: compute dtype (float32 on CPU, bfloat16 on GPU). With FSDP2 the sharded
            parameters stay float32 and ``dtype`` is the mixed-precision compute dtype.
        osft: the run's :class:`.osft.settings.OSFTSettings`, or None for plain fine-tuning.
        vocab_size: embedding rows to resize to (a larger tokenizer, or the vocab a checkpoint
            was saved with); None keeps the model's.
        from_checkpoint: build the structure only (OSFT skeletons laid out by ``plans``, no SVD, no
            weight broadcast): every parameter is about to be loaded from a full-state checkpoint.
        plan_ranks: called by every rank with the loaded dense model before the decomposition
            (real weights on rank 0, the meta device on the others; not called with
            ``from_checkpoint``); returns the URR per module name that overrides
            ``osft.urr`` (None: none), the same on every rank (collective).
        bases: protected subspaces (P, Q) per module name (:mod:`.osft.protect`).
        plans: the checkpoint's module plans (with ``from_checkpoint``).

    Returns:
        ``(model, osft)``: the model in train mode on ``device``; ``osft`` lists its OSFT modules.

    Raises:
        ValueError: the model cannot be loaded, or target patterns match nothing.
    """
    if env.world_size == 1:
        model = load_model(cfg.model_name_or_path, dtype, device)
        _resize_vocab(model, vocab_size, materialised=not from_checkpoint)
        built = None
        if osft is not None and from_checkpoint:
            built = skeleton_osft(model, osft, device, plans)
        elif osft is not None:
            built = apply_osft(model, osft, urr_by_module=plan_ranks(model) if plan_ranks else None, bases=bases)
        return model.train(), built

    from transformers import AutoModelForCausalLM

    param_dtype = torch.float32
    if env.rank == 0:
        model = load_model(cfg.model_name_or_path, param_dtype, "cpu")
    else:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(load_config(cfg.model_name_or_path), dtype=param_dtype)
    _resize_vocab(model, vocab_size, materialised=env.rank == 0 and not from_checkpoint)
    if osft is None:
        built = None
    elif from_checkpoint:
        built = skeleton_osft(model, osft, "meta", plans)
    else:
        built = apply_osft(model, osft, plan_ranks(model) if plan_ranks else None, bases, env.rank, env.world_size)
    full_state = None if from_checkpoint else model.state_dict() if env.rank == 0 else {}
    shard_and_broadcast(model, env, device, dtype, full_state)
    if built is not None:  # the modules are the same objects, now holding DTensors
        built = OSFTModel(modules=[(n, model.get_submodule(n)) for n, _ in built.modules], svd_seconds=built.svd_seconds,
                          experts=[(n, model.get_submodule(n)) for n, _ in built.experts])
    return model.train(), built


def load_protected_bases(cfg: TrainConfig) -> tuple[Path, dict[str, tuple[torch.Tensor, torch.Tensor]]] | None:
    """The protected subspaces of ``--model-name-or-path`` (an export of an earlier OSFT run holding
    ``osft_subspaces.safetensors``), checked against this model's targets.

    Returns:
        ``(file, bases by module name)``, or None: no such file, ``--no-osft`` or
        ``--no-osft-protect-subspaces``.

    Raises:
        ValueError: the file does not match the model's targets (names the module and the file).
    """
    path = subspaces_file(cfg.model_name_or_path)
    if path is None or not (cfg.osft and cfg.osft_protect_subspaces):
        return None
    return path, read_bases(path, target_shapes(cfg.model_name_or_path, cfg.osft_target_patterns))
