"""Checkpoint building blocks on their own: triggers, request polling, manifests, retention, safe
loading and generator states (no torchrun; the worker-group tests are in test_resume.py)."""

from __future__ import annotations

import errno
import json
import os
import pickle
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid

import numpy as np
import psutil
import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import QA, chat, write_jsonl
from osft.trainer.checkpoint.full_state import capture_rng, restore_rng
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
from osft.trainer.launch.cli import main


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


def test_a_failed_background_write_on_one_rank_gives_the_failure_paragraph(tiny_model_dir, tmp_path, monkeypatch,
                                                                           capsys):
    """--async-checkpoint on one rank (in process): the partial checkpoint a dead job left is
    removed at the start, with a line saying what and how many bytes. A rank file that cannot be written (a full
    disk, injected) fails the checkpoint on the writer thread and the run on the training thread.
    As on several ranks: exit 1, the full disk's one line, then the "training failed" paragraph
    (rank, error, last step, newest checkpoint, resume command, where the traceback is), no
    traceback on the console, an ``error`` record carrying the message, ``run.json`` failed. The
    checkpoint never gets a manifest and its partial directory is removed (it would keep the disk full)."""
    real_save = torch.save

    def full_disk(obj, f, *args, **kwargs):
        if "optimizer_rank" in str(f):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    data = write_jsonl(tmp_path / "train.jsonl", [chat(q, a) for q, a in QA[:4]] * 3)
    out = tmp_path / "run"
    argv = ["--model-name-or-path", str(tiny_model_dir), "--data-path", str(data), "--output-dir", str(out),
            "--batch-size", "4", "--max-tokens-per-gpu", "96", "--max-seq-len", "64", "--max-steps", "3",
            "--checkpoint-every-steps", "2", "--async-checkpoint"]
    root = out / "full_state_checkpoints"
    orphan = root / "step_7.tmp-deadjob0"  # a partial checkpoint of a job that died: removed at the start
    (orphan / "model").mkdir(parents=True)
    (orphan / "model" / "__0_0.distcp").write_bytes(b"x" * 300_000)
    capsys.readouterr()
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert ("checkpoints: removed 1 partial checkpoint(s) left by a job that is no longer running (0.3 MB): "
            "step_7.tmp-deadjob0 (0.3 MB)") in err
    assert not list(root.glob("step_*")) and newest_complete(root)[0] is None
    headline, paragraph = [line for line in err.splitlines() if line.strip()][-2:]
    assert re.fullmatch(rf"checkpoint step_2 not written: no space left on device \(errno 28, ENOSPC\) in {re.escape(str(root))}: "
                        r"about [0-9.]+ MB needed, [0-9.]+ MB free; newest complete: none", headline), headline
    message = ("CheckpointWriteError: checkpoint step_2 was not written (rank 0: OSError: [Errno 28] No space left on "
               f"device); it has no manifest.json, so it is never resumed from: {root}/step_2.tmp-")
    assert paragraph.startswith(f"training failed. Rank 0 (local rank 0, pid {os.getpid()}) exited with exit code 1: "
                                f"{message}"), paragraph
    assert re.search(r"was removed\. Last step finished: [23]\. There is no complete checkpoint; this starts the run "
                     r"again: osft-train --model-name-or-path .* \(traceback: the error record in "
                     + re.escape(str(out / "metrics" / "node0.jsonl")) + r"\)$", paragraph), paragraph
    assert "Traceback" not in err
    assert json.loads((out / "run.json").read_text())["state"] == "failed"
    recs = [json.loads(line) for line in (out / "metrics" / "node0.jsonl").read_text().splitlines()]
    (error,) = [r for r in recs if r["event"] == "error"]
    assert error["message"].startswith(message) and "Traceback" in error["traceback"]
    assert (error["headline"], error["errno"], error["checkpoint"], error["exit_code"]) == (headline, 28, "step_2", 1)
    assert not [r for r in recs if r["event"] == "checkpoint_saved"]


def test_a_failure_before_training_on_one_rank_gives_the_same_report(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """One rank, a failure while the trainer is built (a tracker that is installed but cannot be
    imported, injected): exit 1, the "training failed" paragraph and an ``error`` record, as a
    worker group reports it; no traceback on the console."""
    import osft.trainer.run.components

    def broken(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'google.protobuf'")

    monkeypatch.setattr(osft.trainer.run.components, "open_trackers", broken)
    data = write_jsonl(tmp_path / "train.jsonl", [chat(q, a) for q, a in QA[:4]])
    out = tmp_path / "run"
    capsys.readouterr()
    assert main(["--model-name-or-path", str(tiny_model_dir), "--data-path", str(data), "--output-dir", str(out),
                 "--max-steps", "1"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (paragraph,) = [line for line in err.splitlines() if line.startswith("training failed.")]
    assert paragraph.startswith(f"training failed. Rank 0 (local rank 0, pid {os.getpid()}) exited with exit code 1: "
                                "ModuleNotFoundError: No module named 'google.protobuf'. No step had finished.")
    (error,) = [json.loads(line) for line in (out / "metrics" / "node0.jsonl").read_text().splitlines()]
    assert (error["event"], error["message"], error["exit_code"]) == (
        "error", "ModuleNotFoundError: No module named 'google.protobuf'", 1)
    assert json.loads((out / "run.json").read_text())["state"] == "failed"


def test_the_failure_paragraph_names_the_failed_ranks_last_error_line_from_its_log(tmp_path):
    """A rank that died before it could write an ``error`` record (its traceback only in its
    ``stderr.log``): the paragraph quotes the last error line of its log; a line that only repeats
    the recorded message is not quoted again."""
    from osft.trainer.launch.failure_report import failure_paragraph
    from osft.trainer.rundir import RunDir

    run_dir = RunDir(tmp_path / "run")
    log = run_dir.root / "logs" / "node0" / "abc_1" / "attempt_0" / "1" / "stderr.log"
    log.parent.mkdir(parents=True)
    log.write_text("Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
                   "ModuleNotFoundError: No module named 'google.protobuf'\nsome later output\n")
    failures = {"1": {"local_rank": 1, "pid": 42, "exit_code": 1, "signal": None, "message": None},
                "0": {"local_rank": 0, "pid": 41, "exit_code": -15, "signal": "SIGTERM", "message": None}}
    paragraph = failure_paragraph(run_dir, "job", 1, failures, ["--output-dir", "run"])
    assert paragraph.startswith("training failed. Rank 1 (local rank 1, pid 42) exited with exit code 1. Its last "
                                "error line: ModuleNotFoundError: No module named 'google.protobuf'. Then rank 0 was "
                                "killed by SIGTERM. No step had finished."), paragraph
    failures["1"]["message"] = "ModuleNotFoundError: No module named 'google.protobuf'"
    assert "Its last error line" not in failure_paragraph(run_dir, "job", 1, failures, ["--output-dir", "run"])


def test_the_wait_for_the_previous_background_write_is_the_next_saves_blocking_time(tiny_model_dir, tmp_path,
                                                                                    monkeypatch):
    """--async-checkpoint with a checkpoint every step and every write held 2 s (test hook), so
    each save waits for the write before it (the orthogonality check, every step here, does not):
    that wait is counted in the next save's ``blocking_s`` (and ``seconds``), never in
    ``step_time_s`` (nor tokens/s and MFU, computed from it). Every checkpoint is complete, and
    DCP's checkpoint process has ended with the run (nothing is left behind)."""
    monkeypatch.setenv("OSFT_TEST_SAVE_DELAY_S", "2")
    data = write_jsonl(tmp_path / "train.jsonl", [chat(q, a) for q, a in QA[:4]] * 3)
    out = tmp_path / "run"
    assert main(["--model-name-or-path", str(tiny_model_dir), "--data-path", str(data), "--output-dir", str(out),
                 "--batch-size", "4", "--max-tokens-per-gpu", "96", "--max-seq-len", "64", "--max-steps", "3",
                 "--checkpoint-every-steps", "1", "--ortho-check-every", "1", "--async-checkpoint"]) == 0
    recs = [json.loads(line) for line in (out / "metrics" / "node0.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in recs if r["event"] == "step"}
    saved = {r["step"]: r for r in recs if r["event"] == "checkpoint_saved"}
    assert sorted(saved) == [1, 2, 3] and newest_complete(out / "full_state_checkpoints")[0].name == "step_3"
    for step in (2, 3):  # write step-1 (step-2) took 2 s; training waited for it during step 2 (3)
        assert steps[step]["step_time_s"] < 1.0, steps[step]
        assert saved[step]["blocking_s"] + steps[step]["step_time_s"] >= 1.9, (saved[step], steps[step])
        assert saved[step]["blocking_s"] <= saved[step]["seconds"]
        assert steps[step]["tokens_per_s"] == pytest.approx(steps[step]["num_tokens"] / steps[step]["step_time_s"])
    assert not running_spawned_children()


def running_spawned_children() -> list[psutil.Process]:
    """This process's descendants started by multiprocessing's spawn (DCP's checkpoint process) that
    are still running: a zombie (ended, not yet reaped; an earlier test's child too) or one that
    ends while it is looked at is not."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and "spawn_main" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.Error:
            continue
    return found


def test_a_collective_off_the_watching_thread_is_recorded(tmp_path, monkeypatch):
    """The watch of the asynchronous checkpoint test in tests/test_resume.py
    (``OSFT_TEST_COLLECTIVE_THREADS``): a collective of another thread is recorded with the
    thread's name, those of the watching thread are not; unset, the watch ends."""
    import threading

    import torch.distributed as dist
    from osft.trainer import test_hooks

    monkeypatch.setenv(test_hooks.COLLECTIVE_THREADS_ENV, str(tmp_path))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        test_hooks.watch_collective_threads(0)
        dist.all_reduce(torch.zeros(1))
        beside = threading.Thread(target=dist.barrier, name="beside")
        beside.start()
        beside.join()
    finally:
        monkeypatch.delenv(test_hooks.COLLECTIVE_THREADS_ENV)
        test_hooks.watch_collective_threads(0)
        dist.barrier()  # not recorded: no watch
        dist.destroy_process_group()
    assert (tmp_path / "collectives_rank0.txt").read_text().splitlines() == ["watching", "barrier beside"]


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



#: What runs in the private mount namespace of the full-disk test: three ``osft-train`` runs in one
#: interpreter (a run, a resume on the still-full disk, a resume once the filler is gone); after
#: each, the run directory without its checkpoints and a listing of them are copied out of the tmpfs.
FULL_DISK_SCRIPT = """
import json, os, shutil, sys
from pathlib import Path
from osft.trainer.launch.cli import main
argv, out, keep, room = sys.argv[1:-3], Path(sys.argv[-3]), Path(sys.argv[-2]), int(sys.argv[-1])
filler = out.parent / "filler"
stat = os.statvfs(out.parent)
with open(filler, "wb") as f:
    f.write(b"\\0" * (stat.f_bavail * stat.f_frsize - room))
for name, extra in (("full", []), ("still_full", ["--resume"]), ("freed", ["--resume"])):
    if name == "freed":
        filler.unlink()
    print(f"=== {name}", file=sys.stderr, flush=True)
    code = main(argv + extra)
    print(f"=== exit {code}", file=sys.stderr, flush=True)
    shutil.copytree(out, keep / name, ignore=shutil.ignore_patterns("full_state_checkpoints", "hf_format"))
    root = out / "full_state_checkpoints"
    listing = {p.name: sorted(str(f.relative_to(p)) for f in p.rglob("*")) for p in root.iterdir()}
    (keep / name / "listing.json").write_text(json.dumps(listing))
"""


def _can_mount_tmpfs() -> bool:
    return os.geteuid() == 0 and subprocess.run(["unshare", "-m", "--propagation", "private", "true"],
                                                capture_output=True).returncode == 0


@pytest.mark.subprocess
@pytest.mark.skipif(not shutil.which("unshare") or not _can_mount_tmpfs(), reason="needs root and unshare -m")
def test_a_full_disk_costs_nothing_and_the_run_resumes_bit_exactly_once_space_is_freed(tiny_model_dir, tmp_path,
                                                                                      monkeypatch):
    """A real full disk: a tmpfs in a private mount namespace, filled so that step_1 and step_2
    fit and step_3's save runs out of space part way. That run exits 1 with one line naming the
    error, the checkpoint, the directory, the bytes needed and free and the newest complete
    checkpoint, then the failure paragraph, no traceback; step_3's partial directory is removed,
    step_1 and step_2 stay complete, run.json says failed and the metrics hold the error. A
    ``--resume`` on the still-full disk says so in one line before training; once the filler is
    removed, ``--resume`` continues from step_2 bit for bit (state hashes of the uninterrupted run)."""
    data = write_jsonl(tmp_path / "train.jsonl", [chat(q, a) for q, a in QA[:4]] * 3)

    def argv(out):
        return ["--model-name-or-path", str(tiny_model_dir), "--data-path", str(data), "--output-dir", str(out),
                "--batch-size", "4", "--max-tokens-per-gpu", "96", "--max-seq-len", "64", "--max-steps", "4",
                "--learning-rate", "1e-3", "--checkpoint-every-steps", "1", "--no-data-cache"]

    monkeypatch.setenv("OSFT_TEST_STATE_HASH", "1")
    reference = tmp_path / "reference"
    assert main(argv(reference)) == 0
    ref_root = reference / "full_state_checkpoints"

    def size(path):
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())

    step = max(size(ref_root / f"step_{n}") for n in (1, 2, 3))
    room = sum(size(p) for p in ref_root.glob("frozen_*")) + 2 * step + step // 2 + 256 * 1024  # + metrics, run.json
    mount, keep = tmp_path / "disk", tmp_path / "kept"
    mount.mkdir()
    out = mount / "run"
    script = tmp_path / "full_disk.py"
    script.write_text(FULL_DISK_SCRIPT)
    shell = (f"mount -t tmpfs -o size=64m tmpfs {mount} && exec {sys.executable} {script} "
             + " ".join(argv(out)) + f" {out} {keep} {room}")
    done = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", shell], capture_output=True,
                          text=True, timeout=600)
    parts = re.split(r"^=== .+$", done.stderr, flags=re.M)
    assert re.findall(r"^=== exit (\d+)$", done.stderr, flags=re.M) == ["1", "1", "0"], done.stderr
    full, still, freed = parts[1], parts[3], parts[5]
    assert "Traceback" not in done.stderr
    root = out / "full_state_checkpoints"
    lines = [line for line in full.splitlines() if line.strip()]
    assert re.fullmatch(rf"checkpoint step_3 not written: no space left on device \(errno 28, ENOSPC\) in "
                        rf"{re.escape(str(root))}: about [0-9.]+ MB needed, [0-9.]+ MB free; newest complete: step_2",
                        lines[-2]), full
    assert lines[-1].startswith("training failed. Rank 0 ") and "Last step finished: 3." in lines[-1], full
    assert f"Newest complete checkpoint: {root / 'step_2'}. Resume with:" in lines[-1]
    listing = json.loads((keep / "full" / "listing.json").read_text())
    assert sorted(n for n in listing if n.startswith("step_")) == ["step_1", "step_2"]  # no step_3.tmp-*
    assert all("manifest.json" in listing[n] for n in ("step_1", "step_2"))
    assert json.loads((keep / "full" / "run.json").read_text())["state"] == "failed"
    recs = [json.loads(line) for line in (keep / "full" / "metrics" / "node0.jsonl").read_text().splitlines()]
    (error,) = [r for r in recs if r["event"] == "error"]
    assert (error["errno"], error["checkpoint"], error["headline"]) == (28, "step_3", lines[-2])
    assert still.strip().splitlines()[-1].startswith(f"osft-train: no space left for a checkpoint in {root}: "), still
    assert "resumed from" not in still
    assert f"resumed from {root / 'step_2'} at step 2" in freed, freed
    recs = [json.loads(line) for line in (keep / "freed" / "metrics" / "node0.jsonl").read_text().splitlines()]
    want = [json.loads(line) for line in (reference / "metrics" / "node0.jsonl").read_text().splitlines()]
    got = {r["step"]: (r["loss"], r["state_sha256"]) for r in recs if r["event"] == "step" and r["job_id"] == recs[-1]["job_id"]}
    assert got == {r["step"]: (r["loss"], r["state_sha256"]) for r in want if r["event"] == "step" and r["step"] > 2}
