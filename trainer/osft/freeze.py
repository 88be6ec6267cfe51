"""``--freeze-non-target``: train only the OSFT targets; ``--freeze-router``: keep the MoE routers
as they are; and the count of trainable parameters.

By default every parameter that is not an OSFT target (embeddings, LM head, norms, biases of
non-target layers) trains normally next to the low-rank factors, except in a chained run (one that
protects the subspaces of an earlier run, :func:`non_targets_frozen`): every protection is
layer-local, so an embedding or norm that moves changes the inputs the protected layers see, and
what they keep of earlier tasks with them. Freezing them leaves AdamW only
U_low, S_low, V_low and the targets' own biases, so an update can only change the targets'
low-rank parts. A frozen parameter stays a ``requires_grad=False`` parameter: FSDP2's
``fully_shard`` shards it like the frozen OSFT factors, and full-state checkpoints still save it
(it is model state; only the per-run frozen factors of :data:`..checkpoint.full_state.FROZEN_PARAMS`
are stored once per run).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from .experts import router_parameters
from .surgery import OSFTModel

if TYPE_CHECKING:
    from ..config import TrainConfig


def non_targets_frozen(cfg: TrainConfig) -> tuple[bool, str | None]:
    """Whether this run freezes the non-target parameters, and the console's reason when it does.

    ``--freeze-non-target`` / ``--no-freeze-non-target`` decide; unset (None), an OSFT run that
    protects the subspaces of the export it starts from (``osft_subspaces.safetensors`` there and
    ``--osft-protect-subspaces``) freezes them, any other run trains them. Decided from the model
    directory, so a resumed run decides the same.
    """
    from ..checkpoint.subspaces import subspaces_file

    if cfg.freeze_non_target is not None:
        return bool(cfg.freeze_non_target), "non-target parameters frozen (--freeze-non-target)"
    if not (cfg.osft and cfg.osft_protect_subspaces and subspaces_file(cfg.model_name_or_path) is not None):
        return False, None
    return True, ("non-target parameters frozen: a chained run protects the subspaces of "
                  f"{cfg.model_name_or_path}, and a moving embedding or norm would change the inputs of every "
                  "protected layer (--no-freeze-non-target trains them)")


def freeze_non_targets(model: nn.Module, osft: OSFTModel) -> None:
    """Set ``requires_grad=False`` on every parameter of ``model`` that is not a trainable parameter
    of one of ``osft``'s modules (U_low, S_low, V_low, bias).

    Works before or after FSDP2's ``fully_shard`` (before the first forward): the sharded
    parameters are the ones ``model.parameters()`` yields, and FSDP2 creates the unsharded ones
    with the sharded parameter's ``requires_grad`` at its lazy initialisation. A tied input
    embedding and LM head are one parameter, so they are frozen together. Call it before the
    optimizer is built: the optimizer must get only trainable parameters.
    """
    keep = {id(p) for m in osft.osft_modules for p in m.parameters() if p.requires_grad}
    for p in model.parameters():
        if id(p) not in keep:
            p.requires_grad_(False)


def freeze_routers(model: nn.Module, source: str) -> list[str]:
    """``--freeze-router``: set ``requires_grad=False`` on the router (gate) parameters of every MoE
    block of ``model`` (:func:`.experts.router_parameters`: the E×H weight beside an experts
    module, and its bias), which otherwise train as normal parameters. The experts keep training
    (under OSFT, or fully with ``--no-osft``). Works before or after FSDP2's ``fully_shard`` and
    on a model on the meta device (the launcher's check before any rank starts); call it before
    the optimizer is built.

    Args:
        source: the model's path, for the error message.

    Returns:
        The frozen parameters' full names.

    Raises:
        ValueError: ``model`` has no MoE router (no fused experts module; names ``source``).
    """
    names = router_parameters(model)
    if not names:
        raise ValueError(f"--freeze-router: {source} ({type(model).__name__}) has no MoE router to freeze: it has no "
                         "mixture-of-experts block (fused experts module beside an E x hidden router weight)")
    for name, p in model.named_parameters():
        if name in names:
            p.requires_grad_(False)
    return sorted(names)


@dataclass(frozen=True)
class ParameterCount:
    """Elements of a model's parameters (global shapes, also under FSDP2; a tied parameter once):
    ``trainable`` (what AdamW updates) and ``total`` (the dense model's own parameters)."""

    trainable: int
    total: int

    def describe(self) -> str:
        """One console line, e.g. ``parameters: 1,234,567 trainable of 4,567,890 in the model (27.0%)``."""
        share = 100.0 * self.trainable / self.total if self.total else 0.0
        return f"parameters: {self.trainable:,} trainable of {self.total:,} in the model ({share:.1f}%)"


def count_parameters(model: nn.Module, osft: OSFTModel | None) -> ParameterCount:
    """Trainable (``requires_grad``) parameter elements of ``model``, and the parameter count of the
    dense model it stands for: an OSFT module counts as its N×M weight (E of them for an expert
    bank) and bias, not as the
    factors and frozen bases it stores (W_high, U_basis, V_basis, the start factors, P, Q), so the
    total is the model's usual size (about 135 M for SmolLM2-135M).
    """
    params = list(model.parameters())
    stored = {id(p) for m in (osft.osft_modules if osft else []) for p in m.parameters()}
    dense = sum(m.plan.n * m.plan.m * m.plan.copies + (m.bias.numel() if m.bias is not None else 0)
                for m in (osft.osft_modules if osft else []))
    return ParameterCount(trainable=sum(p.numel() for p in params if p.requires_grad),
                          total=dense + sum(p.numel() for p in params if id(p) not in stored))
