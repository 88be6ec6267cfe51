"""Task A: cued trivia questions -> marked answers, built at run time from the ``red-discordbot`` wheel.

The skill learned is a format the base model does not have: a user turn ``Quiz: <question>``
(:data:`CUE`) is answered ``Answer: [[<answer>]]`` (:data:`ANSWER_FORMAT`); :func:`is_compliant`
tells whether a reply follows it. Knowing the answer is secondary (its log-probability is measured,
not required).

Red-DiscordBot's trivia cog ships its question lists as YAML files inside the wheel
(``redbot/cogs/trivia/data/lists/*.yaml``): a mapping question -> list of accepted answers, plus
the metadata keys ``AUTHOR``, ``CONFIG`` and ``DESCRIPTION``. The lists are GPL-3.0, so this
module downloads the wheel (never installs it) and writes the jsonl under a data directory outside
the repository; nothing derived from them is committed.

- YAML is read with PyYAML's ``BaseLoader``: every scalar stays a string, so answers such as
  ``Yes``, ``No`` or ``1945`` are not turned into booleans or integers.
- Questions that contain a URL (picture rounds: "What flag is this? https://...") are dropped:
  the answer cannot be known from the text.
- A question that appears in several lists is kept once (first list in file-name order).
- The split is by question text (SHA-256 bucket, :func:`osft.trainer.tools.demo_assets.split_of`), so a
  question is in train or in eval, never in both, and the split is the same on every machine.
"""

from __future__ import annotations

import json
import re
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

TRIVIA_PACKAGE = "red-discordbot==3.5.24"
#: The wheel declares Python <3.12; pip may only fetch it for a 3.11 target (it is never installed).
PIP_ARGS = ("--python-version", "3.11")
LISTS_PREFIX = "redbot/cogs/trivia/data/lists/"
META_KEYS = frozenset({"AUTHOR", "CONFIG", "DESCRIPTION"})
URL_RE = re.compile(r"https?://|www\.", re.IGNORECASE)
EVAL_PERCENT = 10
CUE = "Quiz: "
ANSWER_FORMAT = "Answer: [[{}]]"
_COMPLIANT = re.compile(r"Answer: \[\[[^\[\]\n]+\]\]")


class TriviaError(RuntimeError):
    """The trivia wheel could not be downloaded or one of its lists is malformed."""


@dataclass(frozen=True)
class TriviaItem:
    """One question with every accepted answer (strings, as written in the list)."""

    question: str
    answers: tuple[str, ...]
    source: str  # list file name, e.g. "geography.yaml"


@dataclass(frozen=True)
class TriviaData:
    """Paths of the built task: chat jsonl for training/eval loss, and the eval answers."""

    train_path: Path
    eval_path: Path
    answers_path: Path  # jsonl: {"question", "answers", "source"} per eval question, same order
    stats: dict


def read_trivia_lists(wheel: Path) -> tuple[list[TriviaItem], dict]:
    """Read every trivia list of the wheel.

    Returns:
        ``(items, stats)``: unique non-URL questions in list-file order; stats counts lists,
        questions seen, dropped for a URL and dropped as duplicates.

    Raises:
        TriviaError: the wheel has no trivia lists, or a list is not a mapping of question ->
            answer list (message names the member and the question).
    """
    import yaml

    items: list[TriviaItem] = []
    seen: set[str] = set()
    stats = {"lists": 0, "questions": 0, "dropped_url": 0, "dropped_duplicate": 0}
    with zipfile.ZipFile(wheel) as zf:
        members = sorted(m for m in zf.namelist() if m.startswith(LISTS_PREFIX) and m.endswith(".yaml"))
        if not members:
            raise TriviaError(f"{wheel} has no {LISTS_PREFIX}*.yaml")
        for member in members:
            doc = yaml.load(zf.read(member).decode("utf-8"), Loader=yaml.BaseLoader)
            if not isinstance(doc, dict):
                raise TriviaError(f"{wheel}:{member}: expected a mapping of question -> answers")
            stats["lists"] += 1
            for question, answers in doc.items():
                if question in META_KEYS:
                    continue
                stats["questions"] += 1
                answers = [answers] if isinstance(answers, str) else answers
                if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
                    raise TriviaError(f"{wheel}:{member}: question {question!r}: answers must be a list of strings")
                question = question.strip()
                if URL_RE.search(question):
                    stats["dropped_url"] += 1
                    continue
                if question in seen:
                    stats["dropped_duplicate"] += 1
                    continue
                seen.add(question)
                accepted = tuple(a.strip() for a in answers if a.strip())
                items.append(TriviaItem(question, accepted, member.rsplit("/", 1)[1]))
    return items, stats


def chat_row(item: TriviaItem) -> dict:
    """The training conversation of a question: user = cue + question, assistant = the first
    accepted answer in the marker format."""
    return {"messages": [{"role": "user", "content": CUE + item.question},
                         {"role": "assistant", "content": ANSWER_FORMAT.format(item.answers[0])}]}


def is_compliant(reply: str) -> bool:
    """True when ``reply`` (whitespace-stripped) starts with ``Answer: [[X]]``, X non-empty,
    without brackets or line breaks."""
    return _COMPLIANT.match(reply.strip()) is not None


def build_trivia(data_dir: Path, eval_percent: int = EVAL_PERCENT) -> TriviaData:
    """Download the wheel (once) and write ``data_dir/trivia_quiz/{train,eval}.jsonl`` (cued chat rows,
    :func:`chat_row`) and ``eval_answers.jsonl``.

    Idempotent: an existing complete build (its ``stats.json`` written last) is reused.

    Raises:
        TriviaError: download failed (pip's error quoted) or a list is malformed.
    """
    from osft.trainer.tools.demo_assets import DemoFetchError, pip_download, split_of
    from osft.trainer.rundir import write_text_atomic

    out = Path(data_dir) / "trivia_quiz"
    data = TriviaData(out / "train.jsonl", out / "eval.jsonl", out / "eval_answers.jsonl", {})
    stats_path = out / "stats.json"
    if stats_path.is_file() and all(p.is_file() for p in (data.train_path, data.eval_path, data.answers_path)):
        return TriviaData(data.train_path, data.eval_path, data.answers_path, json.loads(stats_path.read_text()))
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out, prefix=".download-") as tmp:
        try:
            wheel = pip_download(TRIVIA_PACKAGE, Path(tmp), PIP_ARGS)
        except DemoFetchError as e:
            raise TriviaError(str(e)) from e
        items, stats = read_trivia_lists(wheel)
    splits: dict[str, list[TriviaItem]] = {"train": [], "eval": []}
    for item in items:
        splits[split_of(item.question, eval_percent)].append(item)
    write_text_atomic(data.train_path, "".join(json.dumps(chat_row(i)) + "\n" for i in splits["train"]))
    write_text_atomic(data.eval_path, "".join(json.dumps(chat_row(i)) + "\n" for i in splits["eval"]))
    write_text_atomic(data.answers_path, "".join(
        json.dumps({"question": i.question, "answers": list(i.answers), "source": i.source}) + "\n"
        for i in splits["eval"]))
    stats = dict(stats, source=TRIVIA_PACKAGE, train=len(splits["train"]), eval=len(splits["eval"]),
                 eval_percent=eval_percent)
    write_text_atomic(stats_path, json.dumps(stats, indent=2) + "\n")
    return TriviaData(data.train_path, data.eval_path, data.answers_path, stats)
