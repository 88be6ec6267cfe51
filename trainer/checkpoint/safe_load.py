"""Reading checkpoint files without running code from them.

``torch.load(weights_only=True)`` for the per-rank files, and a DCP reader whose ``.metadata`` is
unpickled with an allow-list: the stock ``FileSystemReader.read_metadata`` calls ``pickle.load``,
so a crafted ``.metadata`` could execute anything on every rank.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from .manifest import CheckpointError

#: (module, name) pairs a DCP ``.metadata`` pickle may reference (torch dtypes are checked apart).
_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or module == _METADATA_MODULE:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint's .metadata")


class SafeFileSystemReader(FileSystemReader):
    """``torch.distributed.checkpoint.FileSystemReader`` whose ``.metadata`` holds only DCP's
    metadata classes, torch dtypes and sizes, and paths.

    Raises:
        CheckpointError: from :meth:`read_metadata`, for anything else in the file.
    """

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as exc:
            raise CheckpointError(f"{path}: refused to load ({exc})") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path}: refused to load (not DCP metadata)")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def load_plain(path: Path) -> Any:
    """``torch.load(path, weights_only=True)``: tensors, numbers, strings and containers only.

    Raises:
        CheckpointError: the file holds anything else (it could run code when unpickled) or is unreadable.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{path}: refused to load: it holds more than tensors and plain data ({first})") from None
    except (RuntimeError, EOFError) as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc})") from None
