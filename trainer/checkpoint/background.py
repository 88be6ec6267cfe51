"""Asynchronous full-state checkpoints (``--async-checkpoint``): what one rank's background writes share.

The training thread only stages a checkpoint: it copies the model shards to shared CPU memory and
hands them to DCP's checkpoint process (``torch.distributed.checkpoint.async_save`` with
``AsyncCheckpointerType.PROCESS``), and copies its optimizer and generator states to CPU memory.
DCP's process plans and writes the shards, with its collectives on a gloo group of its own; a
worker thread of this rank waits for it and writes, syncs and hashes the rank's own files. Neither
runs a collective of the training process: every collective of a checkpoint (the agreement that
every rank's write is done, the file entries, the outcome) runs on the training thread
(:meth:`.full_state.PendingSave.done`, :meth:`.full_state.PendingSave.result`;
docs/architecture.md section 5, "Asynchronous save"). At most one write is in flight. How the
trainer waits for it and serves requests with it: :class:`.manager.CheckpointManager`.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import _async_process_executor as dcp_process
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from ..distributed import is_distributed, on_rank_exit
from .signals import CHECKPOINT_SIGNALS

T = TypeVar("T")

#: Seconds :func:`stop_checkpoint_process` waits for DCP's process to end before it is killed.
STOP_TIMEOUT_S = 30.0


class BackgroundWriter:
    """One rank's resources for checkpoints written off the training thread (every rank makes one,
    at the same point: creating the process group is collective).

    - ``group``: a gloo process group of every rank (None with one rank) for the checkpoint's
      collectives on the training thread and the start of DCP's checkpoint process (the job's
      group is NCCL on GPUs; gloo keeps the one-integer poll off the device). With one rank and no
      process group, a one-rank gloo group is made as the default group (DCP's start information
      needs one; :func:`..distributed.is_distributed` stays False) and destroyed by :meth:`close`;
    - two DCP stagers (``torch.distributed.checkpoint.staging.DefaultStager``) that copy state to CPU
      memory on the calling thread and keep the copies for the next save (pinned memory and
      non-blocking copies on CUDA): the model shards in shared memory (``/dev/shm``), which DCP's
      checkpoint process maps, the optimizer and generator states in private memory; so a rank
      holds a CPU copy of what it saves;
    - one worker thread for this rank's local work (no collective);
    - DCP's checkpoint process (one per training process, a daemon): its start information is
      agreed here (collective), and the worker thread starts it while training is prepared, with
      the checkpoint signals blocked, so a signal sent to every process of the job (SLURM)
      reaches only the ranks. It ends with :meth:`close`, or with the rank
      (:func:`..distributed.exit_rank`, or at the interpreter's exit).

    Args:
        device: the training device (its type picks the staging options).
    """

    def __init__(self, device: torch.device) -> None:
        self.group = dist.new_group(backend="gloo") if is_distributed() else None
        self._own_world = not dist.is_initialized()
        if self._own_world:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        cuda = device.type == "cuda"
        self._shared = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=True,
                                                    use_async_staging=False, use_non_blocking_copy=cuda))
        self._private = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                     use_async_staging=False, use_non_blocking_copy=cuda))
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="osft-checkpoint")
        on_rank_exit(_stop_at_exit)
        atexit.unregister(_stop_at_exit)  # once: before multiprocessing's own exit function, which would
        atexit.register(_stop_at_exit)  # send it SIGTERM (blocked there) and wait for it forever
        with _loopback_master(self.group is None):
            start = _QuietStart(self.group)  # collective: rank 0 broadcasts the address of the process's store
        self._started = self._executor.submit(_start_checkpoint_process, start)
        self._last: Future | None = None

    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        """A CPU copy of ``state`` (tensors copied, containers rebuilt) that training cannot change."""
        return self._private.stage(state)

    def save_model(self, state: dict[str, Any], directory: Path) -> Future:
        """``torch.distributed.checkpoint.async_save`` of the sharded ``state`` to ``directory``:
        staged here into shared memory, planned and written by DCP's checkpoint process (its
        collectives over its own gloo group), which the first call waits for if it is still
        starting. Returns its future (the checkpoint's DCP metadata).

        Raises:
            RuntimeError: DCP's checkpoint process could not be started.
        """
        self._started.result()
        return dcp.async_save(state, checkpoint_id=directory, process_group=self.group,
                              async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                              async_stager=self._shared, no_dist=self.group is None)

    def submit(self, fn: Callable[[], T]) -> Future:
        """Run ``fn`` on the worker thread; returns its future.

        Raises:
            RuntimeError: the previous write has not finished (the caller waits for it first).
        """
        if self._last is not None and not self._last.done():
            raise RuntimeError("a checkpoint is still being written: wait for it before the next one")
        self._last = self._executor.submit(fn)
        return self._last

    def all_done(self, done: bool) -> bool:
        """Whether every rank's ``done`` is True (collective over :attr:`group`: a one-integer
        ``all_reduce`` with MIN; no collective with one rank)."""
        if self.group is None:
            return done
        flag = torch.tensor([int(done)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    def close(self) -> None:
        """Wait for the worker thread, end DCP's checkpoint process, free the staging memory and
        the one-rank group this writer made (after the last checkpoint)."""
        self._executor.shutdown(wait=True)
        stop_checkpoint_process()
        self._shared.close()
        self._private.close()
        if self._own_world and dist.is_initialized():
            dist.destroy_process_group()
            self._own_world = False


class _QuietStart(dcp_process._ProcessGroupInitInfo):
    """DCP's start information for its checkpoint process (rank, world size, the address of the
    store of the process's gloo group; made on the training thread, collectively). Unpickled in
    that process, before DCP would set the root logger to INFO with a handler of its own (every
    request, and every INFO record of torch, on the rank's stderr), it leaves logging as it is:
    warnings and errors only; and it drops DCP's warning about a one-rank save."""

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        dcp_process._init_logger = _leave_logging  # in DCP's checkpoint process only
        # One rank saves with no_dist=True, which DCP warns about at every save.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def _leave_logging(rank: int) -> None:
    """DCP's checkpoint process: instead of ``_init_logger``, logging is left at its defaults."""


def _start_checkpoint_process(start: _QuietStart) -> None:
    """On the worker thread: start DCP's checkpoint process (returns once its gloo group is up on
    every rank) and make it the one ``async_save`` uses. torch 2.13 would start it inside the first
    save, from a thread of its own, with INFO logging (:class:`_QuietStart`) and the checkpoint
    signals at their default action (deadly for SIGUSR1; for SIGTERM an end without the rank's
    stop). Here they are blocked on this thread, which the process inherits across ``exec``: after
    multiprocessing's resource tracker has started, whose start unblocks SIGINT and SIGTERM again."""
    resource_tracker.ensure_running()
    signal.pthread_sigmask(signal.SIG_BLOCK, CHECKPOINT_SIGNALS)  # this thread handles no signal
    dcp_process._CHECKPOINT_PROCESS = dcp_process._AsyncCheckpointProcess(pg_init_info=start)


def stop_checkpoint_process(timeout: float = STOP_TIMEOUT_S) -> None:
    """End DCP's checkpoint process of this process, if one was started (idempotent): ask it to
    stop, wait up to ``timeout`` s, else kill it (SIGKILL: it blocks the checkpoint signals).

    torch 2.13 keeps that process in a module global of
    ``torch.distributed.checkpoint._async_process_executor`` and ends it only when the interpreter
    finalizes, which a rank never does (it ends with ``os._exit``). The global is reset, so a later
    run in this process starts its own."""
    proc = getattr(dcp_process, "_CHECKPOINT_PROCESS", None)
    if proc is None:
        return
    dcp_process._CHECKPOINT_PROCESS = None
    child = proc._save_process
    try:
        proc._send(dcp_process._CheckpointSaveProcessControlOpts.TERMINATE)
    except (OSError, ValueError):  # it is gone already
        pass
    child.join(timeout)
    if child.is_alive():
        child.kill()
        child.join()
    proc._process_pipe.close()


def _stop_at_exit() -> None:
    """:func:`stop_checkpoint_process` as the rank ends (a write still in flight is of no use then)."""
    stop_checkpoint_process(timeout=5.0)


@contextlib.contextmanager
def _loopback_master(one_rank: bool) -> Iterator[None]:
    """With one rank and no ``MASTER_ADDR``, set it to the loopback address meanwhile: DCP reads it
    for the store of its checkpoint process's group (else the host's name, which may not resolve)."""
    if not one_rank or "MASTER_ADDR" in os.environ:
        yield
        return
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    try:
        yield
    finally:
        os.environ.pop("MASTER_ADDR", None)
