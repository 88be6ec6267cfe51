"""Text a chat template inserts that the data did not contain, found so it is not trained and is reported.

Two kinds are found, for any template:

- a **default system prompt**: the template renders a system turn with its own text when a
  conversation has none (SmolLM2, Qwen2.5). Found once per template by rendering a probe with and
  without a system message; it lies outside the assistant turns, so it is never trained (unless
  ``--train-on-all``), only reported.
- text **between the generation prompt and an assistant content**: an empty reasoning block
  (``<think>\\n\\n</think>\\n\\n`` of Qwen3-style templates) or a header that the generation prompt does
  not end with. The assistant content is located with marker characters (see
  :class:`.tokenize.SpanFinder`); text before it in the turn that is not whitespace and holds none
  of the message's other fields (a ``reasoning_content`` the data gave is data) is left out of the
  trained span. The content and the end-of-turn text after it stay trained.

Each distinct inserted text is reported once, with the samples it appears in and its token count
per sample (:func:`summarize`, :func:`describe`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

#: Unicode private-use characters used as content markers in probe renderings.
OPEN, CLOSE = "\ue000", "\ue001"

#: The tags that open and close a reasoning block (``<think>...</think>``) in Qwen3-style and DeepSeek-R1-style text.
THINK_START, THINK_END = "<think>", "</think>"

#: ``where`` of a default system prompt and of text inserted before an assistant content.
SYSTEM_PROMPT, BEFORE_ASSISTANT = "default system prompt", "before assistant content"


@dataclass(frozen=True)
class DefaultSystem:
    """A template's default system prompt: ``text`` starts at character ``start`` of every rendering
    of a conversation without a system message."""

    start: int
    text: str


def default_system_prompt(tokenizer) -> DefaultSystem | None:
    """The text the chat template puts in a system turn when the conversation has none, or None.

    A probe is rendered without a system message (P) and with one whose content is a marker (the
    text before it is H, the text between it and the user content T): the template inserted a
    default prompt X when P = H + X + T with X not empty.
    """
    turns = [{"role": "user", "content": OPEN + "Hi" + CLOSE}, {"role": "assistant", "content": "Hello."}]
    try:
        plain = tokenizer.apply_chat_template(turns, tokenize=False)
        with_system = tokenizer.apply_chat_template(
            [{"role": "system", "content": OPEN + "S" + CLOSE}] + turns, tokenize=False)
    except Exception:  # noqa: BLE001 - a template without system turns has no default one
        return None
    before_user = plain[:plain.find(OPEN)]
    head = with_system[:with_system.find(OPEN)]
    tail = with_system[with_system.find(CLOSE) + 1:with_system.find(OPEN, with_system.find(CLOSE))]
    inserted = before_user[len(head):len(before_user) - len(tail)]
    if (OPEN in plain and with_system.count(OPEN) == 2 and before_user.startswith(head)
            and before_user.endswith(tail) and inserted.strip()):
        return DefaultSystem(len(head), inserted)
    return None


def _other_texts(message: dict) -> list[str]:
    """The non-empty strings of a message's fields other than role and content (e.g. reasoning)."""
    return [v.strip() for k, v in message.items() if k not in ("role", "content") and isinstance(v, str) and v.strip()]


def split_inserted(rendered: str, assistants: list[dict], turns: list[tuple[int, int]],
                   content: list[tuple[int, int]] | None,
                   train_reasoning: bool = True) -> tuple[list[tuple[int, int]], list[tuple[int, int]]] | str:
    """Trained spans without the text inserted before each assistant content, and those inserted ranges.

    Args:
        rendered: the conversation's rendering.
        assistants: the assistant messages of ``turns``, in order.
        turns: the trained span of each of them (from the end of the generation prompt to the end
            of the end-of-turn text).
        content: the position of each one's content in ``rendered`` (None where markers do not
            work for this row: the turns are kept whole).
        train_reasoning: False leaves a turn's reasoning untrained (:func:`after_reasoning`): its
            ``reasoning_content`` (and the tags around it: everything before the content), and
            reasoning inside the turn up to a closing :data:`THINK_END` tag; it is data, so it is
            not reported as inserted.

    Returns:
        ``(spans, inserted)``, or a string when reasoning must be left out but cannot be located.
    """
    if content is None:
        spans = turns if train_reasoning else [after_reasoning(rendered, span) for span in turns]
        if not train_reasoning and any(m.get("reasoning_content", "").strip() and span == cut
                                       for m, span, cut in zip(assistants, turns, spans)):
            return "the assistant content cannot be located in the rendering, so its reasoning cannot be left untrained"
        return spans, []
    spans, inserted = [], []
    for (start, end), (c_start, _), message in zip(turns, content, assistants):
        gap = rendered[start:c_start]
        reasoning = message.get("reasoning_content", "").strip()
        if start < c_start <= end and reasoning and not train_reasoning:
            spans.append((c_start, end))
        elif start < c_start <= end and gap.strip() and not any(t in gap for t in _other_texts(message)):
            spans.append((c_start, end))
            inserted.append((start, c_start))
        else:
            spans.append((start, end))
    if not train_reasoning:
        spans = [after_reasoning(rendered, span) for span in spans]
    return spans, inserted


def holds_reasoning_tag(text: str) -> bool:
    """Whether trained text still holds a reasoning tag (``<think>`` or :data:`THINK_END`)."""
    return THINK_START in text or THINK_END in text


def after_reasoning(rendered: str, span: tuple[int, int]) -> tuple[int, int]:
    """``span`` of a trained turn started after the last :data:`THINK_END` in it and the whitespace
    after that tag (unchanged without one): reasoning written inside an assistant content, as
    ``<think>R</think>C`` or as raw completions have it, ``R</think>C`` (templates that split it out
    render the same tags), is left untrained like a ``reasoning_content``."""
    start, end = span
    found = rendered.rfind(THINK_END, start, end)
    if found < 0:
        return span
    start = found + len(THINK_END)
    while start < end and rendered[start].isspace():
        start += 1
    return start, end


def summarize(keys: list[tuple[str, str]], counts: list[list[list[int]]]) -> list[dict]:
    """Report entries, one per distinct inserted text.

    Args:
        keys: ``(where, text)`` of each distinct inserted text.
        counts: per kept sample, ``[key index, tokens]`` of each range inserted in it.

    Returns:
        dicts with ``where``, ``text``, ``samples`` (kept samples holding it), ``tokens_min`` and
        ``tokens_max`` (tokens per sample), ``tokens_total``.
    """
    per_key: dict[int, list[int]] = {}
    for sample in counts:
        totals: dict[int, int] = {}
        for key, n in sample:
            totals[key] = totals.get(key, 0) + n
        for key, n in totals.items():
            per_key.setdefault(key, []).append(n)
    return [{"where": keys[k][0], "text": keys[k][1], "samples": len(v), "tokens_min": min(v),
             "tokens_max": max(v), "tokens_total": sum(v)} for k, v in sorted(per_key.items())]


def describe(entries: list[dict], train_on_all: bool) -> list[str]:
    """Summary lines (indented) for :func:`summarize`'s entries."""
    lines = []
    for e in entries:
        per = str(e["tokens_min"]) if e["tokens_min"] == e["tokens_max"] else f"{e['tokens_min']}-{e['tokens_max']}"
        trained = "trained (--train-on-all)" if train_on_all else "not trained"
        lines.append(f"  the chat template inserted text the data does not contain, {e['where']} "
                     f"{json.dumps(e['text'], ensure_ascii=False)}: in {e['samples']} samples, {per} tokens per "
                     f"sample, {trained}")
    return lines
