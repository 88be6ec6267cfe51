"""The loss of one evaluation or retention set: the exact token mean over all ranks, computed
like the training loss (same packing and collate, no gradient), without touching the training state.

Every rank packs the whole set with the training packer (:func:`.data.packing.plan_micro_batches`
at ``--max-tokens-per-gpu``) and runs its own micro-batches; the summed token losses and the loss
tokens of all ranks are added up, so the result does not depend on the rank count beyond float
rounding: the float32 token losses are summed in float64, and 2 ranks equal 1 rank to about 1e-8
relative (tested to 1e-7). :func:`evaluation_mode` makes the
evaluation invisible to training: eval mode, no autograd, and every generator state put back.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from .. import test_hooks
from ..checkpoint.full_state import capture_rng, restore_rng
from ..data.micro_batches import micro_batches
from ..distributed import DistEnv, global_sums
from .eval_sets import EvalSet


@dataclass(frozen=True)
class EvalResult:
    """One set evaluated: ``loss`` (nats per loss token, the token mean over all ranks),
    ``loss_tokens`` (over all ranks), ``samples``, ``tokens`` (all tokens of its samples: with the
    sample count, what identifies the set's content) and the wall time ``seconds``."""

    name: str
    kind: str
    loss: float
    loss_tokens: int
    samples: int
    tokens: int
    seconds: float


@contextmanager
def evaluation_mode(model: nn.Module) -> Iterator[None]:
    """Run the body with ``model`` in eval mode under ``torch.no_grad()``; afterwards restore the
    model's mode and every generator state (Python, NumPy, torch, CUDA), so that training goes on
    exactly as if nothing had run."""
    rng = capture_rng()
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)
        restore_rng(rng)


def evaluate_set(eval_set: EvalSet, micro_batch_loss: Callable[[dict | None], torch.Tensor], max_tokens: int,
                 dist: DistEnv, check: Callable[[int], None] | None = None, step: int = 0) -> EvalResult:
    """Evaluate one set (collective: every rank calls it, inside :func:`evaluation_mode`).

    Args:
        micro_batch_loss: summed token loss of one packed micro-batch (a scalar tensor); called
            with None for this rank's empty micro-batch (fewer samples than micro-batches), which
            must still join the model's collectives and add 0.
        max_tokens: token budget of one micro-batch (``--max-tokens-per-gpu``).
        check: called before each micro-batch with its index (every rank has as many):
            :meth:`.checkpoint.requests.RequestPoller.stop_check`, which raises
            :class:`.checkpoint.requests.StopRequested` to abandon the pass on a stop request.
        step: the optimizer steps done (for the test hook :data:`.test_hooks.EVAL_DELAY_ENV`).

    Returns:
        the token-mean loss over every selected sample of the set (NaN if it is not finite).

    Raises:
        ValueError: a sample longer than ``max_tokens`` (as the packer raises it).
        StopRequested: from ``check``.
    """
    start = time.perf_counter()
    loss_sum = torch.zeros((), dtype=torch.float64)
    loss_tokens = 0
    delay = test_hooks.eval_delay(step)
    batches = micro_batches(eval_set.sample, eval_set.lengths, max_tokens, dist.world_size, dist.rank)
    for m, batch in enumerate(batches):
        if check is not None:
            check(m)
        time.sleep(delay)
        loss_sum += micro_batch_loss(batch).double().cpu()
        if batch is not None:
            loss_tokens += int(batch["num_loss_tokens"])
    total, tokens_by_rank = global_sums(loss_sum, loss_tokens)
    tokens = sum(tokens_by_rank)
    loss = total / tokens if tokens else math.nan
    return EvalResult(eval_set.name, eval_set.kind, loss, tokens, len(eval_set), int(eval_set.lengths.sum()),
                      time.perf_counter() - start)
