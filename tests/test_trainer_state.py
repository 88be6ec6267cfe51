"""trainer_state.json as TrainerState (trainer/checkpoint/trainer_state.py): the file's content
round-trips unchanged, older files without the later keys load, and the resume compatibility
check refuses what a bit-identical resume needs unchanged and warns about the rest."""

from __future__ import annotations

import dataclasses
import json

import pytest

from osft.trainer.checkpoint.manifest import CheckpointError
from osft.trainer.checkpoint.trainer_state import TRAINER_STATE, ModelFacts, TrainerState, run_settings
from osft.trainer.config import TrainConfig

CFG = TrainConfig("model", ["data.jsonl"], "out", batch_size=4, learning_rate=1e-4)


def _state(**changes) -> TrainerState:
    state = TrainerState(
        step=6, epoch=1, sampler={"seed": 42, "batch_size": 4, "num_samples": 10, "next_epoch": 1, "next_index": 2},
        counters={"ortho_violations_total": 2, "samples_seen": 24, "tokens_seen": 900},
        scheduler={"base_lrs": [1e-4], "last_epoch": 6, "_step_count": 7, "lr_lambdas": [None]},
        world_size=2, total_steps=10, settings=run_settings(CFG), model=ModelFacts(vocab_size=96, model_type="llama"),
        osft_plan={"model.layers.0.mlp.up_proj": {"k_high": 3}}, monitor={"eval": {}, "divergence": {}},
    )
    return dataclasses.replace(state, **changes)


def test_the_file_round_trips_with_the_keys_in_the_order_written_before(tmp_path):
    state = _state()
    state.write(tmp_path)
    text = (tmp_path / TRAINER_STATE).read_text()
    data = json.loads(text)
    assert list(data) == ["step", "epoch", "sampler", "counters", "scheduler", "world_size", "total_steps",
                          "settings", "model", "osft_plan", "monitor"]
    assert data["model"] == {"vocab_size": 96, "model_type": "llama"} and data["settings"]["batch_size"] == 4
    assert text == json.dumps(data, indent=1)
    assert TrainerState.read(tmp_path) == state


def test_an_older_file_without_the_later_keys_loads_and_a_missing_key_names_the_file(tmp_path):
    data = _state().to_json()
    for key in ("total_steps", "osft_plan", "monitor"):
        del data[key]
    (tmp_path / TRAINER_STATE).write_text(json.dumps(data))
    old = TrainerState.read(tmp_path)
    assert (old.step, old.total_steps, old.osft_plan, old.monitor) == (6, None, None, None)
    del data["sampler"]
    (tmp_path / TRAINER_STATE).write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=f"{tmp_path / TRAINER_STATE}: missing sampler"):
        TrainerState.read(tmp_path)


def test_compatibility_refuses_what_a_bit_identical_resume_needs_and_warns_about_the_rest(tmp_path):
    state, layout = _state(), {"num_samples": 10}
    assert state.check_compatible(CFG, 2, layout, tmp_path) == []
    with pytest.raises(CheckpointError, match="saved with 2 ranks, now 4"):
        state.check_compatible(CFG, 4, layout, tmp_path)
    with pytest.raises(CheckpointError, match="saved with 10 training samples, the data now has 11"):
        state.check_compatible(CFG, 2, {"num_samples": 11}, tmp_path)
    with pytest.raises(CheckpointError, match=r"mixture .* None, this run has \[\[5, 1.0\], \[5, 1.0\]\]"):
        state.check_compatible(CFG, 2, {"num_samples": 10, "mixture": [[5, 1.0], [5, 1.0]]}, tmp_path)
    with pytest.raises(CheckpointError, match="saved with --batch-size 4, this run has 8"):
        state.check_compatible(dataclasses.replace(CFG, batch_size=8), 2, layout, tmp_path)
    faster = dataclasses.replace(CFG, learning_rate=2e-4)
    assert state.changed_settings(faster) == {"learning_rate": (1e-4, 2e-4)}
    assert state.check_compatible(faster, 2, layout, tmp_path) == [
        f"--learning-rate changed from 0.0001 to 0.0002 since checkpoint {tmp_path}: used from step 7 on, "
        "so the resumed run differs from an uninterrupted one"]
