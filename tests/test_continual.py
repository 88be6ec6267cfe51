"""The retention benchmark (benchmarks/continual.py): its data builders, its measurements, its
statistics and, with ``--quick``, the whole pipeline on the real task data with a tiny random model."""

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

import numpy as np  # noqa: E402
from continual_learning import foldoc, trivia, wordnet  # noqa: E402
from continual_learning.evaluate import (  # noqa: E402
    choice_samples, marked_answer_matches, normalize_answer, sample_nll, text_samples)
from continual_learning.stats import Bootstrap, interval, summarize  # noqa: E402

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


@pytest.fixture(scope="module")
def task_data(tmp_path_factory) -> Path:
    """One data directory for the benchmark runs of this file: each task's files are built at run
    time by the first run that needs them (downloads and parsing) and reused by the others, as a
    user's ``--data-dir`` is."""
    return tmp_path_factory.mktemp("task-data")


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
        {"role": "user", "content": "Quiz: Is the Earth round?"}, {"role": "assistant", "content": "Answer: [[Yes]]"}]}


def test_trivia_list_that_is_not_a_mapping_is_named(tmp_path):
    path = tmp_path / "bad.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(trivia.LISTS_PREFIX + "broken.yaml", "Question?:\n  nested: mapping\n")
    with pytest.raises(trivia.TriviaError, match=r"broken\.yaml: question 'Question\?'"):
        trivia.read_trivia_lists(path)


def test_answer_format_compliance_and_marked_answer():
    assert trivia.is_compliant(" Answer: [[Paris]]\nmore")
    assert not trivia.is_compliant("Paris") and not trivia.is_compliant("Answer: [[]]")
    assert not trivia.is_compliant("The answer: [[Paris]]") and not trivia.is_compliant("Answer: [[Pa\nris]]")
    assert normalize_answer("The  Rolling Stones!") == "rolling stones"
    assert marked_answer_matches("Answer: [[the Rolling Stones.]] yes", ["The Rolling Stones"])
    assert not marked_answer_matches("The Rolling Stones", ["The Rolling Stones"])  # unmarked
    assert not marked_answer_matches("Answer: [[a]]", ["a"])  # normalises to "", never a match


def _dictd(tmp_path, entries: list[tuple[list[str], str]]) -> tuple:
    """A dictd database (index + gzip-compressed dict) of ``(headwords, body)`` entries."""
    import gzip

    def b64(n: int) -> str:
        digits = ""
        while True:
            n, r = divmod(n, 64)
            digits = foldoc.B64[r] + digits
            if n == 0:
                return digits

    data, index = b"00-database-short\n     FOLDOC\n\n", []
    index.append(f"00-database-short\t{b64(0)}\t{b64(len(data))}")
    for heads, body in entries:
        text = ("\n".join(heads) + "\n\n" + body + "\n\n").encode()
        for h in heads:
            index.append(f"{h.lower()}\t{b64(len(data))}\t{b64(len(text))}")
        data += text
    (tmp_path / "foldoc.index").write_text("\n".join(index) + "\n")
    with gzip.open(tmp_path / "foldoc.dict.dz", "wb") as fh:
        fh.write(data)
    return tmp_path / "foldoc.index", tmp_path / "foldoc.dict.dz"


def test_foldoc_dictd_parsing(tmp_path):
    assert foldoc.decode_b64("B") == 1 and foldoc.decode_b64("BA") == 64 and foldoc.decode_b64("/") == 63
    index, dict_path = _dictd(tmp_path, [
        (["Abstract Syntax Tree", "AST"], "   <compiler> (AST) A data structure representing something which\n"
         "   has been {parsed}, used by a {compiler}.  Second sentence here.\n\n   (1994-11-08)"),
        (["ASDL"], "   <language> See {Abstract-Type and Scheme-Definition Language}."),
        (["AFUU"], "   <body> French {Unix} users, see {(http://afuu.fr/)} for details today."),
        (["tiny"], "   <jargon> Very small."),
        (["Ünïcode térm"], "   <character> A term whose name is not ASCII but whose text is fine."),
    ])
    entries, stats = foldoc.read_foldoc(index, dict_path)
    assert entries == [
        foldoc.Entry("Abstract Syntax Tree", "(AST) A data structure representing something which has been parsed, "
                                             "used by a compiler."),
        foldoc.Entry("Ünïcode térm", "A term whose name is not ASCII but whose text is fine.")]
    assert stats == {"index_lines": 7, "entries": 5, "skipped_redirect": 1, "skipped_url": 1, "skipped_short": 1}
    assert foldoc.chat_row(entries[0])["messages"][0] == {"role": "user",
                                                          "content": "What is Abstract Syntax Tree in computing?"}
    index.write_text(index.read_text() + "broken line without tabs\n")
    with pytest.raises(foldoc.FoldocError, match=r"foldoc\.index:8: expected"):
        foldoc.read_foldoc(index, dict_path)


def test_wordnet_parsing_and_multiple_choice(tmp_path):
    path = tmp_path / "data.noun"
    path.write_text(
        "  1 This software and database is being provided to you, the LICENSEE, by\n"
        "00001740 03 n 01 entity 0 003 ~ 00001930 n 0000 | that which is perceived to have its own distinct existence\n"
        "02084071 05 n 02 domestic_dog 0 dog 0 001 @ 02083346 n 0000 | a member of the genus Canis; "
        "\"the dog barked all night\"\n")
    assert wordnet.parse_data_file(path, "noun") == [
        ("noun:00001740", "entity", "that which is perceived to have its own distinct existence"),
        ("noun:02084071", "domestic dog", "a member of the genus Canis"),
    ]
    path.write_text("00001740 03 n 01 entity 0 000 no gloss separator\n")
    with pytest.raises(wordnet.WordNetError, match=r"data\.noun:1: synset line without"):
        wordnet.parse_data_file(path, "noun")
    for pos, name in wordnet.POS_FILES.items():  # 40 synsets per part of speech, one definition each
        (tmp_path / name).write_text("".join(f"{i:08d} 03 {pos[0]} 01 {pos}_word{i} 0 000 | {pos} meaning {i}\n"
                                             for i in range(40)))
    texts, items = wordnet.probes(tmp_path, 5, 6)
    assert len(texts) == 5 and len(items) == 6
    used = [o for item in items for o in item.options]
    assert len(set(used)) == len(used)  # no option repeated across items
    for item in items:
        pos, i = item.word.split(" word")
        assert item.options[item.answer] == f"{pos} meaning {i}"  # the right definition at the answer index
        assert all(o.startswith(pos + " meaning") for o in item.options)  # distractors of the same part of speech
        assert f"{item.word}: {item.options[item.answer]}" not in texts  # R2 and R3 items are disjoint
    assert [i.answer for i in items] != [items[0].answer] * 6  # the right option moves around


def test_sample_nll_equals_separate_forwards(tiny_model_dir):
    """Packing several samples into one row gives each sample the NLL it has when forwarded alone;
    a multiple-choice option scores only its definition tokens."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    samples = text_samples(tokenizer, ["hello world", "the capital of France is Paris.", "seven ate nine because"])
    samples += choice_samples(tokenizer, "dog", ("a member of the genus Canis", "a tree"))
    nll, tokens = sample_nll(model, samples, max_tokens=512)
    with torch.no_grad():
        for k, s in enumerate(samples):
            ids = torch.tensor([s["input_ids"]])
            labels = torch.tensor(s["labels"][1:])
            logits = model(input_ids=ids).logits[0, :-1]
            want = F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
            assert tokens[k] == int((labels != -100).sum())
            assert nll[k] == pytest.approx(float(want), rel=1e-4)
    context = len(tokenizer("dog:")["input_ids"])
    assert tokens[3] == len(samples[3]["input_ids"]) - context


def test_paired_bootstrap_pools_items_and_seeds():
    rng = np.random.default_rng(1)
    values, tokens = rng.random((2, 30)), rng.integers(1, 9, (2, 30)).astype(float)
    boot = Bootstrap(2, {"x": 30}, reps=500)
    est = boot.mean("x", values, tokens)
    assert est.shape == (501,) and est[0] == pytest.approx(values.sum() / tokens.sum())
    iv = interval(est)
    assert iv["low"] <= iv["value"] <= iv["high"] and iv["low"] < iv["high"]
    assert interval(np.array([np.nan, 1.0]))["value"] is None
    # two arms with identical per-item results: paired differences are exactly 0, ratios exactly 1
    seeds = ["0", "1"]
    one = {"a_comply": [1, 0, 1, 1], "a_nll": {"nll": [1.0, 2, 3, 4], "tokens": [1, 2, 2, 2]}}
    after = {"a_comply": [0, 0, 1, 0], "a_nll": {"nll": [2.0, 2, 3, 5], "tokens": [1, 2, 2, 2]},
             "b_nll": {"nll": [1.0, 1], "tokens": [2, 2]}, "r1_nll": {"nll": [1.0], "tokens": [1]},
             "r2_correct": [1, 0], "r3_nll": {"nll": [3.0], "tokens": [2]}}
    base = dict(after, b_nll={"nll": [3.0, 2], "tokens": [2, 2]}, r1_nll={"nll": [0.5], "tokens": [1]})
    evals = {"base": base, **{s: {"A:x": one, "B:full_ft": after, "B:osft_same": after} for s in seeds}}
    arms = [{"name": "full_ft", "a_run": "x"}, {"name": "osft_same", "a_run": "x"}]
    rows = summarize(evals, seeds, arms, {"a": 4, "b": 2, "r1": 1, "r2": 2, "r3": 1}, reps=200)
    m = rows[1]["measures"]
    assert m["forgetting_a"]["value"] == pytest.approx(50.0)  # 75 % -> 25 %
    assert m["forgetting_a_nll"]["value"] == pytest.approx(12 / 7 - 10 / 7)
    assert m["learning_b"]["value"] == pytest.approx(5 / 4 - 2 / 4)
    assert m["drift_r1"]["value"] == pytest.approx(0.5)
    assert rows[1]["minus_same"]["forgetting_a"] == {"value": 0.0, "low": 0.0, "high": 0.0}
    assert rows[1]["ratio_to_full"]["learning_b"]["low"] == pytest.approx(1.0)


@pytest.mark.bench
@pytest.mark.slow
@pytest.mark.demo
def test_continual_quick_runs_every_arm_and_seed(tmp_path, demo_assets, task_data):
    out, png, md = tmp_path / "c.json", tmp_path / "c.png", tmp_path / "c.md"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "continual.py"), "--quick", "--out", str(out), "--plot", str(png),
         "--markdown", str(md), "--demo-dir", str(demo_assets.model_dir.parent), "--data-dir", str(task_data)],
        cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = out.read_text()
    result = json.loads(text)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    names = [a["name"] for a in result["arms"]]
    assert names == ["full_ft", "osft_same", "osft_015", "osft_protect", "osft_inputs", "peft_osf"]
    assert md.read_text().count("\n| ") == len(names)  # header + one row per arm
    stats = result["data"]["trivia_stats"]
    assert stats["source"] == "red-discordbot==3.5.24" and stats["lists"] >= 50 and stats["dropped_url"] > 0
    assert stats["train"] + stats["eval"] == stats["questions"] - stats["dropped_url"] - stats["dropped_duplicate"]
    fol = result["data"]["foldoc_stats"]
    assert fol["train"] > 5000 and fol["eval"] > 500 and fol["entries"] > 10000
    eval_questions = [json.loads(r)["question"] for r in (task_data / "trivia_quiz" / "eval_answers.jsonl")
                      .read_text().splitlines()]
    train_questions = {json.loads(r)["messages"][0]["content"] for r in (task_data / "trivia_quiz" /
                                                                         "train.jsonl").read_text().splitlines()}
    assert not {trivia.CUE + q for q in eval_questions} & train_questions
    assert not any(q in text for q in eval_questions if len(q) > 20)  # per-item results by index only
    sizes, seeds = result["sizes"], result["seeds"]
    assert seeds == ["0", "1"] and {k: sizes[k] for k in ("a", "b", "r2", "r3")} == {"a": 8, "b": 8, "r2": 8, "r3": 8}
    assert 0 < sizes["r1"] <= result["data"]["r1_rows"]  # rows with no reply token left after truncation drop out
    item_set = {"a_comply": "a", "a_exact": "a", "a_nll": "a", "b_nll": "b", "r1_nll": "r1", "r2_correct": "r2",
                "r3_nll": "r3"}
    for seed in seeds:
        assert set(result["evals"][seed]) == {f"A:{r}" for r in result["task_a_runs"]} | {f"B:{n}" for n in names}
        for key, e in [("base", result["evals"]["base"]), *result["evals"][seed].items()]:
            for name, items in e.items():
                if name in item_set:
                    got = len(items["nll"]) if isinstance(items, dict) else len(items)
                    assert got == sizes[item_set[name]], (seed, key, name)
        for key, phase in result["phases"][seed].items():
            assert [r["step"] for r in phase["steps"]] == [1, 2] and all(r["num_tokens"] > 0 for r in phase["steps"])
        first = {p["steps"][0]["num_tokens"] for k, p in result["phases"][seed].items() if k.startswith("A:")}
        assert len(first) == 1  # every task-A run sees the same batches

    def pooled(key, name):
        rows = [result["evals"]["base"] if key == "base" else result["evals"][s][key] for s in seeds]
        if isinstance(rows[0][name], dict):
            return sum(sum(r[name]["nll"]) for r in rows) / sum(sum(r[name]["tokens"]) for r in rows)
        return sum(sum(r[name]) for r in rows) / sum(len(r[name]) for r in rows)

    arms = {a["name"]: a for a in result["arms"]}
    for row in result["summary"]:
        m, a, b = row["measures"], f"A:{arms[row['name']]['a_run']}", f"B:{row['name']}"
        assert m["forgetting_a"]["value"] == pytest.approx(100 * (pooled(a, "a_comply") - pooled(b, "a_comply")))
        assert m["learning_b"]["value"] == pytest.approx(pooled("base", "b_nll") - pooled(b, "b_nll"))
        assert m["drift_r1"]["value"] == pytest.approx(pooled(b, "r1_nll") - pooled("base", "r1_nll"))
        assert m["r2_change"]["value"] == pytest.approx(100 * (pooled(b, "r2_correct") - pooled("base", "r2_correct")))
        for iv in m.values():
            assert iv["low"] <= iv["value"] + 1e-9 and iv["value"] <= iv["high"] + 1e-9, (row["name"], iv)
        learn = row["ratio_to_full"]["learning_b"]
        full_learning = result["summary"][0]["measures"]["learning_b"]["value"]
        assert learn["value"] == pytest.approx(m["learning_b"]["value"] / full_learning)
        assert row["minus_same"]["learning_b"]["value"] == pytest.approx(
            m["learning_b"]["value"] - result["summary"][1]["measures"]["learning_b"]["value"])
    protected = {g["name"]: g for g in result["goals"]}
    assert set(protected) == {"osft_015", "osft_protect", "osft_inputs", "peft_osf"}
    assert all(len(g["checks"]) == 7 for g in protected.values())
    assert result["timing"]["task_a_s"] > 0 and result["timing"]["eval_s"] > 0

    # --merge: the same run as two one-seed runs (side by side, one per core) gives the same result
    from continual import merge

    halves = []
    for seed in seeds:
        half = dict(result, seeds=[seed], evals={"base": result["evals"]["base"], seed: result["evals"][seed]},
                    phases={seed: result["phases"][seed]}, settings=dict(result["settings"], seeds=[int(seed)]))
        halves.append(tmp_path / f"seed{seed}.json")
        halves[-1].write_text(json.dumps(half))
    merged = merge(halves)
    assert merged["seeds"] == seeds and merged["summary"] == result["summary"] and merged["goals"] == result["goals"]
    other = json.loads(halves[1].read_text())
    other["settings"]["steps_b"] += 1
    halves[1].write_text(json.dumps(other))
    with pytest.raises(ValueError, match="settings differ"):
        merge(halves)
    with pytest.raises(ValueError, match="share a seed"):
        merge([halves[0], halves[0]])


def test_pilot_picks_the_rate_closest_to_full_fine_tuning():
    from continual import _choose_rates

    pilot = {"full_ft": {"1e-05": 0.50}, "osft_same": {"5e-05": 0.20, "0.0001": 0.45, "0.0002": 0.70},
             "peft_osf": {"5e-05": 0.56, "0.0001": 0.90}}
    assert _choose_rates(pilot) == {"full_ft": 1e-5, "osft_same": 1e-4, "peft_osf": 5e-5}
    assert _choose_rates({"osft_same": {"1e-4": 0.3}}) == {}  # no full FT reference: nothing to match


def test_sequence_pilot_matches_learning_and_widens_the_grid_at_its_edge():
    """Full FT takes the lowest rate within 5 % of its best gain; another arm the rate closest to
    that gain (the lower on a tie); a choice at an edge that is not matched tries one rate past it."""
    from continual_learning import pilot

    assert pilot.first_grid(1e-4) == [7.07e-5, 1e-4, 1.41e-4]
    reference = {7.07e-5: 0.50, 1e-4: 0.98, 1.41e-4: 1.00}
    assert pilot.choose(reference, None) == 1e-4 and pilot.next_rate(reference, None) is None
    rising = {7.07e-5: 0.50, 1e-4: 0.80, 1.41e-4: 1.00}
    assert pilot.choose(rising, None) == 1.41e-4 and pilot.next_rate(rising, None) == 1.99e-4
    flat = {7.07e-5: 0.99, 1e-4: 1.00, 1.41e-4: 1.00}
    assert pilot.choose(flat, None) == 7.07e-5 and pilot.next_rate(flat, None) == 5e-5
    arm = {5e-5: 0.40, 7.07e-5: 0.70, 1e-4: 1.30}
    assert pilot.choose(arm, 1.0) == 7.07e-5  # |0.70 - 1| = 0.30 < |1.30 - 1|
    assert pilot.choose({1e-4: 0.75, 2e-4: 1.25}, 1.0) == 1e-4  # a tie: the lower rate
    assert not pilot.matched(0.70, 1.0) and pilot.matched(0.96, 1.0) and pilot.matched(1.04, 1.0)
    assert pilot.next_rate(arm, 1.0) is None  # not at an edge
    assert pilot.next_rate({5e-5: 0.2, 7.07e-5: 0.5, 1e-4: 0.8}, 1.0) == 1.41e-4  # short of full FT at the top
    assert pilot.next_rate({5e-5: 1.3, 7.07e-5: 1.6, 1e-4: 1.9}, 1.0) == 3.54e-5  # past it at the bottom
    assert pilot.next_rate({5e-5: 0.2, 7.07e-5: 0.5, 1e-4: 0.97}, 1.0) is None  # matched at the edge
    with pytest.raises(ValueError, match="no rate tried"):
        pilot.choose({}, None)


def test_sequence_run_at_a_pilots_rates(tmp_path):
    """``--rates PILOT.json``: a tuned arm takes its chosen rate, an ablation and each ``osft_general`` arm
    the default chain's, multi-task training full FT's, an arm the pilot did not tune its own."""
    import continual_sequence

    path = tmp_path / "pilot.json"
    path.write_text(json.dumps({"arms": {"full_ft": {"chosen": 3e-5}, "osft_default": {"chosen": 7.07e-5}}}))
    arms = continual_sequence.with_rates(continual_sequence.ARMS + continual_sequence.OPT_IN, path)
    rates = {a.name: a.learning_rate for a in arms}
    assert rates["full_ft"] == 3e-5 and rates["multitask"] == 3e-5 and rates["osft_default"] == 7.07e-5
    assert all(rates[a.name] == 7.07e-5 for a in continual_sequence.ABLATIONS + continual_sequence.GENERAL)
    assert rates["lora"] == 2e-4 and rates["replay"] == 5e-5  # not tuned: ARMS' rates


def test_the_self_written_stage_0_protects_the_input_directions_of_the_base_models_own_rows(tmp_path,
                                                                                          tiny_model_dir):
    """``osft_general_self``'s stage 0: the rows are prompts the base model writes itself with its
    greedy replies (the file ``make-retention-set --self-prompts`` writes, same seed and lengths),
    and the directory protects input directions of those rows, as ``osft-train protect-base`` on
    that file would."""
    import argparse

    import continual_sequence

    from osft.trainer.tools.retention_set import retention_rows

    arm = next(a for a in continual_sequence.GENERAL if a.name == "osft_general_self")
    args = argparse.Namespace(general_samples=4, general_new_tokens=6, gen_batch=4, batch=4, max_seq_len=64,
                              max_tokens=256, demo_dir=tmp_path / "no-demo-assets")
    stage0 = continual_sequence.general_basis(arm, tiny_model_dir, tmp_path, args, seed=1)
    record = stage0["record"]
    assert record["general"] == "self" and record["self_rows"] == 4 and record["samples_drawn"] == 4
    rows = [json.loads(line) for line in (tmp_path / "osft_general_self-general.jsonl").read_text().splitlines()]
    assert rows == retention_rows(tiny_model_dir, [], 6, 4, 1, self_prompts=4)
    meta = json.loads((stage0["dir"] / "osft_subspaces.json").read_text())
    assert meta["input_data"] == str(tmp_path / "osft_general_self-general.jsonl") and meta["input_seed"] == 1
    assert record["inputs_modules"] == 14 and record["p_right"]["min"] >= 1
    assert not (tmp_path / "no-demo-assets").exists()  # the demo's chit-chat file is never fetched


def test_pilot_validation_items_are_training_rows_no_stage_trains_on_and_no_test_item(tmp_path):
    """The pilot scores training-file rows after the stages' pool in hash order: never in the pool,
    never a test item; a file too short for both, or sharing a prompt with the test file, is named."""
    import argparse

    import continual_sequence
    from continual_learning.sequence_tasks import TaskSpec

    def chat(i: int) -> dict:
        return {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}

    train, test = tmp_path / "t.train.jsonl", tmp_path / "t.eval.jsonl"
    continual_sequence._write(train, [chat(i) for i in range(30)])
    continual_sequence._write(test, [chat(i) for i in range(100, 104)])
    spec = TaskSpec("t", train, test, "exact")
    args = argparse.Namespace(steps=2, batch=2, eval_items=5)
    pool = continual_sequence._by_hash(continual_sequence._read(train), 16)  # 4 x steps x batch
    files = {"t": {"train": train, "eval": continual_sequence._read(test)}}
    valid = continual_sequence.validation([spec], files, args)["t"]
    prompts = {r["messages"][0]["content"] for r in valid["eval"]}
    assert len(prompts) == 5 and not prompts & {r["messages"][0]["content"] for r in pool}
    assert valid["train"] == train
    with pytest.raises(SystemExit, match=r"t.train.jsonl: 30 rows, the pilot needs 41"):
        continual_sequence.validation([spec], files, argparse.Namespace(steps=2, batch=2, eval_items=25))
    files["t"]["eval"] = valid["eval"][:1]
    with pytest.raises(SystemExit, match="t.train.jsonl: a validation prompt is also a test item of"):
        continual_sequence.validation([spec], files, args)


def test_every_sequence_arm_sets_real_trainer_settings():
    """The arms' and ablations' ``config`` keys are ``TrainConfig`` fields (a misspelt key would
    silently run the default), and each ablation flips one default of the default chain."""
    import dataclasses

    import continual_sequence
    from osft.trainer.config import TrainConfig

    fields = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    default = next(a for a in continual_sequence.ARMS if a.name == "osft_default")
    for arm in continual_sequence.ARMS + continual_sequence.OPT_IN:
        if arm.kind != "peft_lora":
            assert set(arm.config) <= set(fields), arm.name
    for arm in continual_sequence.ABLATIONS:
        flipped = {k: v for k, v in arm.config.items() if default.config.get(k) != v}
        (key, value), = flipped.items()
        assert value != fields[key] and arm.learning_rate == default.learning_rate, arm.name


def test_parts_of_one_sequence_result_share_their_base_evaluation_up_to_summation_order():
    """Parts run with other thread counts differ in the base NLLs' last digits only: merged; a real
    difference in an NLL, a token count or an exact match is refused."""
    import continual_sequence

    base = {"trivia": {"nll": [38.98617, 42.76373], "tokens": [5, 6], "hit": [0, 1]}, "foldoc": {"nll": [3.5], "tokens": [9]}}

    def changed(task, key, value):
        return {t: {k: (value if (t, k) == (task, key) else v) for k, v in e.items()} for t, e in base.items()}

    assert continual_sequence._same_base(base, changed("trivia", "nll", [38.98609, 42.76365]))  # 2e-6 relative
    assert not continual_sequence._same_base(base, changed("trivia", "nll", [38.99617, 42.76373]))  # 2.6e-4
    assert not continual_sequence._same_base(base, changed("trivia", "hit", [1, 1]))
    assert not continual_sequence._same_base(base, changed("foldoc", "tokens", [10]))
    assert not continual_sequence._same_base(base, {"trivia": base["trivia"]})


def test_a_part_made_before_a_setting_existed_merges_as_if_run_with_its_default(tmp_path):
    """The committed parts predate ``--probes``: a new part without probes merges with them, one with
    probes does not."""
    import continual_sequence

    results = REPO / "benchmarks" / "results"
    old = results / "continual_sequence_pilot.json"
    new = json.loads((results / "continual_sequence_pilot_protection.json").read_text())
    assert "probes" not in new["settings"] and "probes" not in json.loads(old.read_text())["settings"]
    new["settings"].update(probes=False, probe_items=48, r1_max_new_tokens=32)
    (tmp_path / "new.json").write_text(json.dumps(new))
    assert continual_sequence.merge([old, tmp_path / "new.json"])["arms"] == [
        "full_ft", "osft_unprotected", "osft_update", "osft_default"]
    new["settings"]["probes"] = True
    (tmp_path / "new.json").write_text(json.dumps(new))
    with pytest.raises(SystemExit, match="new.json: its settings differ"):
        continual_sequence.merge([old, tmp_path / "new.json"])


def test_sequence_measures_of_a_hand_made_accuracy_matrix():
    from continual_learning.matrix import sequence_measures

    R = np.array([[10, 20, 30],  # the base model
                  [80, 25, 35],  # after stage 1 (task 0)
                  [85, 90, 40],  # after stage 2 (task 1): task 0 still improved
                  [50, 70, 95]], dtype=float)  # after stage 3 (task 2)
    got = sequence_measures(R)
    assert got["AA"] == pytest.approx((50 + 70 + 95) / 3) and got["LA"] == pytest.approx((80 + 90 + 95) / 3)
    assert got["BWT"] == pytest.approx(((50 - 80) + (70 - 90)) / 2)  # against the score right after learning
    assert got["F"] == pytest.approx(((85 - 50) + (90 - 70)) / 2)  # against the best before the last stage
    assert got["FWT"] == pytest.approx(((25 - 20) + (40 - 30)) / 2)
    batch = sequence_measures(np.stack([R, R + 1.0, R]))  # bootstrap replicates: one value each
    assert batch["AA"].shape == (3,) and batch["AA"][1] == pytest.approx(got["AA"] + 1) and batch["BWT"][1] == got["BWT"]
    subset = sequence_measures(R[:, [0, 2]], stages=[1, 3])  # the tasks of stages 1 and 3 only
    assert (subset["AA"], subset["LA"]) == (pytest.approx((50 + 95) / 2), pytest.approx((80 + 95) / 2))
    assert (subset["BWT"], subset["F"], subset["FWT"]) == (-30, 85 - 50, 40 - 30)
    with pytest.raises(ValueError, match=r"\[\.\.\., T \+ 1, T\]"):
        sequence_measures(R[:2])
    with pytest.raises(ValueError, match="stages in 1..T"):
        sequence_measures(R[:, :2], stages=[1, 4])


def test_sequence_tasks_spell_numbers_and_roman_numerals_in_one_convention():
    from continual_learning.sequence_tasks import roman_numeral, spell_number

    assert [spell_number(n) for n in (0, 13, 40, 42, 100, 105, 999, 1000, 4821, 9999)] == [
        "zero", "thirteen", "forty", "forty-two", "one hundred", "one hundred five", "nine hundred ninety-nine",
        "one thousand", "four thousand eight hundred twenty-one", "nine thousand nine hundred ninety-nine"]
    assert [roman_numeral(n) for n in (1, 4, 9, 14, 40, 90, 400, 1994, 2024, 3999)] == [
        "I", "IV", "IX", "XIV", "XL", "XC", "CD", "MCMXCIV", "MMXXIV", "MMMCMXCIX"]
    with pytest.raises(ValueError, match="outside"):
        spell_number(10000)
    with pytest.raises(ValueError, match="outside"):
        roman_numeral(0)


def test_task_spec_file_names_the_entry_that_is_wrong(tmp_path):
    from continual_learning.sequence_tasks import read_specs

    for name in ("a", "b"):
        for split in ("train", "eval"):
            (tmp_path / f"{name}.{split}.jsonl").write_text("{}\n")
    good = [{"name": n, "train": f"{n}.train.jsonl", "eval": f"{n}.eval.jsonl", "metric": m}
            for n, m in (("a", "exact"), ("b", "nll"))]
    spec = tmp_path / "tasks.json"
    spec.write_text(json.dumps(good))
    assert [(s.name, s.metric, s.train) for s in read_specs(spec)] == [
        ("a", "exact", tmp_path / "a.train.jsonl"), ("b", "nll", tmp_path / "b.train.jsonl")]
    for bad, message in ((good[:1], "at least 2 tasks"), ([good[0], dict(good[1], metric="bleu")], r"entry 1 \(b\): metric"),
                         ([good[0], dict(good[1], eval="missing.jsonl")], r"entry 1 \(b\): eval file"),
                         ([good[0], dict(good[0])], "names repeat"), ([good[0], {"name": "x"}], "entry 1 must have")):
        spec.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=message):
            read_specs(spec)


def test_probe_quiz_patterns_expand_and_replies_are_scored_by_rule(tmp_path):
    from continual_learning.probes import ProbeItem, arithmetic_items, expand, hit, instruction_items, read_quiz

    assert expand("Central Africa{n Rep{ublic}}") == ["Central Africa", "Central African Rep", "Central African Republic"]
    assert expand("N'Djamena|Ndjamena") == ["N'Djamena", "Ndjamena"]
    assert expand("St. [John's|Johns]") == ["St. John's", "St. Johns"]
    with pytest.raises(ValueError, match="unbalanced"):
        expand("a}b")
    quiz = tmp_path / "africa"
    quiz.write_text("Chad:N'Djamena|Ndjamena\nC[^o|o^|o]te d'Ivoire:Yamoussoukro\n\nCentral Africa{n Rep{ublic}}:Bangui\n")
    assert read_quiz(quiz) == [("Chad", ("N'Djamena", "Ndjamena")), ("Central African Republic", ("Bangui",))]
    quiz.write_text("Chad:N'Djamena\nno colon here\n")
    with pytest.raises(ValueError, match=r"africa:2: expected 'country:capital'"):
        read_quiz(quiz)

    capital = ProbeItem("What is the capital of Chad?", "contains", ("N'Djamena", "Ndjamena"))
    assert hit(capital, "The capital of Chad is ndjamena.\nIt lies on a river.")
    assert not hit(capital, "Chad's capital?\nN'Djamena")  # first line only
    assert not hit(ProbeItem("?", "contains", ("Rome",)), "Romeo")  # whole words
    total = ProbeItem("What is 79 + 67?", "result", ("146",))
    assert hit(total, "79 + 67 = 146") and hit(total, "146.") and not hit(total, "To add 79 and 67, ...")
    assert [i.answers[0] for i in arithmetic_items(4)] == [str(eval(i.prompt.split("?")[0].removeprefix("What is ")))
                                                          for i in arithmetic_items(4)]
    capitals, thrice, yes_no, repeat = instruction_items()[:4]
    assert hit(capitals, " APPLE.") and not hit(capitals, "Apple") and not hit(capitals, "APPLE is a fruit")
    assert hit(thrice, "apple, apple, apple") and not hit(thrice, "apple apple apple")
    assert hit(yes_no, "Yes.") and not hit(yes_no, "Yes. Apple is a word.")
    assert hit(repeat, "I like the colour apple.") and not hit(repeat, "I like the colour of apple.")


@pytest.mark.bench
def test_sequence_quick_runs_every_arm_through_four_tasks(tmp_path, demo_assets, task_data):
    """``continual_sequence.py --quick --probes``: every arm through the four built-in tasks (data
    built at run time), a matrix of T + 1 rows per arm whose measures are those of its point matrix,
    paired differences to full FT, the chained OSFT arms' fold records per stage, and the probes and
    recovery check, whose changes are those of their per-item outcomes."""
    from continual_learning.matrix import sequence_measures

    out = tmp_path / "seq.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "continual_sequence.py"), "--quick", "--seeds", "0",
                           "--out", str(out), "--data-dir", str(task_data), "--probes",
                           "--demo-dir", str(demo_assets.model_dir.parent)],
                          cwd=REPO / "benchmarks", capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [t["name"] for t in result["tasks"]] == ["trivia", "foldoc", "spell", "roman"]
    assert result["arms"] == ["full_ft", "osft_unprotected", "osft_update", "osft_default", "replay", "lora", "multitask"]
    for arm, kinds in result["summary"]["arms"].items():
        assert kinds["points"]["tasks"] == ["trivia", "spell", "roman"] and len(kinds["nll"]["tasks"]) == 4
        for kind, stages in (("points", [1, 3, 4]), ("nll", [1, 2, 3, 4])):
            R = np.array(kinds[kind]["R"], dtype=float)
            assert R.shape == (5, len(stages))
            if arm != "multitask":
                for name, value in sequence_measures(R, stages).items():
                    assert kinds[kind]["measures"][name]["value"] == pytest.approx(float(value), abs=1e-3), (arm, name)  # R rounded
                assert arm == "full_ft" or "minus_full_ft" in kinds[kind]
    assert len(result["summary"]["goals"]) == 9 + 3
    base, probes = result["probes_base"], result["summary"]["probes"]
    assert [len(base[k]["hit"]) for k in ("knowledge", "arithmetic", "instruction")] == [4, 4, 4] and base["r1"]["nll"]
    assert list(probes) == result["arms"]
    for arm in result["arms"]:
        evals = result["evals"]["0"][arm]
        after = evals["probes"]
        for name in ("knowledge", "arithmetic", "instruction"):
            change = 100 * (np.mean(after[name]["hit"]) - np.mean(base[name]["hit"]))
            assert probes[arm][name]["value"] == pytest.approx(change), (arm, name)
        drift = sum(after["r1"]["nll"]) / sum(after["r1"]["tokens"]) - sum(base["r1"]["nll"]) / sum(base["r1"]["tokens"])
        assert probes[arm]["r1"]["value"] == pytest.approx(drift, rel=1e-6), arm
        if arm == "multitask":
            assert "recovery" not in evals and "recovery_gain" not in probes[arm]
            continue
        recovered, last, learned = (100 * np.mean(e["trivia"]["hit"]) for e in (evals["recovery"], evals["4"], evals["1"]))
        assert probes[arm]["recovery_gain"]["value"] == pytest.approx(recovered - last)
        assert probes[arm]["recovery_gap"]["value"] == pytest.approx(learned - recovered)
    stages = result["stages"]["0"]
    assert [s["task"] for s in stages["osft_default"]] == ["trivia", "foldoc", "spell", "roman"]
    folds = [s["fold"] for s in stages["osft_default"]]
    assert all(f["inputs_modules"] == f["modules"] == 14 for f in folds)
    assert all(s["fold"]["inputs_modules"] == 0 for s in stages["osft_update"])
    assert folds[-1]["median_next_k_low_share"] < folds[0]["median_next_k_low_share"] <= 1

    # the same result run in two parts (some arms each) and merged has the same summary
    import continual_sequence

    parts = []
    for i, arms in enumerate((result["arms"][:3], result["arms"][3:])):
        part = dict(result, arms=arms, evals={"base": result["evals"]["base"], "0": {a: result["evals"]["0"][a] for a in arms}},
                    stages={"0": {a: stages[a] for a in arms}}, arm_settings={a: result["arm_settings"][a] for a in arms},
                    settings=dict(result["settings"], arms=arms, out=f"part{i}.json"))
        parts.append(tmp_path / f"part{i}.json")
        parts[-1].write_text(json.dumps(part))
    merged = continual_sequence.merge(parts)
    assert merged["arms"] == result["arms"] and json.dumps(merged["summary"]) == json.dumps(result["summary"])  # NaN too
    table = continual_sequence.markdown(merged).splitlines()
    first = table.index("| arm | lr | AA | LA | BWT | F | AA − full FT | BWT − full FT |") + 2
    assert [row.split(" | ")[0][2:].split(" ")[0] for row in table[first:first + 8]] == result["arms"] + [""]
    assert sum(row.startswith("| osft_default BWT") for row in table) == 3 and "| osft_default | 0 | 4 (roman) | 14 of 14 |" in "\n".join(table)
    # an ablation part (here the default chain's own evaluations under an ablation's name) merges in with
    # its paired difference to the default chain: zero
    ablation = dict(result, arms=["ablate_residual_energy"],
                    evals={"base": result["evals"]["base"], "0": {"ablate_residual_energy": result["evals"]["0"]["osft_default"]}},
                    stages={"0": {"ablate_residual_energy": stages["osft_default"]}},
                    arm_settings={"ablate_residual_energy": result["arm_settings"]["osft_default"]},
                    settings=dict(result["settings"], arms=["ablate_residual_energy"], out="ablation.json"))
    (tmp_path / "ablation.json").write_text(json.dumps(ablation))
    with_ablation = continual_sequence.merge([*parts, tmp_path / "ablation.json"])
    assert with_ablation["arms"] == result["arms"] + ["ablate_residual_energy"]
    diff = with_ablation["summary"]["arms"]["ablate_residual_energy"]["points"]["minus_osft_default"]
    assert all(diff[k]["value"] == 0 for k in ("AA", "LA", "BWT")), diff
    assert "minus_osft_default" not in with_ablation["summary"]["arms"]["lora"]["points"]
    shown = continual_sequence.markdown(with_ablation)
    assert "| ablate_residual_energy | +0.0 [+0.0, +0.0] | +0.0 [+0.0, +0.0] | +0.0 [+0.0, +0.0] |" in shown.splitlines()
    assert "| ablate_residual_energy | 0 | 4 (roman) | 14 of 14 |" in shown  # its fold records beside the default's
    with pytest.raises(SystemExit, match="arm full_ft, seed 0 is in an earlier part too"):
        continual_sequence.merge([parts[0], parts[0]])
    bad = json.loads(parts[1].read_text())
    bad["settings"]["steps"] = 2
    parts[1].write_text(json.dumps(bad))
    with pytest.raises(SystemExit, match="part1.json: its settings differ"):
        continual_sequence.merge(parts)


@pytest.mark.bench
def test_sequence_pilot_quick_tries_each_arms_rates_and_matches_full_ft(tmp_path, task_data):
    """``continual_sequence.py --quick --pilot``: each arm tries its grid (and at most the extensions)
    on the first two tasks' validation items; each rate's gain and BWT are those of its evaluations;
    the choice follows the pilot's rules; the frontier PNG is written; ``--markdown`` shows the table."""
    from continual_learning import pilot

    out = tmp_path / "pilot.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "continual_sequence.py"), "--quick", "--seeds", "0",
           "--data-dir", str(task_data)]
    proc = subprocess.run([*cmd, "--pilot", "--arms", "full_ft", "osft_default", "--out", str(out)], cwd=REPO / "benchmarks",
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert list(result["arms"]) == ["full_ft", "osft_default"] and [t["name"] for t in result["tasks"]] == ["trivia", "foldoc"]
    reference = result["arms"]["full_ft"]["gain"]

    def scores(evals: dict) -> list[float]:
        return [-sum(evals[n]["nll"]) / sum(evals[n]["tokens"]) for n in ("trivia", "foldoc")]

    for arm, row in result["arms"].items():
        rates = [t["learning_rate"] for t in row["tried"]]
        assert set(pilot.first_grid(row["start"])) <= set(rates) and len(rates) <= 3 + pilot.MAX_EXTENSIONS
        for t in row["tried"]:
            r0, r1, r2 = (scores(e) for e in (result["base"], t["evals"]["1"], t["evals"]["2"]))
            assert t["gain"] == pytest.approx((r1[0] - r0[0] + r2[1] - r0[1]) / 2, abs=1e-9), (arm, t["learning_rate"])
            assert t["BWT"] == pytest.approx(r2[0] - r1[0], abs=1e-9)
            assert len(t["evals"]["2"]["trivia"]["nll"]) == result["validation_items"] == 4
        gains = {t["learning_rate"]: t["gain"] for t in row["tried"]}
        target = None if arm == "full_ft" else reference
        assert row["chosen"] == pilot.choose(gains, target) and row["gain"] == gains[row["chosen"]]
        assert pilot.next_rate(gains, target) is None or len(rates) == 3 + pilot.MAX_EXTENSIONS
        assert row["matched"] == pilot.matched(row["gain"], reference)
    assert out.with_suffix(".png").stat().st_size > 10_000
    shown = subprocess.run([*cmd, "--markdown", str(out)], cwd=REPO / "benchmarks", capture_output=True, text=True,
                           timeout=120)
    assert shown.returncode == 0 and "| osft_default |" in shown.stdout and f"**{row['chosen']:.3g}:" in shown.stdout
