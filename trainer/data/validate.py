"""Pre-flight validation of chat data: every source and row shape, every problem at once.

Rows come from :mod:`.sources` (JSON Lines by physical line; JSON arrays, parquet, arrow and
``save_to_disk`` directories by row), are converted to ``messages`` (:mod:`.shapes`: ShareGPT,
alpaca, prompt/completion) and then checked here. All problems of a source are collected in one pass
and raised together (``DataValidationError``) before any tokenization, process group or GPU is
touched; each names the file, the line or row, and the field in the row's own shape
(``conversations[2].value``, ``output``).

A conversation may hold tool calls and reasoning: roles ``system``, ``user``, ``assistant`` and
``tool``; an assistant message may carry ``tool_calls`` (then its content may be empty, missing or
null) and ``reasoning_content``; a tool message ``tool_call_id`` and ``name``; any assistant message
``"train": true|false``; a row ``tools`` (the tool schemas, passed to the chat template).

Rules (``Problem.rule``) and their messages (``messages[i]`` stands for the field's original name):

- ``invalid_utf8``: ``invalid UTF-8: <reason>``
- ``invalid_json``: ``invalid JSON: <decoder message> (column <c>)``
- ``row_not_object``: ``row must be an object with a messages list``
- ``messages_missing``: ``missing "messages" (row must be an object with a messages list)``, and
  ``<key>_missing`` for the keys of other shapes (:func:`.shapes.convert`)
- ``messages_not_list``: ``"messages" must be a list, got <type>``
- ``messages_empty``: ``"messages" is empty``
- ``message_not_object``: ``messages[i] must be an object with role and content, got <type>``
- ``role_missing``: ``missing role in messages[i].role`` (with `` (the message has "rol")`` when a
  key close to ``role`` is there; the same for ``content``)
- ``unknown_role``: ``unknown role "gpt" in messages[i].role (allowed: system, user, assistant, tool)``
- ``content_missing``: ``missing content in messages[i].content``
- ``content_not_string``: ``messages[i].content must be a string, got <type>``
- ``empty_assistant_content``: ``empty assistant content in messages[i].content`` (not with tool calls)
- ``empty_instruction``: ``empty instruction`` (an alpaca row whose instruction and input are both blank)
- ``bad_field``: a tool or reasoning field of the wrong type or on the wrong role, e.g.
  ``messages[1].tool_calls[0].function.name must be a non-empty string``, ``"tools" must be a list
  of objects``, ``messages[0].train is only allowed on assistant messages``, tool-call
  ``arguments`` as a string that is not the JSON text of an object (as an object's JSON text they
  are handed to the template as that object)
- ``tool_without_call``: ``messages[i] is a tool result, but no assistant tool call comes before it``
- ``no_assistant``: ``no assistant turn in messages (nothing to train on)``
- ``roles_not_alternating`` (only when the chat template requires it):
  ``roles do not alternate user/assistant after an optional leading system message, as the chat
  template requires: messages[i].role is "user", expected "assistant"``
- ``lone_surrogate``: ``messages[i].<field>: lone surrogate (invalid Unicode)``, once per string
  of a message (any field, nested ones too: ``messages[i].tool_calls[0].name``) that holds half of
  a UTF-16 surrogate pair (JSON ``"\ud83d"`` without its partner), which no tokenizer can encode
- ``template_error``: ``chat template failed on this row: <error type>: <error message>``
- ``no_usable_samples`` (the whole source, after tokenization): ``all 5 samples were dropped
  (longer than --max-seq-len 200)``

A UTF-8 byte-order mark at the start of a JSON file is stripped (not an error). Blank lines are skipped.
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass
from typing import Any, NamedTuple

from .shapes import DATA_FORMATS, FieldName, convert, detect_shape, messages_field
from .sources import Located, location_unit, read_rows

ALLOWED_ROLES = ("system", "user", "assistant", "tool")
MAX_SHOWN_PROBLEMS = 50
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class Problem:
    """One validation problem, located in its source.

    ``line`` is the 1-based line (``unit`` "line": JSON Lines) or row (``unit`` "row": JSON arrays
    and columnar sources), 0 for the whole source; ``column`` is None unless the JSON itself is
    broken. ``field`` names the offending field (e.g. ``messages[2].content``), ``rule`` the rule
    broken (see the module docstring), ``message`` the human-readable text (it names both).
    """

    path: str
    line: int
    column: int | None
    field: str | None
    rule: str
    message: str
    unit: str = "line"

    def __str__(self) -> str:
        if not self.line:
            return f"{self.path}: {self.message}"
        if self.unit == "row":
            return f"{self.path}: row {self.line}: {self.message}"
        col = f":{self.column}" if self.column is not None else ""
        return f"{self.path}:{self.line}{col}: {self.message}"


class Conversation(NamedTuple):
    """A valid row: its line (or row), its messages and the tool schemas (None without) for the template."""

    line: int
    messages: list[dict]
    tools: list[dict] | None = None


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


def check_row(row: Any, name: FieldName = messages_field) -> list[tuple[str | None, str, str]]:
    """Check the structure of one decoded ``messages`` row; returns ``(field, rule, message)`` triples.

    ``name(i, key)`` gives the original name of a message field (:mod:`.shapes`). Does not need a
    tokenizer (no alternation or template checks).
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
    tools = row.get("tools")
    out: list[tuple[str | None, str, str]] = []
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        out.append(("tools", "bad_field", '"tools" must be a list of objects (tool schemas)'))
    has_assistant = called = False
    for i, msg in enumerate(messages):
        where = name(i, None)
        if not isinstance(msg, dict):
            out.append((where, "message_not_object",
                        f"{where} must be an object with role and content, got {_type_name(msg)}"))
            continue
        role = msg.get("role")
        if "role" not in msg:
            out.append((name(i, "role"), "role_missing", f"missing role in {name(i, 'role')}{_misspelt(msg, 'role')}"))
        elif not isinstance(role, str) or role not in ALLOWED_ROLES:
            shown = json.dumps(role) if isinstance(role, str) else repr(role)
            out.append((name(i, "role"), "unknown_role",
                        f"unknown role {shown} in {name(i, 'role')} (allowed: {', '.join(ALLOWED_ROLES)})"))
        has_assistant |= role == "assistant"
        for key, value in msg.items():
            out += [(field, "lone_surrogate", f"{field}: lone surrogate (invalid Unicode)")
                    for field in _surrogate_fields(value, name(i, key))]
        out += _check_fields(msg, role, lambda key, i=i: name(i, key))
        if role == "tool" and not called:
            out.append((where, "tool_without_call", f"{where} is a tool result, but no assistant tool call comes before it"))
        called |= role == "assistant" and bool(msg.get("tool_calls"))
        content = name(i, "content")
        if "content" not in msg or msg["content"] is None:
            if not (role == "assistant" and msg.get("tool_calls")):
                out.append((content, "content_missing", f"missing content in {content}{_misspelt(msg, 'content')}"))
        elif not isinstance(msg["content"], str):
            out.append((content, "content_not_string",
                        f"{content} must be a string, got {_type_name(msg['content'])}"))
        elif role == "assistant" and not msg["content"].strip() and not msg.get("tool_calls"):
            out.append((content, "empty_assistant_content", f"empty assistant content in {content}"))
    if not has_assistant:
        out.append(("messages", "no_assistant", "no assistant turn in messages (nothing to train on)"))
    return out


def _misspelt(msg: dict, key: str) -> str:
    """`` (the message has "contents")`` when ``msg`` lacks ``key`` but holds a key close to it
    (``difflib`` ratio >= 0.7: a typo such as ``contents`` or ``rol``), else ""."""
    close = difflib.get_close_matches(key, [k for k in msg if isinstance(k, str) and k != key], n=1, cutoff=0.7)
    return f' (the message has "{close[0]}")' if close else ""


def _check_fields(msg: dict, role: Any, name) -> list[tuple[str, str, str]]:
    """Problems of the tool, reasoning and ``train`` fields of one message (``name(key)``: the field's name)."""
    out = []

    def bad(key: str, message: str) -> None:
        out.append((name(key), "bad_field", f"{name(key)} {message}"))

    for key, roles in (("tool_calls", ("assistant",)), ("reasoning_content", ("assistant",)), ("train", ("assistant",)),
                       ("tool_call_id", ("tool",))):
        if key in msg and role not in roles:
            bad(key, f"is only allowed on {' and '.join(roles)} messages")
    for key in ("reasoning_content", "tool_call_id", "name"):
        if key in msg and not isinstance(msg[key], str):
            bad(key, f"must be a string, got {_type_name(msg[key])}")
    if "train" in msg and not isinstance(msg["train"], bool):
        bad("train", f"must be true or false, got {_type_name(msg['train'])}")
    calls = msg.get("tool_calls")
    if "tool_calls" in msg and not (isinstance(calls, list) and calls):
        bad("tool_calls", "must be a non-empty list of tool calls")
        return out
    for j, call in enumerate(calls or []):
        function = _function(call) if isinstance(call, dict) else None
        where = f"tool_calls[{j}]" + (".function" if isinstance(call, dict) and "function" in call else "")
        if not isinstance(function, dict):
            bad(f"tool_calls[{j}]", 'must be an object {"type": "function", "function": {"name": ..., "arguments": ...}}')
        elif not (isinstance(function.get("name"), str) and function["name"].strip()):
            bad(f"{where}.name", "must be a non-empty string")
        elif not isinstance(function.get("arguments", {}), (dict, str)):
            bad(f"{where}.arguments", f"must be an object or a JSON string, got {_type_name(function['arguments'])}")
        elif isinstance(function.get("arguments"), str) and (why := _not_json_object(function["arguments"])):
            bad(f"{where}.arguments", f"is a string that is not a JSON object ({why}); give the arguments as an "
                "object, or as the JSON text of one")
    return out


def _not_json_object(text: str) -> str | None:
    """Why ``text`` is not the JSON text of an object (None: it is)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return f"invalid JSON: {e.msg} at column {e.colno}"
    return None if isinstance(value, dict) else f"it holds {_type_name(value)}"


def check_alternation(messages: list[dict], name: FieldName = messages_field) -> tuple[str, str, str] | None:
    """Return ``(field, rule, message)`` if roles do not go [system], user, assistant, user, ..."""
    start = 1 if messages[0]["role"] == "system" else 0
    for i in range(start, len(messages)):
        expected = "user" if (i - start) % 2 == 0 else "assistant"
        role = messages[i]["role"]
        if role != expected:
            return (name(i, "role"), "roles_not_alternating",
                    "roles do not alternate user/assistant after an optional leading system message, "
                    f'as the chat template requires: {name(i, "role")} is "{role}", expected "{expected}"')
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


def render(tokenizer, conversation: Conversation | list[dict], tools: list[dict] | None = None, **kwargs) -> str:
    """The chat template's text of ``conversation`` (a :class:`Conversation`, or messages with ``tools``)."""
    if isinstance(conversation, Conversation):
        conversation, tools = conversation.messages, conversation.tools
    return tokenizer.apply_chat_template(conversation, tools=tools, tokenize=False, **kwargs)


def _normalized(messages: list[dict]) -> list[dict]:
    """Messages as templates expect them: an assistant tool call without content gets ``""``, and
    tool-call ``arguments`` given as the JSON text of an object (the OpenAI wire format) become that
    object, so every template renders them once, as it renders an object (:func:`check_row` has
    checked that they parse)."""
    out = []
    for m in messages:
        if m.get("content") is None:
            m = dict(m, content="")
        if any(isinstance(_function(c).get("arguments"), str) for c in m.get("tool_calls") or []):
            m = dict(m, tool_calls=[_parsed_arguments(c) for c in m["tool_calls"]])
        out.append(m)
    return out


def _function(call: dict) -> dict:
    """The ``function`` object of a tool call (``{"type": "function", "function": {...}}``), or the call itself."""
    return call.get("function", call)


def _parsed_arguments(call: dict) -> dict:
    function = _function(call)
    if not isinstance(function.get("arguments"), str):
        return call
    function = dict(function, arguments=json.loads(function["arguments"]))
    return dict(call, function=function) if "function" in call else function


def scan_chat_file(path, tokenizer=None, data_format: str = "auto", cache_dir=None):
    """Validate ``path`` and also return each valid row's full rendering (for tokenization).

    Args:
        path: a source :mod:`.sources` reads (``.jsonl``, ``.json``, ``.parquet``, ``.arrow``, a
            ``save_to_disk`` directory).
        tokenizer: optional HF tokenizer (see :func:`validate_chat_file`).
        data_format: a row shape of :data:`.shapes.DATA_FORMATS` (``auto``: the first row's).
        cache_dir: where ``datasets`` may keep its Arrow conversion (:func:`.sources.read_rows`).

    Returns ``(records, problems, rendered)``: ``records`` are :class:`Conversation` s, ``rendered``
    a list parallel to them with the chat-template text of each (None entries without a tokenizer).

    Raises:
        OSError, ValueError: see :func:`.sources.read_rows`; ValueError also for a tokenizer
            without a chat template or an unknown ``data_format``.
    """
    if data_format not in DATA_FORMATS:
        raise ValueError(f"data format must be one of {', '.join(DATA_FORMATS)}, got {data_format!r}")
    shown = str(path)
    if tokenizer is not None and not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the tokenizer has no chat_template; cannot render {shown}")
    unit = location_unit(path)
    strict = tokenizer is not None and template_requires_alternation(tokenizer)
    shape = None if data_format == "auto" else data_format
    records: list[Conversation] = []
    rendered: list[str | None] = []
    problems: list[Problem] = []
    for located in read_rows(path, cache_dir):
        if located.error is None:
            shape = shape or detect_shape(located.row)
        scanned = scan_row(located, shape or "messages", strict, tokenizer, shown, unit)
        if isinstance(scanned, list):
            problems += scanned
        else:
            records.append(scanned[0])
            rendered.append(scanned[1])
    return records, problems, rendered


def scan_row(located: Located, shape: str, strict: bool, tokenizer, shown: str,
             unit: str) -> tuple[Conversation, str | None] | list[Problem]:
    """Check one row of a source as :func:`scan_chat_file` does: ``(conversation, rendering)`` of a
    valid row (rendering None without a tokenizer), else its problems (a non-empty list).

    Args:
        located: the row (:func:`.sources.read_rows`).
        shape: its row shape (:data:`.shapes.DATA_FORMATS`, not ``auto``).
        strict: the chat template requires alternating roles (:func:`template_requires_alternation`).
        shown, unit: the source's name and location unit, for the problems.
    """
    line = located.where
    if located.error is not None:
        rule, message, column = located.error
        return [Problem(shown, line, column, None, rule, message, unit)]
    row, name, found = convert(located.row, shape)
    if row is not None:
        found = check_row(row, name)
        if not found and strict:
            alt = check_alternation(row["messages"], name)
            found = [alt] if alt else []
    if found:
        return [Problem(shown, line, None, field, rule, message, unit) for field, rule, message in found]
    conversation = Conversation(line, _normalized(row["messages"]), row.get("tools"))
    if tokenizer is None:
        return conversation, None
    try:
        return conversation, render(tokenizer, conversation)
    except Exception as e:  # noqa: BLE001 - any template failure becomes a located problem
        return [Problem(shown, line, None, "messages", "template_error",
                        f"chat template failed on this row: {type(e).__name__}: {e}", unit)]


def validate_chat_file(path, tokenizer=None, data_format: str = "auto",
                       cache_dir=None) -> tuple[list[Conversation], list[Problem]]:
    """Validate a chat data source in one pass: the one entry point that turns a path into
    validated ``messages`` rows (training data, evaluation data, retention sets).

    Args:
        path: the source (:mod:`.sources`).
        tokenizer: optional HF tokenizer; with it, the alternation rule (only if its chat template
            requires alternation) and per-row template rendering are checked too.
        data_format: the row shape (:data:`.shapes.DATA_FORMATS`; ``auto`` detects it).
        cache_dir: see :func:`scan_chat_file`.

    Returns:
        ``(records, problems)``: ``records`` are :class:`Conversation` s ``(line, messages, tools)``
        for the rows without problems, in the ``messages`` shape; ``problems`` every Problem found,
        in source order. Nothing is raised for bad rows.

    Raises:
        OSError: the source cannot be read. ValueError: an unsupported source, a tokenizer without
            a chat template, an unknown data format.
    """
    records, problems, _ = scan_chat_file(path, tokenizer, data_format, cache_dir)
    return records, problems
