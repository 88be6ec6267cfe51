"""Module surgery: replace the targeted linear layers of a model by :class:`OSFTLinear`, and back to
dense weights.

Every OSFT module is built here, on one of three paths with one layout rule (each target's
:class:`.plan.ModulePlan` from :meth:`.plan.OSFTSettings.plan` or a checkpoint, then
:meth:`OSFTLinear.from_weight` or :meth:`OSFTLinear.empty` of that plan):

- one rank (:func:`apply_osft`): every target is decomposed in place, the SVDs on threads.
- several ranks (:func:`apply_osft` with ``world_size`` > 1; host memory does not grow with the
  ranks of a node): rank 0 holds the weights, the other ranks the same architecture on the meta
  device. Target i is decomposed by rank i mod world_size: rank 0 sends it the weight (point to
  point, ``torch.distributed.send``/``recv``), it runs :func:`.decomposition.protected_svd` and
  sends the factors back; meanwhile every rank works on its own share, in rounds of one target per
  rank, each after a poll for a stop. Rank 0 builds the real
  modules, the others skeletons whose values arrive with FSDP2's broadcast of rank 0's state.
- resume (:func:`skeleton_osft`): skeletons laid out by the plans a full-state checkpoint stored,
  no SVD; the values come from the checkpoint.

Fused MoE experts (:mod:`.experts`) go the same three ways: each bank (E×N×M) is one target whose
E SVDs are one batched call (:func:`.decomposition.thin_svd`), or, with protected bases (E×N×p,
E×M×p), one :func:`.decomposition.protected_svd` per expert, and the experts module is replaced
by an :class:`.experts.OSFTExperts` holding its banks.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from .. import test_hooks
from ..distributed import control_group, map_on_threads
from ..dtensor import is_sharded
from .decomposition import OSFTLinear, dense_from_factors, protected_svd
from .experts import ExpertLayout, OSFTExperts
from .protect import no_bases
from .plan import ModulePlan, OSFTSettings
from .targets import find_expert_banks, find_target_modules, weight_matrix

#: Protected bases by module name: (P: N×p_L, Q: M×p_R; a bank's E×N×p, E×M×p), see :mod:`.protect`.
Bases = Mapping[str, tuple[torch.Tensor, torch.Tensor]]

#: The thin SVD (U: N×R, S: R, Vh: R×M) of one target, see :func:`.decomposition.protected_svd`.
SVD = tuple[torch.Tensor, torch.Tensor, torch.Tensor]

#: A poll before round r of the SVDs (:func:`apply_osft`); it raises to abandon them.
Check = Callable[[int], None]


@dataclass
class OSFTModel:
    """The OSFT modules of a model after :func:`apply_osft`, by full module name (expert banks
    included, ``<experts>.gate_proj``), the time the decomposition took (``svd_seconds``, s) and the
    experts modules that hold banks (``experts``, by name)."""

    modules: list[tuple[str, OSFTLinear]]
    svd_seconds: float
    experts: list[tuple[str, OSFTExperts]] = field(default_factory=list)

    @property
    def osft_modules(self) -> list[OSFTLinear]:
        """The modules without their names."""
        return [m for _, m in self.modules]


@dataclass(frozen=True)
class Target:
    """One OSFT target of a model before the surgery: its full ``name``, its weight as ``matrix``
    (N×M out×in, a view; E×N×M for an expert bank), its ``bias`` (N, E×N or None), whether the
    module stores the weight transposed (``transposed``, GPT-2 ``Conv1D``), its layout ``plan``, its
    protected bases ``protected`` = (P: N×p_L, Q: M×p_R; a bank's E×N×p, E×M×p) of earlier runs
    (None: nothing protected) and, for a bank, the name of its ``experts`` module (None for a
    linear module)."""

    name: str
    matrix: torch.Tensor
    bias: torch.Tensor | None
    transposed: bool
    plan: ModulePlan
    protected: tuple[torch.Tensor, torch.Tensor] | None
    experts: str | None = None


def target_weights(model: nn.Module, patterns: Sequence[str] | None
                   ) -> list[tuple[str, torch.Tensor, torch.Tensor | None, bool, str | None]]:
    """``(name, matrix, bias, transposed, experts module)`` of every target of ``patterns``
    (``--osft-target-patterns``, None: the model type's): the linear modules of
    :func:`.targets.find_target_modules` (matrix N×M out×in, a view), then the banks of
    :func:`.targets.find_expert_banks` (E×N×M). Works on a meta-device model."""
    model_type = model.config.model_type
    out = []
    for name in find_target_modules(model, model_type, patterns):
        module = model.get_submodule(name)
        matrix, transposed = weight_matrix(module)
        out.append((name, matrix, module.bias, transposed, None))
    for experts, bank in find_expert_banks(model, model_type, patterns):
        module = model.get_submodule(experts)
        layout = ExpertLayout.of(module)
        matrix, bias = layout.split(dict(module.named_parameters(recurse=False)))[bank]
        out.append((f"{experts}.{bank}", matrix, bias, False, experts))
    return out


def plan_targets(model: nn.Module, settings: OSFTSettings, urr_by_module: Mapping[str, float] | None = None,
                 bases: Bases | None = None, plans: Mapping[str, ModulePlan] | None = None) -> list[Target]:
    """The targets of ``model`` (linear modules and expert banks matched by the settings' patterns),
    each with its layout.

    Without ``plans``, a target's plan is :meth:`.plan.OSFTSettings.plan` of its shape, its
    protected ranks (``bases``: (P, Q) by module name; others p_L = p_R = 0) and its URR
    (``urr_by_module[name]`` where given, else the settings'). With ``plans`` (the plans a
    checkpoint stored, by module name), each target takes its stored plan.

    Raises:
        ValueError: from target matching or planning; with ``plans``, a target without a stored plan
            or one whose shape differs from its plan.
    """
    targets = []
    for name, matrix, bias, transposed, experts in target_weights(model, settings.target_patterns):
        n, m = matrix.shape[-2:]
        e = matrix.shape[0] if experts else 0
        protected = (bases or {}).get(name)
        if plans is None:
            p_left, p_right = (protected[0].shape[-1], protected[1].shape[-1]) if protected is not None else (0, 0)
            plan = settings.plan(n, m, p_left, p_right, urr=(urr_by_module or {}).get(name), experts=e)
        else:
            plan = plans.get(name)
            if plan is None or (plan.n, plan.m, plan.experts) != (n, m, e):
                raise ValueError(f"OSFT module {name} ({tuple(matrix.shape)}): the checkpoint stores no plan of this "
                                 "shape for it")
        targets.append(Target(name, matrix, bias, transposed, plan, protected, experts))
    return targets


def apply_osft(model: nn.Module, settings: OSFTSettings, urr_by_module: Mapping[str, float] | None = None,
               bases: Bases | None = None, rank: int = 0, world_size: int = 1, check: Check | None = None) -> OSFTModel:
    """Decompose every target of ``model`` in place (see :func:`plan_targets` for ``urr_by_module``
    and ``bases``; the same on every rank). Every other parameter keeps training normally.

    With ``world_size`` > 1 every rank of the default process group must call it (collective, see
    the module docstring): rank 0 with the real weights, the others with the model on the meta
    device; rank 0 gets the decomposed modules, the others meta-device skeletons. ``check(r)``, when
    given, is called before each round of SVDs (one target per thread or rank), by every rank the
    same number of times: a collective poll for a stop (:meth:`..checkpoint.requests.RequestPoller.stop_check`)
    whose exception abandons the decomposition.

    Returns:
        The replaced modules and the time taken (s).

    Raises:
        ValueError: from :func:`plan_targets`.
    """
    start = time.perf_counter()
    targets = plan_targets(model, settings, urr_by_module, bases)
    svds = _threaded_svds(targets, check) if world_size == 1 else _svds_over_ranks(targets, rank, world_size, check)
    modules, experts = _replace_targets(model, targets, svds, "meta")
    return OSFTModel(modules=modules, svd_seconds=time.perf_counter() - start, experts=experts)


def skeleton_osft(model: nn.Module, settings: OSFTSettings, device: torch.device | str,
                  plans: Mapping[str, ModulePlan] | None) -> OSFTModel:
    """Replace every target by an uninitialised :meth:`OSFTLinear.empty` on ``device`` with the
    layout its checkpoint stored (``plans`` by module name; no SVD): the values come from a
    full-state checkpoint. ``plans=None`` (a checkpoint from before plans were stored) lays out
    unprotected modules at the settings' URR.

    Raises:
        ValueError: from :func:`plan_targets`.
    """
    targets = plan_targets(model, settings, plans=plans)
    modules, experts = _replace_targets(model, targets, itertools.repeat(None), device)
    return OSFTModel(modules=modules, svd_seconds=0.0, experts=experts)


def _replace_targets(model: nn.Module, targets: Sequence[Target], svds: Iterable[SVD | None], device: torch.device | str
                     ) -> tuple[list[tuple[str, OSFTLinear]], list[tuple[str, OSFTExperts]]]:
    """Put an :class:`OSFTLinear` in place of each target: decomposed from its weight with its SVD,
    or, where the SVD is None, an uninitialised skeleton on ``device`` in the weight's dtype. The
    banks of an experts module replace it together, as an :class:`.experts.OSFTExperts`.

    Returns:
        The OSFT modules and the experts modules that hold banks, by name.
    """
    replaced, banks = [], {}
    for target, svd in zip(targets, svds):
        if svd is None:
            new = OSFTLinear.empty(target.plan.n, target.plan.m, target.bias is not None, transposed=target.transposed,
                                   dtype=target.matrix.dtype, device=device, plan=target.plan)
        else:
            stored = target.matrix.mT if target.transposed else target.matrix
            new = OSFTLinear.from_weight(stored, target.bias, transposed=target.transposed, svd=svd,
                                         protected=target.protected, plan=target.plan)
        if target.experts is None:
            replace_module(model, target.name, new)
        else:
            banks.setdefault(target.experts, {})[target.name.rpartition(".")[2]] = new
        replaced.append((target.name, new))
    experts = []
    for name, bank in banks.items():
        fused = model.get_submodule(name)
        wrapper = OSFTExperts(fused, ExpertLayout.of(fused), bank)
        replace_module(model, name, wrapper)
        experts.append((name, wrapper))
    return replaced, experts


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put ``new`` in place of the submodule called ``name`` (a dotted path) of ``model``."""
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def _svd(weight: torch.Tensor, protected: tuple[torch.Tensor, torch.Tensor] | None) -> SVD:
    """:func:`.decomposition.protected_svd` of an N×M weight or an E×N×M bank with its protected
    bases (None: none; a bank without them is one batched :func:`.decomposition.thin_svd`)."""
    time.sleep(test_hooks.svd_delay())  # test hook (.test_hooks.SVD_DELAY_ENV)
    lead = weight.shape[0] if weight.dim() == 3 else 0
    return protected_svd(weight, *(protected or no_bases(*weight.shape[-2:], like=weight, experts=lead)))


def _threaded_svds(targets: Sequence[Target], check: Check | None) -> Iterator[SVD]:
    """The SVD of each target's N×M weight with its protected bases, in order, on one rank: on CPU
    one decomposition per thread (:func:`..distributed.map_on_threads`, ``check(r)`` before each
    round of one target per thread), on CUDA one after another (``check(i)`` before target i)."""
    def one(target: Target) -> SVD:
        return _svd(target.matrix, target.protected)

    if targets and targets[0].matrix.is_cuda:
        for i, target in enumerate(targets):
            if check is not None:
                check(i)
            yield one(target)
        return
    yield from map_on_threads(one, targets, check)


def _svds_over_ranks(targets: Sequence[Target], rank: int, world_size: int, check: Check | None
                     ) -> Iterator[SVD | None]:
    """The SVDs of the targets spread over the ranks (see the module docstring): on rank 0 each
    target's SVD in order (float64 CPU factors), on the others None for each. Collective, in rounds
    of one target per rank (target first + k to rank k): ``check(r)``, when given, is called by
    every rank before round r, ceil(targets / world_size) times, with no message in flight; the
    factors of a round reach rank 0 as the caller asks for its items."""
    host = control_group()  # the factors live on the host: under NCCL its gloo group carries them
    for r, first in enumerate(range(0, len(targets), world_size)):
        if check is not None:
            check(r)
        round_ = targets[first:first + world_size]
        w = None
        for k, target in enumerate(round_):  # 1. weights from rank 0 to their owners
            if rank == 0 and k == 0:
                w = target.matrix.detach().contiguous()
            elif rank == 0:
                dist.send(target.matrix.detach().contiguous(), dst=k, group=host)
            elif rank == k:
                w = torch.empty(target.matrix.shape, dtype=target.matrix.dtype)
                dist.recv(w, src=0, group=host)
        factors = _svd(w, round_[rank].protected) if rank < len(round_) else None  # 2. this rank's share
        for k, target in enumerate(round_):  # 3. factors back to rank 0, one target at a time
            if rank == 0 and k == 0:
                yield factors
            elif rank == 0:
                n, m, rk = target.plan.n, target.plan.m, target.plan.rank
                lead = target.matrix.shape[:-2]
                svd = (torch.empty(*lead, n, rk, dtype=torch.float64), torch.empty(*lead, rk, dtype=torch.float64),
                       torch.empty(*lead, rk, m, dtype=torch.float64))
                for t in svd:
                    dist.recv(t, src=k, group=host)
                yield svd
            else:
                if rank == k:
                    for t in factors:
                        dist.send(t.contiguous(), dst=0, group=host)
                yield None


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's complete (unsharded) state dict.

    Plain ``model.state_dict()`` on one rank; under FSDP2 every rank must call it, rank 0 receives
    the gathered tensors on CPU and the other ranks an empty dict
    (``torch.distributed.checkpoint.state_dict.get_model_state_dict`` with ``full_state_dict`` and
    ``cpu_offload``).
    """
    if not any(is_sharded(p) for p in model.parameters()):
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


@torch.no_grad()
def dense_state_dict(state: dict[str, torch.Tensor], osft: OSFTModel | None) -> dict[str, torch.Tensor]:
    """Turn a full state dict of an OSFT model into one under the original (pre-OSFT) parameter
    names with dense weights.

    Each OSFT module ``X`` contributes ``X.weight`` = W_high + U_low·diag(S_low)·V_low (N×M, or
    its transpose for GPT-2 ``Conv1D``), computed in float32, and ``X.bias``; the banks of an experts
    module ``Y`` are rebuilt the same way (E×N×M each) and fused back into ``Y.gate_up_proj``,
    ``Y.down_proj`` (and their biases) in the original layout (:meth:`.experts.ExpertLayout.fuse`);
    projection bases are dropped; every other entry is passed through.
    """
    if osft is None:
        return dict(state)
    out = {k: v for k, v in state.items() if k.rpartition(".")[0] not in dict(osft.modules)}
    banks = {}
    for name, module in osft.modules:
        dense = dense_from_factors(*(state[f"{name}.{k}"].float() for k in ("W_high", "U_low", "S_low", "V_low")))
        bias = state.get(f"{name}.bias")
        if module.plan.experts:
            banks[name] = (dense, bias)
            continue
        out[f"{name}.weight"] = (dense.t() if module.transposed else dense).contiguous()
        if bias is not None:
            out[f"{name}.bias"] = bias
    for name, experts in osft.experts:
        fused = experts.layout.fuse({bank: banks[f"{name}.{bank}"] for bank in experts.layout.bank_names()})
        out.update({f"{name}.{key}": tensor for key, tensor in fused.items()})
    return out
