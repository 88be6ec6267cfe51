"""Where this process sits in a job: rank, local rank, node rank and world size from the environment.

torchrun sets RANK, LOCAL_RANK, WORLD_SIZE and GROUP_RANK (the node index under c10d rendezvous;
it sets no NODE_RANK). A plain ``python`` process is rank 0 of a world of 1.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class DistEnv:
    """Position of this process: global ``rank``, ``local_rank`` on its node, ``node_rank``,
    ``world_size`` (processes in the job) and ``hostname``."""

    rank: int
    local_rank: int
    node_rank: int
    world_size: int
    hostname: str

    @classmethod
    def from_env(cls) -> "DistEnv":
        """Read torchrun's variables (NODE_RANK is accepted when GROUP_RANK is absent)."""
        env = os.environ
        return cls(
            rank=int(env.get("RANK", 0)),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            node_rank=int(env.get("GROUP_RANK", env.get("NODE_RANK", 0))),
            world_size=int(env.get("WORLD_SIZE", 1)),
            hostname=socket.gethostname(),
        )

    @property
    def is_local_main(self) -> bool:
        """True on each node's LOCAL_RANK 0: it prints progress and writes the node's metrics."""
        return self.local_rank == 0


def is_distributed() -> bool:
    """True when a process group with more than one rank is up."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


#: The process group of the control collectives (:func:`control_group`); None: the default group.
_control: dist.ProcessGroup | None = None


def init_distributed(env: DistEnv, device: torch.device) -> None:
    """Join the job's process group when ``world_size > 1`` (NCCL for CUDA devices, gloo on CPU)
    unless one is up already; with any backend but gloo also a gloo group over the same ranks for
    the control collectives (:func:`control_group`). No-op for one rank."""
    global _control
    if env.world_size == 1:
        return
    if not dist.is_initialized():  # else a caller's group (``torch.distributed`` set up before the trainer)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(minutes=30))
    if _control is None and dist.get_backend() != "gloo":
        _control = dist.new_group(backend="gloo", timeout=timedelta(minutes=30))


def control_group() -> dist.ProcessGroup | None:
    """The group for host (CPU) tensors: the control collectives, small tensors and objects every
    rank must agree on (checkpoint and evaluation requests, token counts, node ranks, rank 0's
    decisions), and the weights and SVD factors that start-up spreads over the ranks
    (:func:`.osft.surgery.apply_osft`), which NCCL, CUDA tensors only, cannot carry. Under NCCL it
    is a gloo group, so a control collective costs no CUDA synchronisation and waits only for the
    other ranks' host threads (the training step reads the
    device only for its loss, grad norm and orthogonality bound: :class:`osft.trainer.run.step.TrainStep`); on CPU it is the default (gloo) group: None,
    as ``group=`` of ``torch.distributed`` takes it."""
    return _control


def shutdown_distributed() -> None:
    """Leave the process group, if any, all ranks together (a rank that tears gloo down while a
    peer is still working can abort with "terminate called without an active exception")."""
    global _control
    if dist.is_available() and dist.is_initialized():
        if dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()  # every group, the control group too
        _control = None


#: What :func:`exit_rank` runs first (:func:`on_rank_exit`), in order.
_at_exit: list[Callable[[], None]] = []


def on_rank_exit(fn: Callable[[], None]) -> None:
    """Run ``fn`` when the rank ends through :func:`exit_rank` (once, however often it is
    registered): what must not outlive the rank, such as DCP's checkpoint process, which
    ``os._exit`` would leave to notice the end by itself. Exceptions of ``fn`` are ignored."""
    if fn not in _at_exit:
        _at_exit.append(fn)


def exit_rank(code: int) -> NoReturn:
    """End this rank's process with exit ``code`` after the :func:`on_rank_exit` functions and
    flushing stdout, stderr and ``logging``, without Python's interpreter finalization
    (``os._exit``). Call it last, once everything the rank writes is closed (metrics, checkpoints,
    exports).

    Why: gloo's worker thread can still be destroying the last collective's work object when the
    main thread returns from it. That work holds earlier works and their tensors, and releasing a
    tensor that has a Python object takes the GIL; if the interpreter is finalizing by then, the
    thread is cancelled inside a ``noexcept`` destructor and ``std::terminate`` aborts the rank
    ("terminate called without an active exception", SIGABRT), so a worker group that completed
    fails. Seen about once in 15-25 two-rank runs on a loaded 2-core machine, also after
    ``barrier()`` + ``destroy_process_group()``; the core dump's aborting thread:
    ``ProcessGroupGloo::runLoop`` > ``~AsyncBarrierWork`` > ``~AsyncAllgatherWork`` >
    ``TensorImpl::decref_pyobject`` > ``PyEval_AcquireThread`` > ``pthread_exit``, while the main
    thread was in ``Py_FinalizeEx``. Skipping finalization removes the race; an ``atexit`` hook
    would run too late for it (pytorch/pytorch PR 179291 tried and dropped one).
    """
    for fn in _at_exit:
        try:
            fn()
        except Exception:  # the rank ends regardless
            pass
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or a broken pipe: nothing more can reach it
            pass
    os._exit(code)


def barrier() -> None:
    """``dist.barrier()`` when distributed, else nothing."""
    if is_distributed():
        dist.barrier()


def node_ranks(env: DistEnv) -> list[int]:
    """Node rank of every global rank (index = global rank); ``[env.node_rank]`` for one rank."""
    return [int(v) for v in gather_float(env.node_rank)]


def global_sums(loss_sum: torch.Tensor, num_tokens: int) -> tuple[float, list[int]]:
    """Sum the per-rank summed token losses (a CPU float64 scalar) over all ranks and gather each
    rank's token count (one ``all_gather`` on the :func:`control_group`).

    Returns:
        ``(global loss sum, tokens of each rank by global rank)``.
    """
    if not is_distributed():
        return float(loss_sum), [num_tokens]
    local = torch.tensor([float(loss_sum), float(num_tokens)], dtype=torch.float64)
    gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local, group=control_group())
    return float(sum(g[0] for g in gathered)), [int(g[1].item()) for g in gathered]


def gather_float(value: float) -> list[float]:
    """Every rank's ``value``, by global rank (one ``all_gather`` on the :func:`control_group`;
    ``[value]`` without a process group)."""
    return [row[0] for row in gather_rows([value])]


def gather_rows(values: Sequence[float]) -> list[list[float]]:
    """Every rank's ``values`` (the same length on every rank), by global rank: a list of rows
    (one ``all_gather`` of float64 on the :func:`control_group`; ``[values]`` without a process group)."""
    if not is_distributed():
        return [[float(v) for v in values]]
    local = torch.tensor([float(v) for v in values], dtype=torch.float64)
    gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local, group=control_group())
    return [g.tolist() for g in gathered]


def gather_on_device(t: torch.Tensor) -> torch.Tensor:
    """Every rank's ``t`` stacked by global rank (W×``t.shape``), on ``t``'s device, over the
    default group (NCCL for CUDA tensors): no host synchronisation (``torch.distributed.all_gather``
    is asynchronous on the stream). One rank: ``t`` with a leading dimension of 1."""
    if not is_distributed():
        return t.unsqueeze(0)
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t)
    return torch.stack(gathered)


def agree(fn, rank: int):
    """Run ``fn()`` on rank 0 and give every rank its result (``broadcast_object_list``); an
    exception of type ValueError (or a subclass) raised by ``fn`` is raised again on every rank,
    with its type and message."""
    if not is_distributed():
        return fn()
    box: list = [None]
    if rank == 0:
        try:
            box[0] = ("ok", fn())
        except ValueError as exc:
            box[0] = ("error", (type(exc), str(exc)))
    dist.broadcast_object_list(box, src=0, group=control_group())
    kind, value = box[0]
    if kind == "error":
        raise value[0](value[1])
    return value


def map_over_ranks(fn: Callable[[T], R], items: Sequence[T] | None, count: int,
                   check: Callable[[int], None] | None = None) -> list[R] | None:
    """``[fn(x) for x in items]`` with item i computed by rank i mod world size, so that host work
    of rank 0's data (e.g. the fold of every module's protected bases at export) takes 1/world of
    the time. Rank 0 passes the ``count`` items, the others None; rank 0 gets the results in order,
    the others None. Items and results travel pickled, point to point over :func:`control_group`
    (``torch.distributed.send_object_list``/``recv_object_list``): host objects only. One process:
    :func:`map_on_threads`.

    The items go in rounds of one per rank: ``check(r)``, when given, is called before round r
    by every rank, ceil(count / world size) times in all, with no message in flight, so a
    collective poll there is safe and an exception it raises (the same on every rank) abandons
    the map between two rounds. Collective: every rank calls it with the same ``count``."""
    if not is_distributed():
        return map_on_threads(fn, items, check)
    rank, world, group = dist.get_rank(), dist.get_world_size(), control_group()

    def receive(src: int):
        box = [None]
        dist.recv_object_list(box, src=src, group=group)
        return box[0]

    results = []
    for r, first in enumerate(range(0, count, world)):
        if check is not None:
            check(r)
        owners = min(world, count - first)  # item first + k goes to rank k
        if rank == 0:
            for k in range(1, owners):
                dist.send_object_list([items[first + k]], dst=k, group=group)
            results.append(fn(items[first]))
            results.extend(receive(k) for k in range(1, owners))
        elif rank < owners:
            dist.send_object_list([fn(receive(0))], dst=0, group=group)
    return results if rank == 0 else None


def map_on_threads(fn: Callable[[T], R], items: Sequence[T], check: Callable[[int], None] | None = None) -> list[R]:
    """``[fn(x) for x in items]`` on as many threads as torch has intra-op threads, each call with
    one intra-op thread: small LAPACK calls (an SVD or QR of a few hundred columns) scale poorly
    across cores, so one call per core does better (SmolLM2's 210 SVDs: 1.4× faster on 2 cores).
    Each item is computed by one thread with one intra-op thread, so the results do not depend on
    the scheduling (a single item: on the calling thread with every intra-op thread). For host
    (CPU) work: torch's thread count is process-wide while it runs.

    The items go in rounds of one per thread: ``check(r)``, when given, is called on the calling
    thread before round r; an exception it raises abandons the map between two rounds."""
    threads = torch.get_num_threads()
    pooled = threads > 1 and len(items) > 1
    results: list[R] = []
    if pooled:
        torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            for r, first in enumerate(range(0, len(items), threads)):
                if check is not None:
                    check(r)
                batch = items[first:first + threads]
                results.extend(pool.map(fn, batch) if pooled else map(fn, batch))
    finally:
        if pooled:
            torch.set_num_threads(threads)
    return results
