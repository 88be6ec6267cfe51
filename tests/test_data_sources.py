"""Data sources (docs/data.md, "Files and row formats"): every accepted source type and row shape
becomes the same validated ``messages`` rows, with problems located by file, line or row, and the
original field."""

import json
import os

import pyarrow as pa
import pytest
from datasets import Dataset, DatasetDict

from helpers import tiny_chat_tokenizer, write_jsonl
from osft.trainer.data import DataValidationError, tokenize_chat_file
from osft.trainer.data.cache import tokenize_chat_file_cached
from osft.trainer.data.validate import validate_chat_file

MESSAGES = [
    [{"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "The capital of France is Paris."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"},
     {"role": "assistant", "content": "hello world thanks"}],
]
ROWS = [{"messages": m} for m in MESSAGES]


def _sources(tmp_path, rows):
    """The same rows as .jsonl, .json (array), .parquet, .arrow (IPC stream) and a save_to_disk directory."""
    jsonl = write_jsonl(tmp_path / "d.jsonl", rows)
    array = tmp_path / "d.json"
    array.write_text(json.dumps(rows, indent=1))
    ds = Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "d.parquet"))
    with pa.OSFile(str(tmp_path / "d.arrow"), "wb") as sink, pa.ipc.new_stream(sink, ds.data.table.schema) as writer:
        writer.write_table(ds.data.table)
    ds.save_to_disk(str(tmp_path / "saved"))
    DatasetDict(train=ds).save_to_disk(str(tmp_path / "saved_dict"))
    return [jsonl, array, tmp_path / "d.parquet", tmp_path / "d.arrow", tmp_path / "saved", tmp_path / "saved_dict"]


def test_every_source_type_gives_the_same_conversations_and_tokens(tmp_path):
    tok = tiny_chat_tokenizer()
    expected = tokenize_chat_file(_sources(tmp_path, ROWS)[0], tok, 128)
    for path in _sources(tmp_path, ROWS):
        records, problems = validate_chat_file(path)
        assert problems == [] and [c.messages for c in records] == MESSAGES, path
        data = tokenize_chat_file(path, tok, 128)
        assert data.dataset["input_ids"] == expected.dataset["input_ids"], path
        assert data.dataset["labels"] == expected.dataset["labels"], path
        assert data.report.unit == ("line" if path.suffix == ".jsonl" else "row")


def test_arrow_null_keys_are_dropped_so_messages_keep_only_their_own_fields(tmp_path):
    """Parquet unifies the rows' keys: a message without "name" gets name=null, which is dropped again."""
    rows = [{"messages": [{"role": "user", "content": "hi", "name": "ann"}, {"role": "assistant", "content": "ok"}]},
            {"messages": MESSAGES[0]}]
    Dataset.from_list(rows).to_parquet(str(tmp_path / "n.parquet"))
    records, problems = validate_chat_file(tmp_path / "n.parquet")
    assert problems == [] and [c.messages for c in records] == [rows[0]["messages"], MESSAGES[0]]


SHAPES = [
    ("sharegpt", {"conversations": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "hello world"}],
                  "system": "Be brief."},
     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"},
      {"role": "assistant", "content": "hello world"}]),
    ("alpaca", {"instruction": "Say hi.", "input": "to Ann", "output": "hi Ann"},
     [{"role": "user", "content": "Say hi.\n\nto Ann"}, {"role": "assistant", "content": "hi Ann"}]),
    ("alpaca", {"instruction": "Say hi.", "input": "", "output": "hi"},
     [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]),
    ("prompt-completion", {"prompt": "Say hi.", "completion": "hi"},
     [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]),
    ("prompt-completion", {"prompt": [{"role": "user", "content": "Say hi."}],
                           "completion": [{"role": "assistant", "content": "hi"}]},
     [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]),
]


@pytest.mark.parametrize("shape,row,messages", SHAPES)
def test_row_shapes_are_detected_or_given_and_converted_to_messages(tmp_path, shape, row, messages):
    path = write_jsonl(tmp_path / "s.jsonl", [row, row])
    for data_format in ("auto", shape):
        records, problems = validate_chat_file(path, tiny_chat_tokenizer(), data_format=data_format)
        assert problems == [] and [c.messages for c in records] == [messages, messages]
    if shape != "prompt-completion":  # the wrong flag names the key it expected
        (first, _) = validate_chat_file(path, data_format="prompt-completion")[1]
        assert str(first) == (f'{path}:1: missing "prompt" (the data is read as prompt-completion rows, which need '
                              '"prompt" and "completion"; see --data-format)')


def test_problems_name_the_original_field_and_the_row(tmp_path):
    rows = [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "ok"}]},
            {"conversations": [{"from": "human", "value": "hi"}, {"from": "bot", "value": "ok"}]},
            {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "  "}]},
            {"messages": MESSAGES[0]}]
    Dataset.from_list([{"conversations": r.get("conversations", [])} for r in rows]).to_parquet(str(tmp_path / "g.parquet"))
    problems = validate_chat_file(tmp_path / "g.parquet")[1]
    assert [str(p) for p in problems] == [
        f"{tmp_path / 'g.parquet'}: row 2: conversations[1].from is 'bot' (allowed: human, user, gpt, assistant, "
        "system, tool, function_response, observation)",
        f"{tmp_path / 'g.parquet'}: row 3: empty assistant content in conversations[1].value",
        f"{tmp_path / 'g.parquet'}: row 4: \"conversations\" is empty"]
    path = write_jsonl(tmp_path / "g.jsonl", rows)
    assert [(p.line, p.field) for p in validate_chat_file(path)[1]] == [
        (2, "conversations[1].from"), (3, "conversations[1].value"), (4, "conversations")]
    alpaca = write_jsonl(tmp_path / "a.jsonl", [{"instruction": "x", "output": ""}, {"instruction": "x", "output": 3}])
    assert [str(p) for p in validate_chat_file(alpaca)[1]] == [
        f"{alpaca}:1: empty assistant content in output", f'{alpaca}:2: "output" must be a string']
    broken = tmp_path / "b.json"
    broken.write_text('[{"messages": []},\n {"messages": ')
    (p,) = validate_chat_file(broken)[1]
    assert str(p) == f"{broken}: invalid JSON: Expecting value (line 2, column 15)"
    with pytest.raises(DataValidationError, match=r"d.json: row 2: "):
        bad = tmp_path / "d.json"
        bad.write_text(json.dumps([ROWS[0], {"messages": []}]))
        tokenize_chat_file(bad, tiny_chat_tokenizer(), 128)


def test_unsupported_sources_are_refused_before_anything_loads(tmp_path):
    from osft.trainer.data.specs import check_sources

    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"unsupported data file type '.csv'"):
        check_sources([str(tmp_path / "d.csv")])
    with pytest.raises(ValueError, match="no such file or directory"):
        check_sources([str(tmp_path / "missing.parquet")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="written by Dataset.save_to_disk"):
        validate_chat_file(tmp_path / "empty")


def test_parquet_conversion_goes_to_the_data_cache_or_a_temporary_directory(tmp_path, monkeypatch):
    """Read-only home (tests/test_readonly_fs.py): datasets' Arrow conversion never needs a writable
    home: it goes to --data-cache-dir's sources folder, or, read-only or --no-data-cache, to a
    temporary directory that is removed."""
    path = _sources(tmp_path, ROWS)[2]
    tok = tiny_chat_tokenizer()
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "never"))
    data, hit = tokenize_chat_file_cached(path, tok, 128, cache_dir=tmp_path / "cache")
    assert not hit and (tmp_path / "cache" / "sources").is_dir() and len(data) == 2
    assert tokenize_chat_file_cached(path, tok, 128, cache_dir=tmp_path / "cache")[1]
    readonly = tmp_path / "ro"
    readonly.mkdir()
    os.chmod(readonly, 0o555)
    warnings = []
    try:
        data, hit = tokenize_chat_file_cached(path, tok, 128, cache_dir=readonly / "c", warn=warnings.append)
    finally:
        os.chmod(readonly, 0o755)
    if os.geteuid() != 0:  # root writes anyway
        assert not hit and len(data) == 2 and "not writable" in warnings[0]
        assert list(readonly.iterdir()) == []
    assert tokenize_chat_file(path, tok, 128, source_cache=None).dataset["input_ids"] == data.dataset["input_ids"]
    assert not (tmp_path / "never").exists()


ALPACA = [{"instruction": "Q", "input": "more", "output": "A"}, {"instruction": "Q", "input": "", "output": "A"},
          {"instruction": "Q", "output": "A"}, {"instruction": "Q", "input": "  \n", "output": "A"},
          {"instruction": "Q", "input": "x", "output": ""}, {"instruction": "", "input": "Something", "output": "ok"},
          {"instruction": "Q", "input": None, "output": "A"}, {"instruction": " ", "input": "", "output": "A"},
          {"instruction": "Q", "input": "more", "output": "A", "system": None}]
#: the user turn of each row of ALPACA, or the (field, message) of its problem
ALPACA_USER = ["Q\n\nmore", "Q", "Q", "Q", ("output", "empty assistant content in output"), "Something", "Q",
               ("instruction", "empty instruction"), "Q\n\nmore"]


def test_alpaca_prompt_is_the_non_blank_instruction_and_input_and_null_is_absent_in_every_format(tmp_path):
    """The user turn is the instruction, a blank line and the input, each only when not blank; an
    input (or system) of null is absent, in JSON Lines as in parquet (where Arrow fills in nulls);
    both formats give the same tokens for every row, all rows together or each next to a normal row."""
    tok = tiny_chat_tokenizer()
    cases = [(ALPACA, ALPACA_USER)] + [([ALPACA[0], r], [ALPACA_USER[0], u])
                                       for r, u in zip(ALPACA[1:], ALPACA_USER[1:])]
    for rows, users in cases:
        write_jsonl(tmp_path / "alpaca.jsonl", rows)
        Dataset.from_list(rows).to_parquet(str(tmp_path / "alpaca.parquet"))
        for path in (tmp_path / "alpaca.jsonl", tmp_path / "alpaca.parquet"):
            records, problems = validate_chat_file(path, tok)
            assert [c.messages[0]["content"] for c in records] == [u for u in users if isinstance(u, str)], path
            assert [(p.line, p.field, p.message) for p in problems] == [
                (i, *u) for i, u in enumerate(users, start=1) if not isinstance(u, str)], path
        good = [r for r, u in zip(rows, users) if isinstance(u, str)]
        write_jsonl(tmp_path / "good.jsonl", good)
        Dataset.from_list(good).to_parquet(str(tmp_path / "good.parquet"))
        assert (tokenize_chat_file(tmp_path / "good.parquet", tok, 128).dataset["input_ids"]
                == tokenize_chat_file(tmp_path / "good.jsonl", tok, 128).dataset["input_ids"])
