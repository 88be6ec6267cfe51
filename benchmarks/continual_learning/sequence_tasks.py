"""The task sequence of ``continual_sequence.py``: a small spec per task, and the built-in tasks.

A task spec is a JSON object ``{"name", "train", "eval", "metric"}``: ``train`` and ``eval`` are chat
jsonl files (one user turn, one assistant turn per row), ``metric`` one of :data:`METRICS`:

- ``exact``: the greedy reply's first line equals the reference reply (whitespace-normalised), in points;
- ``format``: the greedy reply follows the trivia marker format ``Answer: [[X]]`` (:func:`.trivia.is_compliant`);
- ``nll``: no generation; the score is minus the reference replies' NLL (nats per token).

Every task also gets the reference NLL measured, so the NLL matrix exists for every metric.
``--spec FILE`` (a JSON list of such objects, in training order) runs the sequence on a user's tasks.

Built-in tasks (:func:`builtin_specs`), each a skill SmolLM2-135M-Instruct lacks, each with its own
cue and format, written under the data directory at run time (nothing committed):

- ``trivia``: ``Quiz: <question>`` -> ``Answer: [[<answer>]]`` (the ``red-discordbot`` wheel from
  PyPI, :mod:`.trivia`), metric ``format``;
- ``foldoc``: ``What is X in computing?`` -> FOLDOC's definition (Debian ``dict-foldoc``, :mod:`.foldoc`),
  metric ``nll``;
- ``spell``: ``Spell out: 4821`` -> ``four thousand eight hundred twenty-one`` (0-9999, one fixed
  convention: hyphenated tens, no "and"), metric ``exact``;
- ``roman``: ``Roman numeral of 1994?`` -> ``MCMXCIV`` (1-3999), metric ``exact``.

The two generated tasks split by SHA-256 of the number (:func:`osft.trainer.tools.demo_assets.split_of`),
as the package-built ones split by question.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

METRICS = ("exact", "format", "nll")
_ONES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
         "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen")
_TENS = ("", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")
_ROMAN = ((1000, "M"), (900, "CM"), (500, "D"), (400, "CD"), (100, "C"), (90, "XC"), (50, "L"), (40, "XL"),
          (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I"))


@dataclass(frozen=True)
class TaskSpec:
    """One task: ``name``, ``train`` and ``eval`` chat jsonl paths, ``metric`` (:data:`METRICS`)."""

    name: str
    train: Path
    eval: Path
    metric: str


def read_specs(path: Path) -> list[TaskSpec]:
    """The task specs of a JSON file (a list of ``{"name", "train", "eval", "metric"}``, relative
    paths against the file's directory).

    Raises:
        ValueError: naming the file and the entry: not a list of such objects, an unknown metric,
            a missing file, a repeated name, or fewer than 2 tasks.
    """
    try:
        items = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"task spec {path}: cannot read it: {exc}") from exc
    if not isinstance(items, list) or len(items) < 2:
        raise ValueError(f"task spec {path}: expected a JSON list of at least 2 tasks")
    specs = []
    for i, item in enumerate(items):
        if not isinstance(item, dict) or set(item) != {"name", "train", "eval", "metric"}:
            raise ValueError(f"task spec {path}: entry {i} must have exactly the keys name, train, eval, metric")
        if item["metric"] not in METRICS:
            raise ValueError(f"task spec {path}: entry {i} ({item['name']}): metric must be one of {METRICS}")
        files = {k: (Path(path).parent / item[k]) for k in ("train", "eval")}
        for key, file in files.items():
            if not file.is_file():
                raise ValueError(f"task spec {path}: entry {i} ({item['name']}): {key} file {file} not found")
        specs.append(TaskSpec(str(item["name"]), files["train"], files["eval"], item["metric"]))
    if len({s.name for s in specs}) != len(specs):
        raise ValueError(f"task spec {path}: task names repeat")
    return specs


def spell_number(n: int) -> str:
    """0 <= n <= 9999 in words: ``4821`` -> ``"four thousand eight hundred twenty-one"``.

    Raises:
        ValueError: n outside 0-9999.
    """
    if not 0 <= n <= 9999:
        raise ValueError(f"{n} is outside 0-9999")
    if n < 20:
        return _ONES[n]
    if n < 100:
        return _TENS[n // 10] + ("" if n % 10 == 0 else "-" + _ONES[n % 10])
    for size, word in ((1000, "thousand"), (100, "hundred")):
        if n >= size:
            head, rest = divmod(n, size)
            return f"{_ONES[head]} {word}" + ("" if rest == 0 else " " + spell_number(rest))
    raise AssertionError("unreachable")


def roman_numeral(n: int) -> str:
    """1 <= n <= 3999 as a Roman numeral: ``1994`` -> ``"MCMXCIV"``.

    Raises:
        ValueError: n outside 1-3999.
    """
    if not 1 <= n <= 3999:
        raise ValueError(f"{n} is outside 1-3999")
    out = []
    for value, letters in _ROMAN:
        count, n = divmod(n, value)
        out.append(letters * count)
    return "".join(out)


def _row(user: str, assistant: str) -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]}


def _write_generated(out: Path, name: str, numbers: range, prompt, reply) -> TaskSpec:
    from osft.trainer.tools.demo_assets import split_of
    from osft.trainer.rundir import write_text_atomic

    rows = {"train": [], "eval": []}
    for n in numbers:
        rows[split_of(f"{name}:{n}")].append(_row(prompt(n), reply(n)))
    paths = {}
    for split, items in rows.items():
        paths[split] = out / name / f"{split}.jsonl"
        paths[split].parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(paths[split], "".join(json.dumps(r) + "\n" for r in items))
    return TaskSpec(name, paths["train"], paths["eval"], "exact")


def builtin_specs(data_dir: Path, foldoc_dir: Path | None = None) -> list[TaskSpec]:
    """The four built-in tasks in their default order (trivia, foldoc, spell, roman), built under ``data_dir``.

    Raises:
        TriviaError, FoldocError, DebianPackageError: a package could not be fetched or read.
    """
    from . import foldoc, trivia

    tri = trivia.build_trivia(data_dir)
    fol = foldoc.build_foldoc(data_dir, foldoc_dir)
    return [TaskSpec("trivia", tri.train_path, tri.eval_path, "format"),
            TaskSpec("foldoc", fol.train_path, fol.eval_path, "nll"),
            _write_generated(data_dir, "spell", range(10000), lambda n: f"Spell out: {n}", spell_number),
            _write_generated(data_dir, "roman", range(1, 4000), lambda n: f"Roman numeral of {n}?", roman_numeral)]
