"""The load-balancing (auxiliary) loss of MoE routers in the training loss.

A model whose config asks for router logits (``output_router_logits: true``) with a non-zero
``router_aux_loss_coef`` (Mixtral, Qwen3-MoE, ...; what transformers adds to its own loss) trains on
cross-entropy + coefficient × auxiliary loss, as transformers computes it for one sample. Over a
global batch each micro-batch's auxiliary loss (transformers' ``aux_loss`` of that packed row) is
weighted by its share of the batch's loss tokens, so the loss does not depend on the rank count
beyond float rounding; the two parts are logged apart (``ce_loss``, ``router_aux_loss`` in the
``step`` record). Any other model trains on plain cross-entropy (docs/osft.md, Targets, next to
``--freeze-router``; tests/test_osft_experts.py::test_the_router_auxiliary_loss_is_trained_as_transformers_computes_it).
"""

from __future__ import annotations

import torch

from ..data.tokenize import IGNORE_INDEX


def router_aux_coef(config) -> float:
    """The coefficient of the router auxiliary loss the model ``config`` asks for (0.0: none)."""
    if not getattr(config, "output_router_logits", False):
        return 0.0
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)


def router_term(aux_loss: torch.Tensor | None, coef: float, batch: dict | None) -> torch.Tensor | None:
    """``coef`` × ``aux_loss`` × the loss tokens of ``batch`` (a scalar on ``aux_loss``'s device):
    what one micro-batch adds to the summed token loss, so that dividing by the batch's loss tokens
    gives the token-weighted auxiliary loss. None for no term (no coefficient, no auxiliary loss,
    or this rank's empty micro-batch)."""
    if not coef or aux_loss is None or batch is None:
        return None
    return coef * aux_loss.float() * int((batch["labels"][0] != IGNORE_INDEX).sum())


def describe(coef: float) -> str:
    """The start-up line for a model whose routers have an auxiliary loss."""
    return (f"MoE router auxiliary loss: the training loss is cross-entropy + {coef:g} x load-balancing loss "
            "(router_aux_loss_coef and output_router_logits of the model config)")
