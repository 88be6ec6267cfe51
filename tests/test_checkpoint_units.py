"""Checkpoint building blocks on their own: triggers, request polling, manifests, retention, safe
loading and generator states (no torchrun; the worker-group tests are in test_resume.py)."""

from __future__ import annotations

import errno
import json
import os
import pickle
import random
import signal
import time
import uuid

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import QA, chat, write_jsonl
from osft.trainer.checkpoint.full_state import CheckpointWriteError, capture_rng, restore_rng
from osft.trainer.checkpoint.manifest import (
    CheckpointError,
    describe_files,
    read_manifest,
    verify_files,
    write_manifest,
)
from osft.trainer.checkpoint.requests import RequestPoller
from osft.trainer.checkpoint.safe_load import SafeFileSystemReader, load_plain
from osft.trainer.checkpoint.signals import (
    Action,
    TriggerDir,
    action_for_signal,
    install_handlers,
    restore_handlers,
)
from osft.trainer.checkpoint.store import (
    apply_retention,
    newest_complete,
    verify_checkpoint,
)
from osft.trainer.cli import main


@pytest.fixture()
def trigger():
    t = TriggerDir(f"test-{uuid.uuid4().hex[:8]}")
    yield t
    t.remove()


def test_every_signal_maps_to_its_action():
    assert action_for_signal(signal.SIGUSR1) is Action.CHECKPOINT
    assert action_for_signal(signal.SIGUSR1, "checkpoint-and-exit") is Action.CHECKPOINT_AND_EXIT
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2, signal.SIGXCPU, signal.SIGHUP, signal.SIGQUIT):
        assert action_for_signal(s) is Action.CHECKPOINT_AND_EXIT


def test_a_real_signal_is_recorded_in_a_private_trigger_dir(trigger):
    previous = install_handlers(trigger.record)
    try:
        os.kill(os.getpid(), signal.SIGUSR1)  # default action would kill this process
        os.kill(os.getpid(), signal.SIGUSR1)  # a repeated signal is a request of its own (one file each)
    finally:
        restore_handlers(previous)
    assert [t.signum for t in trigger.files()] == [signal.SIGUSR1, signal.SIGUSR1]
    assert (trigger.path.stat().st_mode & 0o777) == 0o700


def test_poller_agrees_on_the_strongest_request_and_forgets_served_ones(trigger, tmp_path):
    poller = RequestPoller(trigger, tmp_path, "checkpoint", rank=0)
    assert poller.poll("before_forward", 1) is None
    trigger.record(signal.SIGUSR1)
    trigger.record(signal.SIGTERM)
    request = poller.poll("after_backward", 1, 1)
    assert (request.action, request.signal, request.point) == (Action.CHECKPOINT_AND_EXIT, "SIGTERM", "after_backward")
    poller.served()
    assert poller.poll("after_step", 1) is None
    (tmp_path / "checkpoint").touch()  # a watcher on another host
    request = poller.poll("after_step", 2)
    assert (request.action, request.signal) == (Action.CHECKPOINT, "control")
    poller.served()
    assert not (tmp_path / "checkpoint").exists()


def test_a_claimed_request_is_passed_over_by_every_rank_until_its_checkpoint_is_complete(trigger, tmp_path):
    """--async-checkpoint: the requests a checkpoint written in the background serves stay pending
    (their files remain) but are not agreed again, also by a rank that had not seen them yet."""
    rank0 = RequestPoller(trigger, tmp_path, "checkpoint", rank=0)
    rank1 = RequestPoller(trigger, None, "checkpoint", rank=1)
    trigger.record(signal.SIGUSR1)
    (tmp_path / "checkpoint").touch()
    assert rank0.poll("after_step", 3).action is Action.CHECKPOINT
    claimed = rank0.claim()
    assert rank0.poll("before_forward", 4) is None and rank1.poll("before_forward", 4) is None
    trigger.record(signal.SIGTERM)  # arrives while the checkpoint is written: a request of its own
    assert rank0.poll("before_forward", 4).signal == "SIGTERM"
    assert [p.name.split(".")[0] for p in claimed[0]] == [f"claimed-sig{int(signal.SIGUSR1)}"]
    rank0.served(claimed)
    assert [t.signum for t in trigger.files()] == [signal.SIGTERM]
    assert not (tmp_path / "checkpoint").exists() and not list(trigger.path.glob("claimed-*"))


def test_a_failed_background_write_leaves_no_manifest_and_fails_the_run(tiny_model_dir, tmp_path, monkeypatch):
    """--async-checkpoint: a rank file that cannot be written (a full disk, injected) fails the
    checkpoint on the writer thread; the run fails on the training thread with the error, and the
    checkpoint never gets a manifest (so --resume never picks it). In process the error is raised;
    under torchrun the worker logs it as an ``error`` record and exits 1."""
    real_save = torch.save

    def full_disk(obj, f, *args, **kwargs):
        if "optimizer_rank" in str(f):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    data = write_jsonl(tmp_path / "train.jsonl", [chat(q, a) for q, a in QA[:4]] * 3)
    out = tmp_path / "run"
    with pytest.raises(CheckpointWriteError) as failed:
        main(["--model-name-or-path", str(tiny_model_dir), "--data-path", str(data), "--output-dir", str(out),
              "--batch-size", "4", "--max-tokens-per-gpu", "96", "--max-seq-len", "64", "--max-steps", "3",
              "--checkpoint-every-steps", "2", "--async-checkpoint"])
    root = out / "full_state_checkpoints"
    (cut,) = root.glob("step_2.tmp-*")
    assert str(failed.value) == ("checkpoint step_2 was not written (rank 0: OSError: [Errno 28] No space left on "
                                 f"device); it has no manifest.json, so it is never resumed from: {cut} is left for inspection")
    assert not (root / "step_2").exists() and not (cut / "manifest.json").exists()
    assert newest_complete(root)[0] is None
    assert json.loads((out / "run.json").read_text())["state"] == "failed"
    assert not [line for line in (out / "metrics" / "node0.jsonl").read_text().splitlines() if "checkpoint_saved" in line]


def test_async_checkpoint_needs_checkpoints_to_write(tiny_model_dir, tmp_path, capsys):
    data = write_jsonl(tmp_path / "train.jsonl", [chat(q, a) for q, a in QA[:4]])
    assert main(["--model-name-or-path", str(tiny_model_dir), "--data-path", str(data),
                 "--output-dir", str(tmp_path / "run"), "--async-checkpoint"]) == 2
    assert ("--async-checkpoint writes periodic and on-demand checkpoints in the background: it needs "
            "--checkpoint-every-steps N or --on-demand-checkpointing") in capsys.readouterr().err


def test_requests_older_than_the_job_are_stale(trigger, tmp_path):
    trigger.record(signal.SIGTERM)
    (tmp_path / "checkpoint-and-exit").touch()
    old = time.time() - 30
    os.utime(trigger.files()[0].path, (old, old))
    os.utime(tmp_path / "checkpoint-and-exit", (old, old))
    trigger.record(signal.SIGUSR1)  # arrived during this job's start-up: kept
    poller = RequestPoller(trigger, tmp_path, "checkpoint", rank=0)
    removed = poller.remove_stale(time.time() - 10)
    assert removed == ["trigger SIGTERM", f"control file {tmp_path / 'checkpoint-and-exit'}"]
    assert poller.poll("before_forward", 1).action is Action.CHECKPOINT


def make_checkpoint(root, step, payload=b"x" * 100):
    """A small checkpoint: real DCP shards from rank 0, a per-rank file from rank 1, a manifest."""
    d = root / f"step_{step}"
    dcp.save({"w": torch.ones(3)}, checkpoint_id=d / "model", no_dist=True)
    (d / "optimizer_rank1.pt").write_bytes(payload)
    files = {**describe_files(d, ["model/.metadata", "model/__0_0.distcp"], 0),
             **describe_files(d, ["optimizer_rank1.pt"], 1)}
    write_manifest(d, files, step=step)
    return d


def test_manifest_names_the_rank_and_file_of_every_problem(tmp_path):
    d = make_checkpoint(tmp_path, 3)
    verify_checkpoint(d)
    (d / "optimizer_rank1.pt").write_bytes(b"y" * 100)  # same size, other bytes
    verify_files(read_manifest(d), checksums=False)
    with pytest.raises(CheckpointError, match=r"rank 1's file optimizer_rank1.pt does not match its SHA-256"):
        verify_checkpoint(d)
    (d / "optimizer_rank1.pt").write_bytes(b"y")
    with pytest.raises(CheckpointError, match=r"rank 1's file optimizer_rank1.pt has 1 bytes, the manifest says 100"):
        verify_checkpoint(d, checksums=False)
    (d / "optimizer_rank1.pt").unlink()
    with pytest.raises(CheckpointError, match=r"rank 1's file optimizer_rank1.pt is missing"):
        verify_checkpoint(d)
    (d / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="incomplete checkpoint step_3 skipped: it has no manifest.json"):
        verify_checkpoint(d)


def test_newest_complete_skips_with_reasons_and_retention_keeps_the_newest(tmp_path):
    for step in (2, 4, 6):
        make_checkpoint(tmp_path, step)
    (tmp_path / "step_6" / "model" / ".metadata").unlink()
    (tmp_path / "step_8.tmp-abc").mkdir()
    (tmp_path / "notes").mkdir()
    found, skipped = newest_complete(tmp_path)
    assert found == tmp_path / "step_4"
    assert skipped == [
        "notes skipped: not a step_<N> checkpoint directory",
        "incomplete checkpoint step_8 skipped: step_8.tmp-abc was never finished",
        f"checkpoint step_6 skipped: checkpoint {tmp_path / 'step_6'}: rank 0's file model/.metadata is missing",
    ]
    (tmp_path / "frozen_old").mkdir()
    removed = apply_retention(tmp_path, keep_last=1, keep_frozen=None)
    assert set(removed) == {tmp_path / "step_2", tmp_path / "frozen_old"}
    assert (tmp_path / "step_4").is_dir() and (tmp_path / "step_6").is_dir()  # broken one left for inspection


class Exploit:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_that_runs_code_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    Exploit.marker = marker
    evil = tmp_path / "optimizer_rank0.pt"
    torch.save({"state": {}, "param_groups": [], "x": Exploit()}, evil)
    with pytest.raises(CheckpointError, match="refused to load"):
        load_plain(evil)
    # A crafted DCP .metadata (the stock reader would pickle.load it).
    ckpt = tmp_path / "dcp"
    dcp.save({"w": torch.ones(3)}, checkpoint_id=ckpt, no_dist=True)
    (ckpt / ".metadata").write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(CheckpointError, match=r"\.metadata: refused to load \(posix.system is not allowed"):
        SafeFileSystemReader(ckpt).read_metadata()
    assert not marker.exists()


def test_safe_reader_loads_a_real_dcp_checkpoint(tmp_path):
    state = {"a": torch.randn(4, 3), "b": torch.arange(5)}
    dcp.save(state, checkpoint_id=tmp_path, no_dist=True)
    loaded = {"a": torch.zeros(4, 3), "b": torch.zeros(5, dtype=torch.long)}
    dcp.load(loaded, storage_reader=SafeFileSystemReader(tmp_path), no_dist=True)
    assert torch.equal(loaded["a"], state["a"]) and torch.equal(loaded["b"], state["b"])


def test_generator_states_round_trip_through_a_weights_only_file(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.randn()  # leaves a cached Gaussian in NumPy's state
    torch.save(capture_rng(), tmp_path / "rng.pt")
    expected = (random.random(), np.random.randn(), torch.rand(3))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    restore_rng(load_plain(tmp_path / "rng.pt"))
    got = (random.random(), np.random.randn(), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])

