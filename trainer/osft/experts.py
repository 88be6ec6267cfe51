"""Mixture-of-experts weights under OSFT: the fused 3-D expert tensors of an experts module,
split into per-projection banks of E expert weights, and put back together.

On transformers 5 an MoE block's experts are one module (Mixtral, Qwen3-MoE, gpt-oss, ...,
decorated by ``transformers.integrations.moe.use_experts_implementation``) holding fused
parameters: ``gate_up_proj`` (E×2I×H; with ``is_transposed`` E×H×2I, the layout of x·W) and
``down_proj`` (E×H×I; transposed E×I×H), ``up_proj`` instead of ``gate_up_proj`` without a gate,
and ``<name>_bias`` (E×out) with ``has_bias``. The gate and up halves are the rows [:I] and [I:] of
the out×in matrix (``is_concatenated``) or its even and odd rows (interleaved, gpt-oss).

Each projection becomes a bank (:class:`.decomposition.OSFTLinear` with a plan of ``experts`` = E):
``gate_proj`` (E×I×H), ``up_proj`` (E×I×H) and ``down_proj`` (E×H×I), in out×in form like the dense
``gate_proj``/``up_proj``/``down_proj`` of a Llama MLP, so the gate and up halves are decomposed
separately, every expert by its own SVD (Nayak et al. 2025, section 3, per weight matrix).
:class:`OSFTExperts` replaces the experts module: each forward rebuilds the fused tensors from the
banks (W = W_high + U_low·diag(S_low)·V_low per expert, ``torch.baddbmm``) and runs the original
experts module's own forward on them, whatever its kernel (eager loop, ``grouped_mm``,
``batched_mm``). The export writes the fused tensors under their original names and shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ExpertLayout:
    """How an experts module stores its fused weights (the flags ``use_experts_implementation``
    sets on it): ``has_gate`` (``gate_up_proj``, else ``up_proj``), ``is_transposed`` (stored as
    E×in×out), ``is_concatenated`` (gate rows then up rows; else interleaved), ``has_bias``."""

    has_gate: bool
    is_transposed: bool
    is_concatenated: bool
    has_bias: bool

    @classmethod
    def of(cls, module: nn.Module) -> ExpertLayout | None:
        """The layout of a fused experts module, None for any other module."""
        flags = ("has_gate", "is_transposed", "is_concatenated", "has_bias")
        if not all(isinstance(getattr(module, f, None), bool) for f in flags):
            return None
        layout = cls(*(getattr(module, f) for f in flags))
        fused = getattr(module, layout.fused_names()[0], None)
        return layout if isinstance(fused, nn.Parameter) and fused.dim() == 3 else None

    def fused_names(self) -> tuple[str, str]:
        """The fused weight parameters: (``gate_up_proj`` or ``up_proj``, ``down_proj``)."""
        return ("gate_up_proj" if self.has_gate else "up_proj"), "down_proj"

    def bank_names(self) -> tuple[str, ...]:
        """The banks, named like a dense MLP's projections: gate_proj, up_proj, down_proj (no
        gate_proj without a gate)."""
        return ("gate_proj", "up_proj", "down_proj") if self.has_gate else ("up_proj", "down_proj")

    def split(self, tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        """Per bank ``(W: E×N×M out×in, bias: E×N or None)`` from the fused tensors by parameter name
        (views where the layout allows, the caller copies)."""
        first, down = self.fused_names()
        out = {}
        for fused, banks in ((first, self.bank_names()[:-1]), (down, ("down_proj",))):
            w = tensors[fused].mT if self.is_transposed else tensors[fused]
            b = tensors.get(f"{fused}_bias") if self.has_bias else None
            for i, bank in enumerate(banks):
                rows = self._rows(i, len(banks), w.shape[-2])
                out[bank] = (w[..., rows, :], None if b is None else b[..., rows])
        return out

    def fuse(self, banks: dict[str, tuple[torch.Tensor, torch.Tensor | None]]) -> dict[str, torch.Tensor]:
        """Inverse of :meth:`split`: the fused tensors by their original parameter names and shapes."""
        first, down = self.fused_names()
        out = {}
        for fused, names in ((first, self.bank_names()[:-1]), (down, ("down_proj",))):
            ws = [banks[n][0] for n in names]
            w = ws[0] if len(ws) == 1 else self._join(ws, dim=-2)
            out[fused] = (w.mT if self.is_transposed else w).contiguous()
            if self.has_bias:
                bs = [banks[n][1] for n in names]
                out[f"{fused}_bias"] = (bs[0] if len(bs) == 1 else self._join(bs, dim=-1)).contiguous()
        return out

    def _rows(self, i: int, parts: int, rows: int) -> slice:
        """The out-rows of part ``i`` of ``parts`` halves of a fused matrix of ``rows`` rows."""
        if parts == 1:
            return slice(None)
        if self.is_concatenated:
            return slice(i * rows // parts, (i + 1) * rows // parts)
        return slice(i, None, parts)

    def _join(self, halves: list[torch.Tensor], dim: int) -> torch.Tensor:
        """Gate and up halves back into one tensor along ``dim`` (negative): concatenated, or
        interleaved (rows a0, b0, a1, b1, ...: stacked on a new axis just inside ``dim``, then
        flattened into it)."""
        if self.is_concatenated:
            return torch.cat(halves, dim=dim)
        return torch.stack(halves, dim=dim).flatten(dim - 1, dim)


def find_experts_modules(model: nn.Module) -> list[tuple[str, nn.Module, ExpertLayout]]:
    """Every fused experts module of ``model`` (:meth:`ExpertLayout.of`), in ``named_modules`` order."""
    return [(name, module, layout) for name, module in model.named_modules() if (layout := ExpertLayout.of(module))]


def router_parameters(model: nn.Module) -> set[str]:
    """Full names of the MoE routers' parameters: those of every module beside an experts module
    (fused, or an :class:`OSFTExperts` after the surgery; its siblings in the MoE block) whose
    ``weight`` has one row per expert (E×H). They stay normal trainable parameters (not OSFT
    targets), or are frozen with ``--freeze-router`` (:func:`.freeze.freeze_routers`) or
    ``--freeze-non-target``."""
    names = set()
    for name, module in model.named_modules():
        experts = _expert_count(module)
        if experts is None:
            continue
        parent_name = name.rpartition(".")[0]
        for child_name, child in model.get_submodule(parent_name).named_children():
            weight = getattr(child, "weight", None)
            if child is not module and isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[0] == experts:
                names |= {f"{parent_name}.{child_name}.{p}" for p, _ in child.named_parameters()}
    return names


def _expert_count(module: nn.Module) -> int | None:
    """E of a fused experts module or an :class:`OSFTExperts`; None for any other module."""
    if isinstance(module, OSFTExperts):
        return next(iter(module.banks().values())).plan.experts
    layout = ExpertLayout.of(module)
    return None if layout is None else getattr(module, layout.fused_names()[1]).shape[0]


class OSFTExperts(nn.Module):
    """An experts module whose fused weights are OSFT banks.

    Children: ``fused`` (the original experts module, its fused weight and bias parameters removed)
    and one bank per projection (:meth:`ExpertLayout.bank_names`, each an
    :class:`.decomposition.OSFTLinear` with a leading expert dimension E on every tensor). FSDP2
    shards the banks along E like any parameter along dim 0, so each rank holds whole experts.
    """

    def __init__(self, fused: nn.Module, layout: ExpertLayout, banks: dict[str, nn.Module]) -> None:
        super().__init__()
        for name in layout.fused_names():
            for key in (name, f"{name}_bias"):
                if key in fused._parameters:
                    del fused._parameters[key]
        self.fused = fused
        self.layout = layout
        for name in layout.bank_names():
            self.add_module(name, banks[name])

    def banks(self) -> dict[str, nn.Module]:
        """The banks by projection name."""
        return {name: getattr(self, name) for name in self.layout.bank_names()}

    def forward(self, *args, **kwargs):
        """The original experts forward on the fused tensors rebuilt from the banks (autograd
        reaches U_low, S_low, V_low and the biases through them); the tensors are dropped after
        the call, so the module holds no dense copy between forwards."""
        dense = self.layout.fuse({name: (bank.dense_weight(), bank.bias) for name, bank in self.banks().items()})
        for key, tensor in dense.items():
            setattr(self.fused, key, tensor)
        try:
            return self.fused(*args, **kwargs)
        finally:
            for key in dense:
                delattr(self.fused, key)
