"""Mixtures (docs/data.md, "Several sources and mixtures (replay)"): several datasets with weights
(replay), drawn deterministically per step, counted per dataset in the metrics, and resumed
bit-exactly from every dataset's position."""

import json

import pytest
from datasets import Dataset

from helpers import QA, chat, save_tiny_model, write_jsonl
from osft.trainer.launch.cli import main
from osft.trainer.config import build_parser, config_from_args
from osft.trainer.config_file import parse_with_config_file
from osft.trainer.data.sampler import GlobalBatchSampler, MixtureSampler, make_sampler
from osft.trainer.data.specs import DataSpec, parse_data_spec, parse_data_specs


def test_a_weight_is_the_number_after_the_last_colon():
    assert parse_data_spec("a.jsonl:0.8") == DataSpec("a.jsonl", 0.8)
    assert parse_data_spec("c:/data/x.parquet:2") == DataSpec("c:/data/x.parquet", 2.0)
    assert parse_data_spec("/data/run:3/a.jsonl") == DataSpec("/data/run:3/a.jsonl")
    assert parse_data_spec("a.jsonl") == DataSpec("a.jsonl")
    for bad in ("a.jsonl:0", "a.jsonl:-1", "a.jsonl:nan", "a.jsonl:inf"):
        with pytest.raises(ValueError, match="must be a number > 0"):
            parse_data_spec(bad)
    with pytest.raises(ValueError, match="give every path a weight"):
        parse_data_specs(["a.jsonl:0.8", "b.parquet"])
    assert parse_data_specs(["a.jsonl", "b.parquet"]) == [DataSpec("a.jsonl"), DataSpec("b.parquet")]


def test_data_path_repeats_lists_and_comes_from_a_config_file(tmp_path):
    base = ["--model-name-or-path", "m", "--output-dir", "o"]
    parse = build_parser().parse_args
    assert parse(base + ["--data-path", "a.jsonl:0.8", "--data-path", "b.parquet:0.2"]).data_path == \
        ["a.jsonl:0.8", "b.parquet:0.2"]
    assert parse(base + ["--data-path", "a.jsonl:0.8", "b.parquet:0.2"]).data_path == ["a.jsonl:0.8", "b.parquet:0.2"]
    config = tmp_path / "c.yaml"
    config.write_text("data_path: [a.jsonl:0.8, b.parquet:0.2]\n")
    assert parse_with_config_file(build_parser(), ["--config", str(config)] + base).data_path == \
        ["a.jsonl:0.8", "b.parquet:0.2"]
    # the command line replaces the file's list, it does not add to it
    assert parse_with_config_file(build_parser(), ["--config", str(config), "--data-path", "c.jsonl"] + base
                                  ).data_path == ["c.jsonl"]
    config.write_text("data_path: a.jsonl\n")
    args = parse_with_config_file(build_parser(), ["--config", str(config)] + base)
    assert config_from_args(args).data_path == ["a.jsonl"]


def test_every_step_takes_each_dataset_s_share_and_positions_restore_exactly():
    sizes, weights, batch = [10, 3], [0.8, 0.2], 5
    sampler = make_sampler(sizes, weights, batch, seed=7)
    assert isinstance(sampler, MixtureSampler) and sampler.steps_per_epoch == 3
    assert isinstance(make_sampler(sizes, None, batch, 7), GlobalBatchSampler)
    steps = [sampler.indices(s) for s in range(40)]
    for s, indices in enumerate(steps):
        assert len(indices) == batch
        taken = sampler.positions(s + 1)
        assert all(abs(c - w * batch * (s + 1)) < 1 for c, w in zip(taken, weights))  # within one sample
    small = [i - 10 for indices in steps for i in indices if i >= 10]
    assert len(small) == 40 and all(sorted(small[k:k + 3]) == [0, 1, 2] for k in range(0, 39, 3))  # every pass whole
    again = MixtureSampler(sizes, weights, batch, seed=7)
    assert [again.indices(s) for s in range(40)] == steps
    assert MixtureSampler(sizes, weights, batch, seed=8).indices(0) != steps[0] or \
        MixtureSampler(sizes, weights, batch, seed=8).indices(1) != steps[1]
    resumed = MixtureSampler(sizes, weights, batch, seed=7)
    state = json.loads(json.dumps(sampler.state(17)))
    assert state["positions"] == sampler.positions(17) and state["mixture"] == [[10, 0.8], [3, 0.2]]
    resumed.restore(state, 17)
    assert [resumed.indices(s) for s in range(17, 40)] == steps[17:]
    with pytest.raises(ValueError, match="cannot go back to step 3"):
        resumed.indices(3)


def _steps(out):
    lines = [json.loads(x) for x in (out / "metrics" / "node0.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in lines if r["event"] == "step"}


def test_a_mixture_trains_counts_each_dataset_and_resumes_bit_identically(tmp_path, monkeypatch):
    """An in-process 1-rank run on a .jsonl and a .parquet source (0.75/0.25), checkpointed at step 2
    and resumed from it: steps 3-4 equal the uninterrupted run's, state hashes included."""
    monkeypatch.setenv("OSFT_TEST_STATE_HASH", "1")
    model = save_tiny_model(tmp_path / "model")
    first = write_jsonl(tmp_path / "new.jsonl", [chat(q, a) for q, a in QA[:4]] * 2)
    Dataset.from_list([chat(q, a) for q, a in QA[4:]]).to_parquet(str(tmp_path / "replay.parquet"))
    specs = [f"{first}:0.75", f"{tmp_path / 'replay.parquet'}:0.25"]
    flags = ["--model-name-or-path", str(model), "--data-path", *specs, "--batch-size", "4",
             "--max-tokens-per-gpu", "128", "--max-seq-len", "64", "--max-steps", "4", "--seed", "3",
             "--data-cache-dir", str(tmp_path / "cache")]
    full = tmp_path / "full"
    assert main(flags + ["--output-dir", str(full), "--checkpoint-every-steps", "2"]) == 0
    steps = _steps(full)
    assert [r["dataset_samples"] for r in steps.values()] == [{str(first): 3, str(tmp_path / "replay.parquet"): 1}] * 4
    state = json.loads((full / "full_state_checkpoints" / "step_2" / "trainer_state.json").read_text())
    assert state["sampler"]["positions"] == [6, 2] and state["sampler"]["mixture"] == [[8, 0.75], [1, 0.25]]
    report = json.loads((full / "data_report.json").read_text())
    assert [(d["path"], d["kept"], d["weight"], d["unit"]) for d in report["datasets"]] == [
        (str(first), 8, 0.75, "line"), (str(tmp_path / "replay.parquet"), 1, 0.25, "row")]
    resumed = tmp_path / "resumed"
    assert main(flags + ["--output-dir", str(resumed), "--resume-from-full-state-checkpoint",
                         str(full / "full_state_checkpoints" / "step_2")]) == 0
    again = _steps(resumed)
    assert sorted(again) == [3, 4]
    for step in (3, 4):
        assert (again[step]["loss"], again[step]["state_sha256"], again[step]["dataset_samples"]) == \
            (steps[step]["loss"], steps[step]["state_sha256"], steps[step]["dataset_samples"])
    # another mixture is refused: the positions would not match
    other = [f"{first}:0.5", f"{tmp_path / 'replay.parquet'}:0.5"]
    assert main([*flags[:3], *other, *flags[5:], "--output-dir", str(tmp_path / "other"),
                 "--resume-from-full-state-checkpoint", str(full / "full_state_checkpoints" / "step_2")]) != 0
