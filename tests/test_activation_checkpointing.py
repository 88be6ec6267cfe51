"""`--activation-checkpointing` (docs/training.md, "Activation checkpointing"): one optimizer step
of the trainer's own step code with and without it gives bit-identical gradients, parameters and RNG
state on CPU, under OSFT and full fine-tuning, with attention dropout on (the recompute must draw
the same dropout mask). Two ranks with FSDP2 and exact resume: tests/test_resume.py (the flag in
resumed segments)."""

import pytest
import torch
from helpers import QA, chat, save_tiny_model, write_jsonl

from osft.trainer.config import TrainConfig, build_parser, config_from_args
from osft.trainer.config_file import parse_with_config_file
from osft.trainer.run.loop import Trainer
from osft.trainer.run.state_hash import state_sha256
from osft.trainer.osft.decomposition import OSFTLinear


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("actckpt")
    model = save_tiny_model(root / "model", hidden_size=64, intermediate_size=128, attention_dropout=0.1)
    return model, write_jsonl(root / "train.jsonl", [chat(q, a) for q, a in QA] * 2)


def one_step(job, out, osft: bool, activation_checkpointing: bool):
    """Prepare a one-rank trainer and run its step 1; returns (gradients by parameter name as
    AdamW received them, forward calls of the first OSFT module or q_proj during the step, the
    trainer, torch's RNG state after the step)."""
    model, data = job
    cfg = TrainConfig(str(model), str(data), str(out), batch_size=5, max_seq_len=64, max_tokens_per_gpu=96,
                      osft=osft, activation_checkpointing=activation_checkpointing, data_cache=False)
    trainer = Trainer(cfg)
    trainer.prepare()
    names = {p: n for n, p in trainer.model.named_parameters()}
    grads = {}

    def record(optimizer, args, kwargs):  # torch.optim.Optimizer.register_step_pre_hook
        grads.update({names[p]: p.grad.clone() for g in optimizer.param_groups for p in g["params"]})

    trainer.optimizer.register_step_pre_hook(record)
    q_proj = trainer.model.get_submodule("model.layers.0.self_attn.q_proj")
    assert isinstance(q_proj, OSFTLinear) == osft
    calls = []
    q_proj.register_forward_hook(lambda *_: calls.append(1))
    rng_before = torch.get_rng_state()
    trainer.train_step(1, trainer.sampler.indices(0))
    assert not torch.equal(torch.get_rng_state(), rng_before)  # attention dropout drew random numbers
    return grads, len(calls), trainer, torch.get_rng_state()


@pytest.mark.parametrize("osft", [True, False], ids=["osft", "full"])
def test_gradients_are_bit_identical_with_and_without_activation_checkpointing(job, tmp_path, osft):
    plain, plain_calls, plain_trainer, plain_rng = one_step(job, tmp_path / "plain", osft, False)
    ckpt, ckpt_calls, ckpt_trainer, ckpt_rng = one_step(job, tmp_path / "ckpt", osft, True)
    assert plain_calls >= 2  # the step accumulates over several packed micro-batches
    assert ckpt_calls == 2 * plain_calls  # each block ran again in the backward pass
    assert set(ckpt) == set(plain) and len(plain) > 0
    for name, grad in plain.items():
        assert torch.equal(ckpt[name], grad), name
    assert (state_sha256(ckpt_trainer.model, ckpt_trainer.optimizer, 1)
            == state_sha256(plain_trainer.model, plain_trainer.optimizer, 1))
    assert torch.equal(ckpt_rng, plain_rng)


def test_flag_parses_and_comes_from_a_config_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("activation_checkpointing: true\n")
    base = ["--model-name-or-path", "m", "--data-path", "d.jsonl", "--output-dir", "o"]

    def resolve(argv):
        return config_from_args(parse_with_config_file(build_parser(), argv))

    assert resolve(base).activation_checkpointing is False
    assert resolve([*base, "--activation-checkpointing"]).activation_checkpointing is True
    assert resolve([*base, "--config", str(path)]).activation_checkpointing is True
