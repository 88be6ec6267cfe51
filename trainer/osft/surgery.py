"""Module surgery: replace targeted linear layers by :class:`OSFTLinear`, and back to dense weights."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from .decomposition import ForwardForm, OSFTLinear, protected_svd
from .targets import find_target_modules

#: Protected bases by module name: (P: N×p_L, Q: M×p_R), see :mod:`.protect`.
Bases = Mapping[str, tuple[torch.Tensor, torch.Tensor]]


@dataclass
class OSFTModel:
    """The OSFT modules of a model after :func:`apply_osft`, by full module name, and the time the
    decomposition took (``svd_seconds``, s)."""

    modules: list[tuple[str, OSFTLinear]]
    svd_seconds: float

    @property
    def osft_modules(self) -> list[OSFTLinear]:
        """The modules without their names."""
        return [m for _, m in self.modules]


def apply_osft(
    model: nn.Module,
    model_type: str,
    urr: float,
    tokens_per_micro_batch: int,
    patterns: Sequence[str] | None = None,
    forward_form: ForwardForm | Literal["auto"] = "auto",
    urr_by_module: Mapping[str, float] | None = None,
    bases: Bases | None = None,
) -> OSFTModel:
    """Decompose every target of ``model`` in place (see :func:`.targets.find_target_modules`).

    Every other parameter keeps training normally. ``urr_by_module`` overrides ``urr`` for the
    modules it names; ``bases`` gives protected subspaces (P, Q) per module name (others start
    with p_L = p_R = 0). Returns the replaced modules.

    Raises:
        ValueError: from target matching or an URR outside (0, 1].
    """
    names = find_target_modules(model, model_type, patterns)
    start = time.perf_counter()
    olds = [model.get_submodule(name) for name in names]
    protected = [(bases or {}).get(name) for name in names]
    replaced = []
    for name, old, prot, svd in zip(names, olds, protected, _parallel_svds(olds, protected)):
        new = OSFTLinear.from_weight(
            old.weight,
            old.bias,
            urr=module_urr(name, urr, urr_by_module),
            tokens_per_micro_batch=tokens_per_micro_batch,
            forward_form=forward_form,
            transposed=isinstance(old, Conv1D),
            svd=svd,
            protected=prot,
        )
        replace_module(model, name, new)
        replaced.append((name, new))
    return OSFTModel(modules=replaced, svd_seconds=time.perf_counter() - start)


def module_urr(name: str, urr: float, urr_by_module: Mapping[str, float] | None) -> float:
    """The URR of module ``name``: ``urr_by_module[name]`` where given, else ``urr``."""
    return (urr_by_module or {}).get(name, urr)


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put ``new`` in place of the submodule called ``name`` (a dotted path) of ``model``."""
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def _parallel_svds(modules: Sequence[nn.Module], protected: Sequence[tuple[torch.Tensor, torch.Tensor] | None]
                   ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """:func:`.decomposition.protected_svd` of each module's N×M weight with its protected bases
    (None: none), in order.

    On CPU the decompositions run on as many threads as torch has intra-op threads, each with one
    intra-op thread (small LAPACK calls scale poorly across cores; measured 1.4× faster on 2 cores).
    Each matrix is still decomposed by one thread, so the result does not depend on scheduling.
    """
    weights = [m.weight.t() if isinstance(m, Conv1D) else m.weight for m in modules]
    pairs = [prot or (w.new_zeros(w.shape[0], 0), w.new_zeros(w.shape[1], 0)) for w, prot in zip(weights, protected)]

    def one(i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return protected_svd(weights[i], *pairs[i])

    if not weights or weights[0].is_cuda:
        yield from (one(i) for i in range(len(weights)))
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            yield from pool.map(one, range(len(weights)))
    finally:
        torch.set_num_threads(threads)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's complete (unsharded) state dict.

    Plain ``model.state_dict()`` on one rank; under FSDP2 every rank must call it, rank 0 receives
    the gathered tensors on CPU and the other ranks an empty dict
    (``torch.distributed.checkpoint.state_dict.get_model_state_dict`` with ``full_state_dict`` and
    ``cpu_offload``).
    """
    if not any(hasattr(p, "full_tensor") for p in model.parameters()):
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


@torch.no_grad()
def dense_state_dict(state: dict[str, torch.Tensor], osft: OSFTModel | None) -> dict[str, torch.Tensor]:
    """Turn a full state dict of an OSFT model into one under the original (pre-OSFT) parameter
    names with dense weights.

    Each OSFT module ``X`` contributes ``X.weight`` = W_high + U_low·diag(S_low)·V_low (N×M, or
    its transpose for GPT-2 ``Conv1D``), computed in float32, and ``X.bias``; its projection bases
    are dropped; every other entry is passed through.
    """
    if osft is None:
        return dict(state)
    out = {k: v for k, v in state.items() if k.rpartition(".")[0] not in dict(osft.modules)}
    for name, module in osft.modules:
        w_high, u, s, v = (state[f"{name}.{k}"].float() for k in ("W_high", "U_low", "S_low", "V_low"))
        dense = torch.addmm(w_high, u * s, v)
        out[f"{name}.weight"] = (dense.t() if module.transposed else dense).contiguous()
        if f"{name}.bias" in state:
            out[f"{name}.bias"] = state[f"{name}.bias"]
    return out
