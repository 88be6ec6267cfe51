"""Full-state checkpoints and bit-exact resume: real `osft-train` launchers, real torchrun worker
groups (2 ranks, gloo), real signals, real DCP files (docs/architecture.md sections 5 and 6;
docs/checkpoints.md): stops at every safe point, slow and cut-off saves, a broken newest checkpoint,
a missing shard, a checkpoint directory not shared between nodes, and the settings a resume
refuses."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
import torch
from helpers import QA, chat, tiny_chat_tokenizer, tiny_llama, write_jsonl
from osft.trainer.checkpoint.safe_load import SafeFileSystemReader
from osft.trainer.checkpoint.signals import TriggerDir
from osft.trainer.exit_codes import EXIT_STOPPED
from osft.trainer.checkpoint.store import newest_complete

pytestmark = pytest.mark.torchrun

STEPS = 8
#: The schedule of every run unless a test says otherwise: the learning rate changes every step, so
#: a scheduler that is not restored shows (the older tool resumed at lr 0).
SCHEDULE = ("--lr-scheduler", "cosine", "--warmup-steps", "3")
COMPARED = ("loss", "grad_norm", "lr", "num_tokens", "state_sha256")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """A tiny Llama with attention dropout (every rank draws its own random numbers), a tokenizer
    one token larger than its embedding table (resized at start), and 25 chat rows."""
    root = tmp_path_factory.mktemp("resume")
    tokenizer = tiny_chat_tokenizer()
    model = tiny_llama(len(tokenizer), hidden_size=64, intermediate_size=128, attention_dropout=0.1)
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(root / "model")
    tokenizer.add_tokens(["<extra_token>"])
    tokenizer.save_pretrained(root / "model")
    data = write_jsonl(root / "train.jsonl", [chat(q, a) for q, a in QA] * 5)
    return root / "model", data


def train(job, out, *flags, env=None, wait=True, data=None):
    """Start `osft-train` (the launcher) on 2 ranks; 5 samples per step over 2-3 micro-batches per rank
    (``data``: another training file than the job's)."""
    model, data = job[0], data or job[1]
    cmd = [sys.executable, "-m", "osft.trainer.launch.cli", "--model-name-or-path", str(model), "--data-path", str(data),
           "--output-dir", str(out), "--batch-size", "5", "--max-tokens-per-gpu", "64", "--max-seq-len", "64",
           "--learning-rate", "2e-3", "--weight-decay", "0.1", "--save-dtype", "float32", "--max-steps", str(STEPS),
           "--nproc-per-node", "2", "--on-demand-checkpointing", *SCHEDULE, *flags]
    env = {**os.environ, "OSFT_TEST_STATE_HASH": "1", **(env or {})}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if not wait:
        return proc
    try:
        output, _ = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        raise
    assert_no_orphans(out)
    return proc.returncode, output


def kill_tree(proc):
    family = [proc.pid, *(p.pid for p in psutil.Process(proc.pid).children(recursive=True))]
    for pid in family:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def assert_no_orphans(out):
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if str(out) in " ".join(p.info["cmdline"] or [])]
    assert not left, f"processes left behind: {left}"


def records(out, event=None):
    """The complete records of node 0's metrics file (a last line still being written, without its
    newline, is not one yet), those of ``event`` when given."""
    lines = (Path(out) / "metrics" / "node0.jsonl").read_text().split("\n")[:-1]
    recs = [json.loads(line) for line in lines]
    return [r for r in recs if event is None or r["event"] == event]


def complete_checkpoints(out):
    root = Path(out) / "full_state_checkpoints"
    return sorted(p.name for p in root.glob("step_*") if (p / "manifest.json").is_file())


def assert_same_steps(run, reference, first):
    got = {r["step"]: r for r in records(run, "step") if r["step"] >= first}
    want = {r["step"]: r for r in records(reference, "step") if r["step"] >= first}
    assert sorted(got) == sorted(want) == list(range(first, STEPS + 1))
    for step in want:
        for key in COMPARED:
            assert got[step][key] == want[step][key], (step, key, got[step][key], want[step][key])


@pytest.fixture(scope="module")
def reference(job, tmp_path_factory):
    """The uninterrupted 8-step run (OSFT, warmup + cosine)."""
    out = tmp_path_factory.mktemp("reference")
    code, output = train(job, out)
    assert code == 0, output
    steps = records(out, "step")
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert len({r["state_sha256"] for r in steps}) == STEPS
    return out


def exit_and_resume(job, tmp_path, point, micro, sig, *flags, env=None):
    """Signal (test hook: rank 0 sends it to the launcher at that safe point of step 3), expect
    exit code 75 with exactly one complete checkpoint, then resume with --resume."""
    out = tmp_path / "run"
    job_env = {"OSFT_JOB_ID": uuid.uuid4().hex[:12], **(env or {})}
    code, output = train(job, out, *flags, env={**job_env, "OSFT_TEST_SIGNAL_AT": f"3:{point}:{micro}:{sig}"})
    assert code == EXIT_STOPPED, output
    saved_step = 3 if point == "after_step" else 2
    assert complete_checkpoints(out) == [f"step_{saved_step}"]
    requested = records(out, "checkpoint_requested")
    assert [(r["signal"], r["step"], r["point"]) for r in requested] == [(sig, saved_step, point)]
    assert len(records(out, "checkpoint_saved")) == 1
    finished = records(out, "run_finished")[-1]
    assert (finished["reason"], finished["exit_code"]) == ("stopped", EXIT_STOPPED)
    assert json.loads((out / "run.json").read_text())["state"] == "stopped"
    # The same job id on the same node at once: no stale request fires again.
    code, output = train(job, out, "--resume", *flags, env=job_env)
    assert code == 0, output
    assert [r["from_step"] for r in records(out, "resumed")] == [saved_step]
    assert len(records(out, "checkpoint_requested")) == 1
    return out, saved_step


#: One job stopped five times and resumed after each stop: every safe point interrupts a real step,
#: each stop signal but SIGUSR1 (its own test) and SIGXCPU (the full fine-tuning test) ends a segment.
#: (step, point, micro-batch, signal, step saved): a request inside a step saves the step before it.
STOPS = [
    (2, "before_forward", 1, "SIGQUIT", 1),
    (3, "before_backward", 0, "SIGINT", 2),
    (5, "after_backward", 1, "SIGHUP", 4),
    (6, "eval", 1, "SIGUSR2", 6),  # inside the evaluation after step 6: the pass is abandoned
    (8, "before_forward", 0, "SIGTERM", 7),
]


def test_stops_at_every_safe_point_resume_bit_identically_and_a_stale_trigger_never_fires(job, reference, tmp_path):
    """Each segment of the chain checks what one stop-and-resume pair checked before: exit code 75
    with one new complete checkpoint at the right step, the request recorded once at its safe point,
    ``run.json`` stopped, the resume (same job id: no stale request fires again) continuing bit for
    bit with the uninterrupted run, the schedule going on, and each rank's generators saved apart.
    The fourth stop arrives inside the evaluation after step 6 (every segment evaluates): the pass
    is abandoned, not recorded, and the stop served by a checkpoint of step 6. Before the first
    segment a SIGTERM request of a killed earlier run lies in the job's trigger directory: it is
    removed with a warning and never served."""
    out = tmp_path / "run"
    job_id = uuid.uuid4().hex[:12]
    trigger = TriggerDir(job_id)
    trigger.record(signal.SIGTERM)
    past = time.time() - 60
    os.utime(trigger.files()[0].path, (past, past))
    metrics = out / "metrics" / "node0.jsonl"
    want = {r["step"]: r for r in records(reference, "step")}
    evaluation = ("--eval-data-path", str(job[1]), "--eval-max-samples", "10", "--eval-every-steps", "6")
    resumed_from = []
    for n, (step, point, micro, sig, saved) in enumerate(STOPS):
        lines_before = len(metrics.read_text().splitlines()) if metrics.is_file() else 0
        # Segments 1 and 3 recompute activations (--activation-checkpointing, FSDP2 and attention
        # dropout): their steps still equal the reference's bit for bit.
        flags = (("--resume",) if n else ()) + (("--activation-checkpointing",) if n % 2 else ()) + evaluation
        code, output = train(job, out, *flags,
                             env={"OSFT_JOB_ID": job_id, "OSFT_TEST_SIGNAL_AT": f"{step}:{point}:{micro}:{sig}"})
        assert code == EXIT_STOPPED, output
        segment = [json.loads(line) for line in metrics.read_text().splitlines()[lines_before:]]
        assert [r["config"]["activation_checkpointing"] for r in segment if r["event"] == "run_started"] == [n % 2 == 1]
        steps = [r for r in segment if r["event"] == "step"]
        first = resumed_from[-1] + 1 if resumed_from else 1
        assert [r["step"] for r in steps] == list(range(first, saved + 1)), (sig, [r["step"] for r in steps])
        for r in steps:
            for key in COMPARED:
                assert r[key] == want[r["step"]][key], (sig, r["step"], key, r[key], want[r["step"]][key])
        if n:
            assert 0 < steps[0]["lr"] != want[1]["lr"]  # warmup/cosine went on where it stopped
        resumed_from.append(saved)
        assert complete_checkpoints(out) == sorted(f"step_{s}" for s in resumed_from)
        requested = records(out, "checkpoint_requested")
        assert [(r["signal"], r["step"], r["point"]) for r in requested] == [(s[3], s[4], s[1]) for s in STOPS[:n + 1]]
        assert len(records(out, "checkpoint_saved")) == n + 1
        finished = records(out, "run_finished")[-1]
        assert (finished["reason"], finished["exit_code"]) == ("stopped", EXIT_STOPPED)
        assert json.loads((out / "run.json").read_text())["state"] == "stopped"
        assert [r["from_step"] for r in records(out, "resumed")] == resumed_from[:-1]
        ckpt = out / "full_state_checkpoints" / f"step_{saved}"
        # Each rank's generators are saved apart (they drew different amounts).
        rng = [torch.load(ckpt / f"rng_rank{r}.pt", weights_only=True) for r in (0, 1)]
        assert not torch.equal(rng[0]["torch"], rng[1]["torch"])
        if n == 0:  # the stale SIGTERM was removed at start and never served
            warnings = [r["message"] for r in records(out, "warning")]
            assert any("stale checkpoint request removed (trigger SIGTERM)" in w for w in warnings), warnings
            assert not trigger.path.exists()
    assert sorted({r["step"] for r in records(out, "eval")}) == [0]  # the pass after step 6 was abandoned
    code, output = train(job, out, "--resume", *evaluation, env={"OSFT_JOB_ID": job_id})
    assert code == 0, output
    assert sorted({r["step"] for r in records(out, "eval")}) == [0, 8]
    assert [r["from_step"] for r in records(out, "resumed")] == resumed_from
    assert len(records(out, "checkpoint_requested")) == len(STOPS)
    assert_same_steps(out, reference, resumed_from[-1] + 1)


def test_sigusr1_to_the_launcher_checkpoints_and_training_goes_on(job, reference, tmp_path):
    out = tmp_path / "run"
    proc = train(job, out, wait=False)
    deadline = time.monotonic() + 300
    while not (out / "metrics" / "node0.jsonl").is_file() or len(records(out, "step")) < 3:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)  # at whatever moment the ranks are in
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output
    assert_no_orphans(out)
    assert len(complete_checkpoints(out)) == 1
    (saved,) = records(out, "checkpoint_saved")
    assert records(out, "checkpoint_requested")[0]["signal"] == "SIGUSR1"
    assert_same_steps(out, reference, 1)  # a served request does not change the trajectory
    assert (out / "hf_format" / f"step_{STEPS}" / "model.safetensors").is_file()
    # Resuming from that checkpoint gives the same curve again.
    again = tmp_path / "again"
    code, output = train(job, again, "--resume-from-full-state-checkpoint", saved["path"])
    assert code == 0, output
    assert_same_steps(again, reference, saved["step"] + 1)


def test_async_checkpoints_let_training_go_on_a_stop_waits_and_the_resume_is_bit_identical(job, reference, tmp_path):
    """``--async-checkpoint``: periodic checkpoints (every 2 steps) and a SIGUSR1 checkpoint (after
    step 3) are written in the background with a manifest each; the trajectory is the reference's.
    No collective runs on a thread of a rank other than the training thread (DCP's planning runs in
    its checkpoint process; test hook ``OSFT_TEST_COLLECTIVE_THREADS``).
    Step 4's write is slowed (test hook: 3 s before its manifest), and a SIGTERM agreed before the
    forward of step 5 waits for it: the stop is served by that very checkpoint (same step), exit 75.
    The resume from it, with async periodic checkpoints again (the last one in flight during the
    final export), goes on bit for bit."""
    out = tmp_path / "run"
    threads = tmp_path / "threads"
    job_env = {"OSFT_JOB_ID": uuid.uuid4().hex[:12], "OSFT_TEST_COLLECTIVE_THREADS": str(threads)}
    flags = ("--async-checkpoint", "--checkpoint-every-steps", "2")
    code, output = train(job, out, *flags, env={**job_env, "OSFT_TEST_SAVE_DELAY_S": "3@4",
                                                "OSFT_TEST_SIGNAL_AT": "3:after_step:0:SIGUSR1,5:before_forward:0:SIGTERM"})
    assert code == EXIT_STOPPED, output
    assert complete_checkpoints(out) == ["step_2", "step_3", "step_4"]
    assert not list((out / "full_state_checkpoints").glob("step_*.tmp-*"))
    events = [(r["event"], r["step"], r.get("signal")) for r in records(out)
              if r["event"] in ("checkpoint_requested", "checkpoint_saved", "run_finished")]
    assert [e for e in events if e[0] == "checkpoint_requested"] == [("checkpoint_requested", 3, "SIGUSR1"),
                                                                     ("checkpoint_requested", 4, "SIGTERM")]
    assert [e[1] for e in events if e[0] == "checkpoint_saved"] == [2, 3, 4]
    # the stop was agreed while step 4 was still being written, and waited for it
    assert events.index(("checkpoint_requested", 4, "SIGTERM")) < events.index(("checkpoint_saved", 4, None))
    assert events[-1] == ("run_finished", 4, "SIGTERM")
    saved = {r["step"]: r for r in records(out, "checkpoint_saved")}
    assert saved[4]["seconds"] >= 3 > saved[4]["blocking_s"] > 0  # training went on during the slow write
    assert all(0 < r["blocking_s"] <= r["seconds"] for r in saved.values())
    assert "SIGTERM: served by the complete checkpoint of step 4" in output
    for step in (3, 4):  # every file of every rank is in the manifest (listed once it was on disk)
        ckpt = out / "full_state_checkpoints" / f"step_{step}"
        listed = set(json.loads((ckpt / "manifest.json").read_text())["files"])
        assert listed == {str(f.relative_to(ckpt)) for f in ckpt.rglob("*") if f.is_file()} - {"manifest.json"}
        assert {"model/.metadata", "model/__1_0.distcp", "optimizer_rank1.pt", "rng_rank0.pt", "trainer_state.json"} <= listed
    assert_same_steps_upto(out, reference, 4)
    code, output = train(job, out, "--resume", *flags, env=job_env)
    assert code == 0, output
    assert [r["from_step"] for r in records(out, "resumed")] == [4]
    assert_same_steps(out, reference, 5)
    assert complete_checkpoints(out) == ["step_2", "step_3", "step_4", "step_6", "step_8"]
    assert [r["step"] for r in records(out, "checkpoint_saved")] == [2, 3, 4, 6, 8]
    for rank in (0, 1):  # both runs watched every collective of the rank's threads
        assert (threads / f"collectives_rank{rank}.txt").read_text().splitlines() == ["watching"] * 2


def assert_same_steps_upto(run, reference, last):
    got = {r["step"]: r for r in records(run, "step")}
    want = {r["step"]: r for r in records(reference, "step")}
    assert sorted(got) == list(range(1, last + 1))
    assert all(got[s][k] == want[s][k] for s in got for k in COMPARED)


def test_full_fine_tuning_resumes_bit_identically(job, tmp_path):
    ref = tmp_path / "ref"
    assert train(job, ref, "--no-osft")[0] == 0
    # A slow save still completes inside the grace period.
    # With --activation-checkpointing (two ranks, FSDP2, attention dropout): the same steps bit for bit.
    out, saved_step = exit_and_resume(job, tmp_path, "after_backward", 0, "SIGXCPU", "--no-osft",
                                      "--activation-checkpointing", env={"OSFT_TEST_SAVE_DELAY_S": "4"})
    assert_same_steps(out, ref, saved_step + 1)
    assert not list((out / "full_state_checkpoints").glob("frozen_*"))


def test_periodic_checkpoints_retention_vocab_and_bad_checkpoints(job, tmp_path):
    out = tmp_path / "run"
    code, output = train(job, out, "--checkpoint-every-steps", "2", "--checkpoint-keep-last", "2", "--max-steps", "6")
    assert code == 0, output
    assert complete_checkpoints(out) == ["step_4", "step_6"]
    saved = records(out, "checkpoint_saved")
    assert [r["step"] for r in saved] == [2, 4, 6]
    assert all(r["bytes"] > 0 and r["seconds"] > 0 for r in saved)
    assert saved[0]["frozen_bytes"] > 0 and saved[1]["frozen_bytes"] == saved[2]["frozen_bytes"] == 0
    root = out / "full_state_checkpoints"
    base_vocab = json.loads((job[0] / "config.json").read_text())["vocab_size"]
    (frozen,) = root.glob("frozen_*")
    for step in (4, 6):
        manifest = json.loads((root / f"step_{step}" / "manifest.json").read_text())
        assert manifest["frozen"]["dir"] == frozen.name and manifest["world_size"] == 2
        frozen_keys = json.loads((frozen / "manifest.json").read_text())["keys"]
        # stored once per run: the frozen factors and the start values (no P/Q: nothing protected yet)
        assert {k.rsplit(".", 1)[1] for k in frozen_keys} == {"W_high", "U_basis", "V_basis", "U_start", "S_start",
                                                              "V_start", "sigma_frozen_min"}
        stored = SafeFileSystemReader(root / f"step_{step}" / "model").read_metadata().state_dict_metadata
        assert not set(frozen_keys) & set(stored) and any(k.endswith("U_low") for k in stored)
        state = json.loads((root / f"step_{step}" / "trainer_state.json").read_text())
        assert state["model"]["vocab_size"] == base_vocab + 1  # resized at start for the added token

    # Newest directory broken, odd entries around; --resume picks step_4.
    b04 = tmp_path / "b04"
    shutil.copytree(root, b04 / "full_state_checkpoints")
    broken = b04 / "full_state_checkpoints" / "step_8"
    (b04 / "full_state_checkpoints" / "step_6").rename(broken)
    (broken / "model" / ".metadata").unlink()
    (broken / "optimizer_rank1.pt").unlink()
    (b04 / "full_state_checkpoints" / "step_abc").mkdir()
    (b04 / "full_state_checkpoints" / "notes").mkdir()
    copy = tmp_path / "elsewhere" / "renamed.jsonl"  # the same data at another path: the same input
    copy.parent.mkdir()
    shutil.copyfile(job[1], copy)
    code, output = train(job, b04, "--resume", "--max-steps", "6", "--checkpoint-every-steps", "5",
                         "--checkpoint-keep-last", "1", env={"OSFT_TEST_SIGNAL_AT": "5:after_step:0:SIGTERM"},
                         data=copy)
    assert code == EXIT_STOPPED, output
    assert [r["from_step"] for r in records(b04, "resumed")] == [4]
    # ... bit for bit, with one embedding row more in the checkpoint than in the base model
    (got,) = records(b04, "step")
    (want,) = [r for r in records(out, "step") if r["step"] == 5]
    assert all(got[k] == want[k] for k in COMPARED)
    assert "checkpoint step_8 skipped" in output and "rank 0's file model/.metadata is missing" in output
    assert "step_abc skipped" in output and "notes skipped" in output
    assert complete_checkpoints(b04) == ["step_5", "step_8"]  # step_8 has a manifest, but its files are gone
    assert not (b04 / "full_state_checkpoints" / "step_4").exists()
    assert broken.exists()  # a broken directory is never taken for complete, and left for inspection

    # A deleted optimizer shard is an error naming the rank and the file.
    (root / "step_6" / "optimizer_rank1.pt").unlink()
    code, output = train(job, tmp_path / "b08", "--resume-from-full-state-checkpoint", str(root / "step_6"))
    assert code == 2
    assert "rank 1's file optimizer_rank1.pt is missing" in output

    # Another micro-batch budget (another accumulation) is refused before any rank starts.
    code, output = train(job, tmp_path / "b12", "--resume-from-full-state-checkpoint", str(root / "step_4"),
                         "--max-tokens-per-gpu", "128")
    assert code == 2 and not (tmp_path / "b12" / "logs").exists()
    assert "saved with --max-tokens-per-gpu 64, this run has 128: resume with the same setting" in output

    # Data of another content (same rows and samples, one row replaced) is refused before any rank
    # starts, naming the file; the checkpoint is left as it was.
    rows = [chat(q, a) for q, a in QA] * 5
    edited = write_jsonl(tmp_path / "edit.jsonl", [chat(*QA[1])] + rows[1:])
    before = {p.relative_to(root): p.read_bytes() for p in (root / "step_4").rglob("*") if p.is_file()}
    code, output = train(job, tmp_path / "edited", "--resume-from-full-state-checkpoint", str(root / "step_4"),
                         data=edited)
    assert code == 2 and not (tmp_path / "edited" / "logs").exists(), output
    assert (f"{edited} differs in content from {job[1]}, the file the checkpoint was trained with" in
            " ".join(output.split())), output
    assert {p.relative_to(root): p.read_bytes() for p in (root / "step_4").rglob("*") if p.is_file()} == before

    # Another world size is refused with both numbers.
    model, data = job
    code = subprocess.run(
        [sys.executable, "-m", "osft.trainer.launch.cli", "--model-name-or-path", str(model), "--data-path", str(data),
         "--output-dir", str(tmp_path / "one"), "--batch-size", "5", "--max-tokens-per-gpu", "64", "--max-seq-len", "64",
         "--resume-from-full-state-checkpoint", str(root / "step_4")], capture_output=True, text=True)
    assert code.returncode == 2
    assert "saved with 2 ranks, now 1" in code.stderr


def test_stop_cut_off_by_the_grace_period_leaves_no_usable_checkpoint(job, tmp_path):
    """A cut-off save: a save slower than the grace period is killed part way; the half-written
    directory is never resumed from, and the previous checkpoint is still there."""
    out = tmp_path / "run"
    env = {"OSFT_TEST_SIGNAL_AT": "3:after_step:0:SIGTERM", "OSFT_TEST_SAVE_DELAY_S": "120@3"}
    code, output = train(job, out, "--checkpoint-grace-seconds", "4", "--checkpoint-every-steps", "2",
                         "--checkpoint-keep-last", "1", env=env)
    assert code == 1, output
    assert "killing the worker group" in output
    root = out / "full_state_checkpoints"
    assert complete_checkpoints(out) == ["step_2"]
    (cut,) = root.glob("step_3.tmp-*")
    found, skipped = newest_complete(root)  # what --resume picks (test_periodic_... runs it for real)
    assert found == root / "step_2"
    assert skipped == [f"incomplete checkpoint step_3 skipped: {cut.name} was never finished"]


def test_checkpoint_directory_not_shared_between_nodes_fails_at_start(job, tmp_path):
    """A checkpoint directory not shared between nodes: two nodes whose output directories are
    different local folders."""
    from test_distributed import free_port

    endpoint = f"127.0.0.1:{free_port()}"
    env = {"OSFT_JOB_ID": uuid.uuid4().hex[:12]}  # one job (one rendezvous id), two storages
    procs = [train(job, tmp_path / f"node{n}", "--nproc-per-node", "1", "--nnodes", "2", "--node-rank", str(n),
                   "--rdzv-endpoint", endpoint, env=env, wait=False) for n in (0, 1)]
    try:
        outputs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p)
    assert all(p.returncode != 0 for p in procs), outputs
    assert any("must be on storage shared by every node" in o for o in outputs), outputs
    assert not (tmp_path / "node0" / "metrics" / "node0.jsonl").exists() or not records(tmp_path / "node0", "step")
