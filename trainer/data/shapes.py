"""Row shapes converted to ``messages`` before validation, with field names of the original shape.

| shape | a row | becomes |
| --- | --- | --- |
| ``messages`` | ``{"messages": [{"role": ..., "content": ...}, ...], "tools": [...]}`` | itself |
| ``sharegpt`` | ``{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}], "system": ...}`` | ``from`` human/user, gpt/assistant, system, tool (function_response, observation) as roles, ``value`` as content |
| ``alpaca`` | ``{"instruction": ..., "input": ..., "output": ..., "system": ...}`` | user: instruction, a blank line, input (each only when not blank; a null input or system is absent); assistant: output |
| ``prompt-completion`` | ``{"prompt": ..., "completion": ...}`` (strings, or lists of messages) | user: prompt, assistant: completion (lists: prompt + completion) |

``--data-format auto`` (the default) takes the shape of a source's first object row (the first
of these key sets it holds: ``messages``; ``conversations``; ``instruction`` and ``output``;
``prompt`` and ``completion``); a later row without it is a problem naming the expected key.

A problem in a converted row names the original field (``conversations[2].value``, ``output``), not
the ``messages`` field it became: :func:`convert` returns a :data:`FieldName` for the row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

SHAPES = ("messages", "sharegpt", "alpaca", "prompt-completion")
DATA_FORMATS = ("auto",) + SHAPES
#: ShareGPT ``from`` values and the roles they become.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "tool": "tool", "function_response": "tool", "observation": "tool"}
_KEYS = {"messages": ("messages",), "sharegpt": ("conversations",), "alpaca": ("instruction", "output"),
         "prompt-completion": ("prompt", "completion")}

#: ``name(i, key)``: the original name of field ``key`` (None: the whole message) of message ``i``.
FieldName = Callable[[int, "str | None"], str]


def messages_field(i: int, key: str | None) -> str:
    """Field names of the ``messages`` shape: ``messages[i]``, ``messages[i].content``."""
    return f"messages[{i}]" + (f".{key}" if key else "")


def detect_shape(row: Any) -> str | None:
    """The shape whose keys ``row`` holds (the first in :data:`SHAPES` order), or None."""
    if isinstance(row, dict):
        for shape in SHAPES:
            if all(k in row for k in _KEYS[shape]):
                return shape
    return None


def convert(row: Any, shape: str) -> tuple[dict | None, FieldName, list[tuple[str, str, str]]]:
    """``row`` of ``shape`` as ``{"messages": [...], "tools": ...}``.

    Returns:
        ``(converted, name, problems)``: ``converted`` is None when the row does not have the
        shape's fields (then ``problems`` say which, as ``(field, rule, message)``); ``name`` maps
        a message field to the original field, for the problems validation finds afterwards.
        A ``messages`` row is returned as it is, whatever it holds (:func:`.validate.check_row`
        checks it).
    """
    if shape == "messages":
        return row, messages_field, []
    if not isinstance(row, dict):
        return None, messages_field, [("row", "row_not_object", f"row must be an object ({_describes(shape)})")]
    missing = [k for k in _KEYS[shape] if k not in row]
    if missing:
        key = missing[0]
        return None, messages_field, [(key, f"{key}_missing", f'missing "{key}" ({_describes(shape)})')]
    return _CONVERT[shape](row)


def _describes(shape: str) -> str:
    keys = " and ".join(f'"{k}"' for k in _KEYS[shape])
    return f"the data is read as {shape} rows, which need {keys}; see --data-format"


def _from_sharegpt(row: dict):
    turns = row["conversations"]
    if not isinstance(turns, list) or not turns:
        return None, messages_field, [("conversations", "messages_empty" if turns == [] else "messages_not_list",
                                       '"conversations" is empty' if turns == [] else '"conversations" must be a list')]
    messages, problems = [], []
    system = row.get("system")
    offset = 1 if isinstance(system, str) and system.strip() else 0
    if offset:
        messages.append({"role": "system", "content": system})
    for i, turn in enumerate(turns):
        where = f"conversations[{i}]"
        if not isinstance(turn, dict):
            problems.append((where, "message_not_object", f"{where} must be an object with from and value"))
            continue
        speaker = turn.get("from")
        if speaker not in SHAREGPT_ROLES:
            shown = "missing" if speaker is None else repr(speaker)
            problems.append((f"{where}.from", "unknown_role", f"{where}.from is {shown} (allowed: "
                             f"{', '.join(SHAREGPT_ROLES)})"))
            continue
        message = {k: v for k, v in turn.items() if k not in ("from", "value")}
        message.update(role=SHAREGPT_ROLES[speaker], **({"content": turn["value"]} if "value" in turn else {}))
        messages.append(message)

    def name(i: int, key: str | None) -> str:
        if i < offset:
            return "system"
        where = f"conversations[{i - offset}]"
        return where + {None: "", "role": ".from", "content": ".value"}.get(key, f".{key}")

    out = {"messages": messages, **({"tools": row["tools"]} if "tools" in row else {})}
    return (None if problems else out), name, problems


def _from_alpaca(row: dict):
    row = {k: v for k, v in row.items() if not (v is None and k in ("input", "system"))}  # null: absent, as in parquet
    problems = [(k, "content_not_string", f'"{k}" must be a string') for k in ("instruction", "input", "output", "system")
                if k in row and not isinstance(row[k], str)]
    if problems:
        return None, messages_field, problems
    parts = [text for text in (row["instruction"], row.get("input", "")) if text.strip()]
    if not parts:
        return None, messages_field, [("instruction", "empty_instruction", "empty instruction")]
    system = row.get("system", "")
    messages = ([{"role": "system", "content": system}] if system.strip() else []) + [
        {"role": "user", "content": "\n\n".join(parts)}, {"role": "assistant", "content": row["output"]}]
    user = "instruction" if row["instruction"].strip() else "input"
    names = (["system"] if system.strip() else []) + [user, "output"]
    return {"messages": messages}, lambda i, key: names[i], []


def _from_prompt_completion(row: dict):
    prompt, completion = row["prompt"], row["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
        return {"messages": messages}, lambda i, key: ("prompt", "completion")[i], []
    if isinstance(prompt, list) and isinstance(completion, list):
        split = len(prompt)

        def name(i: int, key: str | None) -> str:
            where = f"prompt[{i}]" if i < split else f"completion[{i - split}]"
            return where + (f".{key}" if key else "")

        out = {"messages": prompt + completion, **({"tools": row["tools"]} if "tools" in row else {})}
        return out, name, []
    return None, messages_field, [("prompt", "content_not_string",
                                   '"prompt" and "completion" must both be strings or both lists of messages')]


_CONVERT = {"sharegpt": _from_sharegpt, "alpaca": _from_alpaca,
            "prompt-completion": _from_prompt_completion}
