"""On-disk cache of tokenized chat data (``datasets`` Arrow files), keyed by everything that
determines the result, so a rerun on the same source skips validation and tokenization.

An entry is ``report.json`` (the :class:`.tokenize.DataReport`) and ``dataset/`` with one Arrow
file per shard (:mod:`.prepare`), memory-mapped when read. Key = SHA-256 over: the SHA-256 of the source's bytes
(a file's, or every file's of a ``save_to_disk`` directory with its relative name:
:func:`.fingerprint.content_sha256`, shared with the run's fingerprint), the tokenizer (the SHA-256
of its serialized fast tokenizer, and its chat template),
``max_seq_len``, the overlong policy, the labelling options (``train_on_all``, the row shape, ...)
and :data:`CACHE_FORMAT`. Only successful results are stored; an entry is written to a temporary
directory and renamed, so a half-written entry is never read. ``datasets``' own Arrow conversion of
a parquet or arrow source goes to the cache's ``sources`` folder. A cache directory that cannot be
written (a read-only home or image) is never required: the data is tokenized without it, with a
warning naming the directory, and the conversion goes to a temporary directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

from .fingerprint import content_sha256, tokenizer_sha256
from .prepare import load_shards
from .tokenize import DataReport, TokenizedChat, tokenize_chat_file

#: Bump when the tokenization or the stored layout changes.
CACHE_FORMAT = 5
#: Environment variable overriding the default cache directory.
DATA_CACHE_ENV = "OSFT_DATA_CACHE"


def default_cache_dir() -> Path:
    """``$OSFT_DATA_CACHE`` if set, else ``platformdirs.user_cache_dir("osft")/tokenized``."""
    env = os.environ.get(DATA_CACHE_ENV)
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("osft")) / "tokenized"


def cache_key(path, tokenizer, max_seq_len: int, overlong: str, **options) -> str:
    """Hex SHA-256 identifying one tokenization result (see the module docstring); ``options`` are
    the keyword arguments of :func:`.tokenize.tokenize_chat_file` that change the result."""
    h = hashlib.sha256()
    h.update(content_sha256(path).encode())
    h.update(tokenizer_sha256(tokenizer).encode())
    h.update(str(tokenizer.chat_template).encode())
    h.update(json.dumps([max_seq_len, overlong, sorted(options.items()), CACHE_FORMAT]).encode())
    return h.hexdigest()


def tokenize_chat_file_cached(
    path, tokenizer, max_seq_len: int, overlong: str = "drop", cache_dir: Path | None = None,
    warn: Callable[[str], None] | None = None, num_proc: int | None = None, **options,
) -> tuple[TokenizedChat, bool]:
    """:func:`.tokenize.tokenize_chat_file` through the cache in ``cache_dir``.

    Args:
        warn: called with a message when the cache cannot be written (default: ``warnings.warn``);
            the data is then returned without being stored.
        num_proc: processes preparing the data (:func:`.tokenize.tokenize_chat_file`; not part of the
            key: the result does not depend on it).
        options: keyword arguments of :func:`.tokenize.tokenize_chat_file` (``train_on_all``,
            ``data_format``, ...), part of the key.

    Returns:
        ``(data, hit)``: the tokenized data (memory-mapped from the cache) and whether it came
        from the cache.

    Raises:
        Everything :func:`.tokenize.tokenize_chat_file` raises (errors are never cached).
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    entry = root / cache_key(path, tokenizer, max_seq_len, overlong, **options)
    if (entry / "report.json").is_file():
        report = DataReport(**json.loads((entry / "report.json").read_text()))
        report.path = str(path)
        return TokenizedChat(dataset=load_shards(sorted((entry / "dataset").glob("*.arrow"))), report=report), True
    tmp = entry.with_name(f".{entry.name}.tmp{os.getpid()}")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "dataset").mkdir(parents=True)
        data = tokenize_chat_file(path, tokenizer, max_seq_len, overlong, source_cache=root / "sources",
                                  out_dir=tmp / "dataset", num_proc=num_proc, **options)
        (tmp / "report.json").write_text(data.report.to_json())
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if not _unwritable(root):
            raise
        (warn or warnings.warn)(f"the tokenized-data cache {root} is not writable ({exc.strerror or exc}): the data "
                                f"is tokenized without it; give a writable --data-cache-dir (or --no-data-cache)")
        return tokenize_chat_file(path, tokenizer, max_seq_len, overlong, num_proc=num_proc, **options), False
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        os.replace(tmp, entry)
    except OSError:  # another process stored the same entry first
        shutil.rmtree(tmp, ignore_errors=True)
    return TokenizedChat(dataset=load_shards(sorted((entry / "dataset").glob("*.arrow"))), report=data.report), False


def _unwritable(root: Path) -> bool:
    """True when no file can be created in ``root`` (created if missing)."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=root):
            return False
    except OSError:
        return True


def tokenize_source(cfg, path, tokenizer, warn: Callable[[str], None]) -> tuple[TokenizedChat, bool]:
    """Tokenize the source ``path`` with the run's settings: through the cache in
    ``--data-cache-dir`` (or the default), or without it under ``--no-data-cache``.

    Returns:
        ``(data, hit)`` as :func:`tokenize_chat_file_cached`.

    Raises:
        Everything :func:`.tokenize.tokenize_chat_file` raises.
    """
    options = dict(train_on_all=cfg.train_on_all, data_format=cfg.data_format, train_reasoning=cfg.train_reasoning,
                   last_turn_only=cfg.train_last_turn_only)
    if not cfg.data_cache:
        return tokenize_chat_file(path, tokenizer, cfg.max_seq_len, cfg.overlong, **options), False
    return tokenize_chat_file_cached(path, tokenizer, cfg.max_seq_len, cfg.overlong, cache_dir=cfg.data_cache_dir,
                                     warn=warn, **options)
