"""Model construction on one rank or many: rank 0 reads the weights, the SVD is spread over the
ranks, and FSDP2 (``torch.distributed.fsdp.fully_shard``) shards every parameter, OSFT factors
included.

Multi-rank recipe (host memory does not grow with the number of ranks on a node):

1. Rank 0 loads the checkpoint on CPU; the other ranks build the same architecture on the meta
   device (no memory).
2. Target i is decomposed by rank i mod world_size: rank 0 sends it the weight (point to point),
   it runs :func:`.osft.decomposition.protected_svd` and sends the factors back; meanwhile every rank
   works on its own share. Ranks other than 0 replace targets by
   :meth:`.osft.decomposition.OSFTLinear.empty` skeletons.
3. ``fully_shard`` wraps every decoder block and then the root; the full state dict of rank 0 is
   broadcast and sharded with ``set_model_state_dict(..., broadcast_from_rank0=True)``; buffers
   (rotary frequencies) are broadcast from rank 0.

On GPU the sharded parameters are float32 and FSDP2 computes in bfloat16 with float32 gradient
reduction (``MixedPrecisionPolicy``); on CPU everything is float32.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from transformers.pytorch_utils import Conv1D

from .checkpoint.subspaces import read_bases, subspaces_file
from .config import TrainConfig
from .distributed import DistEnv
from .model_loading import load_config, load_model
from .osft.decomposition import OSFTLinear, protected_svd
from .osft.plan import ModulePlan
from .osft.protect import no_bases
from .osft.surgery import Bases, OSFTModel, apply_osft, module_urr, replace_module
from .osft.targets import decoder_block_names, find_target_modules, weight_shape


def model_vocab_size(path: str) -> int:
    """Rows of the model's input embedding table, from its config (no weights loaded)."""
    return load_config(path).vocab_size


def _decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks (:func:`.osft.targets.decoder_block_names`)."""
    return [model.get_submodule(name) for name in decoder_block_names(model)]


def _osft_options(cfg: TrainConfig, module: nn.Module) -> dict:
    """Keyword arguments of :class:`.osft.decomposition.OSFTLinear` constructors for ``module``
    (all but the URR)."""
    return dict(tokens_per_micro_batch=cfg.max_tokens_per_gpu, forward_form=cfg.osft_forward,
                transposed=isinstance(module, Conv1D))


def _distributed_osft(model: nn.Module, cfg: TrainConfig, env: DistEnv, urr_by_module: Mapping[str, float] | None = None,
                      bases: Bases | None = None) -> OSFTModel:
    """Decompose the targets with the SVD spread over the ranks (see the module docstring).

    ``urr_by_module`` overrides the config's URR per module name; ``bases`` are the protected
    subspaces (P, Q) per module name, the same on every rank (each rank reads them from the model
    directory)."""
    start = time.perf_counter()
    names = find_target_modules(model, model.config.model_type, cfg.osft_target_patterns)
    modules = [model.get_submodule(n) for n in names]
    shapes = [weight_shape(m) for m in modules]
    protected = [(bases or {}).get(name) or no_bases(n, m) for name, (n, m) in zip(names, shapes)]
    owner = [i % env.world_size for i in range(len(names))]
    mine: dict[int, torch.Tensor] = {}
    # 1. weights from rank 0 to their owners
    for i, (module, (n, m)) in enumerate(zip(modules, shapes)):
        w = None
        if env.rank == 0:
            w = (module.weight.t() if isinstance(module, Conv1D) else module.weight).detach().contiguous()
            if owner[i] != 0:
                dist.send(w, dst=owner[i])
        elif owner[i] == env.rank:
            w = torch.empty(n, m, dtype=module.weight.dtype)
            dist.recv(w, src=0)
        if owner[i] == env.rank:
            mine[i] = w
    # 2. every rank decomposes its share
    factors = {i: protected_svd(w, *protected[i]) for i, w in mine.items()}
    # 3. factors back to rank 0, which builds the real modules; the others build skeletons
    replaced = []
    for i, (name, module, (n, m)) in enumerate(zip(names, modules, shapes)):
        common = dict(_osft_options(cfg, module), urr=module_urr(name, cfg.osft_unfreeze_rank_ratio, urr_by_module))
        P, Q = protected[i]
        if env.rank == 0:
            if owner[i] == 0:
                svd = factors.pop(i)
            else:
                r = min(n - P.shape[1], m - Q.shape[1])
                svd = (torch.empty(n, r, dtype=torch.float64), torch.empty(r, dtype=torch.float64),
                       torch.empty(r, m, dtype=torch.float64))
                for t in svd:
                    dist.recv(t, src=owner[i])
            new = OSFTLinear.from_weight(module.weight, module.bias, svd=svd, protected=(P, Q), **common)
        else:
            if owner[i] == env.rank:
                for t in factors.pop(i):
                    dist.send(t.contiguous(), dst=0)
            new = OSFTLinear.empty(n, m, module.bias is not None, dtype=module.weight.dtype,
                                   protected_rank=(P.shape[1], Q.shape[1]), **common)
        replace_module(model, name, new)
        replaced.append((name, new))
    return OSFTModel(modules=replaced, svd_seconds=time.perf_counter() - start)


def _skeleton_osft(model: nn.Module, cfg: TrainConfig, device: torch.device | str,
                   plans: Mapping[str, ModulePlan] | None) -> OSFTModel:
    """Replace every target by an uninitialised :meth:`.osft.decomposition.OSFTLinear.empty` with
    the layout its checkpoint stored (``plans`` by module name; no SVD): the values come from a
    full-state checkpoint. ``plans=None`` (a checkpoint from before plans were stored) lays out
    unprotected modules at the config's URR.

    Raises:
        ValueError: a target without a stored plan, or one whose shape differs from its plan.
    """
    replaced = []
    for name in find_target_modules(model, model.config.model_type, cfg.osft_target_patterns):
        module = model.get_submodule(name)
        n, m = weight_shape(module)
        plan = None if plans is None else plans.get(name)
        if plans is not None and (plan is None or (plan.n, plan.m) != (n, m)):
            raise ValueError(f"OSFT module {name} ({n}×{m}): the checkpoint stores no plan of this shape for it")
        new = OSFTLinear.empty(n, m, module.bias is not None, urr=cfg.osft_unfreeze_rank_ratio, dtype=module.weight.dtype,
                               device=device, plan=plan, **_osft_options(cfg, module))
        replace_module(model, name, new)
        replaced.append((name, new))
    return OSFTModel(modules=replaced, svd_seconds=0.0)


def target_shapes(path: str, patterns: list[str] | None) -> dict[str, tuple[int, int]]:
    """(N, M) of every OSFT target of the model at ``path``, by module name, from its config alone
    (the model is built on the meta device: no weights read)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(load_config(path))
    return {name: weight_shape(model.get_submodule(name))
            for name in find_target_modules(model, model.config.model_type, patterns)}


def _resize_vocab(model: nn.Module, vocab_size: int | None, materialised: bool) -> None:
    """Resize the input (and tied or separate output) embeddings to ``vocab_size`` rows when it
    differs; new rows get the mean of the old ones (``mean_resizing``) where the weights are real."""
    if vocab_size and vocab_size != model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(vocab_size, mean_resizing=materialised)


def build_model(cfg: TrainConfig, env: DistEnv, device: torch.device, dtype: torch.dtype, vocab_size: int | None = None,
                from_checkpoint: bool = False, plan_ranks: Callable[[nn.Module], Mapping[str, float] | None] | None = None,
                bases: Bases | None = None, plans: Mapping[str, ModulePlan] | None = None
                ) -> tuple[nn.Module, OSFTModel | None]:
    """Load the model, decompose its OSFT targets (unless ``--no-osft``) and, with more than one
    rank, shard it with FSDP2.

    Args:
        dtype: compute dtype (float32 on CPU, bfloat16 on GPU). With FSDP2 the sharded
            parameters stay float32 and ``dtype`` is the mixed-precision compute dtype.
        vocab_size: embedding rows to resize to (a larger tokenizer, or the vocab a checkpoint
            was saved with); None keeps the model's.
        from_checkpoint: build the structure only (OSFT skeletons laid out by ``plans``, no SVD, no
            weight broadcast): every parameter is about to be loaded from a full-state checkpoint.
        plan_ranks: called by every rank with the loaded dense model before the decomposition
            (real weights on rank 0, the meta device on the others; not called with
            ``from_checkpoint``); returns the URR per module name that overrides
            ``cfg.osft_unfreeze_rank_ratio`` (None: none), the same on every rank (collective).
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
        osft = None
        if cfg.osft and from_checkpoint:
            osft = _skeleton_osft(model, cfg, device, plans)
        elif cfg.osft:
            osft = apply_osft(model, model.config.model_type, cfg.osft_unfreeze_rank_ratio,
                              tokens_per_micro_batch=cfg.max_tokens_per_gpu, patterns=cfg.osft_target_patterns,
                              forward_form=cfg.osft_forward, urr_by_module=plan_ranks(model) if plan_ranks else None,
                              bases=bases)
        return model.train(), osft

    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    param_dtype = torch.float32
    if env.rank == 0:
        model = load_model(cfg.model_name_or_path, param_dtype, "cpu")
    else:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(load_config(cfg.model_name_or_path), dtype=param_dtype)
    _resize_vocab(model, vocab_size, materialised=env.rank == 0 and not from_checkpoint)
    if not cfg.osft:
        osft = None
    elif from_checkpoint:
        osft = _skeleton_osft(model, cfg, "meta", plans)
    else:
        osft = _distributed_osft(model, cfg, env, plan_ranks(model) if plan_ranks else None, bases)
    full_state = model.state_dict() if env.rank == 0 and not from_checkpoint else {}
    buffers_before = {n: b for n, b in model.named_buffers()}
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if device.type == "cuda" else MixedPrecisionPolicy()
    for block in _decoder_blocks(model):
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    model.to_empty(device=device)
    if not from_checkpoint:
        set_model_state_dict(model, full_state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    # Non-persistent buffers (e.g. rotary inv_freq) are not in the state dict: copy rank 0's.
    for name, buf in model.named_buffers():
        if env.rank == 0:
            buf.copy_(buffers_before[name].to(device))
        dist.broadcast(buf, src=0)
    if osft is not None:  # the modules are the same objects, now holding DTensors
        osft = OSFTModel(modules=[(n, model.get_submodule(n)) for n, _ in osft.modules], svd_seconds=osft.svd_seconds)
    return model.train(), osft


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
