"""A third text set untouched by both tasks: word definitions from WordNet 3.0 (Debian ``wordnet-base``).

Its held-out loss before and after the two tasks tells whether a method kept the model's general
English, beyond the two tasks it was trained on.

Source: Debian's ``wordnet-base`` package (Princeton WordNet 3.0 database files, under the WordNet
license, a BSD-style licence). When the package is installed its files are read from
``/usr/share/wordnet``; otherwise ``apt-get download wordnet-base`` fetches the ``.deb`` (no root
needed) and ``dpkg-deb -x`` unpacks it under the data directory.

Database format (``wndb(5WN)``): in ``data.{noun,verb,adj,adv}`` every line that does not start
with two spaces (the licence header does) is one synset::

    synset_offset lex_filenum ss_type w_cnt word lex_id [word lex_id...] p_cnt ... | gloss

``w_cnt`` is hexadecimal; words use ``_`` for spaces; the gloss is the definition, then optional
``; "example"`` sentences.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import tempfile
from pathlib import Path

PACKAGE = "wordnet-base"
SYSTEM_DIR = Path("/usr/share/wordnet")
POS_FILES = {"noun": "data.noun", "verb": "data.verb", "adj": "data.adj", "adv": "data.adv"}


class WordNetError(RuntimeError):
    """The WordNet files could not be found, downloaded or read."""


def locate_wordnet(data_dir: Path) -> Path:
    """The directory holding ``data.noun`` etc.: the installed package's, else a cached unpacked ``.deb``.

    Raises:
        WordNetError: ``apt-get download`` or ``dpkg-deb`` failed (their error quoted, with what to do).
    """
    if all((SYSTEM_DIR / f).is_file() for f in POS_FILES.values()):
        return SYSTEM_DIR
    unpacked = Path(data_dir) / "wordnet" / "root"
    files = unpacked / "usr" / "share" / "wordnet"
    if all((files / f).is_file() for f in POS_FILES.values()):
        return files
    for tool in ("apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise WordNetError(f"{tool} not found: install Debian's {PACKAGE} package, or pass --wordnet-dir "
                               "with a directory that holds WordNet 3.0's data.noun, data.verb, data.adj, data.adv")
    unpacked.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=unpacked.parent, prefix=".download-") as tmp:
        _run(["apt-get", "download", PACKAGE], cwd=tmp)
        debs = list(Path(tmp).glob("*.deb"))
        if len(debs) != 1:
            raise WordNetError(f"apt-get download {PACKAGE} left {len(debs)} .deb files in {tmp}")
        _run(["dpkg-deb", "-x", str(debs[0]), str(Path(tmp) / "root")], cwd=tmp)
        if unpacked.exists():
            shutil.rmtree(unpacked)
        (Path(tmp) / "root").rename(unpacked)
    return files


def _run(cmd: list[str], cwd: str) -> None:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-4:])
        raise WordNetError(f"`{' '.join(cmd)}` failed ({tail}); run `apt-get update` first, or install "
                           f"{PACKAGE}, or pass --wordnet-dir")


def parse_data_file(path: Path, pos: str) -> list[tuple[str, str]]:
    """``(key, text)`` per synset of one ``data.<pos>`` file.

    ``key`` is ``"<pos>:<offset>"`` (stable across machines); ``text`` is
    ``"<first word>: <definition>"`` (example sentences removed, underscores turned into spaces).

    Raises:
        WordNetError: a synset line without the ``|`` gloss separator (file and line number named).
    """
    out = []
    with open(path, encoding="utf-8", errors="replace") as fh:
        for number, line in enumerate(fh, 1):
            if line.startswith("  ") or not line.strip():
                continue
            head, sep, gloss = line.partition(" | ")
            if not sep:
                raise WordNetError(f"{path}:{number}: synset line without a ' | ' gloss")
            fields = head.split()
            word = fields[4].replace("_", " ")
            definition = gloss.split('; "', 1)[0].strip().rstrip(";").strip()
            if definition:
                out.append((f"{pos}:{fields[0]}", f"{word}: {definition}"))
    return out


def definitions(wordnet_dir: Path, n: int) -> list[str]:
    """``n`` definitions chosen by SHA-256 of their synset key (the same ones on every machine).

    Raises:
        WordNetError: a data file is missing or malformed, or ``n`` exceeds the synsets available.
    """
    synsets = []
    for pos, name in POS_FILES.items():
        path = Path(wordnet_dir) / name
        if not path.is_file():
            raise WordNetError(f"{path} not found (expected WordNet 3.0's database files)")
        synsets.extend(parse_data_file(path, pos))
    if n > len(synsets):
        raise WordNetError(f"asked for {n} definitions, {wordnet_dir} has {len(synsets)}")
    synsets.sort(key=lambda kv: hashlib.sha256(kv[0].encode()).digest())
    return [text for _, text in synsets[:n]]
