"""Full-state checkpoints: save everything a bit-identical resume needs, and load it back.

One ``step_<N>`` directory (docs/architecture.md section 5)::

    model/                 DCP shards of every parameter except the frozen OSFT factors
                           (torch.distributed.checkpoint; each rank writes its own shard)
    optimizer_rank<R>.pt   rank R's AdamW state (its local shard of exp_avg/exp_avg_sq, step)
    rng_rank<R>.pt         rank R's Python, NumPy, torch CPU and CUDA generator states
    trainer_state.json     step, counters, LR scheduler, data position, batch settings, world size,
                           vocab size, OSFT settings (:class:`.trainer_state.TrainerState`)
    manifest.json          written last: every file with its writing rank, size and SHA-256, and
                           the checksum of the frozen factors' manifest

Per-rank state lives in per-rank files: under one shared DCP key only one rank's copy would be kept
and every rank would load it back (per-rank RNG files: tests/test_resume.py). The frozen factors W_high, U_basis and V_basis
and the other frozen parameters of :data:`FROZEN_PARAMS` never change during a run: they are written
once, to ``frozen_<job_id>-<token>/``, and referenced.
"""

from __future__ import annotations

import errno
import hashlib
import os
import random
import shutil
import time
import uuid
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    set_model_state_dict,
)

from .. import test_hooks
from ..distributed import DistEnv, agree, barrier, is_distributed
from ..dtensor import local_tensor
from ..osft.surgery import OSFTModel
from ..run.schedule import restore_position
from .manifest import (
    MANIFEST,
    CheckpointError,
    describe_files,
    read_manifest,
    write_manifest,
)
from .background import BackgroundWriter
from .safe_load import SafeFileSystemReader, load_plain
from .store import NO_ROOM_ERRNOS, apply_retention, newest_complete, no_room_line, versions
from .trainer_state import TRAINER_STATE, TrainerState

# One rank without a process group is a supported case (no_dist=True), not something to warn about.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

#: OSFTLinear parameters that never change during a run (stored once per run): the frozen part,
#: the projection bases, the protected bases P/Q, this run's start factors (from which the export
#: computes the run's update, also after a resume) and the smallest frozen singular value.
FROZEN_PARAMS = ("W_high", "U_basis", "V_basis", "P", "Q", "U_start", "S_start", "V_start", "sigma_frozen_min")

def capture_rng() -> dict[str, Any]:
    """This process's generator states: Python, NumPy, torch CPU and (when initialised) CUDA."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Set every generator to a state from :func:`capture_rng`."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def with_run_hyperparameters(saved: dict, optimizer: torch.optim.Optimizer) -> dict:
    """A saved optimizer state dict whose parameter groups carry ``optimizer``'s hyperparameters
    (lr, initial_lr, betas, eps, weight_decay, ...; built from this run's settings) instead of the
    saved ones: loading it restores AdamW's moments and step counts, never the old settings.

    Raises:
        CheckpointError: the saved state has another number of parameter groups.
    """
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise CheckpointError(f"the saved optimizer state has {len(saved['param_groups'])} parameter groups, "
                              f"this run's optimizer {len(optimizer.param_groups)}")
    groups = [{**group, **{k: v for k, v in current.items() if k != "params"}}
              for group, current in zip(saved["param_groups"], optimizer.param_groups)]
    return {**saved, "param_groups": groups}


@dataclass(frozen=True)
class SavedCheckpoint:
    """A complete checkpoint just written: its step and directory, its size (bytes, frozen factors
    excluded), the time from the start of the save to its manifest and retention (s; with
    ``--async-checkpoint`` to the step boundary that completed it), how long the training thread
    was blocked by it (s; ``seconds`` for a synchronous save; with ``--async-checkpoint`` the
    staging, the polls while it was written and its completion), the bytes of the frozen factors
    written with it (0 when reused), and what retention removed after it (rank 0; empty
    elsewhere). Both times include the time training waited for the previous background write
    before this save could begin, wherever it waited."""

    step: int
    path: Path
    bytes: int
    seconds: float
    blocking_s: float
    frozen_bytes: int
    removed: tuple[Path, ...] = ()


class PendingSave:
    """A checkpoint being written in the background (:meth:`Checkpointer.save_async`): its step,
    its final directory (which exists only once it is complete), the training thread's seconds
    spent on it so far (``blocking_s``: the wait for the previous write, the staging, and then each
    :meth:`done`), and this rank's part of the write (``future``: its file entries, or its failure).

    Every rank calls :meth:`done` and :meth:`result` at the same points, on the training thread:
    both are collective. ``all_done`` agrees over the ranks (``BackgroundWriter.all_done``),
    ``finish`` completes the checkpoint from this rank's report and the blocking seconds so far
    (``Checkpointer._finish``), ``on_wait`` is told how long :meth:`result` waited (s)."""

    def __init__(self, step: int, path: Path, blocking_s: float, future: Future, on_wait: Callable[[float], None],
                 all_done: Callable[[bool], bool], finish: Callable[[Any, float], SavedCheckpoint]) -> None:
        self.step, self.path, self.blocking_s, self.future = step, path, blocking_s, future
        self._on_wait, self._all_done, self._finish = on_wait, all_done, finish

    def done(self) -> bool:
        """True once every rank's part of the write has finished, complete or failed. Never waits
        for the write; collective while there are several ranks (one all-reduce of one integer)."""
        start = time.perf_counter()
        try:
            return self._all_done(self.future.done())
        finally:
            self.blocking_s += time.perf_counter() - start

    def result(self) -> SavedCheckpoint:
        """Wait for this rank's part (the time waited goes to ``on_wait``: the training thread's
        wait, counted in the next save's ``blocking_s`` and kept out of the step's time), then
        complete the checkpoint with every rank (collective: gather, manifest, rename, outcome).

        Raises:
            CheckpointWriteError: on every rank, when a rank's write failed; the checkpoint has no manifest.
        """
        start = time.perf_counter()
        report = self.future.result()  # a rank's failure is a report too: every rank goes on to the gather
        self._on_wait(time.perf_counter() - start)
        return self._finish(report, self.blocking_s)


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (a rank's file, DCP shard or the manifest failed); it got
    no manifest, so it is never resumed from. The message names the checkpoint and every rank's error.

    For lack of space or permission (:data:`.store.NO_ROOM_ERRNOS`) ``headline`` is the one line the
    failure report starts with (:func:`.store.no_room_line`) and ``fields`` its numbers (``checkpoint``,
    ``errno``, ``bytes_needed``, ``bytes_free``, ``newest_complete``); else both are empty."""

    def __init__(self, message: str, headline: str | None = None, fields: dict | None = None) -> None:
        super().__init__(message)
        self.headline = headline
        self.fields = fields or {}


@dataclass(frozen=True)
class _RankFailure:
    """One rank's failed write, as gathered: its message and the errno of the ``OSError`` behind it (or 0)."""

    message: str
    errno: int


def _rank_failure(rank: int, exc: BaseException) -> _RankFailure:
    """``rank``'s failure from ``exc``; a DCP ``CheckpointException`` (whose text is every rank's
    traceback) is told by the ``OSError`` behind it when there is one."""
    found = os_error(exc)
    shown = found if found is not None and isinstance(exc, CheckpointException) else exc
    if isinstance(shown, CheckpointException):
        first = next(iter(shown.failures.values()))[0]
        shown = first
    return _RankFailure(f"rank {rank}: {type(shown).__name__}: {shown}", found.errno if found is not None else 0)


def os_error(exc: BaseException) -> OSError | None:
    """The first ``OSError`` with an errno in ``exc``, its causes and contexts, and the per-rank
    failures of a DCP ``CheckpointException`` (None if there is none)."""
    todo, seen = [exc], set()
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno:
            return e
        if isinstance(e, CheckpointException):
            todo += [pair[0] for pair in e.failures.values()]
        todo += [e.__cause__, e.__context__]
    return None


def _free_bytes(path: Path) -> int:
    """Free bytes of the file system of ``path`` (0 when it cannot be read)."""
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 0


def _tree_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (0 when it is gone)."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def _nbytes(state: Any) -> int:
    """Bytes of the tensors in ``state`` (nested dicts and lists; a DTensor's local shard)."""
    if isinstance(state, dict):
        return sum(_nbytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_nbytes(v) for v in state)
    if isinstance(state, torch.Tensor):
        t = local_tensor(state)
        return t.numel() * t.element_size()
    return 0


class Checkpointer:
    """Saves and loads the full training state of one rank (every rank calls every method).

    Args:
        root: ``<output_dir>/full_state_checkpoints`` (on storage every node sees).
        env: this rank's place in the job. job_id: the job's id.
        model: the (FSDP2-sharded or plain) model. optimizer, scheduler: AdamW and its LR schedule.
        osft: the OSFT modules (None with ``--no-osft``).
        keep_last: ``--checkpoint-keep-last``: complete checkpoints kept after each save (0: all).
        writer: what :meth:`save_async` writes with (``--async-checkpoint``); None: synchronous saves only.
    """

    def __init__(self, root: Path, env: DistEnv, job_id: str, model: nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: Any, osft: OSFTModel | None, keep_last: int = 0, writer: BackgroundWriter | None = None) -> None:
        self.root = root
        self.writer = writer
        self.keep_last = keep_last
        self.env = env
        self.job_id = job_id
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.frozen_keys = {f"{n}.{k}" for n, _ in osft.modules for k in FROZEN_PARAMS} if osft else set()
        #: name of the frozen store this run references (written at the first save, or the resumed one's)
        self.frozen_dir: str | None = None
        #: seconds the training thread waited for background writes since the last save began
        #: (:meth:`PendingSave.result`): the next save counts them in its ``blocking_s`` and ``seconds``
        self.waited_s = 0.0

    # -- model ---------------------------------------------------------------------------------
    def _model_state(self) -> tuple[dict, dict]:
        """(trainable-and-other state, frozen OSFT factors) as sharded state dicts."""
        state = get_model_state_dict(self.model)
        frozen = {k: v for k, v in state.items() if k in self.frozen_keys}
        return {k: v for k, v in state.items() if k not in self.frozen_keys}, frozen

    def _my_files(self, directory: Path, sub: str = "") -> list[str]:
        """Files of ``directory/sub`` this rank wrote (DCP names them ``__<rank>_<i>.distcp``)."""
        base = directory / sub
        names = sorted(p.name for p in base.glob(f"__{self.env.rank}_*.distcp"))
        if self.env.rank == 0 and (base / ".metadata").is_file():
            names.append(".metadata")
        return [f"{sub}/{n}" if sub else n for n in names]

    def _gather(self, obj: Any, group: dist.ProcessGroup | None = None) -> list:
        """Every rank's ``obj``, in rank order (collective over ``group``, default: the job's)."""
        if not is_distributed():
            return [obj]
        everything: list = [None] * dist.get_world_size()
        dist.all_gather_object(everything, obj, group=group)
        return everything

    def _write_frozen(self, frozen: dict) -> int:
        """Write this run's frozen factors once, to a new ``frozen_<job_id>-<token>`` (never over a
        store that older checkpoints of the same job id reference); returns their bytes."""
        name = f"frozen_{self.job_id}-{agree(lambda: uuid.uuid4().hex[:8], self.env.rank)}"
        final, tmp = self.root / name, self.root / f"{name}.tmp"
        if self.env.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            self._make_dir(tmp, final, _nbytes(frozen))
        barrier()
        try:
            dcp.save(frozen, checkpoint_id=tmp, no_dist=not is_distributed())
        except CheckpointException as exc:  # raised on every rank alike (DCP gathers the errors)
            raise CheckpointWriteError(*self._failed(final, tmp, [_rank_failure(self.env.rank, exc)],
                                                     _nbytes(frozen))) from None
        files = {k: v for e in self._gather(describe_files(tmp, self._my_files(tmp), self.env.rank)) for k, v in e.items()}
        if self.env.rank == 0:
            write_manifest(tmp, files, kind="frozen_osft_factors", job_id=self.job_id, keys=sorted(frozen))
            os.replace(tmp, final)
        barrier()
        self.frozen_dir = name
        return sum(f["size"] for f in files.values())

    # -- save ----------------------------------------------------------------------------------
    def save(self, step: int, trainer_state: TrainerState, rng: dict[str, Any]) -> SavedCheckpoint:
        """Write ``step_<step>`` (temporary directory, shards, per-rank files, manifest, rename),
        then, on rank 0, apply retention (:func:`.store.apply_retention` with ``keep_last`` and
        this run's frozen store). Collective; returns once the checkpoint is complete.

        Args:
            trainer_state: the state for ``trainer_state.json`` (written by rank 0).
            rng: this rank's generator states (:func:`capture_rng`) at the saved point.

        Raises:
            CheckpointWriteError: on every rank when a rank's write failed (no manifest is written).
        """
        start = time.perf_counter() - self._take_wait()
        rest, frozen_bytes, tmp = self._begin(step)
        optim = self._optimizer_state()

        def write() -> list[str]:
            dcp.save(rest, checkpoint_id=tmp / "model", no_dist=not is_distributed())
            return self._write_rank_files(tmp, optim, rng, trainer_state)

        report = self._write_local(step, tmp, write)
        return self._finish(step, tmp, report, _nbytes(rest) + _nbytes(optim), None, start, None, frozen_bytes)

    def save_async(self, step: int, trainer_state: TrainerState, rng: dict[str, Any]) -> PendingSave:
        """Stage ``step_<step>`` on this thread and start writing it (collective,
        ``--async-checkpoint``): the model shards through DCP's process-based ``async_save`` (staged
        into shared memory, written by DCP's checkpoint process), this rank's optimizer and
        generator states as CPU copies and ``trainer_state.json`` as a copy of ``trainer_state``,
        written, synced and described by the writer's thread once DCP is done (no collective
        there). Training may change the model and optimizer as soon as this returns. The manifest
        (once every rank's files are on disk), the rename and the retention follow as in
        :meth:`save`, on the training thread, in :meth:`PendingSave.result` (after
        :meth:`PendingSave.done` agreed every rank is done, or as a wait). The caller waits for the
        previous save's :class:`PendingSave` first (at most one in flight).

        The frozen OSFT factors of a run's first save are still written on this thread (once per run).
        """
        start = time.perf_counter() - self._take_wait()
        rest, frozen_bytes, tmp = self._begin(step)
        model = self.writer.save_model(rest, tmp / "model")
        staged = self.writer.stage({"optimizer": self._optimizer_state(), "rng": rng})
        state = TrainerState.from_json(trainer_state.to_json())  # a copy: to_json copies every container
        needed = _nbytes(rest) + _nbytes(staged["optimizer"])

        def write() -> list[str]:
            model.result()
            return self._write_rank_files(tmp, staged["optimizer"], staged["rng"], state)

        def finish(report: dict | _RankFailure, blocking_s: float) -> SavedCheckpoint:
            return self._finish(step, tmp, report, needed, self.writer.group, start, blocking_s, frozen_bytes)

        future = self.writer.submit(lambda: self._write_local(step, tmp, write))
        return PendingSave(step, self.root / f"step_{step}", time.perf_counter() - start, future, self._add_wait,
                           self.writer.all_done, finish)

    def _add_wait(self, seconds: float) -> None:
        self.waited_s += seconds

    def _take_wait(self) -> float:
        """The training thread's wait for the previous write (s), now counted by the save beginning."""
        waited, self.waited_s = self.waited_s, 0.0
        return waited

    def close(self) -> None:
        """Free what asynchronous saves hold (after the last one has finished)."""
        if self.writer is not None:
            self.writer.close()

    def _begin(self, step: int) -> tuple[dict, int, Path]:
        """The model state to save (frozen factors left out, and written once per run first), its
        frozen bytes written now, and the new empty temporary directory (collective)."""
        rest, frozen = self._model_state()
        frozen_bytes = self._write_frozen(frozen) if frozen and self.frozen_dir is None else 0
        tmp = self.root / f"step_{step}.tmp-{self.job_id}"
        if self.env.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            self._make_dir(tmp / "model", self.root / f"step_{step}", _nbytes(rest))
        barrier()
        return rest, frozen_bytes, tmp

    def _make_dir(self, path: Path, final: Path, needed: int) -> None:
        """Rank 0: create ``path`` (and its parents) for the checkpoint ``final``.

        Raises:
            CheckpointWriteError: it cannot be created (:meth:`_failed`: one line for lack of space
                or permission); torchrun then stops the peers waiting at the barrier.
        """
        try:
            path.mkdir(parents=True)
        except OSError as exc:
            tmp = path.parent if path.name == "model" else path
            raise CheckpointWriteError(*self._failed(final, tmp, [_rank_failure(0, exc)], needed)) from None

    def _optimizer_state(self) -> dict:
        """This rank's AdamW state dict with its local shards of the moments (no DTensors)."""
        optim = self.optimizer.state_dict()
        optim["state"] = {i: {k: local_tensor(v) for k, v in s.items()} for i, s in optim["state"].items()}
        return optim

    def _write_rank_files(self, tmp: Path, optim: dict, rng: dict[str, Any], trainer_state: TrainerState) -> list[str]:
        """Write this rank's optimizer and generator files (and, on rank 0, ``trainer_state.json``)
        to ``tmp`` and flush them to disk (``os.fsync``; DCP syncs its shards itself); returns their names."""
        r = self.env.rank
        torch.save(optim, tmp / f"optimizer_rank{r}.pt")
        torch.save(rng, tmp / f"rng_rank{r}.pt")
        if r == 0:
            trainer_state.write(tmp)
        names = [f"optimizer_rank{r}.pt", f"rng_rank{r}.pt"] + ([TRAINER_STATE] if r == 0 else [])
        for name in names:
            fd = os.open(tmp / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        return names

    def _write_local(self, step: int, tmp: Path, write: Callable[[], list[str]]) -> dict | _RankFailure:
        """This rank's part of a save (no collective): run ``write`` (returns the names of the files
        it wrote besides the DCP shards), then describe this rank's files (size, SHA-256:
        :func:`.manifest.describe_files`). Returns the entries, or this rank's failure."""
        r = self.env.rank
        try:
            written = write()  # first: the DCP shards are listed once they are on disk
            if r == 0 and (delay := test_hooks.save_delay(step)):
                time.sleep(delay)
            return describe_files(tmp, self._my_files(tmp, "model") + written, r)
        except (Exception, CheckpointException) as exc:  # every rank learns it in _finish: none writes a manifest or waits alone
            return _rank_failure(r, exc)

    def _finish(self, step: int, tmp: Path, report: dict | _RankFailure, local_bytes: int,
                group: dist.ProcessGroup | None, start: float, blocking_s: float | None,
                frozen_bytes: int) -> SavedCheckpoint:
        """Complete a save from this rank's ``report`` (:meth:`_write_local`; collective over
        ``group``, on the training thread): gather every rank's report, and, when no rank failed,
        let rank 0 write the manifest and rename ``tmp`` to ``step_<step>``; broadcast the outcome;
        then rank 0 applies retention. ``local_bytes``: what this rank's part needs on disk (for the
        report of a full disk). ``blocking_s``: None for a synchronous save (it blocked all along),
        else the training thread's seconds on it so far, to which this call's time is added.

        Raises:
            CheckpointWriteError: on every rank, naming each rank's error, when a write failed
                (:meth:`_failed`).
        """
        begun = time.perf_counter()
        r = self.env.rank
        final = self.root / f"step_{step}"
        reports = self._gather((report, local_bytes), group)
        failures = [e for e, _ in reports if isinstance(e, _RankFailure)]
        outcome: list = [None]
        if r == 0 and not failures:
            try:
                self._write_manifest(step, tmp, final, {k: v for e, _ in reports for k, v in e.items()})
            except OSError as exc:
                failures = [_rank_failure(0, exc)]
        if r == 0 and failures:
            outcome = [self._failed(final, tmp, failures, sum(b for _, b in reports))]
        if is_distributed():
            dist.broadcast_object_list(outcome, src=0, group=group)
        if outcome[0] is not None:
            raise CheckpointWriteError(*outcome[0])
        size = sum(f["size"] for e, _ in reports for f in e.values()) if r == 0 else 0
        removed = tuple(apply_retention(self.root, self.keep_last, self.frozen_dir)) if r == 0 else ()
        end = time.perf_counter()
        blocking = end - start if blocking_s is None else blocking_s + end - begun
        return SavedCheckpoint(step, final, size, end - start, blocking, frozen_bytes, removed)

    def _failed(self, final: Path, tmp: Path, failures: list[_RankFailure], needed: int) -> tuple[str, str | None, dict]:
        """Rank 0, a write failed: the :class:`CheckpointWriteError` arguments. For lack of space or
        permission the partial ``tmp`` is removed (it would keep the disk full) and the error gets
        its one line with the bytes ``needed`` and free; else ``tmp`` is left for inspection."""
        errors = "; ".join(f.message for f in failures)
        no_room = next((f.errno for f in failures if f.errno in NO_ROOM_ERRNOS), 0)
        if not no_room and _free_bytes(self.root) < needed - _tree_bytes(tmp):
            no_room = errno.ENOSPC  # a short write with no errno (torch.save's zip writer): what is left does not fit
        if not no_room:
            return (f"checkpoint {final.name} was not written ({errors}); it has no {MANIFEST}, so it is never "
                    f"resumed from: {tmp} is left for inspection", None, {})
        shutil.rmtree(tmp, ignore_errors=True)
        free = _free_bytes(self.root)
        newest, _skipped = newest_complete(self.root)
        line = no_room_line(final.name, no_room, self.root, needed, free, newest.name if newest else None)
        fields = {"checkpoint": final.name, "errno": no_room, "bytes_needed": needed, "bytes_free": free,
                  "newest_complete": str(newest) if newest else None}
        removed = f"{tmp} was removed" if not tmp.exists() else f"{tmp} could not be removed"
        return (f"checkpoint {final.name} was not written ({errors}); it has no {MANIFEST}, so it is never "
                f"resumed from: {removed}", line, fields)

    def _write_manifest(self, step: int, tmp: Path, final: Path, files: dict[str, dict]) -> None:
        """Rank 0: the manifest (last, after every rank's files are on disk), then ``tmp`` renamed to ``final``."""
        frozen_ref = None
        if self.frozen_dir:
            digest = hashlib.sha256((self.root / self.frozen_dir / MANIFEST).read_bytes()).hexdigest()
            frozen_ref = {"dir": self.frozen_dir, "manifest_sha256": digest}
        write_manifest(tmp, files, kind="full_state", step=step, world_size=self.env.world_size,
                       job_id=self.job_id, created=time.time(), frozen=frozen_ref, versions=versions())
        if final.exists():  # the same step saved again (e.g. stopped right after a resume)
            old = self.root / f"step_{step}.replaced-{self.job_id}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)

    # -- load ----------------------------------------------------------------------------------
    def load(self, step_dir: Path) -> tuple[TrainerState, dict[str, Any]]:
        """Load model, optimizer and scheduler from a verified checkpoint.

        AdamW's state (moments, step counts) and the schedule's position come from the checkpoint;
        the hyperparameters (lr, betas, eps, weight decay) and the schedule's shape are this run's
        (:func:`with_run_hyperparameters`, :func:`..schedule.restore_position`), so a setting
        changed on resume applies from the first resumed step.

        Returns:
            ``(trainer_state, rng)``: the checkpoint's trainer state, and this rank's generator states
            (for the caller to restore last, after everything else that draws random numbers).

        Raises:
            CheckpointError: a file is missing or holds more than tensors and plain data.
        """
        manifest = read_manifest(step_dir)
        trainer_state = TrainerState.read(step_dir)
        rest, frozen = self._model_state()
        dcp.load(rest, storage_reader=SafeFileSystemReader(step_dir / "model"), no_dist=not is_distributed())
        ref = manifest.data.get("frozen")
        if frozen:
            if not ref:
                raise CheckpointError(f"checkpoint {step_dir}: saved without OSFT factors, but this run uses OSFT")
            frozen_dir = step_dir.parent / ref["dir"]
            dcp.load(frozen, storage_reader=SafeFileSystemReader(frozen_dir), no_dist=not is_distributed())
            if frozen_dir.parent.resolve() == self.root.resolve():
                self.frozen_dir = ref["dir"]
        set_model_state_dict(self.model, {**rest, **frozen})
        r = self.env.rank
        optim = load_plain(step_dir / f"optimizer_rank{r}.pt")
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        for i, s in optim["state"].items():
            p = params[int(i)]
            if hasattr(p, "device_mesh"):
                from torch.distributed.tensor import DTensor

                s.update({k: DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                                                run_check=False)
                          for k, v in s.items() if k != "step"})
        self.optimizer.load_state_dict(with_run_hyperparameters(optim, self.optimizer))
        restore_position(self.scheduler, trainer_state.scheduler)
        rng = load_plain(step_dir / f"rng_rank{r}.pt")
        return trainer_state, rng
