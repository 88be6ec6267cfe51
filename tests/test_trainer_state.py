"""trainer_state.json as TrainerState (trainer/checkpoint/trainer_state.py): the file's content
round-trips unchanged, older files without the later keys load, and the resume compatibility
check refuses what a bit-identical resume needs unchanged and warns about the rest."""

from __future__ import annotations

import dataclasses
import json

import pytest

from osft.trainer.checkpoint.manifest import CheckpointError
from osft.trainer.checkpoint.trainer_state import TRAINER_STATE, ModelFacts, TrainerState
from osft.trainer.config import TrainConfig

CFG = TrainConfig("model", ["data.jsonl"], "out", batch_size=4, learning_rate=1e-4)


def _state(**changes) -> TrainerState:
    state = TrainerState(
        step=6, epoch=1, sampler={"seed": 42, "batch_size": 4, "num_samples": 10, "next_epoch": 1, "next_index": 2},
        counters={"ortho_violations_total": 2, "samples_seen": 24, "tokens_seen": 900},
        scheduler={"base_lrs": [1e-4], "last_epoch": 6, "_step_count": 7, "lr_lambdas": [None]},
        world_size=2, total_steps=10, settings=CFG.resume_settings(), model=ModelFacts(vocab_size=96, model_type="llama"),
        osft_plan={"model.layers.0.mlp.up_proj": {"k_high": 3}}, monitor={"eval": {}, "divergence": {}},
    )
    return dataclasses.replace(state, **changes)


def test_the_file_round_trips_with_the_keys_in_the_order_written_before(tmp_path):
    state = _state()
    state.write(tmp_path)
    text = (tmp_path / TRAINER_STATE).read_text()
    data = json.loads(text)
    assert list(data) == ["step", "epoch", "sampler", "counters", "scheduler", "world_size", "total_steps",
                          "settings", "model", "osft_plan", "monitor", "inputs"]
    assert data["model"] == {"vocab_size": 96, "model_type": "llama"} and data["settings"]["batch_size"] == 4
    assert text == json.dumps(data, indent=1)
    assert TrainerState.read(tmp_path) == state


def test_an_older_file_without_the_later_keys_loads_and_a_missing_key_names_the_file(tmp_path):
    data = _state().to_json()
    for key in ("total_steps", "osft_plan", "monitor", "inputs"):
        del data[key]
    (tmp_path / TRAINER_STATE).write_text(json.dumps(data))
    old = TrainerState.read(tmp_path)
    assert (old.step, old.total_steps, old.osft_plan, old.monitor, old.inputs) == (6, None, None, None, None)
    assert old.accept_inputs(CFG, {"training": []}, tmp_path) == (old, [])  # nothing recorded: nothing compared
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


def test_inputs_of_another_content_are_refused_naming_them_an_identical_copy_is_not(tmp_path):
    """The checkpoint's fingerprint of the training data, tokenizer, chat template, evaluation and
    retention sets is compared by content: an edited or longer file is refused naming it, a copy
    at another path is the same input; --resume-accept-changed-inputs goes on and resets what
    depends on the changed input."""
    from helpers import QA, chat, tiny_chat_tokenizer, write_jsonl
    from osft.trainer.data.fingerprint import run_inputs

    tok = tiny_chat_tokenizer()
    rows = [chat(q, a) for q, a in QA]
    d64 = write_jsonl(tmp_path / "d64.jsonl", rows)
    held = write_jsonl(tmp_path / "eval.jsonl", rows[:2])
    cfg = dataclasses.replace(CFG, eval_data_path=str(held))
    monitor = {"eval": {"baselines": {}, "best_loss": 1.5, "best_step": 4, "patience_ref": 1.5, "since_improvement": 1,
                        "last": {"eval_loss": 1.5}}, "divergence": {}}
    state = _state(inputs=run_inputs(cfg, tok, [(str(d64), None)]), monitor=monitor)

    (tmp_path / "copy").mkdir()
    copy = (tmp_path / "copy" / "other-name.jsonl")
    copy.write_bytes(d64.read_bytes())
    assert state.accept_inputs(cfg, run_inputs(cfg, tok, [(str(copy), None)]), tmp_path) == (state, [])

    edit = write_jsonl(tmp_path / "edit.jsonl", rows[3:] + rows[:3])
    longer = write_jsonl(tmp_path / "longer.jsonl", rows + rows[:1])
    for path in (edit, longer):
        with pytest.raises(CheckpointError) as exc:
            state.accept_inputs(cfg, run_inputs(cfg, tok, [(str(path), None)]), tmp_path)
        assert str(exc.value).startswith(
            f"checkpoint {tmp_path} was trained with other inputs than this run's: the training data (--data-path): "
            f"{path} differs in content from {d64}, the file the checkpoint was trained with (sha256 "
            f"{state.inputs['training'][0]['sha256'][:12]} at the checkpoint, ")
        assert str(exc.value).endswith(
            "give --resume-accept-changed-inputs to go on with these from the saved position")
    with pytest.raises(CheckpointError,
                       match=r"the training data \(--data-path\): weight None at the checkpoint, 0.5 now"):
        state.accept_inputs(cfg, run_inputs(cfg, tok, [(str(d64), 0.5)]), tmp_path)
    other_template = tiny_chat_tokenizer(default_system=False)
    with pytest.raises(CheckpointError, match=r"other inputs than this run's: the chat template: sha256 \w{12} at the "
                                              r"checkpoint, \w{12} now\. A resume"):
        state.accept_inputs(cfg, run_inputs(cfg, other_template, [(str(d64), None)]), tmp_path)
    other_vocabulary = tiny_chat_tokenizer()  # the same chat template, one token more
    other_vocabulary.add_tokens(["<new_token>"])
    with pytest.raises(CheckpointError, match=r"other inputs than this run's: the tokenizer: sha256 \w{12} at the "
                                              r"checkpoint, \w{12} now\. A resume"):
        state.accept_inputs(cfg, run_inputs(cfg, other_vocabulary, [(str(d64), None)]), tmp_path)

    # accepted: the training data alone changed: the evaluation state still compares the same set
    accepting = dataclasses.replace(cfg, resume_accept_changed_inputs=True)
    kept, (warning,) = state.accept_inputs(accepting, run_inputs(cfg, tok, [(str(edit), None)]), tmp_path)
    assert kept.monitor == monitor and "the resumed run differs from an uninterrupted one" in warning
    # another evaluation set: the best evaluation and the patience counter are reset, and the run says so
    write_jsonl(held, rows[2:4])
    reset, (warning,) = state.accept_inputs(accepting, run_inputs(cfg, tok, [(str(d64), None)]), tmp_path)
    assert reset.monitor["eval"] == {"baselines": {}, "best_loss": None, "best_step": None, "patience_ref": None,
                                     "since_improvement": 0, "last": {}}
    assert warning.startswith(f"--resume-accept-changed-inputs: resuming from checkpoint {tmp_path} on other inputs: "
                              f"the evaluation set (--eval-data-path): {held} differs in content")
    assert warning.endswith("; reset: the best evaluation (loss 1.5000 at step 4), the early-stopping patience counter")
    assert state.monitor == monitor  # the state read from the checkpoint is left as it was


def test_a_start_reads_each_source_once_and_an_edited_source_again(tmp_path, monkeypatch):
    """The data cache key and the fingerprint of one start share one read of each source (a warm
    start's fingerprint costs no second pass over the data); a source edited since is read again."""
    import hashlib
    import os

    from helpers import QA, chat, tiny_chat_tokenizer, write_jsonl
    from osft.trainer.data import fingerprint
    from osft.trainer.data.cache import tokenize_source

    reads, original = [], fingerprint.hash_source
    monkeypatch.setattr(fingerprint, "hash_source", lambda h, path: reads.append(path) or original(h, path))
    tok = tiny_chat_tokenizer()
    data = write_jsonl(tmp_path / "train.jsonl", [chat(q, a) for q, a in QA])
    cfg = TrainConfig("model", [str(data)], str(tmp_path / "out"), data_cache_dir=str(tmp_path / "cache"))
    assert [tokenize_source(cfg, str(data), tok, print)[1] for _ in range(2)] == [False, True]  # cold, then warm
    inputs = fingerprint.run_inputs(cfg, tok, [(str(data), None)])
    assert reads == [data.resolve()]
    assert inputs["training"][0]["sha256"] == hashlib.sha256(data.read_bytes()).hexdigest()

    answer = QA[0][1]
    data.write_text(data.read_text().replace(answer, answer[::-1], 1))  # the same size, another content, saved later
    os.utime(data, ns=(data.stat().st_atime_ns, data.stat().st_mtime_ns + 10**9))
    edited = fingerprint.run_inputs(cfg, tok, [(str(data), None)])
    assert reads == [data.resolve()] * 2
    assert edited["training"][0]["sha256"] == hashlib.sha256(data.read_bytes()).hexdigest() != inputs["training"][0]["sha256"]
    assert tokenize_source(cfg, str(data), tok, print)[1] is False  # a new cache entry for the new content
