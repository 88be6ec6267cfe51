"""Learning-rate schedules (trainer/run/schedule.py) against transformers' own, value for value, and
warmups that cover the whole run (docs/training.md, "Learning-rate schedule")."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import QA, chat, write_jsonl

from osft.trainer.launch.cli import main
from osft.trainer.run.schedule import build_scheduler, check_warmup, lr_multiplier


def _lrs(scheduler, optimizer, steps):
    out = []
    for _ in range(steps):
        out.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return out


@pytest.mark.parametrize(("ours", "theirs"), [("constant", "constant_with_warmup"), ("linear", "linear"),
                                              ("cosine", "cosine")])
@pytest.mark.parametrize(("warmup", "total"), [(0, 7), (3, 10), (5, 5)])
def test_schedules_equal_transformers_exactly(ours, theirs, warmup, total):
    from transformers import get_scheduler

    got_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    want_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    got = _lrs(build_scheduler(ours, got_opt, warmup, total), got_opt, total + 2)
    want = _lrs(get_scheduler(theirs, want_opt, num_warmup_steps=warmup, num_training_steps=total), want_opt, total + 2)
    assert got == want


def test_warmup_then_constant_and_bad_name():
    assert [lr_multiplier("constant", s, 4, 10) for s in range(6)] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    with pytest.raises(ValueError, match="unknown learning-rate schedule 'exp'"):
        lr_multiplier("exp", 0, 0, 1)


def test_check_warmup_warns_when_the_peak_is_never_reached_and_refuses_a_run_at_lr_0():
    """The warmup rule, for any run length and resume point: a warning when the peak is never
    reached, a refusal when every step would train at learning rate 0."""
    assert check_warmup(0, 1) is None and check_warmup(4, 5) is None  # the last step reaches the peak
    assert check_warmup(5, 2) == ("--warmup-steps 5 >= the run's 2 optimizer steps: the learning rate never reaches "
                                  "its peak (--learning-rate); the last step uses 0.2 × the peak")
    assert "the last step uses 0.5 × the peak" in check_warmup(2, 2, start_step=1)  # resumed: one step left, lr > 0
    for warmup in (1, 7):
        with pytest.raises(ValueError, match=rf"--warmup-steps {warmup} with a run of 1 optimizer step\(s\): every "
                                             "step would train at learning rate 0"):
            check_warmup(warmup, 1)


@pytest.fixture(scope="module")
def eight_rows(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("b55") / "train.jsonl", [chat(q, a) for q, a in QA[:4]] * 2)


def _train(model, data, out, *flags):
    return main(["--model-name-or-path", str(model), "--data-path", str(data), "--output-dir", str(out),
                 "--batch-size", "4", "--max-tokens-per-gpu", "96", "--max-seq-len", "64", *flags])


def test_a_run_whose_every_step_would_have_lr_0_is_refused_before_training(tiny_model_dir, eight_rows, tmp_path,
                                                                              capsys):
    """`--max-steps 1 --warmup-steps 1` used to train its only step at lr 0 and end `done`. In
    process and before a worker group starts (the unit tier fails any subprocess)."""
    for flags in (["--max-steps", "1"], ["--max-steps", "1", "--nproc-per-node", "2"]):
        out = tmp_path / f"run{len(flags)}"
        assert _train(tiny_model_dir, eight_rows, out, *flags, "--warmup-steps", "1", "--lr-scheduler", "linear") == 2
        err = capsys.readouterr().err
        assert "--warmup-steps 1 with a run of 1 optimizer step(s): every step would train at learning rate 0" in err
        assert not (out / "hf_format").exists()


def test_a_warmup_longer_than_the_run_is_named_at_start_up(tiny_model_dir, eight_rows, tmp_path, capsys):
    """`--max-steps 2 --warmup-steps 5 --lr-scheduler cosine`, and the same run length from
    `--num-epochs` (8 rows, 4 per step: 2 steps)."""
    for flags in (["--max-steps", "2"], ["--num-epochs", "1"]):
        out = tmp_path / flags[0].strip("-")
        assert _train(tiny_model_dir, eight_rows, out, *flags, "--warmup-steps", "5", "--lr-scheduler", "cosine",
                      "--learning-rate", "1e-3") == 0
        assert "--warmup-steps 5 >= the run's 2 optimizer steps" in capsys.readouterr().err
        recs = [json.loads(line) for line in (out / "metrics" / "node0.jsonl").read_text().splitlines()]
        (warning,) = [r["message"] for r in recs if r["event"] == "warning"]
        assert warning.startswith("--warmup-steps 5 >= the run's 2 optimizer steps")
        assert [r["event"] for r in recs].index("warning") < [r["event"] for r in recs].index("step")
        assert [r["lr"] for r in recs if r["event"] == "step"] == [0.0, 1e-3 / 5]
