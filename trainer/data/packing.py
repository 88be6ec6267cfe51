"""Micro-batch planning: LPT (longest-processing-time-first) bin packing, compiled with numba.

Samples (by token length) are packed into bins of at most ``max_tokens_per_micro_batch`` tokens;
each bin becomes one packed micro-batch (see collate.py). The number of bins is a multiple of the
number of ranks, so every rank runs the same number of micro-batches per step (FSDP collectives
need every rank in every forward/backward). It starts at ``num_ranks * ceil(total / (max *
num_ranks))`` and grows by ``num_ranks`` until LPT places every sample within the limit.

LPT: samples in order of decreasing length (ties: lower index first) each go to the currently
least-loaded bin (ties: lower bin first). The result is deterministic; final bin loads differ by
at most the longest sample.
"""

from __future__ import annotations

import numpy as np
from numba import njit


def _compiled(fn):
    """``fn`` compiled by numba, with its on-disk cache where numba finds a writable place for it
    (next to this file, or ``$NUMBA_CACHE_DIR``, or the user's cache directory), else without: a
    read-only install directory and home (a container with a read-only root file system) costs a
    compilation per process, never the start."""
    try:
        return njit(cache=True)(fn)
    except RuntimeError as exc:  # numba: "cannot cache function ...: no locator available for file ..."
        if "no locator available" not in str(exc):
            raise
        return njit(fn)


@_compiled
def lpt_assign(lengths, n_bins, capacity):  # pragma: no cover - compiled
    """LPT-assign samples to ``n_bins`` bins of ``capacity`` tokens (numba-compiled).

    Args: ``lengths`` int64[n] (>= 1), ``n_bins`` int64 (>= 1), ``capacity`` int64.
    Returns ``(bin_of, loads, ok)``: ``bin_of`` int64[n], the bin of each sample; ``loads``
    int64[n_bins], tokens per bin; ``ok`` False if some bin would exceed ``capacity`` (the
    assignment is then incomplete).
    """
    n = lengths.shape[0]
    order = np.argsort(-lengths, kind="mergesort")  # stable: equal lengths keep index order
    bin_of = np.full(n, -1, dtype=np.int64)
    loads = np.zeros(n_bins, dtype=np.int64)
    # binary min-heap of bins keyed by (load, bin index)
    heap = np.arange(n_bins, dtype=np.int64)
    for k in range(n):
        i = order[k]
        b = heap[0]
        if loads[b] + lengths[i] > capacity:
            return bin_of, loads, False
        loads[b] += lengths[i]
        bin_of[i] = b
        # sift the root down
        pos = 0
        while True:
            left = 2 * pos + 1
            if left >= n_bins:
                break
            child = left
            right = left + 1
            if right < n_bins:
                cl, cr = heap[left], heap[right]
                if loads[cr] < loads[cl] or (loads[cr] == loads[cl] and cr < cl):
                    child = right
            c = heap[child]
            if loads[c] < loads[b] or (loads[c] == loads[b] and c < b):
                heap[pos] = c
                pos = child
            else:
                break
        heap[pos] = b
    return bin_of, loads, True


def plan_micro_batches(lengths, max_tokens_per_micro_batch: int, num_ranks: int = 1) -> list[list[list[int]]]:
    """Plan packed micro-batches for every rank.

    Args:
        lengths: token length of each sample, shape [n], integers >= 1.
        max_tokens_per_micro_batch: token budget of one packed micro-batch.
        num_ranks: data-parallel world size.

    Returns:
        ``plan[rank][m]`` = sorted sample indices (into ``lengths``) of micro-batch ``m`` of that
        rank. Every rank gets the same number of micro-batches, and micro-batch ``m`` of each rank
        has a similar load (bins are ranked by load and dealt out in rank order). A micro-batch is
        empty only when there are fewer samples than bins: n < num_ranks, or (when nearly every
        sample needs a bin of its own) n not a multiple of num_ranks. The trainer must still run
        an empty micro-batch (e.g. a dummy forward with zero loss) so that collectives stay
        matched. No samples gives no micro-batches.

    Raises:
        ValueError: a sample longer than the budget (its index and length named), a length < 1,
        or a budget/num_ranks < 1.
    """
    lengths = np.ascontiguousarray(np.asarray(lengths, dtype=np.int64).reshape(-1))
    cap = int(max_tokens_per_micro_batch)
    if cap < 1 or int(num_ranks) < 1:
        raise ValueError(f"max_tokens_per_micro_batch and num_ranks must be >= 1, got {cap} and {num_ranks}")
    num_ranks = int(num_ranks)
    if lengths.size == 0:
        return [[] for _ in range(num_ranks)]
    if lengths.min() < 1:
        i = int(np.argmin(lengths))
        raise ValueError(f"sample {i} has length {int(lengths[i])}; lengths must be >= 1")
    if lengths.max() > cap:
        i = int(np.argmax(lengths))
        raise ValueError(f"sample {i} has {int(lengths[i])} tokens, more than max_tokens_per_micro_batch {cap}")
    total = int(lengths.sum())
    n_bins = num_ranks * max(1, -(-total // (cap * num_ranks)))
    while True:
        bin_of, loads, ok = lpt_assign(lengths, np.int64(n_bins), np.int64(cap))
        if ok:
            break
        n_bins += num_ranks  # terminates: with n_bins >= n every sample gets its own bin
    bins: list[list[int]] = [[] for _ in range(n_bins)]
    for i, b in enumerate(bin_of.tolist()):
        bins[b].append(i)
    ranked = sorted(range(n_bins), key=lambda b: (-int(loads[b]), b))
    per_rank = n_bins // num_ranks
    return [[bins[ranked[m * num_ranks + r]] for m in range(per_rank)] for r in range(num_ranks)]
