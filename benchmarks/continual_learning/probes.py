"""Probes no arm of the sequence benchmark trains on: what a chain of stages costs the base model.

Each probe is a list of single-turn prompts scored on the greedy reply (0/1 per item), except R1,
scored by NLL:

- ``knowledge``: ``What is the capital of <country>?`` from the capital quiz files of Debian's
  ``bsdgames`` package (``africa``, ``america``, ``asia``, ``europe``; :func:`read_quiz`); a hit
  when the reply's first line holds an accepted answer (case-insensitive, whole words);
- ``arithmetic``: ``What is a + b?`` / ``What is a - b?`` (``Reply with the number only.``) with
  10 <= b <= a <= 99 drawn from a fixed seed; a hit when the reply's result is right: the number
  after its first ``=``, else its first number;
- ``instruction``: simple instructions whose following is checked by rule (:data:`INSTRUCTIONS`):
  a word in capitals and nothing else, a word three times separated by commas, yes or no only, a
  sentence repeated exactly (the first of each with the first word, then the next word);
- ``r1``: the base model's own greedy replies to held-out chit-chat prompts (the demo's eval file,
  ``osft-train make-retention-set``); the score is their NLL in nats per token, so its change is
  the drift away from what the base model would say.

The quiz files are BSD-licensed data of a Debian package, fetched at run time (never committed);
the JSON results keep per-item outcomes by index only.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path

QUIZ_PACKAGE = "bsdgames"
QUIZ_DIR = "usr/share/games/bsdgames/quiz"
CAPITAL_FILES = ("africa", "america", "asia", "europe")
_NUMBER = re.compile(r"-?\d+")
#: A diacritic written as alternatives of an accent and a letter (``C[^o|o^|o]te``).
_ESCAPE = re.compile(r"\[[^\]]*[\^'`~\"][^\]]*\]")


@dataclass(frozen=True)
class ProbeItem:
    """One prompt and what a reply must show: ``kind`` picks the rule of :func:`hit`, ``answers``
    its accepted strings."""

    prompt: str
    kind: str
    answers: tuple[str, ...]


def expand(pattern: str) -> list[str]:
    """Every string a quiz pattern stands for: ``a|b`` either side, ``{x}`` x or nothing, ``[a|b]``
    one of its alternatives, nested (``Central Africa{n Rep{ublic}}`` -> ``Central Africa``,
    ``Central African Rep``, ``Central African Republic``), whitespace collapsed.

    Raises:
        ValueError: unbalanced brackets (naming the pattern).
    """
    def alternatives(i: int, closer: str | None) -> tuple[list[str], int]:
        out, current = [], [""]
        while i < len(pattern):
            c = pattern[i]
            if c == closer:
                return out + current, i + 1
            if c == "|":
                out += current
                current = [""]
                i += 1
            elif c in "{[":
                inner, i = alternatives(i + 1, "}" if c == "{" else "]")
                inner = [""] + inner if c == "{" else inner
                current = [a + b for a in current for b in inner]
            elif c in "}]":
                raise ValueError(f"quiz pattern {pattern!r}: unbalanced {c!r}")
            else:
                current = [a + c for a in current]
                i += 1
        if closer is not None:
            raise ValueError(f"quiz pattern {pattern!r}: {closer!r} missing")
        return out + current, i

    found = alternatives(0, None)[0]
    return list(dict.fromkeys(" ".join(s.split()) for s in found if s.strip()))


def read_quiz(path: Path) -> list[tuple[str, tuple[str, ...]]]:
    """``(country, capitals)`` per line ``Country:Capital`` of a quiz file: the country as its
    longest expansion, every expansion of the capital accepted; lines whose country or capital
    holds a diacritic escape (``[^o|o^|o]``) are skipped, their spelling not being plain text.

    Raises:
        ValueError: a line without one ``:`` between the two columns, naming the file and line.
    """
    items = []
    for number, line in enumerate(Path(path).read_text(encoding="latin-1").splitlines(), 1):
        if not line.strip():
            continue
        parts = re.split(r"(?<!\\):", line)
        if len(parts) != 2:
            raise ValueError(f"{path}:{number}: expected 'country:capital', got {line!r}")
        if _ESCAPE.search(line):
            continue
        countries, capitals = expand(parts[0]), expand(parts[1])
        if countries and capitals:
            items.append((max(countries, key=len), tuple(capitals)))
    return items


def knowledge_items(quiz_dir: Path) -> list[ProbeItem]:
    """The capital questions of every file of :data:`CAPITAL_FILES`, in file and line order."""
    return [ProbeItem(f"What is the capital of {country}?", "contains", capitals)
            for name in CAPITAL_FILES for country, capitals in read_quiz(Path(quiz_dir) / name)]


def arithmetic_items(n: int, seed: int = 0) -> list[ProbeItem]:
    """``n`` sums and differences of two-digit numbers, half each, from ``random.Random(seed)``."""
    rng = random.Random(seed)
    items = []
    for i in range(n):
        a, b = sorted((rng.randint(10, 99), rng.randint(10, 99)), reverse=True)
        op, value = ("+", a + b) if i % 2 == 0 else ("-", a - b)
        items.append(ProbeItem(f"What is {a} {op} {b}? Reply with the number only.", "result", (str(value),)))
    return items


#: Instruction templates: (prompt with ``{w}``, rule of :func:`hit`, accepted replies built from ``w``).
INSTRUCTIONS = (
    ("Reply with the word {w} in capital letters and nothing else.", "exact", lambda w: (w.upper(),)),
    ("Write the word {w} three times, separated by commas, and nothing else.", "exact",
     lambda w: (f"{w}, {w}, {w}",)),
    ("Is {w} a word? Answer with only yes or no.", "exact", lambda w: ("yes", "no")),
    ("Repeat this sentence exactly: I like the colour {w}.", "contains", lambda w: (f"I like the colour {w}.",)),
)
INSTRUCTION_WORDS = ("apple", "river", "green", "window", "tiger", "music", "cloud", "pencil", "garden",
                     "silver", "bread", "winter")


def instruction_items() -> list[ProbeItem]:
    """Every template of :data:`INSTRUCTIONS` with every word of :data:`INSTRUCTION_WORDS`, word by
    word (the first four items are the four templates with the first word)."""
    return [ProbeItem(prompt.format(w=w), kind, answers(w))
            for w in INSTRUCTION_WORDS for prompt, kind, answers in INSTRUCTIONS]


def hit(item: ProbeItem, reply: str) -> bool:
    """Whether ``reply`` satisfies ``item``: ``contains``, an answer in its first line (whole words,
    case-insensitive); ``result``, the number after its first ``=`` (else its first number) is the
    answer; ``exact``, its text once stripped of whitespace and a final full stop equals an answer
    (case-insensitive, but an all-capitals answer only in capitals).

    Raises:
        ValueError: an unknown ``item.kind``.
    """
    text = reply.strip()
    first = (text.splitlines() or [""])[0]
    if item.kind == "contains":
        return any(re.search(rf"(?<!\w){re.escape(a)}(?!\w)", first, re.IGNORECASE) for a in item.answers)
    if item.kind == "result":
        found = _NUMBER.search(text.split("=", 1)[1] if "=" in text else text)
        return bool(found) and found.group() == item.answers[0]
    if item.kind == "exact":
        bare = text.rstrip(".!").strip()
        return any(bare == a if a.isupper() else bare.lower() == a.lower() for a in item.answers)
    raise ValueError(f"unknown probe rule {item.kind!r}")


def build_probes(data_dir: Path, items: int, seed: int = 0) -> dict[str, list[ProbeItem]]:
    """The generated probes, ``items`` of each at most (a seeded sample of the capitals; the first
    ``items`` instructions), the quiz files fetched when missing
    (:func:`.debian.package_dir`).

    Raises:
        DebianPackageError: bsdgames could not be found or fetched.
    """
    from .debian import package_dir

    quiz = package_dir(QUIZ_PACKAGE, QUIZ_DIR, CAPITAL_FILES, data_dir, "install bsdgames")
    capitals = knowledge_items(quiz)
    chosen = sorted(random.Random(seed).sample(range(len(capitals)), min(items, len(capitals))))
    return {"knowledge": [capitals[i] for i in chosen], "arithmetic": arithmetic_items(items, seed),
            "instruction": instruction_items()[:items]}
