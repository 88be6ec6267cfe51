"""Checkpoint manifests: which files a checkpoint holds, who wrote them, their sizes and SHA-256.

A checkpoint directory counts as complete only when its ``manifest.json`` exists and every file it
lists is present with the recorded size (and, when verified fully, checksum). docs/architecture.md section 5.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: incomplete, corrupt, or saved with other settings. The
    message names the directory and, for a file problem, the rank that wrote it and the file."""


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    """Hex SHA-256 of a file, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def describe_files(root: Path, names: list[str], rank: int) -> dict[str, dict]:
    """Manifest entries (size in bytes, SHA-256, writing rank) for files ``names`` relative to ``root``."""
    return {n: {"size": (root / n).stat().st_size, "sha256": sha256_file(root / n), "rank": rank} for n in names}


@dataclass(frozen=True)
class Manifest:
    """A parsed manifest: the directory it describes and its JSON content."""

    root: Path
    data: dict[str, Any]

    @property
    def files(self) -> dict[str, dict]:
        return self.data["files"]


def write_manifest(root: Path, files: dict[str, dict], **fields: Any) -> Path:
    """Write ``root/manifest.json`` (last, after every listed file is on disk) and return its path."""
    data = {"format": FORMAT_VERSION, **fields, "files": files}
    path = root / MANIFEST
    tmp = root / f".{MANIFEST}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
    tmp.replace(path)
    return path


def read_manifest(root: Path) -> Manifest:
    """Parse ``root/manifest.json``.

    Raises:
        CheckpointError: no manifest (an incomplete checkpoint), or one that is not valid JSON.
    """
    path = root / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"incomplete checkpoint {root.name} skipped: it has no {MANIFEST}")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not a valid manifest ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT_VERSION or not isinstance(data.get("files"), dict):
        raise CheckpointError(f"{path}: unknown manifest format {data.get('format') if isinstance(data, dict) else data!r}")
    return Manifest(root, data)


def verify_files(manifest: Manifest, checksums: bool = True) -> None:
    """Check every listed file: present, recorded size and (``checksums``) SHA-256.

    Raises:
        CheckpointError: naming the checkpoint, the rank that wrote the file and the file.
    """
    for name, entry in manifest.files.items():
        path = manifest.root / name
        who = f"rank {entry['rank']}'s file {name}"
        if not path.is_file():
            raise CheckpointError(f"checkpoint {manifest.root}: {who} is missing")
        size = path.stat().st_size
        if size != entry["size"]:
            raise CheckpointError(f"checkpoint {manifest.root}: {who} has {size} bytes, the manifest says {entry['size']}")
        if checksums and sha256_file(path) != entry["sha256"]:
            raise CheckpointError(f"checkpoint {manifest.root}: {who} does not match its SHA-256 (corrupt)")
