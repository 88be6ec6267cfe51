"""Learning-rate schedules (trainer/schedule.py) against transformers' own, value for value."""

from __future__ import annotations

import pytest
import torch
from osft.trainer.schedule import build_scheduler, lr_multiplier


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
