"""Asynchronous full-state checkpoints (``--async-checkpoint``): what one rank's background writes share.

The training thread only stages a checkpoint: it copies the model shards (through DCP's
``async_save``), its optimizer state and generator states to CPU memory; the files are written, hashed
and, once every rank's files are on disk, completed by the manifest on a worker thread while
training goes on (docs/architecture.md section 5, "Asynchronous save"). At most one write is in
flight. How the trainer waits for it and serves requests with it: :class:`.manager.CheckpointManager`.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from ..distributed import is_distributed

T = TypeVar("T")


class BackgroundWriter:
    """One rank's resources for checkpoints written off the training thread (every rank makes one,
    at the same point: creating the process group is collective).

    - ``group``: a gloo process group of every rank (None with one rank) for the writes'
      collectives: DCP's ``async_save`` needs a CPU backend (the job's group is NCCL on GPUs), and the
      worker thread's collectives must not interleave with the training thread's on one group;
    - a DCP stager (``torch.distributed.checkpoint.staging.DefaultStager``) that copies state to CPU
      memory on the calling thread and keeps the copies for the next save (pinned memory and
      non-blocking copies on CUDA, ``StagingOptions``); so a rank holds a CPU copy of what it saves;
    - one worker thread.

    Args:
        device: the training device (its type picks the staging options).
    """

    def __init__(self, device: torch.device) -> None:
        self.group = dist.new_group(backend="gloo") if is_distributed() else None
        cuda = device.type == "cuda"
        self._stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                    use_async_staging=False, use_non_blocking_copy=cuda))
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="osft-checkpoint")
        self._last: Future | None = None

    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        """A CPU copy of ``state`` (tensors copied, containers rebuilt) that training cannot change."""
        return self._stager.stage(state)

    def save_model(self, state: dict[str, Any], directory: Path) -> Future:
        """``torch.distributed.checkpoint.async_save`` of the sharded ``state`` to ``directory``: staged
        here, written by DCP's own thread (collective over :attr:`group`). Returns its future."""
        return dcp.async_save(state, checkpoint_id=directory, process_group=self.group, async_stager=self._stager,
                              no_dist=self.group is None)

    def submit(self, fn: Callable[[], T]) -> Future:
        """Run ``fn`` on the worker thread; returns its future.

        Raises:
            RuntimeError: the previous write has not finished (the caller waits for it first).
        """
        if self._last is not None and not self._last.done():
            raise RuntimeError("a checkpoint is still being written: wait for it before the next one")
        self._last = self._executor.submit(fn)
        return self._last

    def close(self) -> None:
        """Wait for the worker thread and free the staging memory (after the last checkpoint)."""
        self._executor.shutdown(wait=True)
        self._stager.close()
