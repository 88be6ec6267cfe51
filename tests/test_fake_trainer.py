"""The fake trainer (``tests/fake_trainer.py``) keeps the run-directory and signal contract.

Real processes, real signals, real files: each test starts the fake launcher with short steps and
checks what a dashboard would see (``run.json``, metrics records, checkpoints, logs, exit codes,
processes left).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from osft.trainer.checkpoint.manifest import read_manifest, verify_files
from osft.trainer.checkpoint.signals import TriggerDir
from osft.trainer.exit_codes import EXIT_STOPPED

FAKE = Path(__file__).with_name("fake_trainer.py")
STEP = "0.1"

BASE_FIELDS = {"ts", "event", "node_rank", "rank", "local_rank", "world_size", "hostname", "job_id"}
STEP_FIELDS = {"loss", "grad_norm", "lr", "num_tokens", "num_loss_tokens", "num_samples", "step_time_s", "tokens_per_s",
               "node_tokens_per_s", "samples_per_s", "model_flops", "flops_per_s", "mfu", "node_mfu", "ortho_violations", "ortho_max_dev_deg", "step", "epoch",
               "ortho_violations_total", "rss_bytes", "gpu_mem_bytes", "gpus"}
RUN_JSON_FIELDS = {"argv", "config", "job_id", "launcher_pid", "torchrun_pids", "nnodes", "nproc_per_node", "start_time",
                   "state", "exit_code"}

pytestmark = [pytest.mark.tui_process,
              pytest.mark.skipif(sys.platform != "linux", reason="signals and /proc: Linux only")]


def records(out: Path, name: str = "node0") -> list[dict]:
    path = out / "metrics" / f"{name}.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def events(out: Path, event: str, name: str = "node0") -> list[dict]:
    return [r for r in records(out, name) if r["event"] == event]


def run_json(out: Path, node: int = 0) -> dict:
    return json.loads((out / ("run.json" if node == 0 else f"run.node{node}.json")).read_text())


def rank_pids(out: Path) -> list[int]:
    """Pids from every ``run_started`` record under ``out``."""
    files = sorted((out / "metrics").glob("*.jsonl")) if (out / "metrics").is_dir() else []
    return [r["pid"] for f in files for r in records(out, f.stem) if r["event"] == "run_started"]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def wait_until(predicate, timeout: float = 15.0, what: str = "condition"):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if result := predicate():
            return result
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def rank_log(out: Path, local_rank: int, name: str, node: int = 0) -> str:
    (path,) = (out / "logs" / f"node{node}").glob(f"*/attempt_0/{local_rank}/{name}")
    return path.read_text()


def steps_of(out: Path, name: str = "node0", job_id: str | None = None) -> list[int]:
    return [r["step"] for r in events(out, "step", name) if job_id is None or r["job_id"] == job_id]


@pytest.fixture
def launch(tmp_path):
    """``launch(out, *flags)`` starts the fake launcher; teardown kills whatever is left."""
    started: list[tuple[subprocess.Popen, Path]] = []

    def start(out: Path, *flags: str) -> subprocess.Popen:
        err = open(tmp_path / f"launcher{len(started)}.err", "w")
        proc = subprocess.Popen([sys.executable, str(FAKE), "--output-dir", str(out), *flags],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)
        err.close()
        proc.err_path = err.name
        started.append((proc, out))
        return proc

    yield start
    for proc, out in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in rank_pids(out):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_two_ranks_complete(tmp_path, launch):
    out = tmp_path / "run"
    proc = launch(out, "--nproc-per-node", "2", "--max-steps", "4", "--fake-step-seconds", STEP,
                  "--fake-violations-at", "2", "--fake-flood-lines-per-s", "50", "--some-real-flag", "7")
    wait_until(lambda: len(rank_pids(out)) == 2, what="run_started of both ranks")
    pids = rank_pids(out)
    assert all(alive(p) for p in pids) and proc.pid not in pids
    info = run_json(out)
    assert info["launcher_pid"] == proc.pid and info["state"] in ("starting", "running")
    assert proc.wait(timeout=15) == 0

    info = run_json(out)
    assert RUN_JSON_FIELDS <= set(info)
    assert (info["state"], info["exit_code"], info["torchrun_pids"], info["nproc_per_node"]) == ("completed", 0, [], 2)
    started = [r for f in ("node0", "rank1") for r in events(out, "run_started", f)]
    assert [(r["rank"], r["local_rank"], r["world_size"]) for r in started] == [(0, 0, 2), (1, 1, 2)]
    assert {r["job_id"] for r in started} == {info["job_id"]}
    steps = events(out, "step")
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all(set(r) == BASE_FIELDS | STEP_FIELDS for r in steps)
    assert [r["ortho_violations"] for r in steps] == [0, 2, 0, 0]
    assert [r["ortho_violations_total"] for r in steps] == [0, 2, 2, 2]
    assert steps[0]["loss"] > steps[-1]["loss"] and steps[0]["gpu_mem_bytes"] is None
    assert not events(out, "step", "rank1")  # only run_started/warning/error on a non-zero local rank
    assert [r["message"][:6] for r in events(out, "warning", "rank1")] == ["step 2"]
    (finished,) = events(out, "run_finished")
    assert (finished["reason"], finished["exit_code"], finished["step"]) == ("completed", 0, 4)
    assert (out / "hf_format" / "step_4").is_dir() and info["export_dir"] == finished["export_dir"]
    assert not any(alive(p) for p in pids)
    assert "step 4 rank 1" in rank_log(out, 1, "stdout.log")
    assert "rank 1 flood line 1 " in rank_log(out, 1, "stderr.log")


def test_sigusr1_checkpoints_and_continues(tmp_path, launch):
    out = tmp_path / "run"
    proc = launch(out, "--nproc-per-node", "2", "--max-steps", "10", "--fake-step-seconds", STEP,
                  "--on-demand-checkpointing", "--fake-save-seconds", "0.05")
    wait_until(lambda: steps_of(out), what="the first step")
    os.kill(proc.pid, signal.SIGUSR1)
    (first,) = wait_until(lambda: events(out, "checkpoint_saved"), what="a checkpoint")
    # the dashboard may signal a worker instead (os.kill, not killpg)
    rank1 = next(r["pid"] for r in events(out, "run_started", "rank1"))
    os.kill(rank1, signal.SIGUSR1)
    assert proc.wait(timeout=15) == 0

    lines = (out / "fake_signals.node0.log").read_text().splitlines()
    assert len(lines) == 1 and lines[0].split()[0] == "SIGUSR1" and float(lines[0].split()[1]) > 0
    assert (out / "fake_signals.rank1.log").read_text().split()[0] == "SIGUSR1"
    requested = events(out, "checkpoint_requested")
    assert [(r["signal"], r["point"]) for r in requested] == [("SIGUSR1", "after_step")] * 2
    saved = events(out, "checkpoint_saved")
    assert [s["step"] for s in saved] == [r["step"] for r in requested] and saved[0] == first
    root = out / "full_state_checkpoints"
    assert sorted(p.name for p in root.iterdir()) == sorted(f"step_{s['step']}" for s in saved)
    for s in saved:
        manifest = read_manifest(Path(s["path"]))
        verify_files(manifest)
        assert manifest.data["step"] == s["step"] and s["bytes"] > 0 and s["seconds"] >= 0.05
    assert steps_of(out) == list(range(1, 11))
    assert run_json(out)["state"] == "completed"
    assert not TriggerDir(run_json(out)["job_id"]).path.exists()


def test_a_stop_sent_while_a_checkpoint_is_written_still_stops(tmp_path, launch):
    """``c`` then ``s`` on the dashboard: the stop's trigger file appears while the first
    checkpoint is written; it stays pending and stops the run at the next step (it was removed with
    the served request before, and the run trained on: test_tui_keys timed out on it)."""
    out = tmp_path / "run"
    proc = launch(out, "--max-steps", "60", "--fake-step-seconds", STEP, "--on-demand-checkpointing",
                  "--fake-save-seconds", "1.5")
    wait_until(lambda: steps_of(out), what="the first step")
    os.kill(proc.pid, signal.SIGUSR1)
    wait_until(lambda: events(out, "checkpoint_requested"), what="the checkpoint being written")
    assert not events(out, "checkpoint_saved")
    os.kill(proc.pid, signal.SIGUSR2)
    assert proc.wait(timeout=30) == EXIT_STOPPED
    requested = [(r["signal"], r["step"]) for r in events(out, "checkpoint_requested")]
    assert [sig for sig, _ in requested] == ["SIGUSR1", "SIGUSR2"] and requested[1][1] > requested[0][1]
    (finished,) = events(out, "run_finished")
    assert (finished["reason"], finished["signal"], finished["step"]) == ("stopped", "SIGUSR2", requested[1][1])


def test_sigusr2_stops_then_resume(tmp_path, launch):
    out = tmp_path / "run"
    flags = ("--nproc-per-node", "2", "--fake-step-seconds", STEP, "--on-demand-checkpointing")
    proc = launch(out, *flags, "--max-steps", "100", "--fake-violations-at", "1")
    wait_until(lambda: len(steps_of(out)) >= 2, what="two steps")
    os.kill(proc.pid, signal.SIGUSR2)
    assert proc.wait(timeout=15) == EXIT_STOPPED

    info = run_json(out)
    assert (info["state"], info["exit_code"]) == ("stopped", EXIT_STOPPED)
    assert not any(alive(p) for p in rank_pids(out))
    (finished,) = events(out, "run_finished")
    n = finished["step"]
    assert (finished["reason"], finished["exit_code"], finished["signal"]) == ("stopped", EXIT_STOPPED, "SIGUSR2")
    ckpt = out / "full_state_checkpoints" / f"step_{n}"
    assert finished["checkpoint"] == str(ckpt) and steps_of(out)[-1] == n
    verify_files(read_manifest(ckpt))
    assert json.loads((ckpt / "trainer_state.json").read_text())["counters"]["ortho_violations_total"] == 2

    proc = launch(out, *flags, "--max-steps", str(n + 2), "--resume-from-full-state-checkpoint", str(ckpt))
    assert proc.wait(timeout=15) == 0
    job = run_json(out)["job_id"]
    assert job != info["job_id"] and run_json(out)["state"] == "completed"
    (resumed,) = [r for r in events(out, "resumed") if r["job_id"] == job]
    assert (resumed["from_step"], resumed["path"]) == (n, str(ckpt))
    new_steps = [r for r in events(out, "step") if r["job_id"] == job]
    assert [r["step"] for r in new_steps] == [n + 1, n + 2]
    assert new_steps[0]["ortho_violations_total"] == 2  # carried across the resume

    proc = launch(out, *flags, "--max-steps", str(n + 1), "--resume")  # newest complete checkpoint
    assert proc.wait(timeout=15) == 0
    assert [r["from_step"] for r in events(out, "resumed") if r["job_id"] == run_json(out)["job_id"]] == [n]


def test_resume_from_incomplete_checkpoint_is_refused(tmp_path, launch):
    out = tmp_path / "run"
    bad = out / "full_state_checkpoints" / "step_3"
    bad.mkdir(parents=True)
    (bad / "trainer_state.json").write_text('{"step": 3, "world_size": 1}')
    proc = launch(out, "--resume-from-full-state-checkpoint", str(bad))
    assert proc.wait(timeout=15) == 2
    assert str(bad) in Path(proc.err_path).read_text()
    assert (run_json(out)["state"], run_json(out)["exit_code"]) == ("failed", 2)
    assert not records(out)


@pytest.mark.parametrize(("name", "code"), [("checkpoint", 0), ("checkpoint-and-exit", EXIT_STOPPED)])
def test_control_file_requests_checkpoint(tmp_path, launch, name, code):
    out = tmp_path / "run"
    proc = launch(out, "--max-steps", "6", "--fake-step-seconds", STEP, "--on-demand-checkpointing",
                  "--fake-save-seconds", "0.05")
    wait_until(lambda: steps_of(out), what="the first step")
    (out / "control" / name).touch()
    assert proc.wait(timeout=15) == code
    (requested,) = events(out, "checkpoint_requested")
    (saved,) = events(out, "checkpoint_saved")
    assert requested["signal"] == "control" and saved["step"] == requested["step"]
    verify_files(read_manifest(Path(saved["path"])))
    assert not (out / "control" / name).exists()  # consumed
    assert steps_of(out)[-1] == (6 if code == 0 else saved["step"])


def test_crashing_rank_fails_the_job(tmp_path, launch):
    out = tmp_path / "run"
    proc = launch(out, "--nproc-per-node", "2", "--max-steps", "50", "--fake-step-seconds", STEP,
                  "--fake-crash-rank", "1", "--fake-crash-step", "2")
    assert proc.wait(timeout=15) == 1
    assert (run_json(out)["state"], run_json(out)["exit_code"]) == ("failed", 1)
    pids = rank_pids(out)
    assert len(pids) == 2 and not any(alive(p) for p in pids)
    err = rank_log(out, 1, "stderr.log")
    assert "Traceback (most recent call last):" in err and "RuntimeError: fake crash of rank 1 at step 2" in err
    (error,) = events(out, "error", "rank1")
    assert "fake crash" in error["message"] and "Traceback" in error["traceback"]
    assert not events(out, "run_finished")


def test_two_nodes_share_job_and_stop_together(tmp_path, launch):
    out = tmp_path / "run"
    flags = ("--nnodes", "2", "--rdzv-endpoint", "localhost:29411", "--max-steps", "100", "--fake-step-seconds", STEP,
             "--on-demand-checkpointing", "--fake-slow-node", "1", "--fake-slow-factor", "0.5")
    node0 = launch(out, *flags, "--node-rank", "0")
    node1 = launch(out, *flags, "--node-rank", "1")
    wait_until(lambda: len(steps_of(out)) >= 2 and len(steps_of(out, "node1")) >= 2, what="steps on both nodes")
    assert run_json(out)["job_id"] == run_json(out, 1)["job_id"]
    os.kill(node0.pid, signal.SIGUSR2)
    assert node0.wait(timeout=15) == EXIT_STOPPED
    assert node1.wait(timeout=15) == EXIT_STOPPED

    for node in (0, 1):
        info = run_json(out, node)
        assert (info["state"], info["exit_code"], info["nnodes"]) == ("stopped", EXIT_STOPPED, 2)
        (finished,) = events(out, "run_finished", f"node{node}")
        assert (finished["reason"], finished["exit_code"], finished["node_rank"]) == ("stopped", EXIT_STOPPED, node)
    saved0, saved1 = events(out, "checkpoint_saved"), events(out, "checkpoint_saved", "node1")
    assert [s["path"] for s in saved0] == [s["path"] for s in saved1] and len(saved0) == 1
    assert steps_of(out) == steps_of(out, "node1")
    last0, last1 = events(out, "step")[-1], events(out, "step", "node1")[-1]
    assert 0.35 < last1["node_tokens_per_s"] / last0["node_tokens_per_s"] < 0.65
    assert last0["tokens_per_s"] == pytest.approx(last0["node_tokens_per_s"] + last1["node_tokens_per_s"], rel=0.15)
    assert not any(alive(p) for p in rank_pids(out))
    assert (out / "fake_signals.node0.log").read_text().split()[0] == "SIGUSR2"
    assert not (out / "fake_signals.node1.log").exists()


def test_without_on_demand_checkpointing_sigterm_stops_at_once(tmp_path, launch):
    out = tmp_path / "run"
    proc = launch(out, "--nproc-per-node", "2", "--max-steps", "100", "--fake-step-seconds", STEP)
    wait_until(lambda: steps_of(out), what="the first step")
    os.kill(proc.pid, signal.SIGUSR1)  # ignored: on-demand checkpointing is off
    time.sleep(0.3)
    assert proc.poll() is None
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=15) == 128 + signal.SIGTERM
    assert (run_json(out)["state"], run_json(out)["exit_code"]) == ("stopped", 128 + signal.SIGTERM)
    assert [line.split()[0] for line in (out / "fake_signals.node0.log").read_text().splitlines()] == ["SIGUSR1", "SIGTERM"]
    assert not (out / "full_state_checkpoints").exists()
    assert not any(alive(p) for p in rank_pids(out))


def test_grace_period_kills_a_slow_checkpoint(tmp_path, launch):
    out = tmp_path / "run"
    proc = launch(out, "--nproc-per-node", "2", "--max-steps", "100", "--fake-step-seconds", STEP,
                  "--on-demand-checkpointing", "--fake-save-seconds", "30", "--checkpoint-grace-seconds", "1")
    wait_until(lambda: steps_of(out), what="the first step")
    os.kill(proc.pid, signal.SIGTERM)
    wait_until(lambda: run_json(out)["state"] == "checkpointing", timeout=5, what="state checkpointing")
    assert proc.wait(timeout=15) == 1
    assert (run_json(out)["state"], run_json(out)["exit_code"]) == ("failed", 1)
    assert not any(alive(p) for p in rank_pids(out))
    names = [p.name for p in (out / "full_state_checkpoints").iterdir()]
    assert len(names) == 1 and ".tmp-" in names[0]  # never completed, never renamed


def test_sigusr1_action_checkpoint_and_exit(tmp_path, launch):
    out = tmp_path / "run"
    proc = launch(out, "--max-steps", "100", "--fake-step-seconds", STEP, "--on-demand-checkpointing",
                  "--sigusr1-action", "checkpoint-and-exit", "--fake-save-seconds", "0.05")
    wait_until(lambda: steps_of(out), what="the first step")
    os.kill(proc.pid, signal.SIGUSR1)
    assert proc.wait(timeout=15) == EXIT_STOPPED
    (finished,) = events(out, "run_finished")
    assert (finished["signal"], run_json(out)["state"]) == ("SIGUSR1", "stopped")
    verify_files(read_manifest(Path(finished["checkpoint"])))
