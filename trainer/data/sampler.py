"""Deterministic global-batch samplers: one dataset (a seeded permutation per epoch, cut into global
batches) or a weighted mixture of datasets (each step takes a fixed share of its batch from each).

Both give the sample indices of an optimizer step from the step number (``indices``), describe their
position for a checkpoint (``state``), take it back on resume (``restore``) and name what a resume
needs unchanged (``layout``).
"""

from __future__ import annotations

import hashlib
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

    def indices(self, step: int) -> list[int]:
        """Sample indices of optimizer step ``step`` (0-based)."""
        return self.batch(*divmod(step, self.steps_per_epoch))

    def layout(self) -> dict:
        """What a bit-identical resume needs unchanged (compared with a checkpoint's ``sampler``)."""
        return {"num_samples": self.num_samples}

    def state(self, step: int) -> dict:
        """The data position after ``step`` steps, for ``trainer_state.json``."""
        epoch, index = divmod(step, self.steps_per_epoch)
        return {"seed": self.seed, "batch_size": self.batch_size, "num_samples": self.num_samples,
                "next_epoch": epoch, "next_index": index}

    def restore(self, state: dict, step: int) -> None:
        """Nothing to take back: the position is a function of the step."""


class MixtureSampler:
    """Yields the sample indices of each optimizer step from several datasets with weights.

    Dataset ``i`` (``sizes[i]`` samples, at ``offsets[i]`` of the concatenation) is an endless
    stream of passes, pass ``p`` a permutation seeded by ``(seed, i, p)``; its **position** is how
    many samples of the stream the run has taken. Step ``s`` takes ``n_i`` samples from each
    stream, the counts that keep every position within one sample of its target
    ``w_i * batch_size * (s + 1)`` and sum to ``batch_size`` (so the shares hold exactly over any
    stretch of steps, and a small dataset repeats while a large one is subsampled). An **epoch** is
    ``ceil(sum(sizes) / batch_size)`` steps: as many samples as all datasets hold together, drawn by
    weight. The positions after each step are saved in the checkpoint and restored on resume.

    Raises:
        ValueError: a dataset without samples, or ``batch_size`` < 1.
    """

    def __init__(self, sizes: list[int], weights: list[float], batch_size: int, seed: int) -> None:
        if min(sizes) < 1:
            raise ValueError(f"a dataset of the mixture has no usable training samples (sizes {sizes})")
        if batch_size < 1:
            raise ValueError(f"batch size must be >= 1, got {batch_size}")
        self.sizes, self.weights, self.batch_size, self.seed = list(sizes), list(weights), batch_size, seed
        self.num_samples = sum(sizes)
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self._base = self._last = (0, [0] * len(sizes))  # (step, positions before it)
        self._perms: dict[int, tuple[int, list[int]]] = {}

    # An epoch is the same number of steps as a single dataset of all the samples (class docstring).
    steps_per_epoch = GlobalBatchSampler.steps_per_epoch
    run_steps = GlobalBatchSampler.run_steps

    def counts(self, step: int, positions: list[int]) -> list[int]:
        """Samples step ``step`` takes from each dataset, given the ``positions`` before it."""
        target = [w * self.batch_size * (step + 1) for w in self.weights]
        n = [max(0, math.floor(t - c)) for t, c in zip(target, positions)]
        while sum(n) > self.batch_size:
            i = max((i for i in range(len(n)) if n[i] > 0), key=lambda i: positions[i] + n[i] - target[i])
            n[i] -= 1
        while sum(n) < self.batch_size:
            i = max(range(len(n)), key=lambda i: target[i] - positions[i] - n[i])
            n[i] += 1
        return n

    def positions(self, step: int) -> list[int]:
        """Every dataset's position after ``step`` steps.

        Raises:
            ValueError: ``step`` lies before the position this sampler was restored to.
        """
        start, positions = self._last if self._last[0] <= step else self._base
        if start > step:
            raise ValueError(f"the mixture sampler was restored at step {start}, cannot go back to step {step}")
        for s in range(start, step):
            positions = [c + n for c, n in zip(positions, self.counts(s, positions))]
        self._last = (step, positions)
        return positions

    def _perm(self, i: int, p: int) -> list[int]:
        if self._perms.get(i, (None,))[0] != p:
            key = hashlib.sha256(f"{self.seed}:{i}:{p}".encode()).digest()
            gen = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") >> 1)
            self._perms[i] = (p, torch.randperm(self.sizes[i], generator=gen).tolist())
        return self._perms[i][1]

    def indices(self, step: int) -> list[int]:
        """Sample indices (of the concatenation) of optimizer step ``step`` (0-based)."""
        positions = self.positions(step)
        out = []
        for i, (c, n) in enumerate(zip(positions, self.counts(step, positions))):
            for k in range(c, c + n):
                p, j = divmod(k, self.sizes[i])
                out.append(self.offsets[i] + self._perm(i, p)[j])
        return out

    def layout(self) -> dict:
        """What a bit-identical resume needs unchanged: the sizes and weights of the datasets."""
        return {"num_samples": self.num_samples, "mixture": [[n, w] for n, w in zip(self.sizes, self.weights)]}

    def state(self, step: int) -> dict:
        """The data position after ``step`` steps: every dataset's position, for ``trainer_state.json``."""
        epoch, index = divmod(step, self.steps_per_epoch)
        return {"seed": self.seed, "batch_size": self.batch_size, **self.layout(),
                "positions": self.positions(step), "next_epoch": epoch, "next_index": index}

    def restore(self, state: dict, step: int) -> None:
        """Continue from the positions a checkpoint saved after ``step`` steps."""
        self._base = self._last = (step, list(state["positions"]))


def make_sampler(sizes: list[int], weights: list[float] | None, batch_size: int, seed: int):
    """A :class:`MixtureSampler` for weighted datasets, else a :class:`GlobalBatchSampler` over all of them."""
    if weights is None:
        return GlobalBatchSampler(sum(sizes), batch_size, seed)
    return MixtureSampler(sizes, weights, batch_size, seed)


def check_enough_samples(num_samples: int, world_size: int) -> None:
    """Every rank needs at least one sample per epoch (tests/test_distributed.py::test_fewer_samples_than_ranks_fails_at_start).

    Raises:
        ValueError: ``num_samples < world_size``; the message names both counts.
    """
    if num_samples < world_size:
        raise ValueError(f"dataset has {num_samples} usable samples, fewer than world size {world_size}")
