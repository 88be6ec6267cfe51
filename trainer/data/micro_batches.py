"""One batch's packed micro-batches: the plan of every rank (:func:`.packing.plan_micro_batches`)
paired with the collation of this rank's micro-batches (:func:`.collate.collate_packed`).

The train step, evaluation, the input Grams of the protected-subspace export and the importance
calibration all iterate a batch this way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from .collate import collate_packed
from .packing import plan_micro_batches


@dataclass(frozen=True)
class MicroBatches:
    """The packed micro-batches of one batch of samples.

    ``plans[r][m]``: the sample positions (into ``lengths``) of micro-batch m of rank r;
    ``sample(i)``: the tokenized row at position i; ``lengths``: int array [n], tokens per sample.
    Iterating yields this rank's micro-batches, collated (:func:`.collate.collate_packed`), and None
    for an empty one (fewer samples than micro-batches: the rank still joins the collectives).
    """

    plans: list[list[list[int]]]
    rank: int
    sample: Callable[[int], dict]
    lengths: np.ndarray

    def __len__(self) -> int:
        return len(self.plans[self.rank])

    def __iter__(self) -> Iterator[dict | None]:
        for micro in self.plans[self.rank]:
            yield collate_packed([self.sample(i) for i in micro]) if micro else None

    def lengths_by_rank(self) -> list[np.ndarray]:
        """The token lengths of the samples each rank trains (one int array per rank)."""
        return [self.lengths[[i for micro in plan for i in micro]] for plan in self.plans]


def micro_batches(sample: Callable[[int], dict], lengths, max_tokens: int, world_size: int = 1,
                  rank: int = 0) -> MicroBatches:
    """Plan the samples of ``lengths`` (tokens each; ``sample(i)`` gives row i) into micro-batches of
    at most ``max_tokens`` tokens for ``world_size`` ranks, iterated as this ``rank``'s.

    Raises:
        ValueError: a sample longer than ``max_tokens`` or of length 0 (from the packer).
    """
    lengths = np.asarray(lengths)
    return MicroBatches(plan_micro_batches(lengths, max_tokens, world_size), rank, sample, lengths)
