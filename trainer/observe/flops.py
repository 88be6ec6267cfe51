"""Model FLOPs of a training step, as in the usual MFU definition.

Source: Chowdhery et al., "PaLM: Scaling Language Modeling with Pathways" (2022), appendix B. A
training step (forward + backward) of a decoder costs per token

    6·N + 12·L·H·Q·T   FLOPs

where N counts the parameters used in matrix products (every linear layer, including the LM head
whether or not it is tied to the embedding; not the embedding lookup, norms or biases' adds), L is
the number of layers, H·Q the attention width (heads × head dimension) and T the length of the
sequence the token attends over. We take T as each sample's own length, not the packed row's (a
block-diagonal mask makes a sample attend only to itself), so a step over samples of lengths T_i
costs ``6·N·ΣT_i + 12·L·H·Q·ΣT_i²``. As in PaLM the attention term is not halved for the causal
mask. The count depends only on the model's config, so OSFT and full fine-tuning are measured with
the same formula: OSFT's extra projection work is overhead, not model FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from transformers.pytorch_utils import Conv1D


@dataclass(frozen=True)
class FlopModel:
    """The two numbers of the formula: ``matmul_params`` (N) and ``attention_width`` (L·H·Q)."""

    matmul_params: int
    attention_width: int

    @property
    def dense_flops_per_token(self) -> int:
        """6·N: FLOPs per token of the linear layers (forward + backward)."""
        return 6 * self.matmul_params

    def step_flops(self, lengths) -> float:
        """Model FLOPs of one training step over samples of ``lengths`` (tokens each, int array [S])."""
        t = np.asarray(lengths, dtype=np.float64)
        return float(6 * self.matmul_params * t.sum() + 12 * self.attention_width * (t * t).sum())

    def to_json(self) -> dict:
        """Plain data for the ``run_started`` record."""
        return {"matmul_params": self.matmul_params, "attention_width": self.attention_width,
                "dense_flops_per_token": self.dense_flops_per_token,
                "formula": "6*matmul_params*sum(T) + 12*attention_width*sum(T^2) per step (PaLM app. B)"}


def flop_model(config, vocab_size: int | None = None) -> FlopModel:
    """N and L·H·Q of a Hugging Face causal LM ``config``, counted on a meta-device instance (no
    memory, no weights): the weights of every ``nn.Linear`` and GPT-2 ``Conv1D``, the LM head
    counted once even when tied. ``vocab_size`` overrides the config's (a resized embedding)."""
    from transformers import AutoModelForCausalLM

    if vocab_size is not None and vocab_size != config.vocab_size:
        config = type(config).from_dict({**config.to_dict(), "vocab_size": vocab_size})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = sum(m.weight.numel() for m in model.modules() if isinstance(m, (nn.Linear, Conv1D)))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return FlopModel(matmul_params=int(params),
                     attention_width=int(config.num_hidden_layers * config.num_attention_heads * head_dim))


def mfu(flops: float, seconds: float, peak_flops_per_s: float) -> float | None:
    """Model FLOPs utilisation: ``flops`` / ``seconds`` / ``peak_flops_per_s`` (a fraction; None
    without a positive time or peak)."""
    if seconds <= 0 or not peak_flops_per_s or peak_flops_per_s <= 0:
        return None
    return flops / seconds / peak_flops_per_s


@dataclass
class Utilization:
    """MFU of the step records: the job's and one node's, against the peaks measured on every rank.

    ``peaks`` holds each rank's measured GEMM peak (FLOP/s, by global rank, :mod:`osft.trainer.observe.matmul_peak`);
    ``node_of_rank`` each rank's node. A peak measured while the machine was busy can come out
    below what a training step then achieves in model FLOP/s (which never exceeds the true peak):
    the denominator is the larger of the measured peak and the fastest step so far
    (``fastest``: job, node; FLOP/s), so MFU never exceeds 1, and :attr:`peak_exceeded` says when
    a step went past the measurement.
    """

    flops: FlopModel
    peaks: tuple[float, ...]
    node_of_rank: tuple[int, ...]
    node_rank: int
    fastest: list[float] = field(default_factory=lambda: [0.0, 0.0])

    def __post_init__(self) -> None:
        #: This node's global ranks, and the measured peaks (FLOP/s) of the job and of this node.
        self.mine = [r for r, node in enumerate(self.node_of_rank) if node == self.node_rank]
        self.measured = (sum(self.peaks), sum(self.peaks[r] for r in self.mine))

    @property
    def peak_exceeded(self) -> bool:
        """Whether a step achieved more model FLOP/s than the measured peak of the job or the node."""
        return self.fastest[0] > self.measured[0] or self.fastest[1] > self.measured[1]

    def fields(self, lengths_by_rank: list, seconds: float) -> dict:
        """``model_flops`` (job, FLOPs), ``flops_per_s``, ``mfu`` and ``node_mfu`` of a step of
        ``seconds`` in which rank r trained samples of ``lengths_by_rank[r]`` tokens."""
        per_rank = [self.flops.step_flops(lengths) for lengths in lengths_by_rank]
        total, node_total = sum(per_rank), sum(per_rank[r] for r in self.mine)
        if seconds > 0:
            self.fastest = [max(self.fastest[0], total / seconds), max(self.fastest[1], node_total / seconds)]
        return dict(model_flops=total, flops_per_s=total / seconds if seconds > 0 else None,
                    mfu=mfu(total, seconds, max(self.measured[0], self.fastest[0])),
                    node_mfu=mfu(node_total, seconds, max(self.measured[1], self.fastest[1])))
