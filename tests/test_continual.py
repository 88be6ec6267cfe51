"""The continual-learning benchmark (benchmarks/continual.py): its data builders, its measurements
and, with ``--quick``, the whole pipeline on the real task data with a tiny random model."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from continual_learning import trivia, wordnet  # noqa: E402
from continual_learning.evaluate import is_exact_match, normalize_answer, packed_loss, text_samples  # noqa: E402

GEOGRAPHY = """AUTHOR: someone
Capital of France?:
- Paris
Is the Earth round?:
- Yes
- yes indeed
When did World War II end?:
- 1945
What flag is this? https://i.imgur.com/abc.png:
- Chad
See www.example.com for the answer?:
- none
Single answer written as a scalar?: Scalar
"""
HISTORY = """DESCRIPTION: history
CONFIG:
  bot_plays: false
Capital of France?:
- Lutetia
Is water wet?:
- No
"""


def _wheel(tmp_path: Path) -> Path:
    path = tmp_path / "red_discordbot-3.5.24-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(trivia.LISTS_PREFIX + "geography.yaml", GEOGRAPHY)
        zf.writestr(trivia.LISTS_PREFIX + "history.yaml", HISTORY)
        zf.writestr("redbot/cogs/trivia/__init__.py", "")
    return path


def test_trivia_lists_keep_answers_as_strings_and_drop_urls_and_duplicates(tmp_path):
    items, stats = trivia.read_trivia_lists(_wheel(tmp_path))
    by_q = {i.question: i for i in items}
    assert by_q["Is the Earth round?"].answers == ("Yes", "yes indeed")  # BaseLoader: not True
    assert by_q["When did World War II end?"].answers == ("1945",)  # not the int 1945
    assert by_q["Is water wet?"].answers == ("No",)
    assert by_q["Single answer written as a scalar?"].answers == ("Scalar",)
    assert by_q["Capital of France?"].answers == ("Paris",) and by_q["Capital of France?"].source == "geography.yaml"
    assert not any("http" in q or "www." in q for q in by_q)
    assert "AUTHOR" not in by_q and "CONFIG" not in by_q and "DESCRIPTION" not in by_q
    assert stats == {"lists": 2, "questions": 8, "dropped_url": 2, "dropped_duplicate": 1}
    assert trivia.chat_row(by_q["Is the Earth round?"]) == {"messages": [
        {"role": "user", "content": "Is the Earth round?"}, {"role": "assistant", "content": "Yes"}]}


def test_trivia_list_that_is_not_a_mapping_is_named(tmp_path):
    path = tmp_path / "bad.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(trivia.LISTS_PREFIX + "broken.yaml", "Question?:\n  nested: mapping\n")
    with pytest.raises(trivia.TriviaError, match=r"broken\.yaml: question 'Question\?'"):
        trivia.read_trivia_lists(path)


def test_wordnet_data_file_parsing(tmp_path):
    path = tmp_path / "data.noun"
    path.write_text(
        "  1 This software and database is being provided to you, the LICENSEE, by\n"
        "  2 Princeton University under the following license.\n"
        "00001740 03 n 01 entity 0 003 ~ 00001930 n 0000 | that which is perceived to have its own distinct existence\n"
        "02084071 05 n 02 dog 0 domestic_dog 0 001 @ 02083346 n 0000 | a member of the genus Canis; "
        "\"the dog barked all night\"\n")
    assert wordnet.parse_data_file(path, "noun") == [
        ("noun:00001740", "entity: that which is perceived to have its own distinct existence"),
        ("noun:02084071", "dog: a member of the genus Canis"),
    ]
    path.write_text("00001740 03 n 01 entity 0 000 no gloss separator\n")
    with pytest.raises(wordnet.WordNetError, match=r"data\.noun:1: synset line without"):
        wordnet.parse_data_file(path, "noun")


def test_exact_match_normalisation():
    assert normalize_answer("The  Rolling Stones!") == "rolling stones"
    assert is_exact_match("the rolling stones.\nThey played first.", ["The Rolling Stones"])
    assert is_exact_match("1945", ["1945", "nineteen forty-five"])
    assert not is_exact_match("It ended in 1945.", ["1945"])
    assert not is_exact_match("", ["a"])  # "a" normalises to "", an empty reply never matches


def test_packed_loss_equals_the_mean_over_separate_forwards(tiny_model_dir):
    """Packing several samples into one row (block-diagonal attention) gives the same token-mean
    loss as forwarding each sample alone."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    samples = text_samples(tokenizer, ["hello world", "the capital of France is Paris.", "seven ate nine because"])
    loss, count = packed_loss(model, samples, max_tokens=512)
    total, n = 0.0, 0
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s["input_ids"]])
            logits = model(input_ids=ids).logits[0, :-1]
            total += float(F.cross_entropy(logits, ids[0, 1:], reduction="sum"))
            n += ids.shape[1] - 1
    assert count == n
    assert loss == pytest.approx(total / n, rel=1e-5)


@pytest.mark.slow
@pytest.mark.demo
def test_continual_quick_runs_every_method_on_the_real_tasks(tmp_path, demo_assets):
    out, png = tmp_path / "c.json", tmp_path / "c.png"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "continual.py"), "--quick", "--out", str(out), "--plot", str(png),
         "--demo-dir", str(demo_assets.model_dir.parent), "--data-dir", str(tmp_path / "data")],
        cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    names = [m["name"] for m in result["methods"]]
    assert names == ["osft_urr0.1", "osft_urr0.25", "osft_urr0.5", "full_ft", "lora_r4", "peft_osf_urr0.25"]
    stats = result["data"]["trivia_stats"]
    assert stats["source"] == "red-discordbot==3.5.24" and stats["lists"] >= 50 and stats["dropped_url"] > 0
    assert stats["train"] + stats["eval"] == stats["questions"] - stats["dropped_url"] - stats["dropped_duplicate"]
    train_rows = (tmp_path / "data" / "trivia" / "train.jsonl").read_text().splitlines()
    eval_questions = {json.loads(r)["question"] for r in (tmp_path / "data" / "trivia" / "eval_answers.jsonl")
                      .read_text().splitlines()}
    train_questions = {json.loads(r)["messages"][0]["content"] for r in train_rows}
    assert len(train_rows) == stats["train"] and not train_questions & eval_questions
    assert not any("http://" in q or "https://" in q for q in train_questions | eval_questions)
    for m in result["methods"]:
        for when, losses in (("after_a", ("loss_a", "loss_b")), ("after_b", ("loss_a", "loss_b", "loss_c"))):
            e = m[when]
            assert all(0 < e[k] < 20 for k in losses), (m["name"], when, e)
            assert 0 <= e["exact_match_b"] <= 1
        assert m["after_a"]["loss_c"] is None  # C is measured on the base model and after the last task
        for task, steps in (("A", 2), ("B", 2)):
            recorded = m["phases"][task]["steps"]
            assert [r["step"] for r in recorded] == list(range(1, steps + 1)), (m["name"], task)
            assert all(r["num_tokens"] > 0 for r in recorded)
    # the same batches reach every method: its first step of A sees the same number of tokens
    first_tokens = {m["phases"]["A"]["steps"][0]["num_tokens"] for m in result["methods"]}
    assert len(first_tokens) == 1
    full = next(r for r in result["summary"] if r["name"] == "full_ft")
    for row, m in zip(result["summary"], result["methods"]):
        assert row["forgetting_a"] == pytest.approx(m["after_b"]["loss_a"] - m["after_a"]["loss_a"])
        assert row["learning_b"] == pytest.approx(m["after_a"]["loss_b"] - m["after_b"]["loss_b"])
        for key, ratio in (("forgetting_a", "forgetting_vs_full"), ("learning_b", "learning_vs_full")):
            expected = row[key] / full[key] if full[key] > 0 else None
            assert row[ratio] == (pytest.approx(expected) if expected is not None else None), (row["name"], ratio)
