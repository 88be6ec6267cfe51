"""Pre-flight validation of chat JSONL files (docs/data.md, "Validation"): a BOM, truncated JSON,
rows that are not objects, role alternation, unknown roles, missing content, and every rule's
message."""

from __future__ import annotations

import json

import pytest
from helpers import PLAIN_CHATML_TEMPLATE, chat, tiny_chat_tokenizer, write_jsonl

from osft.trainer.data.validate import (
    MAX_SHOWN_PROBLEMS,
    DataValidationError,
    Problem,
    template_requires_alternation,
    validate_chat_file,
)

GOOD = chat("What is the capital of France?", "Paris.")


def test_bom_truncated_json_and_array(tmp_path):
    truncated = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}'
    path = tmp_path / "b16.jsonl"
    lines = [json.dumps(GOOD)] * 3 + [truncated, "[1, 2, 3]"]
    path.write_bytes(b"\xef\xbb\xbf" + ("\n".join(lines) + "\n").encode())

    records, problems = validate_chat_file(path)

    assert [c.line for c in records] == [1, 2, 3]  # the BOM on line 1 is handled
    assert [(p.line, p.rule) for p in problems] == [(4, "invalid_json"), (5, "row_not_object")]
    bad_json, array = problems
    col = len(truncated) + 1
    assert bad_json.column == col
    assert bad_json.message == f"invalid JSON: Expecting ',' delimiter (column {col})"
    assert str(bad_json) == f"{path}:4:{col}: invalid JSON: Expecting ',' delimiter (column {col})"
    assert array.message == "row must be an object with a messages list"
    assert str(array) == f"{path}:5: row must be an object with a messages list"

    err = DataValidationError(problems)
    assert isinstance(err, ValueError)
    text = str(err)
    assert text.splitlines()[0] == "2 problems in the training data:"
    assert f"{path}:4:{col}:" in text and f"{path}:5:" in text


def test_alternation_unknown_role_missing_content(tmp_path):
    rows = [
        GOOD,
        {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                      {"role": "assistant", "content": "c"}]},
        {"messages": [{"role": "user", "content": "a"}, {"role": "gpt", "content": "b"},
                      {"role": "user"}]},
    ]
    path = write_jsonl(tmp_path / "b17.jsonl", rows)
    strict = tiny_chat_tokenizer(require_alternation=True)
    assert template_requires_alternation(strict)

    records, problems = validate_chat_file(path, strict)

    assert [c.line for c in records] == [1]
    assert [(p.line, p.field, p.rule) for p in problems] == [
        (2, "messages[1].role", "roles_not_alternating"),
        (3, "messages[1].role", "unknown_role"),
        (3, "messages[2].content", "content_missing"),
        (3, "messages", "no_assistant"),
    ]
    assert problems[0].message == (
        "roles do not alternate user/assistant after an optional leading system message, as the chat "
        'template requires: messages[1].role is "user", expected "assistant"')
    assert problems[1].message == 'unknown role "gpt" in messages[1].role (allowed: system, user, assistant, tool)'
    assert problems[2].message == "missing content in messages[2].content"
    assert str(problems[1]) == f'{path}:3: unknown role "gpt" in messages[1].role (allowed: system, user, assistant, tool)'


def test_alternation_only_checked_when_the_template_requires_it(tmp_path):
    row = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "a"},
                        {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}]}
    path = write_jsonl(tmp_path / "d.jsonl", [row])
    lenient = tiny_chat_tokenizer()
    assert not template_requires_alternation(lenient)
    assert validate_chat_file(path, lenient)[1] == []
    assert validate_chat_file(path)[1] == []  # no tokenizer: structure only
    (p,) = validate_chat_file(path, tiny_chat_tokenizer(require_alternation=True))[1]
    assert (p.field, p.rule) == ("messages[2].role", "roles_not_alternating")


U = {"role": "user", "content": "q"}
A = {"role": "assistant", "content": "a"}


@pytest.mark.parametrize("row, field, rule, message", [
    ("not json", None, "invalid_json", "invalid JSON: Expecting value (column 1)"),
    ('"text"', "row", "row_not_object", "row must be an object with a messages list"),
    ({"conversations": []}, "messages", "messages_missing",
     'missing "messages" (row must be an object with a messages list)'),
    ({"messages": {"role": "user"}}, "messages", "messages_not_list", '"messages" must be a list, got object'),
    ({"messages": []}, "messages", "messages_empty", '"messages" is empty'),
    ({"messages": [U, "hello", A]}, "messages[1]", "message_not_object",
     "messages[1] must be an object with role and content, got string"),
    ({"messages": [U, {"content": "x"}, A]}, "messages[1].role", "role_missing", "missing role in messages[1].role"),
    ({"messages": [U, {"role": "gpt", "content": "x"}, A]}, "messages[1].role", "unknown_role",
     'unknown role "gpt" in messages[1].role (allowed: system, user, assistant, tool)'),
    ({"messages": [U, A, {"role": "user"}, A]}, "messages[2].content", "content_missing",
     "missing content in messages[2].content"),
    ({"messages": [U, A, {"role": "user", "contents": "x"}, A]}, "messages[2].content", "content_missing",
     'missing content in messages[2].content (the message has "contents")'),
    ({"messages": [U, {"rol": "user", "content": "x"}, A]}, "messages[1].role", "role_missing",
     'missing role in messages[1].role (the message has "rol")'),
    ({"messages": [U, A, {"role": "user", "content": ["x"]}, A]}, "messages[2].content", "content_not_string",
     "messages[2].content must be a string, got array"),
    ({"messages": [U, {"role": "assistant", "content": " \n"}]}, "messages[1].content",
     "empty_assistant_content", "empty assistant content in messages[1].content"),
    ({"messages": [U]}, "messages", "no_assistant", "no assistant turn in messages (nothing to train on)"),
])
def test_each_rule_has_its_exact_message(tmp_path, row, field, rule, message):
    path = write_jsonl(tmp_path / "r.jsonl", [GOOD, row])
    records, problems = validate_chat_file(path, tiny_chat_tokenizer())
    assert [c.line for c in records] == [1]
    assert problems == [Problem(str(path), 2, problems[0].column, field, rule, message)]
    assert str(problems[0]).startswith(f"{path}:2")
    assert str(problems[0]).endswith(f": {message}")


def test_template_errors_are_reported_per_row(tmp_path):
    template = ("{% for m in messages %}{% if 'boom' in m['content'] %}"
                "{{ raise_exception('no boom allowed') }}{% endif %}{% endfor %}" + PLAIN_CHATML_TEMPLATE)
    tok = tiny_chat_tokenizer(chat_template=template)
    path = write_jsonl(tmp_path / "t.jsonl", [GOOD, chat("boom", "x"), GOOD])
    records, problems = validate_chat_file(path, tok)
    assert [c.line for c in records] == [1, 3]
    (p,) = problems
    assert (p.line, p.field, p.rule) == (2, "messages", "template_error")
    assert p.message == "chat template failed on this row: TemplateError: no boom allowed"


def test_blank_lines_crlf_and_physical_line_numbers(tmp_path):
    path = tmp_path / "b.jsonl"
    path.write_bytes(b"\r\n".join([json.dumps(GOOD).encode(), b"", b"   ", b"{bad", json.dumps(GOOD).encode()]))
    records, problems = validate_chat_file(path)
    assert [c.line for c in records] == [1, 5]
    assert [(p.line, p.column) for p in problems] == [(4, 2)]


def test_invalid_utf8_is_located(tmp_path):
    path = tmp_path / "u.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n" + b'{"messages": "\xff"}\n')
    (p,) = validate_chat_file(path)[1]
    assert (p.line, p.rule) == (2, "invalid_utf8")
    assert p.message == "invalid UTF-8: invalid start byte at byte 15"


def test_all_problems_in_one_pass_and_capped_display(tmp_path):
    path = write_jsonl(tmp_path / "many.jsonl", ["[]"] * 60 + [GOOD])
    records, problems = validate_chat_file(path)
    assert len(records) == 1 and len(problems) == 60
    text = str(DataValidationError(problems))
    lines = text.splitlines()
    assert lines[0] == "60 problems in the training data:"
    assert len(lines) == 1 + MAX_SHOWN_PROBLEMS + 1
    assert lines[-1] == "  ... and 10 more problems (not shown)"


def test_tokenizer_without_chat_template_is_refused(tmp_path):
    tok = tiny_chat_tokenizer()
    tok.chat_template = None
    path = write_jsonl(tmp_path / "x.jsonl", [GOOD])
    with pytest.raises(ValueError, match="no chat_template"):
        validate_chat_file(path, tok)


def test_problem_is_frozen():
    p = Problem("f.jsonl", 3, None, "messages", "messages_empty", '"messages" is empty')
    with pytest.raises(Exception):
        p.line = 4  # type: ignore[misc]
    assert str(p) == 'f.jsonl:3: "messages" is empty'


def test_lone_surrogates_in_any_field_are_located_in_one_pass(tiny_model_dir, tmp_path, capsys):
    from osft.trainer.launch.cli import main

    lines = [
        json.dumps(GOOD),
        '{"messages": [{"role": "user", "content": "thumbs \\ud83d"}, {"role": "assistant", "content": "\\udc4d up"}]}',
        '{"messages": [{"role": "user", "content": "ok \\ud83d\\udc4d", "name": "x\\udfff"}, '
        '{"role": "assistant", "content": "fine", "tool_calls": [{"name": "f", "arguments": {"q": "\\ud800"}}]}]}',
    ]
    path = tmp_path / "s.jsonl"
    path.write_bytes("\n".join(lines[:3]).encode() + b"\n" + b'{"messages": "\xff"}\n')
    records, problems = validate_chat_file(path, tiny_chat_tokenizer())
    assert [c.line for c in records] == [1]
    assert [str(p) for p in problems] == [
        f"{path}:2: messages[0].content: lone surrogate (invalid Unicode)",
        f"{path}:2: messages[1].content: lone surrogate (invalid Unicode)",
        f"{path}:3: messages[0].name: lone surrogate (invalid Unicode)",  # the pair in its content is one character
        f"{path}:3: messages[1].tool_calls[0].arguments.q: lone surrogate (invalid Unicode)",
        f"{path}:4: invalid UTF-8: invalid start byte at byte 15",
    ]
    assert {p.rule for p in problems[:4]} == {"lone_surrogate"}
    out = tmp_path / "run"
    assert main(["--model-name-or-path", str(tiny_model_dir), "--data-path", str(path), "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err.replace("\n", "")
    assert all(str(p) in err for p in problems) and "codec" not in err
