"""The checkpoint root ``<output_dir>/full_state_checkpoints``: complete checkpoints, the frozen
OSFT factors they share, retention, and the shared-storage check.

Layout (docs/architecture.md section 5)::

    full_state_checkpoints/
      frozen_<job_id>-<token>/   the frozen parameters of every OSFT module (W_high, bases, P/Q, start
                         factors; DCP) + manifest.json;
                         written once per run, referenced by checksum from each step's manifest
      step_<N>/          one complete checkpoint (see :mod:`.full_state`)
      step_<N>.tmp-<job_id>/   being written (or cut off): never resumed from
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

from ..distributed import is_distributed
from ..rundir import STEP_DIR
from .manifest import MANIFEST, CheckpointError, Manifest, read_manifest, verify_files


def verify_checkpoint(step_dir: Path, checksums: bool = True) -> Manifest:
    """Verify a ``step_<N>`` checkpoint and the frozen OSFT factors its manifest references.

    Raises:
        CheckpointError: a missing manifest, a missing, truncated or corrupt file (named with the
            rank that wrote it), a DCP ``.metadata`` holding more than metadata, or frozen factors
            that are missing or not the referenced ones.
    """
    # torch.distributed.checkpoint only to read a checkpoint: a launcher that starts a fresh run
    # imports this module (orphans, free space) but never loads it
    from .safe_load import SafeFileSystemReader

    manifest = read_manifest(step_dir)
    verify_files(manifest, checksums)
    SafeFileSystemReader(step_dir / "model").read_metadata()  # refuses a .metadata that could run code
    frozen = manifest.data.get("frozen")
    if frozen:
        frozen_dir = step_dir.parent / frozen["dir"]
        path = frozen_dir / MANIFEST
        if not path.is_file():
            raise CheckpointError(f"checkpoint {step_dir}: its frozen OSFT factors {frozen_dir} are missing")
        if hashlib.sha256(path.read_bytes()).hexdigest() != frozen["manifest_sha256"]:
            raise CheckpointError(f"checkpoint {step_dir}: {frozen_dir} holds other frozen OSFT factors than it was saved with")
        verify_files(read_manifest(frozen_dir), checksums)
        SafeFileSystemReader(frozen_dir).read_metadata()
    return manifest


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every ``step_<N>`` directory under ``root``, newest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name))]
    return sorted(found, reverse=True)


def newest_complete(root: Path, max_step: int | None = None) -> tuple[Path | None, list[str]]:
    """The newest checkpoint under ``root`` that verifies (at or before ``max_step`` when given),
    and one line per directory skipped on the way (with the reason), also for entries that are not
    checkpoints at all.

    Returns:
        ``(step dir or None, skip messages)``.
    """
    skipped = []
    if root.is_dir():
        for p in sorted(root.iterdir()):
            if not STEP_DIR.match(p.name) and not p.name.startswith(("frozen_", ".")):
                if ".tmp-" in p.name:
                    skipped.append(f"incomplete checkpoint {p.name.split('.tmp-')[0]} skipped: {p.name} was never finished")
                else:
                    skipped.append(f"{p.name} skipped: not a step_<N> checkpoint directory")
    for step, path in step_dirs(root):
        if max_step is not None and step > max_step:
            continue
        try:
            verify_checkpoint(path)
            return path, skipped
        except CheckpointError as exc:
            skipped.append(str(exc) if "skipped" in str(exc) else f"checkpoint {path.name} skipped: {exc}")
    return None, skipped


def apply_retention(root: Path, keep_last: int, keep_frozen: str | None) -> list[Path]:
    """Remove all but the newest ``keep_last`` complete checkpoints (0 keeps all; the newest
    complete one always stays), then every ``frozen_*`` store that no remaining checkpoint
    references, except ``keep_frozen`` (this run's). Returns what was removed.

    "Complete" = a manifest whose files are all present with their sizes (checksums are not
    re-read here); a broken directory never counts towards the K kept and is left for inspection.
    """
    removed = []
    complete = [p for _s, p in step_dirs(root) if _is_complete(p)]
    if keep_last > 0:
        for path in complete[max(keep_last, 1):]:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    referenced = {keep_frozen}
    for _s, p in step_dirs(root):
        try:
            referenced.add((read_manifest(p).data.get("frozen") or {}).get("dir"))
        except CheckpointError:
            continue
    for p in root.glob("frozen_*"):
        if p.is_dir() and p.name not in referenced and not p.name.endswith(".tmp"):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def _is_complete(step_dir: Path) -> bool:
    try:
        verify_checkpoint(step_dir, checksums=False)
        return True
    except CheckpointError:
        return False


def check_shared(root: Path, rank: int, hostname: str) -> None:
    """Collective start-up check that the checkpoint root is one directory for every rank
    (tests/test_resume.py::test_checkpoint_directory_not_shared_between_nodes_fails_at_start): rank 0 writes a sentinel with a random token, every rank reads it back.

    Raises:
        ValueError: on every rank, naming the ranks and hosts that could not see the sentinel.
    """
    root.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex
    objs = [token]
    if is_distributed():
        dist.broadcast_object_list(objs, src=0)
    sentinel = root / f".sentinel-{objs[0]}"
    if rank == 0:
        sentinel.write_text(objs[0])
    if is_distributed():
        dist.barrier()
    try:
        ok = sentinel.read_text() == objs[0]
    except OSError:
        ok = False
    seen = [(ok, rank, hostname)]
    if is_distributed():
        seen = [None] * dist.get_world_size()
        dist.all_gather_object(seen, (ok, rank, hostname))
        dist.barrier()
    if rank == 0:
        sentinel.unlink(missing_ok=True)
    blind = [f"rank {r} on {h}" for o, r, h in seen if not o]
    if blind:
        raise ValueError(
            f"checkpoint directory {root} is not visible from {', '.join(blind)}: it must be on storage shared by "
            "every node (a file rank 0 wrote there could not be read)"
        )


#: Errors of a save that mean the checkpoint root has no room for it (space, quota) or cannot be
#: written (read-only, permission): the partial checkpoint is removed and one line says so.
NO_ROOM_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})


def megabytes(n: int | None) -> str:
    """``51.2 MB`` (``?`` for None)."""
    return "?" if n is None else f"{n / 1e6:.1f} MB"


def no_room_line(name: str, code: int, root: Path, needed: int, free: int | None, newest: str | None) -> str:
    """The one line a save that failed for lack of space or permission gives, e.g. ``checkpoint
    step_3 not written: no space left on device (errno 28, ENOSPC) in <root>: about 51.2 MB needed,
    17.9 MB free; newest complete: step_2``."""
    what = os.strerror(code)
    return (f"checkpoint {name} not written: {what[:1].lower()}{what[1:]} (errno {code}, {errno.errorcode[code]}) "
            f"in {root}: about {megabytes(needed)} needed, {megabytes(free)} free; newest complete: {newest or 'none'}")


def remove_orphans(root: Path) -> list[tuple[str, int]]:
    """Remove the partial checkpoints under ``root`` (``step_<N>.tmp-<job>``, ``step_<N>.replaced-<job>``,
    ``frozen_*.tmp``) that a job left when it died; called before the next job of the run starts
    (the run directory is then owned by no live job: :mod:`..ownership`). Returns ``(name, bytes)``
    of each, in name order."""
    if not root.is_dir():
        return []
    removed = []
    for p in sorted(root.iterdir()):
        if p.is_dir() and (".tmp-" in p.name or ".replaced-" in p.name or (p.name.startswith("frozen_")
                                                                          and p.name.endswith(".tmp"))):
            size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
            shutil.rmtree(p, ignore_errors=True)
            removed.append((p.name, size))
    return removed


def room_problem(root: Path) -> str | None:
    """Why a run that checkpoints to ``root`` cannot start: its free space is below the size of
    the newest checkpoint there with a manifest (what the next save needs: retention removes old
    ones only after it); None when there is room or no checkpoint to size it by."""
    for _step, newest in step_dirs(root):
        try:
            needed = sum(f["size"] for f in read_manifest(newest).files.values())
            break
        except CheckpointError:
            continue
    else:
        return None
    free = shutil.disk_usage(root).free
    if free >= needed:
        return None
    return (f"no space left for a checkpoint in {root}: {megabytes(free)} free, a checkpoint of this run needs "
            f"about {megabytes(needed)} (as {newest.name}); free space there, then start again")


def versions() -> dict[str, str]:
    """Versions recorded in each manifest."""
    from importlib.metadata import PackageNotFoundError, version

    import transformers

    try:
        osft = version("osft")
    except PackageNotFoundError:
        osft = "unknown"
    return {"osft": osft, "torch": torch.__version__, "transformers": transformers.__version__}
