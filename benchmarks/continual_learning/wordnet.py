"""Probes untouched by both tasks: word definitions from WordNet 3.0 (Debian ``wordnet-base``).

- R3, definitions as plain text (``"dog: a member of the genus Canis"``): their loss before and
  after the tasks tells whether a method kept the model's general English;
- R2, 4-way multiple choice: which of four definitions fits a word (:func:`multiple_choice`).

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
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "wordnet-base"
POS_FILES = {"noun": "data.noun", "verb": "data.verb", "adj": "data.adj", "adv": "data.adv"}


class WordNetError(RuntimeError):
    """The WordNet files could not be found, downloaded or read."""


def locate_wordnet(data_dir: Path) -> Path:
    """The directory holding ``data.noun`` etc.: the installed package's, else a cached unpacked ``.deb``.

    Raises:
        DebianPackageError: ``apt-get download`` or ``dpkg-deb`` failed (their error quoted, with what to do).
    """
    from .debian import package_dir

    return package_dir(PACKAGE, "usr/share/wordnet", tuple(POS_FILES.values()), data_dir,
                       "pass --wordnet-dir with a directory that holds WordNet 3.0's data.noun, data.verb, data.adj, "
                       "data.adv")


def parse_data_file(path: Path, pos: str) -> list[tuple[str, str, str]]:
    """``(key, word, definition)`` per synset of one ``data.<pos>`` file.

    ``key`` is ``"<pos>:<offset>"`` (stable across machines); ``word`` the synset's first word
    (underscores turned into spaces); ``definition`` the gloss without its example sentences.

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
            definition = gloss.split('; "', 1)[0].strip().rstrip(";").strip()
            if definition:
                out.append((f"{pos}:{fields[0]}", fields[4].replace("_", " "), definition))
    return out


def _synsets(wordnet_dir: Path) -> list[tuple[str, str, str]]:
    """Every synset of the four data files, ordered by SHA-256 of its key (the same order on every machine)."""
    synsets = []
    for pos, name in POS_FILES.items():
        path = Path(wordnet_dir) / name
        if not path.is_file():
            raise WordNetError(f"{path} not found (expected WordNet 3.0's database files)")
        synsets.extend(parse_data_file(path, pos))
    synsets.sort(key=lambda s: hashlib.sha256(s[0].encode()).digest())
    return synsets


@dataclass(frozen=True)
class Choice:
    """One multiple-choice item: ``word``, four ``options`` (definitions) and the index of the right one."""

    word: str
    options: tuple[str, ...]
    answer: int


def probes(wordnet_dir: Path, n_text: int, n_choice: int, n_options: int = 4) -> tuple[list[str], list[Choice]]:
    """The R3 texts and the R2 items, from disjoint synsets chosen by hash.

    R3: the first ``n_text`` synsets as ``"word: definition"``. R2: each of the next ``n_choice``
    synsets is an item; its wrong options are the definitions of the next ``n_options - 1`` synsets
    of the same part of speech in hash order after it (random, other words), and the right option
    goes to position ``sha256(key) mod n_options``.

    Raises:
        WordNetError: a data file is missing or malformed, or too few synsets.
    """
    synsets = _synsets(wordnet_dir)
    if n_text + n_choice * n_options > len(synsets):
        raise WordNetError(f"asked for {n_text} texts and {n_choice} items, {wordnet_dir} has {len(synsets)} synsets")
    texts = [f"{word}: {definition}" for _, word, definition in synsets[:n_text]]
    pools: dict[str, list[tuple[str, str, str]]] = {}
    for synset in synsets[n_text + n_choice :]:
        pools.setdefault(synset[0].split(":", 1)[0], []).append(synset)
    items = []
    for key, word, definition in synsets[n_text : n_text + n_choice]:
        pool = pools[key.split(":", 1)[0]]
        wrong = []
        while len(wrong) < n_options - 1:  # each distractor used once: taken off the pool
            _, w, d = pool.pop(0)
            if w != word and d != definition and d not in wrong:
                wrong.append(d)
        answer = int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "big") % n_options
        items.append(Choice(word, tuple(wrong[:answer] + [definition] + wrong[answer:]), answer))
    return texts, items
