"""The summed token loss of one packed micro-batch: what the train step, evaluation and the input
Grams of the export run the model with.

Loss = cross-entropy summed over the trained tokens of the row (labels already shifted by
:func:`.data.collate.collate_packed`); the caller divides by the loss tokens of the global batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..data.tokenize import IGNORE_INDEX
from ..model.packed_attention import BOUNDS_KWARG
from .router_loss import router_aux_coef, router_term


class MicroBatchLoss:
    """``loss(batch, float64_sum=False)``: the summed token loss of ``batch`` through ``model`` on
    ``device``, each packed sample attending only to itself with ``packed_attention``
    (:mod:`osft.trainer.model.packed_attention`). With a router auxiliary loss (:mod:`osft.trainer.run.router_loss`: ``router_coef``
    non-zero) each forward keeps transformers' ``aux_loss`` for :meth:`router_term`."""

    def __init__(self, model: nn.Module, device: torch.device, packed_attention: bool) -> None:
        self.model, self.device, self.packed_attention = model, device, packed_attention
        self.router_coef = router_aux_coef(model.config)
        self.last_aux_loss: torch.Tensor | None = None

    def __call__(self, batch: dict | None, float64_sum: bool = False) -> torch.Tensor:
        """Summed token loss of one packed micro-batch (float32 scalar, on the device; with
        ``float64_sum`` the float32 token losses are summed in float64, as evaluation does, so the
        sum hardly depends on how the samples were packed).

        ``None`` is this rank's empty micro-batch (fewer samples than micro-batches): a one-token
        forward whose loss is multiplied by 0, so the rank still joins FSDP's collectives.
        """
        if batch is None:
            pad = torch.zeros((1, 1), dtype=torch.long, device=self.device)
            return self.model(input_ids=pad, use_cache=False).logits.float().sum() * 0.0
        # The LM head runs only where a label is trained (transformers' ``logits_to_keep`` with the
        # positions as a 1-D tensor): prompts, system turns and padding get no V-wide logits, and no
        # float32 copy of them is made for the cross-entropy (the packed row is one sample row).
        # The positions are found on the host, where collate_packed made the labels: a nonzero()
        # on the device would wait for it once per micro-batch.
        keep = (batch["labels"][0] != IGNORE_INDEX).nonzero().squeeze(1)
        bounds = {BOUNDS_KWARG: batch["sample_bounds"]} if self.packed_attention else {}
        out = self.model(
            input_ids=batch["input_ids"].to(self.device),
            position_ids=batch["position_ids"].to(self.device),
            use_cache=False,
            logits_to_keep=keep.to(self.device),
            **bounds,
        )
        self.last_aux_loss = getattr(out, "aux_loss", None)
        logits = out.logits
        losses = F.cross_entropy(
            logits.view(-1, logits.shape[-1]).float(),
            batch["labels"][0, keep].to(self.device),
            reduction="none" if float64_sum else "sum",
        )
        return losses.double().sum() if float64_sum else losses

    def router_term(self, batch: dict | None) -> torch.Tensor | None:
        """What the routers' auxiliary loss of the last forward (on ``batch``) adds to its summed
        token loss (:func:`osft.trainer.run.router_loss.router_term`); None without one."""
        return router_term(self.last_aux_loss, self.router_coef, batch)

    def router_fields(self, losses: list[float], loss_tokens: int) -> dict[str, float]:
        """The step record's ``ce_loss`` and ``router_aux_loss`` from the ranks' (CE sum, router
        term) pairs in ``losses`` (empty without a router auxiliary loss)."""
        if not self.router_coef:
            return {}
        return {"ce_loss": sum(losses[0::2]) / loss_tokens,
                "router_aux_loss": sum(losses[1::2]) / loss_tokens / self.router_coef}
