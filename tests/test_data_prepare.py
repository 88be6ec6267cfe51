"""The parallel data-preparation driver: shards of a file in processes give the result of one pass."""

from itertools import pairwise

import pytest
from helpers import chat, tiny_chat_tokenizer, write_jsonl
from osft.trainer.data import DataValidationError
from osft.trainer.data.cache import tokenize_chat_file_cached
from osft.trainer.data.prepare import plan_shards
from osft.trainer.data.sources import json_lines


def _rows(n: int) -> list:
    return [chat(f"question {i} " + "x" * (i % 7), f"answer {i} " + "y" * (i % 11)) for i in range(n)]


def test_shards_cover_the_file_at_line_starts_with_their_line_numbers(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", _rows(50))
    shards = plan_shards(path, shard_bytes=300)
    assert len(shards) > 5 and shards[0].start == 0 and shards[-1].stop == path.stat().st_size
    assert all(a.stop == b.start for a, b in pairwise(shards))
    rows = [located for s in shards for located in json_lines(path, s.start, s.stop, s.first_line)]
    assert [r.where for r in rows] == list(range(1, 51))
    assert [r.row for r in rows] == [r.row for r in json_lines(path)]


def test_one_and_two_processes_write_byte_identical_caches(tmp_path):
    """The cache entry (every shard's Arrow file and the report) is the same for 1 and 2 processes,
    and the samples are those of one shard over the whole file."""
    tok = tiny_chat_tokenizer()
    path = write_jsonl(tmp_path / "d.jsonl", _rows(120))
    entries = {}
    for procs in (1, 2):
        cache = tmp_path / f"cache{procs}"
        data, hit = tokenize_chat_file_cached(path, tok, 48, cache_dir=cache, num_proc=procs, shard_bytes=1500)
        assert not hit
        entry = next(cache.iterdir())
        entries[procs] = {p.relative_to(entry): p.read_bytes() for p in sorted(entry.rglob("*")) if p.is_file()}
        assert len(data) == data.report.kept > 0 and data.report.dropped_overlong  # some rows over 48 tokens
    assert len([p for p in entries[1] if p.suffix == ".arrow"]) > 3
    assert entries[1] == entries[2]
    whole, _ = tokenize_chat_file_cached(path, tok, 48, cache_dir=tmp_path / "whole", num_proc=1,
                                         shard_bytes=1 << 30)
    assert whole.report == data.report
    assert whole.dataset["input_ids"] == data.dataset["input_ids"]
    assert whole.dataset["line"] == data.dataset["line"]


def test_problems_of_every_shard_are_reported_in_file_order(tmp_path):
    tok = tiny_chat_tokenizer()
    rows = _rows(60)
    rows[3], rows[31], rows[58] = "[1]", {"messages": []}, chat("q", " ")
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataValidationError) as err:
        tokenize_chat_file_cached(path, tok, 64, cache_dir=tmp_path / "c", num_proc=1, shard_bytes=400)
    assert [(p.line, p.rule) for p in err.value.problems] == [
        (4, "row_not_object"), (32, "messages_empty"), (59, "empty_assistant_content")]
