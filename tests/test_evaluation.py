"""Evaluation during training (docs/evaluation.md): evaluation and retention sets, forgetting, the forgetting
budget, best export, early stopping, divergence (stop, rollback), ``control/evaluate``, and that
none of it changes the training trajectory. Tiny random Llama, in-process one-rank runs, and one
two-rank worker group compared with a one-rank run."""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import QA, chat, write_jsonl

from osft.trainer.launch.cli import main
from osft.trainer.data.collate import collate_packed
from osft.trainer.data.tokenize import IGNORE_INDEX, tokenize_chat_file
from osft.trainer.data.validate import DataValidationError
from osft.trainer.run.divergence import DivergenceCheck, DivergenceState, data_position
from osft.trainer.data.mixture import TrainingData
from osft.trainer.run.eval_sets import retention_names, spread_indices, split_training_data, tokenize_files
from osft.trainer.run.evaluation import EvalResult
from osft.trainer.run.forgetting import EvalRules, EvalState

STEPS = 6
#: Evaluations of the evaluated runs: step 0, the control/evaluate request served after step 1,
#: every 2 steps, and the last step.
EVAL_STEPS = [0, 1, 2, 4, 6]


# -- units -------------------------------------------------------------------------------------------
def test_spread_indices_and_split_are_deterministic_and_disjoint(tiny_model_dir, tmp_path):
    assert spread_indices(10, 4).tolist() == [0, 2, 5, 7]
    assert spread_indices(3, 5).tolist() == [0, 1, 2]
    from osft.trainer.model.loading import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir)
    data = tokenize_chat_file(write_jsonl(tmp_path / "d.jsonl", [chat(q, a) for q, a in QA] * 2), tokenizer, 64)
    train, held = split_training_data(TrainingData.build([data], None), 0.3)
    assert held.indices.tolist() == [0, 3, 6]  # round(0.3 * 10) = 3 samples: floor(i * 10 / 3)
    lines = {int(data[i]["line"]) for i in held.indices}
    assert lines == {1, 4, 7}
    assert sorted(int(train[i]["line"]) for i in range(len(train))) == [2, 3, 5, 6, 8, 9, 10]
    assert held.limited(2).indices.tolist() == [0, 3]  # samples floor(i * 3 / 2) = 0, 1 of the set
    with pytest.raises(ValueError, match="nothing is left to train on"):
        split_training_data(TrainingData.build([data], None), 0.99)
    other = tokenize_chat_file(write_jsonl(tmp_path / "e.jsonl", [chat(q, a) for q, a in QA]), tokenizer, 64)
    with pytest.raises(ValueError, match="give the evaluation set with --eval-data-path"):
        split_training_data(TrainingData.build([data, other], [0.5, 0.5]), 0.3)
    assert retention_names(["a/x.jsonl", "b/x.jsonl", "eval.jsonl"]) == ["x", "x-2", "eval-2"]


def test_problems_of_every_evaluation_file_are_reported_together(tiny_model_dir, tmp_path):
    from osft.trainer.model.loading import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    bad1 = tmp_path / "bad1.jsonl"
    bad1.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    bad2 = tmp_path / "bad2.jsonl"
    bad2.write_text("not json\n")
    with pytest.raises(DataValidationError) as err:
        tokenize_files([str(bad1), str(bad2)], lambda p: tokenize_chat_file(p, tok, 64))
    assert {(Path(p.path).name, p.line) for p in err.value.problems} == {("bad1.jsonl", 1), ("bad2.jsonl", 1)}


def result(name, kind, loss):
    return EvalResult(name, kind, loss, 10, 2, 20, 0.1)


def test_rules_forgetting_budget_best_and_patience():
    rules, state = EvalRules(max_forgetting=0.5, patience=2, threshold=0.1), EvalState()
    v0 = rules.judge(state, 0, [result("eval", "eval", 3.0), result("r", "retention", 2.0)])
    assert (v0.forgetting, v0.new_best, v0.over_budget) == ({"r": 0.0}, False, False)  # step 0: baselines only
    v1 = rules.judge(state, 2, [result("eval", "eval", 2.5), result("r", "retention", 2.25)])
    assert v1.forgetting == {"r": 0.25} and v1.new_best and (state.best_loss, state.best_step) == (2.5, 2)
    v2 = rules.judge(state, 4, [result("eval", "eval", 2.45), result("r", "retention", 2.4)])
    assert v2.new_best and state.since_improvement == 1 and not v2.early_stop  # better, but by < threshold
    v3 = rules.judge(state, 6, [result("eval", "eval", 2.0), result("r", "retention", 2.6)])
    assert v3.over_budget and not v3.new_best and state.best_step == 4  # lower loss, but over budget
    assert state.since_improvement == 0
    rules.judge(state, 8, [result("eval", "eval", 2.1), result("r", "retention", 2.1)])
    assert rules.judge(state, 10, [result("eval", "eval", 2.1), result("r", "retention", 2.1)]).early_stop
    assert EvalState.from_dict(json.loads(json.dumps(state.to_dict()))) == state


def test_divergence_check_and_skipped_positions():
    check, state = DivergenceCheck(spike_factor=3.0), DivergenceState([], [])
    assert "non-finite loss" in check.reason(state, math.nan, 1.0)
    assert "non-finite gradient norm" in check.reason(state, 2.0, math.inf)
    for loss in (2.0, 2.2, 1.8, 2.1, 1.9):
        assert check.reason(state, 7.0, 1.0) is None  # fewer than SPIKE_MIN_STEPS good steps: no spike check
        check.accept(state, loss)
    assert check.reason(state, 5.9, 1.0) is None
    assert "loss spike 7 > 3 x the median 2" in check.reason(state, 7.0, 1.0)
    assert DivergenceCheck(None).reason(state, 1e9, 1.0) is None
    assert [data_position(s, [1, 4]) for s in range(1, 6)] == [0, 2, 3, 5, 6]


# -- end to end, one rank in this process -------------------------------------------------------------
@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_model_dir):
    """Training data (24 rows: 6 steps of 4), an evaluation file, a retention file, and a retention
    set of the base model's own greedy replies (``make-retention-set``)."""
    from osft.trainer.tools.retention_set import make_retention_set

    root = tmp_path_factory.mktemp("evaluation")
    train = write_jsonl(root / "train.jsonl", [chat(q, a) for q, a in QA[:4]] * 6)
    evaluation = write_jsonl(root / "eval.jsonl", [chat(q, a) for q, a in QA[2:]] * 2)
    other = write_jsonl(root / "other.jsonl", [chat("hello", "hello world thanks"), chat("Say something short.", "ok")])
    own = root / "own.jsonl"
    made = make_retention_set(tiny_model_dir, own, [q for q, _ in QA], max_new_tokens=12)
    assert made.rows >= 3
    return {"train": train, "eval": evaluation, "other": other, "own": own, "model": tiny_model_dir}


def train(files, out, *flags, control: str | None = None) -> int:
    if control:
        (out / "control").mkdir(parents=True, exist_ok=True)
        (out / "control" / control).touch()
    return main(["--model-name-or-path", str(files["model"]), "--data-path", str(files["train"]),
                 "--output-dir", str(out), "--batch-size", "4", "--max-tokens-per-gpu", "96", "--max-seq-len", "64",
                 "--learning-rate", "5e-3", "--osft-unfreeze-rank-ratio", "0.5", "--max-steps", str(STEPS), *flags])


def records(out, event=None):
    rows = [json.loads(line) for line in (out / "metrics" / "node0.jsonl").read_text().splitlines()]
    return [r for r in rows if event is None or r["event"] == event]


def evals(out, name):
    return {r["step"]: r for r in records(out, "eval") if r["set"] == name}


def trajectory(out):
    return [(r["step"], r["loss"], r["grad_norm"], r["state_sha256"]) for r in records(out, "step")]


def eval_flags(files):
    return ["--eval-data-path", str(files["eval"]), "--retention-data-path", str(files["other"]), str(files["own"]),
            "--eval-every-steps", "2"]


@pytest.fixture(scope="module")
def reference(files, tmp_path_factory):
    """The run without any evaluation; every step record carries the hash of the whole state."""
    out = tmp_path_factory.mktemp("ref") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OSFT_TEST_STATE_HASH", "1")
        assert train(files, out) == 0
    return out


@pytest.fixture(scope="module")
def evaluated(files, tmp_path_factory):
    """The same run with an evaluation set, two retention sets, a generous budget, best export,
    patience (never reached), a periodic checkpoint and a control/evaluate request before the start."""
    out = tmp_path_factory.mktemp("eval") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OSFT_TEST_STATE_HASH", "1")
        assert train(files, out, *eval_flags(files), "--max-forgetting", "100", "--save-best-eval",
                     "--early-stopping-patience", "9", "--checkpoint-every-steps", "3", control="evaluate") == 0
    return out


def dense_eval_loss(files) -> float:
    """Token-mean loss of the base model on the evaluation file, computed with plain transformers."""
    from transformers import AutoModelForCausalLM

    from osft.trainer.model.loading import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(files["model"], dtype=torch.float32).eval()
    data = tokenize_chat_file(files["eval"], load_tokenizer(files["model"]), 64)
    total, tokens = 0.0, 0
    with torch.no_grad():
        for i in range(len(data)):
            batch = collate_packed([data[i]])
            logits = model(input_ids=batch["input_ids"]).logits
            total += float(F.cross_entropy(logits[0], batch["labels"][0], ignore_index=IGNORE_INDEX, reduction="sum"))
            tokens += batch["num_loss_tokens"]
    return total / tokens


def test_evaluation_leaves_training_bit_identical_and_records_every_set(files, reference, evaluated):
    assert trajectory(evaluated) == trajectory(reference)
    ev, other, own = evals(evaluated, "eval"), evals(evaluated, "other"), evals(evaluated, "own")
    assert sorted(ev) == sorted(other) == sorted(own) == EVAL_STEPS
    assert [ev[s]["trigger"] for s in EVAL_STEPS] == ["start", "request", "every", "every", "end"]
    assert not (evaluated / "control" / "evaluate").exists()
    assert ev[0]["eval_loss"] == pytest.approx(dense_eval_loss(files), rel=1e-5)
    assert ev[0]["eval_samples"] == 6 and ev[0]["eval_tokens"] > 0 and ev[0]["eval_time_s"] >= 0
    for s in EVAL_STEPS:
        for r in (other[s], own[s]):
            assert r["kind"] == "retention" and r["baseline_step"] == 0
            assert r["forgetting"] == r["eval_loss"] - r["baseline_loss"]  # exactly, nats per token
            assert r["baseline_loss"] == (other if r["set"] == "other" else own)[0]["eval_loss"]
    assert own[STEPS]["forgetting"] > 0  # the base model's own replies got less likely
    assert ev[STEPS]["eval_loss"] < ev[0]["eval_loss"]
    best = json.loads((evaluated / "hf_format" / "best" / "best_eval.json").read_text())
    steps_after_0 = [s for s in EVAL_STEPS if s]
    assert best["step"] == min(steps_after_0, key=lambda s: ev[s]["eval_loss"])
    assert best["eval_loss"] == ev[best["step"]]["eval_loss"]
    assert [r["step"] for r in records(evaluated, "best_eval")][-1] == best["step"]
    assert (evaluated / "hf_format" / "best" / "model.safetensors").is_file()
    assert records(evaluated)[-1]["reason"] == "completed"


def test_resume_in_the_middle_of_a_budgeted_run_is_bit_identical(files, evaluated, tmp_path, monkeypatch, capsys):
    """Stopped after step 4 (SIGUSR2 to itself), resumed: the same steps, evaluations, best and the
    same evaluation state in the last checkpoint as the uninterrupted run. Resumed again from step 4
    on other evaluation and retention files: refused, or accepted with their state reset."""
    out = tmp_path / "run"
    flags = [*eval_flags(files), "--max-forgetting", "100", "--save-best-eval", "--early-stopping-patience", "9",
             "--checkpoint-every-steps", "3", "--on-demand-checkpointing"]
    monkeypatch.setenv("OSFT_TEST_STATE_HASH", "1")
    monkeypatch.setenv("OSFT_TEST_SIGNAL_AT", "4:after_step:0:SIGUSR2")
    assert train(files, out, *flags, control="evaluate") == 75
    monkeypatch.delenv("OSFT_TEST_SIGNAL_AT")
    state = json.loads((out / "full_state_checkpoints" / "step_4" / "trainer_state.json").read_text())["monitor"]
    assert state["eval"]["best_step"] is not None and set(state["eval"]["baselines"]) == {"other", "own"}
    assert len(state["divergence"]["window"]) == 4
    assert train(files, out, *flags, "--resume") == 0
    last_segment = records(out)[[r["event"] for r in records(out)].index("resumed"):]
    assert [(r["step"], r["loss"], r["state_sha256"]) for r in last_segment if r["event"] == "step"] == \
        [(s, loss, h) for s, loss, _, h in trajectory(evaluated)[4:]]
    for name in ("eval", "other", "own"):
        resumed = {r["step"]: r for r in last_segment if r["event"] == "eval" and r["set"] == name}
        assert sorted(resumed) == [6]  # step 0 is not evaluated again: its losses come from the checkpoint
        for key in ("eval_loss", "forgetting", "baseline_loss"):
            assert resumed[6][key] == evals(evaluated, name)[6][key]
    def final_state(run):
        return json.loads((run / "full_state_checkpoints" / "step_6" / "trainer_state.json").read_text())["monitor"]

    assert final_state(out) == final_state(evaluated)

    # Another evaluation file and retention file (same names, other rows) are refused; with
    # --resume-accept-changed-inputs the run goes on with what depends on them reset, and says so.
    (tmp_path / "changed").mkdir()
    changed = {**files, "eval": write_jsonl(tmp_path / "changed" / "eval.jsonl", [chat(q, a) for q, a in QA[1:]] * 2),
               "other": write_jsonl(tmp_path / "changed" / "other.jsonl", [chat("hello", "hello world")])}
    again = [*eval_flags(changed), "--save-best-eval", "--early-stopping-patience", "9", "--max-steps", "5",
             "--resume-from-full-state-checkpoint", str(out / "full_state_checkpoints" / "step_4")]
    assert train(files, tmp_path / "refused", *again) == 2
    assert (f"the evaluation set (--eval-data-path): {changed['eval']} differs in content from {files['eval']}"
            in " ".join(capsys.readouterr().err.split()))
    accepted = tmp_path / "accepted"
    assert train(files, accepted, *again, "--resume-accept-changed-inputs") == 0
    warnings = [r["message"] for r in records(accepted, "warning")]
    assert any(w.startswith("--resume-accept-changed-inputs: resuming from checkpoint") and w.endswith(
        f"reset: the best evaluation (loss {state['eval']['best_loss']:.4f} at step {state['eval']['best_step']}), "
        "the early-stopping patience counter, the retention baselines (forgetting is measured from step 4 on)")
        for w in warnings), warnings
    assert {r["set"]: r["trigger"] for r in records(accepted, "eval") if r["step"] == 4} == {"other": "baseline",
                                                                                            "own": "baseline"}
    assert [r["step"] for r in records(accepted, "best_eval")] == [5]  # the first evaluation on the new set


def test_a_stop_during_a_slow_evaluation_is_served_within_seconds_and_the_pass_is_not_recorded(files, tmp_path,
                                                                                                 monkeypatch):
    """A real SIGTERM 0.5 s into the evaluation after step 2, whose every micro-batch takes 2 s (test
    hook; an evaluation and a retention set: at least 3 micro-batches, 6 s or more): the pass is
    abandoned at its next micro-batch and the stop served by a checkpoint of step 2 within 5 s
    (exit 75, point ``eval``); the abandoned evaluation is not recorded. A SIGUSR1 during the same
    kind of pass waits for it (a checkpoint request need not hurry) and training goes on."""
    out = tmp_path / "run"
    metrics = out / "metrics" / "node0.jsonl"
    sent: list[float] = []

    def signal_during_the_evaluation(signum: int, after_step: int) -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            lines = metrics.read_text().splitlines() if metrics.is_file() else []
            if any(r["event"] == "step" and r["step"] == after_step for r in map(json.loads, lines)):
                time.sleep(0.5)
                sent.append(time.time())
                os.kill(os.getpid(), signum)
                return
            time.sleep(0.05)

    flags = ["--eval-data-path", str(files["eval"]), "--retention-data-path", str(files["other"]),
             "--eval-every-steps", "2", "--on-demand-checkpointing"]
    monkeypatch.setenv("OSFT_TEST_EVAL_DELAY_S", "2@2")
    thread = threading.Thread(target=signal_during_the_evaluation, args=(signal.SIGTERM, 2))
    thread.start()
    try:
        assert train(files, out, *flags) == 75
    finally:
        thread.join()
    finished = records(out, "run_finished")[-1]
    assert (finished["reason"], finished["step"], finished["signal"]) == ("stopped", 2, "SIGTERM")
    assert finished["ts"] - sent[0] < 5.0, finished["ts"] - sent[0]
    assert [(r["step"], r["point"]) for r in records(out, "checkpoint_requested")] == [(2, "eval")]
    assert [r["step"] for r in records(out, "checkpoint_saved")] == [2]
    assert sorted({r["step"] for r in records(out, "eval")}) == [0]  # the abandoned pass left no record

    again = tmp_path / "again"
    metrics = again / "metrics" / "node0.jsonl"
    monkeypatch.setenv("OSFT_TEST_EVAL_DELAY_S", "1@2")  # a pass of 3 s or more
    thread = threading.Thread(target=signal_during_the_evaluation, args=(signal.SIGUSR1, 2))
    thread.start()
    try:
        assert train(files, again, *flags, "--max-steps", "3") == 0
    finally:
        thread.join()
    assert sorted({r["step"] for r in records(again, "eval")}) == [0, 2, 3]  # the pass was finished
    requested = records(again, "checkpoint_requested")
    assert [(r["step"], r["point"], r["signal"]) for r in requested] == [(2, "after_step", "SIGUSR1")]


def test_forgetting_budget_ends_the_run_with_the_best_export_within_budget(files, evaluated, tmp_path):
    ev, worst = evals(evaluated, "eval"), {}
    for s in EVAL_STEPS[1:]:
        worst[s] = max(evals(evaluated, n)[s]["forgetting"] for n in ("other", "own"))
    # the first evaluation whose forgetting exceeds every earlier one (after one within budget)
    end = next(s for i, s in enumerate(EVAL_STEPS[2:], 2)
               if worst[s] > max(worst[t] for t in EVAL_STEPS[1:i]) and worst[s] > 0)
    earlier = [t for t in EVAL_STEPS[1:] if t < end]
    budget = (max(worst[t] for t in earlier) + worst[end]) / 2
    out = tmp_path / "run"
    assert train(files, out, *eval_flags(files), "--max-forgetting", repr(max(budget, 0.0)), control="evaluate") == 0
    finished = records(out)[-1]
    assert (finished["event"], finished["reason"], finished["exit_code"], finished["step"]) == \
        ("run_finished", "forgetting_budget", 0, end)
    best = min(earlier, key=lambda t: ev[t]["eval_loss"])
    assert finished["best_step"] == best and finished["export_dir"] == str(out / "hf_format" / "best")
    assert json.loads((out / "hf_format" / "best" / "best_eval.json").read_text())["step"] == best
    assert (out / "full_state_checkpoints" / f"step_{end}" / "manifest.json").is_file()
    assert not (out / "hf_format" / f"step_{end}").exists()
    assert json.loads((out / "run.json").read_text())["reason"] == "forgetting_budget"


def test_early_stopping_after_patience_evaluations_without_improvement(files, tmp_path):
    out = tmp_path / "run"
    assert train(files, out, "--eval-split", "0.2", "--eval-every-steps", "1", "--early-stopping-patience", "2",
                 "--early-stopping-threshold", "100", "--save-best-eval") == 0
    finished = records(out)[-1]
    assert (finished["reason"], finished["exit_code"], finished["step"]) == ("early_stopping", 0, 3)
    assert finished["export_dir"] == str(out / "hf_format" / "step_3") and (out / "hf_format" / "step_3").is_dir()
    ev = evals(out, "eval")
    assert sorted(ev) == [0, 1, 2, 3] and ev[0]["eval_samples"] == 5  # round(0.2 * 24) rows held out
    assert finished["best_step"] == min((1, 2, 3), key=lambda s: ev[s]["eval_loss"])
    assert (out / "full_state_checkpoints" / "step_3" / "manifest.json").is_file()


def test_divergence_without_a_checkpoint_stops_with_one_of_the_last_good_step(files, reference, tmp_path,
                                                                              monkeypatch):
    """A NaN gradient at step 3 (finite loss): rollback has no checkpoint, so the run stops with a
    checkpoint of step 2 and exit code 1; resuming from it replays steps 3-6 of the reference."""
    out = tmp_path / "run"
    monkeypatch.setenv("OSFT_TEST_STATE_HASH", "1")
    monkeypatch.setenv("OSFT_TEST_DIVERGE_AT", "3:grad")
    assert train(files, out, "--on-divergence", "rollback") == 1
    divergence = records(out, "divergence")[0]
    assert divergence["step"] == 3 and divergence["reason"].startswith("non-finite gradient norm")
    assert len(divergence["lines"]) == 4 and all(1 <= line <= 24 for line in divergence["lines"])
    finished = records(out)[-1]
    assert (finished["reason"], finished["exit_code"], finished["step"]) == ("diverged", 1, 2)
    assert finished["checkpoint"] == str(out / "full_state_checkpoints" / "step_2")
    assert json.loads((out / "run.json").read_text())["state"] == "failed"
    monkeypatch.delenv("OSFT_TEST_DIVERGE_AT")
    assert train(files, out, "--resume") == 0
    assert trajectory(out)[2:] == trajectory(reference)[2:]


def test_rollback_reloads_the_newest_checkpoint_and_skips_the_batch(files, reference, tmp_path, monkeypatch):
    out = tmp_path / "run"
    monkeypatch.setenv("OSFT_TEST_STATE_HASH", "1")
    monkeypatch.setenv("OSFT_TEST_DIVERGE_AT", "4")
    assert train(files, out, "--on-divergence", "rollback", "--checkpoint-every-steps", "2") == 0
    rollback = records(out, "rollback")[0]
    assert (rollback["step"], rollback["to_step"], rollback["skipped_batch"]) == \
        (4, 2, {"position": 3, "epoch": 0, "index": 3})
    steps = records(out, "step")
    assert [r["step"] for r in steps] == [1, 2, 3, 3, 4, 5, 6]  # step 3 replayed after the rollback
    assert trajectory(out)[:3] == trajectory(reference)[:3] and trajectory(out)[3] == trajectory(reference)[2]
    assert steps[4]["num_samples"] == 4 and steps[4]["loss"] != reference_loss(reference, 4)
    state = json.loads((out / "full_state_checkpoints" / "step_6" / "trainer_state.json").read_text())
    assert state["monitor"]["divergence"]["skipped"] == [3] and state["monitor"]["divergence"]["rollbacks"] == 1
    assert state["sampler"]["next_epoch"] == 1 and state["sampler"]["next_index"] == 1  # one batch more read
    assert records(out)[-1]["reason"] == "completed"


def reference_loss(out, step):
    return next(r["loss"] for r in records(out, "step") if r["step"] == step)


def test_eval_flags_are_checked_before_training(files, tmp_path, capsys):
    base = ["--model-name-or-path", str(files["model"]), "--data-path", str(files["train"]),
            "--output-dir", str(tmp_path / "r")]
    for flags, message in [
        (["--eval-split", "0.1", "--eval-data-path", str(files["eval"])], "exclude each other"),
        (["--max-forgetting", "0.1"], "needs a retention set"),
        (["--save-best-eval"], "needs an evaluation set"),
        (["--eval-every-steps", "5"], "needs an evaluation or retention set"),
        (["--retention-data-path", str(tmp_path / "nope.jsonl")], "no such file"),
    ]:
        assert main([*base, *flags]) == 2
        assert message in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": []}\n')
    assert main([*base, "--eval-data-path", str(bad), "--max-steps", "1"]) == 2
    assert f"{bad}:1" in capsys.readouterr().err


# -- two ranks ------------------------------------------------------------------------------------------
@pytest.mark.torchrun
def test_two_ranks_evaluate_like_one_and_roll_back_together(files, tmp_path, monkeypatch):
    """One worker group of 2 ranks against the same run on 1 rank: equal evaluation losses (step 0
    to 1e-7 relative), the same divergence, rollback and skipped batch."""
    flags = [*eval_flags(files), "--on-divergence", "rollback", "--checkpoint-every-steps", "2"]
    monkeypatch.setenv("OSFT_TEST_DIVERGE_AT", "4")
    assert train(files, tmp_path / "one", *flags) == 0
    assert train(files, tmp_path / "two", *flags, "--nproc-per-node", "2") == 0
    for name in ("eval", "other", "own"):
        one, two = evals(tmp_path / "one", name), evals(tmp_path / "two", name)
        assert sorted(one) == sorted(two) == [0, 2, 4, 6]
        assert two[0]["eval_loss"] == pytest.approx(one[0]["eval_loss"], rel=1e-7)
        assert two[0]["eval_tokens"] == one[0]["eval_tokens"] and two[0]["world_size"] == 2
        for s in (2, 4, 6):
            assert two[s]["eval_loss"] == pytest.approx(one[s]["eval_loss"], rel=1e-5)
    strip = ("ts", "hostname", "job_id", "world_size", "path")
    one_rb, two_rb = (
        [{k: v for k, v in r.items() if k not in strip} for r in records(tmp_path / run, "rollback")]
        for run in ("one", "two"))
    assert one_rb == two_rb and len(one_rb) == 1
    for a, b in zip(records(tmp_path / "one", "step"), records(tmp_path / "two", "step")):
        assert (b["step"], b["num_loss_tokens"]) == (a["step"], a["num_loss_tokens"])
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    assert records(tmp_path / "two")[-1]["reason"] == "completed"
    assert json.loads((tmp_path / "two" / "run.json").read_text())["export_dir"] == \
        str(tmp_path / "two" / "hf_format" / "step_6")
    assert np.isfinite(records(tmp_path / "two", "step")[-1]["loss"])


def test_retention_paths_repeat_on_the_command_line_and_replace_a_config_files_list(tmp_path):
    from osft.trainer.config import build_parser, config_from_args, config_to_argv
    from osft.trainer.config_file import parse_with_config_file

    base = ["--model-name-or-path", "m", "--data-path", "d", "--output-dir", "o"]
    cfg = config_from_args(build_parser().parse_args([*base, "--retention-data-path", "a", "b",
                                                      "--retention-data-path", "c"]))
    assert cfg.retention_data_path == ["a", "b", "c"]
    assert config_from_args(build_parser().parse_args(config_to_argv(cfg))) == cfg
    config = tmp_path / "c.yaml"
    config.write_text("retention_data_path: [x, y]\n")
    args = parse_with_config_file(build_parser(), [*base, "--config", str(config)])
    assert args.retention_data_path == ["x", "y"]
    args = parse_with_config_file(build_parser(), [*base, "--config", str(config), "--retention-data-path", "z"])
    assert args.retention_data_path == ["z"]
