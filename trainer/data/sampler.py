"""Deterministic global-batch sampler: a seeded permutation per epoch, cut into global batches."""

from __future__ import annotations

import math

import torch


class GlobalBatchSampler:
    """Yields the sample indices of each optimizer step.

    Epoch ``e`` shuffles all ``num_samples`` indices with a generator seeded ``seed + e`` (the same
    on every rank and on resume) and cuts the permutation into batches of ``batch_size`` samples;
    the last batch of an epoch may be smaller (its loss is still the exact token mean).

    Raises:
        ValueError: ``num_samples`` < 1 or ``batch_size`` < 1.
    """

    def __init__(self, num_samples: int, batch_size: int, seed: int) -> None:
        if num_samples < 1:
            raise ValueError("no usable training samples")
        if batch_size < 1:
            raise ValueError(f"batch size must be >= 1, got {batch_size}")
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.seed = seed

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps in one pass over the data."""
        return math.ceil(self.num_samples / self.batch_size)

    def run_steps(self, max_steps: int | None, num_epochs: int) -> int:
        """Optimizer steps of the whole run: ``max_steps`` when given (as in HF Trainer it overrides
        ``num_epochs``; epochs repeat as needed), else ``num_epochs`` passes over the data."""
        return max_steps or num_epochs * self.steps_per_epoch

    def batch(self, epoch: int, index: int) -> list[int]:
        """Sample indices of batch ``index`` (0-based) of ``epoch`` (0-based)."""
        gen = torch.Generator().manual_seed(self.seed + epoch)
        perm = torch.randperm(self.num_samples, generator=gen)
        return perm[index * self.batch_size : (index + 1) * self.batch_size].tolist()


def check_enough_samples(num_samples: int, world_size: int) -> None:
    """Every rank needs at least one sample per epoch (field case B25).

    Raises:
        ValueError: ``num_samples < world_size``; the message names both counts.
    """
    if num_samples < world_size:
        raise ValueError(f"dataset has {num_samples} usable samples, fewer than world size {world_size}")
