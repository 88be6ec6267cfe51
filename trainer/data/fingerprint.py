"""Fingerprints of the inputs a resumed run must share with its checkpoint to reproduce it.

A full-state checkpoint records :func:`run_inputs` of the run that saved it (``trainer_state.json``
key ``inputs``); a resume compares them with its own (:func:`changed_inputs`). Every input whose
change alters the trajectory or its comparisons is there, by content, never by path (an identical
copy at another path has the same fingerprint):

| key | what is hashed (SHA-256) |
| --- | --- |
| ``training`` | each ``--data-path`` source in order: its bytes (:func:`content_sha256`, the digest the data cache key is made from), with its mixture weight |
| ``tokenizer`` | the serialized fast tokenizer (vocabulary, merges, added and special tokens) |
| ``chat_template`` | the chat template's text (after ``--chat-template``) |
| ``evaluation`` | the ``--eval-data-path`` file's bytes and ``--eval-max-samples`` (None without one; an ``--eval-split`` set is part of the training data) |
| ``retention`` | each ``--retention-data-path`` file's bytes and ``--eval-max-samples`` |

The tokenization settings (``--max-seq-len``, the overlong policy, the labelling flags) are
settings of the checkpoint (:data:`..checkpoint.trainer_state.RESUME_SETTINGS`), compared there.
Standard library only.
"""

from __future__ import annotations

import functools
import hashlib
import weakref
from pathlib import Path
from typing import Any

#: How each fingerprinted input is named in a message.
INPUT_NAMES = {"training": "the training data (--data-path)", "tokenizer": "the tokenizer",
               "chat_template": "the chat template", "evaluation": "the evaluation set (--eval-data-path)",
               "retention": "the retention sets (--retention-data-path)"}


def source_files(path: Path) -> list[Path]:
    """The files of a source: the file itself, or every file under a directory, sorted."""
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]


def hash_source(h, path) -> None:
    """Feed ``h`` (a ``hashlib`` object) with the content of the source ``path``: its bytes, or for a
    directory each file's name relative to it followed by its bytes. The path itself is not hashed.

    Raises:
        OSError: a file cannot be read.
    """
    path = Path(path)
    for file in source_files(path):
        h.update(str(file.relative_to(path) if path.is_dir() else "").encode())
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)


def _stat_key(path: Path) -> tuple:
    """What stands for a source's content within one process without reading it: each file's
    name relative to it, size, modification time (ns) and inode."""
    return tuple((str(f.relative_to(path)) if path.is_dir() else "", st.st_size, st.st_mtime_ns, st.st_ino)
                 for f in source_files(path) for st in (f.stat(),))


@functools.lru_cache(maxsize=256)
def _content_digest(path: Path, stat_key: tuple) -> str:
    h = hashlib.sha256()
    hash_source(h, path)
    return h.hexdigest()


def content_sha256(path) -> str:
    """Hex SHA-256 of the content of the source ``path`` (:func:`hash_source`). Read once per
    process while the files' sizes, modification times and inodes stay the same: the data cache
    key and the fingerprint of one start share one read.

    Raises:
        OSError: a file cannot be read.
    """
    path = Path(path).resolve()
    return _content_digest(path, _stat_key(path))


def _text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


#: tokenizer -> (its length, its chat template, the SHA-256 of its serialization)
_TOKENIZER_DIGESTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def tokenizer_sha256(tokenizer) -> str:
    """Hex SHA-256 of the serialized fast tokenizer (vocabulary, merges, added and special tokens),
    serialized once per tokenizer object while its length and chat template stay the same."""
    seen = _TOKENIZER_DIGESTS.get(tokenizer)
    if seen is None or seen[:2] != (len(tokenizer), tokenizer.chat_template):
        seen = (len(tokenizer), tokenizer.chat_template, _text_sha256(tokenizer.backend_tokenizer.to_str()))
        _TOKENIZER_DIGESTS[tokenizer] = seen
    return seen[2]


def run_inputs(cfg, tokenizer, training: list[tuple[str, float | None]]) -> dict[str, Any]:
    """The fingerprint of a run's inputs (the module docstring), plain JSON data.

    Args:
        cfg: the run's config (``--eval-data-path``, ``--retention-data-path``, ``--eval-max-samples``).
        tokenizer: the fast tokenizer the data is tokenized with (``--chat-template`` applied).
        training: ``(path, weight)`` of each ``--data-path`` source in order (weight None: not a mixture).
    """
    def entry(path: str, **extra) -> dict[str, Any]:
        return {"path": str(path), "sha256": content_sha256(path), **extra}

    return {
        "training": [entry(path, weight=weight) for path, weight in training],
        "tokenizer": tokenizer_sha256(tokenizer),
        "chat_template": _text_sha256(str(tokenizer.chat_template)),
        "evaluation": entry(cfg.eval_data_path, max_samples=cfg.eval_max_samples) if cfg.eval_data_path else None,
        "retention": [entry(path, max_samples=cfg.eval_max_samples) for path in cfg.retention_data_path or []],
    }


def _content(value):
    """``value`` (an input of :func:`run_inputs`) without its paths: what is compared."""
    if isinstance(value, list):
        return [_content(v) for v in value]
    if isinstance(value, dict):
        return {k: v for k, v in value.items() if k != "path"}
    return value


def _paths(entries: list[dict]) -> str:
    return ", ".join(e["path"] for e in entries) or "none"


def _describe(saved, now) -> str:
    """What differs between the checkpoint's value of one input and this run's."""
    if isinstance(saved, str) or isinstance(now, str):
        return f"sha256 {str(saved)[:12]} at the checkpoint, {str(now)[:12]} now"
    if isinstance(saved, list) or isinstance(now, list):
        saved, now = saved or [], now or []
        if len(saved) != len(now):
            return f"{len(saved)} file(s) at the checkpoint ({_paths(saved)}), {len(now)} now ({_paths(now)})"
        return "; ".join(_describe(a, b) for a, b in zip(saved, now) if _content(a) != _content(b))
    if saved is None or now is None:
        return f"{_paths([saved] if saved else [])} at the checkpoint, {_paths([now] if now else [])} now"
    parts = [f"{key} {saved.get(key)} at the checkpoint, {now.get(key)} now" for key in sorted(set(saved) | set(now))
             if key not in ("path", "sha256") and saved.get(key) != now.get(key)]
    if saved["sha256"] != now["sha256"]:
        parts.insert(0, f"{now['path']} differs in content from {saved['path']}, the file the checkpoint was "
                        f"trained with (sha256 {saved['sha256'][:12]} at the checkpoint, {now['sha256'][:12]} now)")
    return "; ".join(parts)


def changed_inputs(saved: dict[str, Any] | None, now: dict[str, Any]) -> dict[str, str]:
    """``{input key: what differs}`` for every input of ``now`` (:func:`run_inputs`) whose content
    differs from ``saved`` (a checkpoint's; None: a checkpoint older than fingerprints, nothing compared)."""
    if saved is None:
        return {}
    return {key: _describe(saved.get(key), now.get(key)) for key in INPUT_NAMES
            if _content(saved.get(key)) != _content(now.get(key))}
