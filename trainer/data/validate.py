"""Pre-flight validation of a chat JSONL file.

Every row must be a JSON object ``{"messages": [{"role": ..., "content": ...}, ...]}``. The file is
read line by line here (not by a JSON-lines library), so each problem carries the physical line
number, and for broken JSON the column. All problems of a file are collected in one pass and raised
together (``DataValidationError``) before any tokenization, process group or GPU is touched.

Rules (``Problem.rule``) and their messages (``i`` is the message index):

- ``invalid_utf8``: ``invalid UTF-8: <reason>``
- ``invalid_json``: ``invalid JSON: <decoder message> (column <c>)``
- ``row_not_object``: ``row must be an object with a messages list``
- ``messages_missing``: ``missing "messages" (row must be an object with a messages list)``
- ``messages_not_list``: ``"messages" must be a list, got <type>``
- ``messages_empty``: ``"messages" is empty``
- ``message_not_object``: ``messages[i] must be an object with role and content, got <type>``
- ``role_missing``: ``missing role in messages[i].role``
- ``unknown_role``: ``unknown role "gpt" in messages[i].role (allowed: system, user, assistant)``
- ``content_missing``: ``missing content in messages[i].content``
- ``content_not_string``: ``messages[i].content must be a string, got <type>``
- ``empty_assistant_content``: ``empty assistant content in messages[i].content``
- ``no_assistant``: ``no assistant turn in messages (nothing to train on)``
- ``roles_not_alternating`` (only when the chat template requires it):
  ``roles do not alternate user/assistant after an optional leading system message, as the chat
  template requires: messages[i].role is "user", expected "assistant"``
- ``lone_surrogate``: ``messages[i].<field>: lone surrogate (invalid Unicode)``, once per string
  of a message (any field, nested ones too: ``messages[i].tool_calls[0].name``) that holds half of
  a UTF-16 surrogate pair (JSON ``"\ud83d"`` without its partner), which no tokenizer can encode
- ``template_error``: ``chat template failed on this row: <error type>: <error message>``

A UTF-8 byte-order mark at the start of the file is stripped (not an error). Blank lines are skipped.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ALLOWED_ROLES = ("system", "user", "assistant")
MAX_SHOWN_PROBLEMS = 50
_BOM = b"\xef\xbb\xbf"
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class Problem:
    """One validation problem, located in the physical file.

    ``line`` and ``column`` are 1-based; ``column`` is None unless the JSON itself is broken.
    ``field`` names the offending field (e.g. ``messages[2].content``), ``rule`` the rule broken
    (see the module docstring), ``message`` the human-readable text (it names both).
    """

    path: str
    line: int
    column: int | None
    field: str | None
    rule: str
    message: str

    def __str__(self) -> str:
        col = f":{self.column}" if self.column is not None else ""
        return f"{self.path}:{self.line}{col}: {self.message}"


class DataValidationError(ValueError):
    """Raised when a data file has problems; ``problems`` holds all of them (a list of Problem).

    The rendered message lists every problem, up to ``MAX_SHOWN_PROBLEMS``, then a count of the rest.
    """

    def __init__(self, problems: list[Problem], header: str | None = None):
        self.problems = list(problems)
        n = len(self.problems)
        head = header or f"{n} problem{'s' if n != 1 else ''} in the training data"
        lines = [head + ":"] + [f"  {p}" for p in self.problems[:MAX_SHOWN_PROBLEMS]]
        if n > MAX_SHOWN_PROBLEMS:
            lines.append(f"  ... and {n - MAX_SHOWN_PROBLEMS} more problems (not shown)")
        super().__init__("\n".join(lines))


def _type_name(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), type(value).__name__
    )


def _surrogate_fields(value: Any, where: str):
    """Yield the path of every string in ``value`` (nested lists and objects too) that holds a lone
    surrogate; a JSON escape pair that forms one character never does."""
    if isinstance(value, str):
        if _SURROGATE.search(value):
            yield where
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _surrogate_fields(item, f"{where}.{key}")
    elif isinstance(value, list):
        for j, item in enumerate(value):
            yield from _surrogate_fields(item, f"{where}[{j}]")


def check_row(row: Any) -> list[tuple[str | None, str, str]]:
    """Check the structure of one decoded row; returns ``(field, rule, message)`` triples.

    Does not need a tokenizer (no alternation or template checks).
    """
    bad = "row must be an object with a messages list"
    if not isinstance(row, dict):
        return [("row", "row_not_object", bad)]
    if "messages" not in row:
        return [("messages", "messages_missing", f'missing "messages" ({bad})')]
    messages = row["messages"]
    if not isinstance(messages, list):
        return [("messages", "messages_not_list", f'"messages" must be a list, got {_type_name(messages)}')]
    if not messages:
        return [("messages", "messages_empty", '"messages" is empty')]
    out: list[tuple[str | None, str, str]] = []
    has_assistant = False
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            out.append((where, "message_not_object",
                        f"{where} must be an object with role and content, got {_type_name(msg)}"))
            continue
        role = msg.get("role")
        if "role" not in msg:
            out.append((f"{where}.role", "role_missing", f"missing role in {where}.role"))
        elif not isinstance(role, str) or role not in ALLOWED_ROLES:
            shown = json.dumps(role) if isinstance(role, str) else repr(role)
            out.append((f"{where}.role", "unknown_role",
                        f"unknown role {shown} in {where}.role (allowed: {', '.join(ALLOWED_ROLES)})"))
        has_assistant |= role == "assistant"
        out += [(field, "lone_surrogate", f"{field}: lone surrogate (invalid Unicode)")
                for field in _surrogate_fields(msg, where)]
        if "content" not in msg:
            out.append((f"{where}.content", "content_missing", f"missing content in {where}.content"))
        elif not isinstance(msg["content"], str):
            out.append((f"{where}.content", "content_not_string",
                        f"{where}.content must be a string, got {_type_name(msg['content'])}"))
        elif role == "assistant" and not msg["content"].strip():
            out.append((f"{where}.content", "empty_assistant_content",
                        f"empty assistant content in {where}.content"))
    if not has_assistant:
        out.append(("messages", "no_assistant", "no assistant turn in messages (nothing to train on)"))
    return out


def check_alternation(messages: list[dict]) -> tuple[str, str, str] | None:
    """Return ``(field, rule, message)`` if roles do not go [system], user, assistant, user, ..."""
    start = 1 if messages[0]["role"] == "system" else 0
    for i in range(start, len(messages)):
        expected = "user" if (i - start) % 2 == 0 else "assistant"
        role = messages[i]["role"]
        if role != expected:
            return (f"messages[{i}].role", "roles_not_alternating",
                    "roles do not alternate user/assistant after an optional leading system message, "
                    f'as the chat template requires: messages[{i}].role is "{role}", expected "{expected}"')
    return None


def template_requires_alternation(tokenizer) -> bool:
    """Probe the chat template once: True if it refuses a user, user, assistant conversation.

    A Jinja ``TemplateError`` (what ``raise_exception`` in HF templates raises) on the probe, while
    a well-formed user, assistant conversation renders, means the template requires alternation.
    """
    from jinja2 import TemplateError

    def renders(msgs) -> bool:
        try:
            tokenizer.apply_chat_template(msgs, tokenize=False)
            return True
        except TemplateError:
            return False

    good = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
           {"role": "assistant", "content": "c"}]
    try:
        return renders(good) and not renders(bad)
    except Exception:  # a broken template: every row will report its own template error
        return False


def _iter_lines(path: Path):
    """Yield (1-based line number, raw bytes without the line ending), BOM stripped from line 1."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if lineno == 1 and raw.startswith(_BOM):
                raw = raw[len(_BOM):]
            yield lineno, raw.rstrip(b"\r\n")


def scan_chat_file(path, tokenizer=None):
    """Validate ``path`` and also return each valid row's full rendering (for tokenization).

    Returns ``(records, problems, rendered)``: ``rendered`` is a list parallel to ``records`` with
    the chat-template text of each valid row (None entries when no tokenizer is given).
    """
    path = Path(path)
    shown = str(path)
    if tokenizer is not None and not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the tokenizer has no chat_template; cannot render {shown}")
    strict = tokenizer is not None and template_requires_alternation(tokenizer)
    records: list[tuple[int, list[dict]]] = []
    rendered: list[str | None] = []
    problems: list[Problem] = []

    def report(line, field, rule, message, column=None):
        problems.append(Problem(shown, line, column, field, rule, message))

    for line, raw in _iter_lines(path):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            report(line, None, "invalid_utf8", f"invalid UTF-8: {e.reason} at byte {e.start + 1}")
            continue
        if not text.strip():
            continue
        try:
            row = json.loads(text)
        except json.JSONDecodeError as e:
            report(line, None, "invalid_json", f"invalid JSON: {e.msg} (column {e.colno})", e.colno)
            continue
        found = check_row(row)
        if not found and strict:
            alt = check_alternation(row["messages"])
            found = [alt] if alt else []
        if found:
            for field, rule, message in found:
                report(line, field, rule, message)
            continue
        messages = row["messages"]
        text_out = None
        if tokenizer is not None:
            try:
                text_out = tokenizer.apply_chat_template(messages, tokenize=False)
            except Exception as e:  # noqa: BLE001 - any template failure becomes a located problem
                report(line, "messages", "template_error",
                       f"chat template failed on this row: {type(e).__name__}: {e}")
                continue
        records.append((line, messages))
        rendered.append(text_out)
    return records, problems, rendered


def validate_chat_file(path, tokenizer=None) -> tuple[list[tuple[int, list[dict]]], list[Problem]]:
    """Validate a chat JSONL file in one pass.

    Args:
        path: the ``.jsonl`` file.
        tokenizer: optional HF tokenizer; with it, the alternation rule (only if its chat template
            requires alternation) and per-row template rendering are checked too.

    Returns:
        ``(records, problems)``: ``records`` are ``(line, messages)`` for the rows without problems,
        ``problems`` every Problem found, in file order. Nothing is raised for bad rows.

    Raises:
        OSError: the file cannot be read. ValueError: the tokenizer has no chat template.
    """
    records, problems, _ = scan_chat_file(path, tokenizer)
    return records, problems
