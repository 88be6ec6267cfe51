"""What the user changes on resume happens (docs/checkpoints.md, "What may change on resume"): every
optimisation setting given to the resumed run is the one its first step uses, and the step records
and the checkpoints it writes show it. In-process one-rank runs with real full-state checkpoints;
the two-rank bit-exact resume with unchanged settings is tests/test_resume.py."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import QA, chat, write_jsonl
from safetensors.torch import load_file

from osft.trainer.launch.cli import main
from osft.trainer.run.schedule import lr_multiplier

BASE = ("--batch-size", "4", "--max-tokens-per-gpu", "96", "--max-seq-len", "64", "--save-dtype", "float32",
        "--checkpoint-every-steps", "2")
#: The first run: constant lr 1e-3, AdamW defaults but weight decay 0.1.
FIRST = ("--learning-rate", "1e-3", "--weight-decay", "0.1", "--lr-scheduler", "constant")
#: Every optimisation setting changed on resume (and, as a variant, another schedule).
CHANGED = {"learning_rate": ("--learning-rate", "1e-2", 1e-2), "lr_scheduler": ("--lr-scheduler", "linear", "linear"),
           "warmup_steps": ("--warmup-steps", "3", 3), "weight_decay": ("--weight-decay", "0.05", 0.05),
           "beta1": ("--beta1", "0.8", 0.8), "beta2": ("--beta2", "0.99", 0.99), "eps": ("--eps", "1e-6", 1e-6),
           "max_grad_norm": ("--max-grad-norm", "0.5", 0.5), "max_steps": ("--max-steps", "6", 6)}
OLD = {"learning_rate": 1e-3, "lr_scheduler": "constant", "warmup_steps": 0, "weight_decay": 0.1, "beta1": 0.9,
       "beta2": 0.95, "eps": 1e-8, "max_grad_norm": 1.0, "max_steps": 4}


def records(out, event):
    recs = [json.loads(line) for line in (out / "metrics" / "node0.jsonl").read_text().splitlines()]
    return [r for r in recs if r["event"] == event]


def train(model, data, out, *flags):
    return main(["--model-name-or-path", str(model), "--data-path", str(data), "--output-dir", str(out), *BASE, *flags])


@pytest.fixture(scope="module")
def first(tiny_model_dir, tmp_path_factory):
    """4 steps at constant lr 1e-3, checkpoints at steps 2 and 4."""
    data = write_jsonl(tmp_path_factory.mktemp("data") / "train.jsonl", [chat(q, a) for q, a in QA[:4]] * 4)
    out = tmp_path_factory.mktemp("first") / "run"
    assert train(tiny_model_dir, data, out, *FIRST, "--max-steps", "4") == 0
    return tiny_model_dir, data, out


def test_every_changed_optimisation_setting_is_used_from_the_first_resumed_step(first, tmp_path):
    model, data, out = first
    resumed = tmp_path / "resumed"
    flags = [f for flag, value, _ in CHANGED.values() for f in (flag, value)]
    step_2 = out / "full_state_checkpoints" / "step_2"
    assert train(model, data, resumed, "--resume-from-full-state-checkpoint", str(step_2), *flags) == 0

    # The records tell what happened: one warning per setting, naming the step it applies from.
    (record,) = records(resumed, "resumed")
    assert record["from_step"] == 2
    assert record["changed"] == {k: [OLD[k], new] for k, (_, _, new) in CHANGED.items()}
    warnings = [r["message"] for r in records(resumed, "warning")]
    for key, (flag, _, new) in CHANGED.items():
        assert any(w.startswith(f"{flag} changed from {OLD[key]} to {new} since checkpoint") and
                   "used from step 3 on" in w for w in warnings), (flag, warnings)

    # The schedule: step k (1-based) uses 1e-2 × the linear multiplier of step index k-1 with
    # warmup 3 over 6 steps, from the first resumed step on (not one step late).
    steps = records(resumed, "step")
    assert [r["step"] for r in steps] == [3, 4, 5, 6]
    assert [r["lr"] for r in steps] == [1e-2 * lr_multiplier("linear", k - 1, 3, 6) for k in (3, 4, 5, 6)]
    # Step 3 starts from the checkpoint's parameters (same loss as the first run); its update used
    # the new settings, so step 4 starts elsewhere.
    before = {r["step"]: r for r in records(out, "step")}
    assert steps[0]["loss"] == before[3]["loss"] and steps[1]["loss"] != before[4]["loss"]

    # AdamW itself ran with the new hyperparameters: the resumed run's checkpoints store them.
    for step in (4, 6):
        (group,) = torch.load(resumed / "full_state_checkpoints" / f"step_{step}" / "optimizer_rank0.pt",
                              weights_only=True)["param_groups"]
        assert (group["initial_lr"], tuple(group["betas"]), group["eps"], group["weight_decay"]) == (
            1e-2, (0.8, 0.99), 1e-6, 0.05)
        assert group["lr"] == 1e-2 * lr_multiplier("linear", step, 3, 6)  # the lr of the next step
        state = json.loads((resumed / "full_state_checkpoints" / f"step_{step}" / "trainer_state.json").read_text())
        assert state["settings"]["max_grad_norm"] == 0.5 and state["total_steps"] == 6


def test_unchanged_settings_resume_bit_identically_in_process(first, tmp_path):
    """The same flags: steps 3-4 of the resumed run are those of the first run, bit for bit
    (lr, loss, gradient norm, exported weights), and no setting is reported as changed."""
    model, data, out = first
    resumed = tmp_path / "resumed"
    step_2 = out / "full_state_checkpoints" / "step_2"
    assert train(model, data, resumed, "--resume-from-full-state-checkpoint", str(step_2), *FIRST,
                 "--max-steps", "4") == 0
    assert records(resumed, "resumed")[0]["changed"] == {}
    assert not [r for r in records(resumed, "warning") if "changed from" in r["message"]]
    got = [(r["step"], r["lr"], r["loss"], r["grad_norm"]) for r in records(resumed, "step")]
    want = [(r["step"], r["lr"], r["loss"], r["grad_norm"]) for r in records(out, "step") if r["step"] > 2]
    assert got == want
    exported = [load_file(run / "hf_format" / "step_4" / "model.safetensors") for run in (out, resumed)]
    assert exported[0].keys() == exported[1].keys()
    assert all(torch.equal(exported[0][k], exported[1][k]) for k in exported[0])
