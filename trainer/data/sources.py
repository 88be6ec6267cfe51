"""Rows of a training-data source, each with its location: JSON by line, columnar files by row.

Accepted sources (by the path):

- ``.jsonl`` and ``.json``: JSON Lines (one object a line), or, for a ``.json`` file whose first
  non-blank character is ``[``, one JSON array of objects. Read here with the standard library, so each
  problem carries the physical line (and for broken JSON the column) of JSON Lines, or the 1-based
  index of the array element (``row N``); ``datasets``' JSON loader would merge every row into one
  Arrow schema and lose both.
- ``.parquet`` and ``.arrow`` files, and a directory written by ``Dataset.save_to_disk``: read with
  ``datasets`` (``load_dataset("parquet"|"arrow")``, ``load_from_disk``); a problem carries the
  1-based row. Arrow gives every row the union of all rows' keys, with null where a row had none;
  those nulls are dropped again, so a message holds only the fields it was written with.

``load_dataset`` converts a file into Arrow in a cache directory: the caller names it (the data
cache's ``sources`` folder), or, without a writable one, a temporary directory removed after
reading.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: File suffixes read as JSON (lines or one array) and through ``datasets``' builders.
JSON_SUFFIXES = (".jsonl", ".json")
BUILDER_SUFFIXES = {".parquet": "parquet", ".arrow": "arrow"}
_BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True)
class Located:
    """One row of a source: ``where`` is its 1-based line (``unit`` "line") or row (``unit`` "row");
    ``row`` the decoded object, or None with ``error`` = ``(rule, message, column)`` when it could
    not be decoded."""

    where: int
    row: Any = None
    error: tuple[str, str, int | None] | None = None


def source_kind(path) -> str:
    """``"json"``, ``"parquet"``, ``"arrow"`` or ``"saved"`` (a ``save_to_disk`` directory).

    Raises:
        ValueError: the path is neither a directory nor a file with one of the accepted suffixes.
    """
    path = Path(path)
    if path.is_dir():
        return "saved"
    suffix = path.suffix.lower()
    if suffix in JSON_SUFFIXES:
        return "json"
    if suffix in BUILDER_SUFFIXES:
        return BUILDER_SUFFIXES[suffix]
    raise ValueError(f"{path}: unsupported data file type {suffix or '(no suffix)'!r}: use .jsonl, .json, .parquet, "
                     ".arrow or a directory written by Dataset.save_to_disk")


def location_unit(path) -> str:
    """``"line"`` for JSON Lines files, ``"row"`` for everything else (JSON arrays, columnar data)."""
    return "line" if source_kind(path) == "json" and not _is_json_array(Path(path)) else "row"


def _is_json_array(path: Path) -> bool:
    if path.suffix.lower() != ".json":
        return False
    with open(path, "rb") as f:
        head = f.read(4096).removeprefix(_BOM).lstrip()
    return head.startswith(b"[")


def read_rows(path, cache_dir: Path | None = None) -> Iterator[Located]:
    """Every row of ``path`` in order (see the module docstring for the formats).

    Args:
        cache_dir: where ``datasets`` may write its Arrow conversion of a parquet or arrow file,
            created when needed (None, or not writable: a temporary directory, removed once the
            rows are read).

    Raises:
        OSError: the source cannot be read. ValueError: unsupported type (:func:`source_kind`), a
            directory that ``load_from_disk`` cannot read, or a ``DatasetDict`` without a train split.
    """
    kind = source_kind(path)
    path = Path(path)
    if kind == "json":
        yield from (_json_array(path) if _is_json_array(path) else json_lines(path))
    elif kind == "saved":
        yield from _dataset_rows(_load_saved(path))
    elif cache_dir is not None and _writable_dir(Path(cache_dir)):
        yield from _dataset_rows(_load_file(path, kind, cache_dir))
    else:
        with tempfile.TemporaryDirectory(prefix="osft-source-") as tmp:
            yield from _dataset_rows(_load_file(path, kind, Path(tmp), in_memory=True))


def _writable_dir(path: Path) -> bool:
    """True when ``path`` exists or could be created, and this process can write in it."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(path, os.W_OK)


def json_lines(path, start: int = 0, stop: int | None = None, first_line: int = 1) -> Iterator[Located]:
    """The rows of a JSON Lines file, or of its bytes ``[start, stop)`` (both at line starts; the
    line at ``start`` is ``first_line``), with their physical lines."""
    with open(path, "rb") as f:
        f.seek(start)
        lines = f if stop is None else iter(lambda: f.readline() if f.tell() < stop else b"", b"")
        for line, raw in enumerate(lines, start=first_line):
            if line == 1:
                raw = raw.removeprefix(_BOM)
            raw = raw.rstrip(b"\r\n")
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield Located(line, error=("invalid_utf8", f"invalid UTF-8: {e.reason} at byte {e.start + 1}", None))
                continue
            if not text.strip():
                continue
            try:
                yield Located(line, json.loads(text))
            except json.JSONDecodeError as e:
                yield Located(line, error=("invalid_json", f"invalid JSON: {e.msg} (column {e.colno})", e.colno))


def _json_array(path: Path) -> Iterator[Located]:
    raw = path.read_bytes().removeprefix(_BOM)
    try:
        rows = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        yield Located(0, error=("invalid_utf8", f"invalid UTF-8: {e.reason} at byte {e.start + 1}", None))
        return
    except json.JSONDecodeError as e:
        yield Located(0, error=("invalid_json", f"invalid JSON: {e.msg} (line {e.lineno}, column {e.colno})", None))
        return
    if not isinstance(rows, list):
        yield Located(0, error=("row_not_object", "a .json file must hold one array of rows or one row per line", None))
        return
    for i, row in enumerate(rows, start=1):
        yield Located(i, row)


def _load_file(path: Path, kind: str, cache_dir: Path, in_memory: bool = False):
    from datasets import load_dataset
    from datasets.utils.logging import disable_progress_bar

    disable_progress_bar()
    return load_dataset(kind, data_files=str(path), split="train", cache_dir=str(cache_dir), keep_in_memory=in_memory)


def _load_saved(path: Path):
    from datasets import DatasetDict, load_from_disk

    try:
        data = load_from_disk(str(path))
    except FileNotFoundError as e:
        raise ValueError(f"{path}: a directory must be one written by Dataset.save_to_disk ({e})") from None
    if isinstance(data, DatasetDict):
        if "train" not in data:
            raise ValueError(f"{path}: a saved DatasetDict needs a 'train' split, it has {', '.join(data)}")
        data = data["train"]
    return data


def _dataset_rows(dataset) -> Iterator[Located]:
    for i, row in enumerate(dataset, start=1):
        yield Located(i, _without_nulls(row))


def _without_nulls(value: Any) -> Any:
    """``value`` with every null-valued key of every nested object removed (Arrow's filled-in keys)."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value
