"""Task B: "What is X in computing?" -> X's definition, from FOLDOC (Debian ``dict-foldoc``).

FOLDOC, the Free On-line Dictionary of Computing (editor Denis Howe), is under the GNU Free
Documentation License; Debian ships it for the ``dictd`` server as ``/usr/share/dictd/foldoc.index``
and ``foldoc.dict.dz``. When the package is not installed, ``apt-get download dict-foldoc`` +
``dpkg-deb -x`` unpack it under the data directory (:mod:`.debian`). The chat files built from it
stay there; nothing derived from FOLDOC's text is committed.

dictd format (``dictd(8)``, ``dictfmt(1)``):

- ``.index``: one line per headword, ``headword TAB offset TAB length``; offset and length are byte
  counts into the uncompressed ``.dict`` written in base 64 with the digits ``A-Z a-z 0-9 + /``
  (most significant first). Several headwords (synonyms, abbreviations) may point at one entry.
  Headwords starting ``00-database-`` are the database's own metadata.
- ``.dict.dz``: the ``.dict`` text compressed with ``dictzip`` (a gzip file with random-access
  chunks; plain gzip reads it whole).
- an entry: its headword lines, a blank line, then indented paragraphs. The first paragraph is the
  definition: ``<category, ...>`` subject tags, then text where ``{term}`` marks a cross-reference
  (to be read as plain ``term``); later paragraphs hold references, URLs and the ``(yyyy-mm-dd)``
  edit date.

A question's definition is the first sentence of the entry's first paragraph, markup removed;
entries whose definition is a redirect (``See {X}.``), holds a URL or is shorter than
:data:`MIN_WORDS` words are skipped. The split is by headword (SHA-256 bucket,
:func:`osft.trainer.tools.demo_assets.split_of`).
"""

from __future__ import annotations

import gzip
import json
import re
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "dict-foldoc"
SHARE_DIR = "usr/share/dictd"
INDEX = "foldoc.index"
DICT_NAMES = ("foldoc.dict.dz", "foldoc.dict")
B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
MIN_WORDS = 6
MAX_WORDS = 40
EVAL_PERCENT = 10
QUESTION = "What is {} in computing?"
_TAG = re.compile(r"<[^<>]*>")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z(])")
_URL = re.compile(r"https?://|www\.|ftp://|\w@\w", re.IGNORECASE)


class FoldocError(RuntimeError):
    """The FOLDOC files are missing or malformed (the message names the file and line)."""


def decode_b64(text: str) -> int:
    """A dictd base-64 number: ``"B"`` -> 1, ``"BA"`` -> 64.

    Raises:
        ValueError: a character outside the dictd alphabet.
    """
    value = 0
    for ch in text:
        digit = B64.find(ch)
        if digit < 0:
            raise ValueError(f"{ch!r} is not a dictd base-64 digit")
        value = value * 64 + digit
    return value


def clean_definition(paragraph: str) -> str:
    """The first sentence of a definition paragraph as plain text (at most :data:`MAX_WORDS` words).

    ``"<language> (ASDL) A {language} developed by {Esprit}.  It ..."`` ->
    ``"(ASDL) A language developed by Esprit."``
    """
    text = " ".join(_TAG.sub(" ", paragraph).replace("{", "").replace("}", "").split())
    sentence = _SENTENCE_END.split(text, maxsplit=1)[0]
    words = sentence.split()
    return " ".join(words[:MAX_WORDS]) + ("" if len(words) <= MAX_WORDS else " ...")


@dataclass(frozen=True)
class Entry:
    """One dictionary entry: its first headword (as printed in the entry) and its definition."""

    term: str
    definition: str


def read_foldoc(index_path: Path, dict_path: Path) -> tuple[list[Entry], dict]:
    """Every usable entry of a dictd database, in index order, once per entry.

    Returns:
        ``(entries, stats)``: stats counts index lines, distinct entries and those skipped
        (redirect, URL, too short).

    Raises:
        FoldocError: an index line without three tab-separated fields, a bad base-64 number, or an
            offset/length outside the ``.dict`` (``FILE:LINE`` named).
    """
    opener = gzip.open if str(dict_path).endswith(".dz") else open
    with opener(dict_path, "rb") as fh:
        data = fh.read()
    entries: list[Entry] = []
    seen: set[int] = set()
    stats = {"index_lines": 0, "entries": 0, "skipped_redirect": 0, "skipped_url": 0, "skipped_short": 0}
    with open(index_path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            fields = line.rstrip("\n").split("\t")
            if len(fields) != 3:
                raise FoldocError(f"{index_path}:{number}: expected 'headword<TAB>offset<TAB>length'")
            stats["index_lines"] += 1
            if fields[0].startswith("00-database-"):
                continue
            try:
                offset, length = decode_b64(fields[1]), decode_b64(fields[2])
            except ValueError as e:
                raise FoldocError(f"{index_path}:{number}: {e}") from e
            if offset + length > len(data):
                raise FoldocError(f"{index_path}:{number}: entry at byte {offset} + {length} is past the end of "
                                  f"{dict_path} ({len(data)} bytes)")
            if offset in seen:
                continue
            seen.add(offset)
            stats["entries"] += 1
            text = data[offset : offset + length].decode("utf-8", errors="replace")
            head, _, body = text.strip("\n").partition("\n\n")
            paragraph = body.strip().split("\n\n", 1)[0]
            definition = clean_definition(paragraph)
            if re.match(r"see\b", _TAG.sub("", paragraph).strip(), re.IGNORECASE):
                stats["skipped_redirect"] += 1
            elif _URL.search(paragraph):
                stats["skipped_url"] += 1
            elif len(definition.split()) < MIN_WORDS:
                stats["skipped_short"] += 1
            else:
                entries.append(Entry(head.splitlines()[0].strip(), definition))
    return entries, stats


def chat_row(entry: Entry) -> dict:
    """The training conversation of an entry: "What is X in computing?" -> the definition."""
    return {"messages": [{"role": "user", "content": QUESTION.format(entry.term)},
                         {"role": "assistant", "content": entry.definition}]}


@dataclass(frozen=True)
class FoldocData:
    """The built task: chat jsonl for training and for held-out loss, and the build's stats."""

    train_path: Path
    eval_path: Path
    stats: dict


def build_foldoc(data_dir: Path, foldoc_dir: Path | None = None, eval_percent: int = EVAL_PERCENT) -> FoldocData:
    """Write ``data_dir/foldoc/{train,eval}.jsonl`` (and ``stats.json``, written last) from FOLDOC.

    ``foldoc_dir`` is a directory with ``foldoc.index`` and ``foldoc.dict(.dz)``; by default the
    installed package's, else Debian's package unpacked under ``data_dir``. Idempotent.

    Raises:
        DebianPackageError: the package is not installed and cannot be downloaded.
        FoldocError: the database is malformed.
    """
    from osft.trainer.tools.demo_assets import split_of
    from osft.trainer.rundir import write_text_atomic

    from .debian import package_dir

    out = Path(data_dir) / "foldoc"
    data = FoldocData(out / "train.jsonl", out / "eval.jsonl", {})
    stats_path = out / "stats.json"
    if stats_path.is_file() and data.train_path.is_file() and data.eval_path.is_file():
        return FoldocData(data.train_path, data.eval_path, json.loads(stats_path.read_text()))
    root = Path(foldoc_dir) if foldoc_dir else package_dir(PACKAGE, SHARE_DIR, (INDEX,), data_dir,
                                                          "pass --foldoc-dir with foldoc.index and foldoc.dict.dz")
    dict_path = next((root / n for n in DICT_NAMES if (root / n).is_file()), root / DICT_NAMES[0])
    if not (root / INDEX).is_file() or not dict_path.is_file():
        raise FoldocError(f"{root}: expected {INDEX} and {' or '.join(DICT_NAMES)}")
    entries, stats = read_foldoc(root / INDEX, dict_path)
    splits: dict[str, list[Entry]] = {"train": [], "eval": []}
    for entry in entries:
        splits[split_of(entry.term, eval_percent)].append(entry)
    out.mkdir(parents=True, exist_ok=True)
    for split, rows in splits.items():
        write_text_atomic(out / f"{split}.jsonl", "".join(json.dumps(chat_row(e)) + "\n" for e in rows))
    stats = dict(stats, source=f"Debian {PACKAGE} ({root})", train=len(splits["train"]), eval=len(splits["eval"]),
                 eval_percent=eval_percent)
    write_text_atomic(stats_path, json.dumps(stats, indent=2) + "\n")
    return FoldocData(data.train_path, data.eval_path, stats)
