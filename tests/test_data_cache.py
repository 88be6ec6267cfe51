"""The tokenized-data cache: hits only when file, tokenizer and settings are all the same."""

import json

import pytest
from helpers import chat, tiny_chat_tokenizer, write_jsonl

from osft.trainer.data import DataValidationError
from osft.trainer.data.cache import tokenize_chat_file_cached


def test_cache_hits_and_misses(tmp_path):
    tok = tiny_chat_tokenizer()
    path = write_jsonl(tmp_path / "a.jsonl", [chat("hi", "ok"), chat("what is 2+2?", "4")])
    cache = tmp_path / "cache"
    first, hit = tokenize_chat_file_cached(path, tok, 64, cache_dir=cache)
    assert not hit
    second, hit = tokenize_chat_file_cached(path, tok, 64, cache_dir=cache)
    assert hit
    assert second.dataset["input_ids"] == first.dataset["input_ids"]
    assert second.dataset["labels"] == first.dataset["labels"]
    assert second.report.kept == first.report.kept == 2
    assert len(list(cache.iterdir())) == 1
    # Another length limit, another template, or changed content: a new entry each.
    assert not tokenize_chat_file_cached(path, tok, 32, cache_dir=cache)[1]
    assert not tokenize_chat_file_cached(path, tok, 64, train_on_all=True, cache_dir=cache)[1]
    tok_alt = tiny_chat_tokenizer(require_alternation=True)
    assert not tokenize_chat_file_cached(path, tok_alt, 64, cache_dir=cache)[1]
    write_jsonl(path, [chat("hi", "ok"), chat("what is 2+3?", "5")])
    data, hit = tokenize_chat_file_cached(path, tok, 64, cache_dir=cache)
    assert not hit and tok.decode([t for t in data[1]["labels"] if t >= 0]).startswith("5")
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]


def test_errors_are_not_cached(tmp_path):
    tok = tiny_chat_tokenizer()
    path = write_jsonl(tmp_path / "bad.jsonl", [chat("hi", "ok"), "[1]"])
    cache = tmp_path / "cache"
    for _ in range(2):
        with pytest.raises(DataValidationError, match="row must be an object"):
            tokenize_chat_file_cached(path, tok, 64, cache_dir=cache)
    assert not cache.exists() or not list(cache.iterdir())


def test_an_unwritable_cache_is_named_and_the_data_tokenized_without_it(tmp_path):
    """An unwritable cache (tests/test_readonly_fs.py for a whole read-only run): a cache directory
    that cannot be created (here under a regular file; a read-only home in the field) warns once,
    naming it and the flag, and never stops the run."""
    tok = tiny_chat_tokenizer()
    path = write_jsonl(tmp_path / "a.jsonl", [chat("hi", "ok"), chat("what is 2+2?", "4")])
    (tmp_path / "file").write_text("")
    cache = tmp_path / "file" / "cache"
    warnings: list[str] = []
    data, hit = tokenize_chat_file_cached(path, tok, 64, cache_dir=cache, warn=warnings.append)
    assert not hit and data.report.kept == 2 and len(data.dataset) == 2
    assert warnings == [f"the tokenized-data cache {cache} is not writable (Not a directory): the data is tokenized "
                        "without it; give a writable --data-cache-dir (or --no-data-cache)"]


def test_a_source_left_without_samples_is_refused_naming_it_in_every_cache_mode(tmp_path):
    """Every sample of long.jsonl is longer than --max-seq-len: as a mixture source, alone, or as the
    evaluation file, with the cache (a first run and a repeat) and without it, the run stops before
    training with the file, the count and the reason; nothing empty is cached."""
    from osft.trainer.config import TrainConfig
    from osft.trainer.data.cache import tokenize_source
    from osft.trainer.launch.startup import load_data

    tok = tiny_chat_tokenizer()
    short = write_jsonl(tmp_path / "a.jsonl", [chat("hi", "ok")] * 4)
    long = write_jsonl(tmp_path / "long.jsonl", [chat("hello world " * 20, "ok " * 10)] * 5)
    why = f"{long}: all 5 samples were dropped (longer than --max-seq-len 32)"
    variants = [([f"{short}:0.5", f"{long}:0.5"], None, "1 problem in the training data"),
                ([str(long)], None, "1 problem in the training data"),
                ([str(short)], str(long), "1 problem(s) in the evaluation file (--eval-data-path)")]
    for data_path, eval_path, header in variants:
        for cache in (True, True, False):
            cfg = TrainConfig("m", data_path, str(tmp_path / "run"), max_seq_len=32, eval_data_path=eval_path,
                              data_cache=cache, data_cache_dir=str(tmp_path / "cache"))
            with pytest.raises(DataValidationError) as exc:
                load_data(cfg, tok, print, lambda path, cfg=cfg: tokenize_source(cfg, path, tok, print)[0])
            assert str(exc.value) == f"{header}:\n  {why}", (data_path, eval_path, cache)
    entries = [p for p in (tmp_path / "cache").iterdir() if p.name != "sources"]
    assert [json.loads((p / "report.json").read_text())["kept"] for p in entries] == [4]  # a.jsonl's only
