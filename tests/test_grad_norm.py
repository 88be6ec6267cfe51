"""The reported (and clipped) gradient norm against a float64 reference (docs/training.md, "Loss and
gradient norm").

One rank here, in process, OSFT on and off; two ranks ride on test_distributed.py's two-rank run.
The reference (:func:`helpers.float64_grad_norm`) runs every sample alone in float64; the trainer
packs samples into micro-batches and accumulates float32 gradients, so the two agree to float32
rounding (measured: 2e-7 relative on one rank, 2e-8 on two)."""

from __future__ import annotations

import pytest
from helpers import QA, chat, float64_grad_norm, write_jsonl

from osft.trainer.config import build_parser, config_from_args
from osft.trainer.run.loop import Trainer

#: float32 rounding of a sum over about 1e5 gradient entries, with margin.
REL = 1e-6


def prepared(model, data, out, *flags) -> Trainer:
    """A one-rank Trainer after :meth:`Trainer.prepare`: 8 samples per step, 2-3 micro-batches."""
    argv = ["--model-name-or-path", str(model), "--data-path", str(data), "--output-dir", str(out),
            "--batch-size", "8", "--max-tokens-per-gpu", "96", "--max-seq-len", "64", "--max-steps", "2",
            "--learning-rate", "1e-2", "--max-grad-norm", "0.5", "--no-data-cache", *flags]
    trainer = Trainer(config_from_args(build_parser().parse_args(argv)))
    trainer.prepare()
    return trainer


@pytest.mark.parametrize("flags", [[], ["--no-osft"]], ids=["osft", "full"])
def test_grad_norm_of_one_rank_equals_a_float64_reference(tiny_model_dir, tmp_path, flags):
    data = write_jsonl(tmp_path / "train.jsonl", [chat(q, a) for q, a in QA] * 3)
    trainer = prepared(tiny_model_dir, data, tmp_path / "run", *flags)
    for step in (1, 2):  # the second step starts from parameters AdamW moved (and OSFT re-projected)
        indices = trainer.sampler.batch(0, step - 1)
        want = float64_grad_norm(trainer, indices)
        record = trainer.train_step(step, indices)
        assert record["grad_norm"] == pytest.approx(want, rel=REL), (step, record["grad_norm"], want)
        assert record["grad_norm"] > 0.5  # so the step was clipped with this norm
