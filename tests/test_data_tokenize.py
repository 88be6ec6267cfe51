"""Tokenization, label masks and the overlong policies (docs/data.md, "Which tokens are trained" and
"Overlong samples"): a row left with no trained token after truncation, and what drop, error and
truncate report."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import (
    ALTERNATION_CHECK,
    PLAIN_CHATML_TEMPLATE,
    REASONING_CHATML_TEMPLATE,
    chat,
    tiny_chat_tokenizer,
    write_jsonl,
)

from osft.trainer.data import DataReport, DataValidationError, OverlongSampleError, tokenize_chat_file
from osft.trainer.data.tokenize import IGNORE_INDEX, SpanFinder, assistant_char_spans

END = "<|im_end|>"


def trained_runs(sample) -> list[list[int]]:
    """Maximal runs of consecutive trained token ids."""
    runs, cur = [], []
    for tok_id, label in zip(sample["input_ids"], sample["labels"]):
        if label != IGNORE_INDEX:
            assert label == tok_id  # labels are not shifted here
            cur.append(tok_id)
        elif cur:
            runs.append(cur)
            cur = []
    return runs + ([cur] if cur else [])


CONVERSATIONS = [
    chat("What is the capital of France?", "The capital of France is Paris."),
    chat("hi", "Hello! How can I help?", "Tell me a joke", "Why was six afraid of seven?", system="Be brief."),
    chat("one", "two", "three", "four", "five"),  # ends with an untrained user turn
    chat("  spaced  ", "  answer with spaces\n\n", "x", " y"),
    chat("unicode: é ü 東京", "答え: 東京 ✓"),
]


@pytest.mark.parametrize("alternating", [False, True])
def test_label_mask_is_assistant_content_plus_end_token(tmp_path, alternating):
    tok = tiny_chat_tokenizer(require_alternation=alternating)
    path = write_jsonl(tmp_path / "c.jsonl", CONVERSATIONS)
    data = tokenize_chat_file(path, tok, max_seq_len=512)
    assert len(data) == len(CONVERSATIONS)
    for k, row in enumerate(CONVERSATIONS):
        sample = data[k]
        expected = [m["content"] + END for m in row["messages"] if m["role"] == "assistant"]
        assert [tok.decode(run) for run in trained_runs(sample)] == expected
        assert sample["num_loss_tokens"] == sum(len(r) for r in trained_runs(sample))
        assert sample["length"] == len(sample["input_ids"]) == len(sample["labels"])
        assert sample["line"] == k + 1
        full = tok.apply_chat_template(row["messages"], tokenize=False)
        assert tok.decode(sample["input_ids"]) == full
    assert data.lengths.dtype == np.int64 and data.lengths.tolist() == [data[k]["length"] for k in range(len(data))]


def test_train_on_all(tmp_path):
    tok = tiny_chat_tokenizer()
    path = write_jsonl(tmp_path / "c.jsonl", CONVERSATIONS[:2])
    data = tokenize_chat_file(path, tok, 512, train_on_all=True)
    for k in range(2):
        assert data[k]["labels"] == data[k]["input_ids"]
        assert data[k]["num_loss_tokens"] == data[k]["length"]
    assert data.report.train_on_all


@pytest.mark.parametrize("template", [
    PLAIN_CHATML_TEMPLATE,
    ALTERNATION_CHECK + PLAIN_CHATML_TEMPLATE,
    # Llama-2-like layout: no generation prompt text, end token right after the content
    "{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
    "{% elif m['role'] == 'system' %}{{ '<<SYS>>' + m['content'] + '<</SYS>>' }}"
    "{% else %}{{ ' ' + m['content'] + '<|im_end|>' }}{% endif %}{% endfor %}",
    # a template that trims contents (the marker fast path must fall back where that matters)
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] | trim + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
])
def test_fast_span_finder_matches_reference(template):
    tok = tiny_chat_tokenizer(chat_template=template)
    finder = SpanFinder(tok, verify_rows=0)
    assert finder.suffixes is not None
    rows = CONVERSATIONS + [chat("a", "b\ue000c")]  # a marker character in the data: reference path
    for row in rows:
        msgs = row["messages"]
        rendered = tok.apply_chat_template(msgs, tokenize=False)
        assert finder.spans(msgs, rendered) == assistant_char_spans(tok, msgs, rendered)


def test_fast_path_renders_once_per_row(tmp_path, monkeypatch):
    tok = tiny_chat_tokenizer()
    calls = []
    original = type(tok).apply_chat_template

    def counting(self, *a, **k):
        calls.append(1)
        return original(self, *a, **k)

    monkeypatch.setattr(type(tok), "apply_chat_template", counting)
    rows = [chat(*[f"turn {i} {j}" for j in range(8)]) for i in range(200)]
    data = tokenize_chat_file(write_jsonl(tmp_path / "many.jsonl", rows), tok, 512)
    assert len(data) == 200
    # validation render + marked render per row, the reference on the first 16 rows (8 renders
    # each) and those rows' 2 renders once more (the driver verifies the fast path before the
    # shards start), plus a handful of probes
    assert len(calls) <= 2 * 200 + 16 * (8 + 2) + 20


def test_a_template_that_renders_earlier_turns_differently_splits_the_conversation_by_turn(tmp_path):
    # renders an assistant content only when it is the last message (like templates that drop
    # the reasoning of earlier turns): turn 1 is trained in a sample of its own, as it is rendered
    # when it is the newest turn; turn 3 in the whole conversation
    template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}"
                "{% if m['role'] != 'assistant' or loop.last %}{{ m['content'] }}{% endif %}"
                "{{ '<|im_end|>\n' }}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    tok = tiny_chat_tokenizer(chat_template=template)
    path = write_jsonl(tmp_path / "c.jsonl", [chat("a", "b", "c", "d")])
    data = tokenize_chat_file(path, tok, 512)
    assert [[tok.decode(run) for run in trained_runs(data[k])] for k in range(len(data))] == [["d" + END], ["b" + END]]
    assert data.dataset["line"] == [1, 1] and data.report.split == [(1, 2)] and data.report.rows == 1
    assert any("split 1 rows" in line and "line 1 (2 samples)" in line for line in data.report.summary_lines())
    # training on every token needs no spans: one sample
    assert len(tokenize_chat_file(path, tok, 512, train_on_all=True)) == 1
    # a generation prompt that is not where the template renders the turn cannot be located: refused
    odd = tiny_chat_tokenizer(chat_template=template.replace("'<|im_start|>assistant\n' }}{% endif %}",
                                                             "'<|im_start|>bot\n' }}{% endif %}"))
    with pytest.raises(DataValidationError, match="does not let us locate") as info:
        tokenize_chat_file(path, odd, 512)
    (p,) = info.value.problems
    assert (p.line, p.rule) == (1, "template_prefix_mismatch") and "messages[1]" in p.message


B15_ROWS = [
    chat("hi", "ok"),
    chat("tell me " + "a" * 40, "sure"),
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]},
]


def test_both_lines_reported_in_one_pass(tmp_path):
    path = write_jsonl(tmp_path / "b15.jsonl", B15_ROWS)
    with pytest.raises(DataValidationError) as info:
        tokenize_chat_file(path, tiny_chat_tokenizer(default_system=False), 16, overlong="truncate")
    line2, line3 = info.value.problems
    assert (line2.line, line2.rule) == (2, "no_trainable_tokens")
    assert str(line2) == f"{path}:2: 0 trainable tokens after truncation to 16"
    assert (line3.line, line3.rule) == (3, "empty_assistant_content")
    assert str(line3) == f"{path}:3: empty assistant content in messages[1].content"
    assert f"{path}:2: 0 trainable tokens after truncation to 16" in str(info.value)


def test_no_trainable_tokens_after_truncation(tmp_path):
    tok = tiny_chat_tokenizer(default_system=False)
    path = write_jsonl(tmp_path / "b15.jsonl", B15_ROWS[:2])

    data = tokenize_chat_file(path, tok, 16, overlong="truncate")
    rep = data.report
    assert (rep.rows, rep.kept, rep.dropped_no_trainable, rep.truncated) == (2, 1, [2], [])
    assert data[0]["line"] == 1 and data[0]["num_loss_tokens"] > 0
    assert any("0 trainable tokens after truncation to 16" in s and "line 2" in s for s in rep.summary_lines())

    data = tokenize_chat_file(path, tok, 16, overlong="drop")
    rep = data.report
    assert rep.kept == 1 and [line for line, _ in rep.dropped_overlong] == [2]
    assert rep.dropped_overlong[0][1] > 16
    assert all(n > 0 for n in data.dataset["num_loss_tokens"])


def _overlong_file(tmp_path, tok, max_len):
    """3 rows; row 3 tokenizes to exactly 3 * max_len tokens, with the answer at the end."""
    rows = [chat("hi", "ok"), chat("What is the capital of France?", "Paris.")]
    base = tok.apply_chat_template(chat("", "The answer is Paris.")["messages"], tokenize=False)
    pad = 3 * max_len - len(tok(base, add_special_tokens=False)["input_ids"])
    rows.append(chat("0" * pad, "The answer is Paris."))  # each "0" is one token
    path = write_jsonl(tmp_path / "b19.jsonl", rows)
    text = tok.apply_chat_template(rows[2]["messages"], tokenize=False)
    assert len(tok(text, add_special_tokens=False)["input_ids"]) == 3 * max_len
    return path


def test_drop_policy_reports_line_and_length(tmp_path):
    tok = tiny_chat_tokenizer()
    path = _overlong_file(tmp_path, tok, 32)
    data = tokenize_chat_file(path, tok, 32)  # drop is the default
    rep = data.report
    assert (rep.rows, rep.kept, rep.dropped_overlong) == (3, 2, [(3, 96)])
    assert data.dataset["line"] == [1, 2]
    summary = "\n".join(rep.summary_lines())
    assert "dropped 1 overlong (> 32 tokens): line 3 (96 tokens)" in summary
    assert rep.total_tokens == sum(data.lengths.tolist())
    assert rep.total_loss_tokens == sum(data.dataset["num_loss_tokens"])


def test_error_policy_names_line_and_length(tmp_path):
    tok = tiny_chat_tokenizer()
    path = _overlong_file(tmp_path, tok, 32)
    with pytest.raises(OverlongSampleError) as info:
        tokenize_chat_file(path, tok, 32, overlong="error")
    (p,) = info.value.problems
    assert str(p) == f"{path}:3: sample has 96 tokens, more than max_seq_len 32 (overlong policy: error)"
    assert str(info.value).startswith("1 sample(s) longer than max_seq_len 32 (overlong policy: error):")
    assert info.value.report.dropped_overlong == [(3, 96)]


def test_truncate_never_silently_removes_every_answer_token(tmp_path):
    tok = tiny_chat_tokenizer()
    path = _overlong_file(tmp_path, tok, 32)
    rep = tokenize_chat_file(path, tok, 32, overlong="truncate").report
    assert (rep.kept, rep.dropped_no_trainable, rep.truncated) == (2, [3], [])
    assert "0 trainable tokens after truncation to 32" in "\n".join(rep.summary_lines())


def test_truncate_keeps_the_first_tokens_and_counts_kept_loss(tmp_path):
    tok = tiny_chat_tokenizer(default_system=False)
    row = chat("hi", "The capital of France is Paris. " * 4)
    path = write_jsonl(tmp_path / "t.jsonl", [row])
    full = tokenize_chat_file(path, tok, 512)[0]
    data = tokenize_chat_file(path, tok, 20, overlong="truncate")
    sample = data[0]
    assert sample["input_ids"] == full["input_ids"][:20] and sample["labels"] == full["labels"][:20]
    kept_loss = sum(lab != IGNORE_INDEX for lab in full["labels"][:20])
    assert data.report.truncated == [(1, full["length"], kept_loss)]
    assert sample["num_loss_tokens"] == kept_loss and sample["length"] == 20


def test_report_json_round_trip(tmp_path):
    tok = tiny_chat_tokenizer()
    path = _overlong_file(tmp_path, tok, 32)
    rep = tokenize_chat_file(path, tok, 32).report
    loaded = json.loads(rep.to_json())
    assert loaded == rep.to_dict()
    assert loaded["dropped_overlong"] == [[3, 96]] and loaded["overlong"] == "drop"
    assert DataReport(**{**loaded, "dropped_overlong": [tuple(x) for x in loaded["dropped_overlong"]]}) == rep


def test_bad_arguments(tmp_path):
    tok = tiny_chat_tokenizer()
    path = write_jsonl(tmp_path / "c.jsonl", CONVERSATIONS[:1])
    with pytest.raises(ValueError, match="overlong must be one of"):
        tokenize_chat_file(path, tok, 32, overlong="clip")
    with pytest.raises(ValueError, match="max_seq_len must be >= 1"):
        tokenize_chat_file(path, tok, 0)


def test_an_empty_reasoning_block_the_template_inserts_is_not_trained_and_is_reported(tmp_path):
    """Qwen3-style templates open the last assistant turn with `<think>\\n\\n</think>\\n\\n` when
    the data has no reasoning; only the content and the end-of-turn token are trained."""
    tok = tiny_chat_tokenizer(chat_template=REASONING_CHATML_TEMPLATE)
    reasoned = {"messages": [{"role": "user", "content": "Why?"},
                             {"role": "assistant", "content": "Hi.", "reasoning_content": "Because."}]}
    path = write_jsonl(tmp_path / "r.jsonl", [chat("Say hi.", "Hi."), reasoned, chat("Say hi.", "think")])
    data = tokenize_chat_file(path, tok, 512)
    block = "<think>\n\n</think>\n\n"
    assert [tok.decode(run) for run in trained_runs(data[0])] == ["Hi." + END]
    assert [tok.decode(run) for run in trained_runs(data[2])] == ["think" + END]  # content found, not the tag
    # reasoning the data gave is data: trained with its block
    assert [tok.decode(run) for run in trained_runs(data[1])] == ["<think>\nBecause.\n</think>\n\nHi." + END]
    (entry,) = data.report.template_inserted
    ids, labels = data[0]["input_ids"], data[0]["labels"]
    first_trained = next(j for j, label in enumerate(labels) if label != IGNORE_INDEX)
    header = len(tok(tok.apply_chat_template(chat("Say hi.", "Hi.")["messages"][:1], tokenize=False,
                                             add_generation_prompt=True), add_special_tokens=False)["input_ids"])
    assert tok.decode(ids[header:first_trained]) == block
    assert entry == {"where": "before assistant content", "text": block, "samples": 2,
                     "tokens_min": first_trained - header, "tokens_max": first_trained - header,
                     "tokens_total": 2 * (first_trained - header)}
    assert json.loads(data.report.to_json())["template_inserted"] == [entry]
    line = [text for text in data.report.summary_lines() if "inserted" in text]
    assert line == [f'  the chat template inserted text the data does not contain, before assistant content '
                    f'"<think>\\n\\n</think>\\n\\n": in 2 samples, {first_trained - header} tokens per sample, not trained']
    # a multi-turn row renders its prefixes differently: each turn trained as the newest, its empty block not
    multi = tokenize_chat_file(write_jsonl(tmp_path / "m.jsonl", [chat("a", "b", "c", "d")]), tok, 512)
    assert [[tok.decode(run) for run in trained_runs(multi[k])] for k in range(2)] == [["d" + END], ["b" + END]]
    assert multi.report.template_inserted[0]["samples"] == 2


def test_a_default_system_prompt_the_template_inserts_is_reported_once(tmp_path):
    """SmolLM2-style templates insert a system turn when a conversation has none."""
    tok = tiny_chat_tokenizer()  # SmolLM2-like: "You are a helpful assistant." by default
    rows = [chat("hi", "ok"), chat("hello", "hello world"), chat("hi", "ok", system="Be brief.")]
    data = tokenize_chat_file(write_jsonl(tmp_path / "s.jsonl", rows), tok, 512)
    prompt = "You are a helpful assistant."
    n = len(tok(prompt, add_special_tokens=False)["input_ids"])
    assert data.report.template_inserted == [{"where": "default system prompt", "text": prompt, "samples": 2,
                                              "tokens_min": n, "tokens_max": n, "tokens_total": 2 * n}]
    assert [text for text in data.report.summary_lines() if "inserted" in text] == [
        f'  the chat template inserted text the data does not contain, default system prompt "{prompt}": '
        f"in 2 samples, {n} tokens per sample, not trained"]
    for k, row in enumerate(rows):  # still only the assistant turns are trained
        expected = [m["content"] + END for m in row["messages"] if m["role"] == "assistant"]
        assert [tok.decode(run) for run in trained_runs(data[k])] == expected
    everything = tokenize_chat_file(write_jsonl(tmp_path / "s.jsonl", rows), tok, 512, train_on_all=True)
    assert everything.report.template_inserted == data.report.template_inserted
    assert any("tokens per sample, trained (--train-on-all)" in text for text in everything.report.summary_lines())
    plain = tiny_chat_tokenizer(default_system=False)
    assert tokenize_chat_file(write_jsonl(tmp_path / "s.jsonl", rows), plain, 512).report.template_inserted == []
