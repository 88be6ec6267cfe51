"""One run per output directory (docs/checkpoints.md, "One run per output directory"). A second job
into a directory that a live job owns is refused before it writes anything; a finished or stopped
run's directory needs --resume or --overwrite-output-dir; nothing of the other job's checkpoints is
removed."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml
from helpers import QA, chat, write_jsonl

from osft.trainer.exit_codes import EXIT_STOPPED
from osft.trainer.launch.cli import main
from osft.trainer.launch.ownership import STALE_S, OutputDirInUse, check_output_dir
from osft.trainer.rundir import RunDir, write_json_atomic


def _flags(model, data, out) -> list[str]:
    return ["--model-name-or-path", str(model), "--data-path", str(data), "--output-dir", str(out), "--batch-size", "2",
            "--max-tokens-per-gpu", "96", "--max-seq-len", "64"]


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.2)


def _refused(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    return " ".join(capsys.readouterr().err.split())


@pytest.mark.torchrun
def test_a_second_run_is_refused_while_the_first_runs_and_needs_resume_or_overwrite_after(tiny_model_dir, tmp_path,
                                                                                            capsys):
    data = write_jsonl(tmp_path / "train.jsonl", [chat(q, a) for q, a in QA])
    out = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "osft.trainer.launch.cli", *_flags(tiny_model_dir, data, out),
                              "--max-steps", "100000", "--on-demand-checkpointing", "--checkpoint-every-steps", "2"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for(out / "full_state_checkpoints" / "step_2" / "manifest.json", first)
        owner = json.loads((out / "run.json").read_text())
        frozen = sorted(p.name for p in (out / "full_state_checkpoints").glob("frozen_*"))
        assert owner["launcher_pid"] == first.pid and frozen
        second = [*_flags(tiny_model_dir, data, out), "--max-steps", "4", "--seed", "7"]
        for extra in ([], ["--resume"], ["--overwrite-output-dir"]):
            err = _refused(capsys, [*second, *extra])
            assert f"is in use by job {owner['job_id']} (pid {first.pid} on host {socket.gethostname()})" in err
        # nothing of the second job was written: the first job's state, config and checkpoints are as it left them
        assert json.loads((out / "run.json").read_text())["job_id"] == owner["job_id"]
        assert yaml.safe_load((out / "config.yaml").read_text())["seed"] == 42
        assert set(frozen) <= {p.name for p in (out / "full_state_checkpoints").glob("frozen_*")}
        assert (out / "full_state_checkpoints" / "step_2" / "manifest.json").is_file()
        first.send_signal(signal.SIGTERM)
        output, _ = first.communicate(timeout=300)
        assert first.returncode == EXIT_STOPPED, output
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert {json.loads(line)["job_id"] for line in (out / "metrics" / "node0.jsonl").read_text().splitlines()} == {
        owner["job_id"]}
    err = _refused(capsys, second)
    assert f"holds the run of job {owner['job_id']}" in err and "state stopped" in err
    assert "--resume" in err and "--overwrite-output-dir" in err
    # killed without a word, its pid now another process: not live (process creation time), still not a new directory
    stranger = subprocess.Popen(["sleep", "60"])
    try:
        RunDir(out).update_run_json(state="running", exit_code=None, launcher_pid=stranger.pid)
        err = _refused(capsys, second)
        assert f"holds the run of job {owner['job_id']} (pid {stranger.pid}" in err and "state running" in err
    finally:
        stranger.kill()
        stranger.wait()
    assert main([*second, "--max-steps", "2", "--overwrite-output-dir"]) == 0
    assert not list((out / "full_state_checkpoints").glob("frozen_*")) and (out / "hf_format" / "step_2").is_dir()
    assert json.loads((out / "run.json").read_text())["job_id"] != owner["job_id"]
    # the overwrite was a one-time action: replaying the run's config.yaml without --resume is refused
    assert "overwrite_output_dir" not in (out / "config.yaml").read_text()
    capsys.readouterr()
    assert "--overwrite-output-dir" in _refused(capsys, ["--config", str(out / "config.yaml")])
    assert (out / "hf_format" / "step_2").is_dir()


def _record(run_dir: RunDir, **fields) -> None:
    run_dir.root.mkdir(parents=True, exist_ok=True)
    write_json_atomic(run_dir.run_json, {"job_id": "jobA", "state": "running", "exit_code": None, **fields})
    (run_dir.checkpoints / "step_2").mkdir(parents=True, exist_ok=True)


def test_a_live_launcher_on_this_host_is_told_from_a_reused_pid_by_its_creation_time(tmp_path):
    run_dir = RunDir(tmp_path / "run")
    parent = psutil.Process(os.getppid())
    _record(run_dir, launcher_pid=parent.pid, hostname=socket.gethostname(), launcher_create_time=parent.create_time())
    with pytest.raises(OutputDirInUse, match=f"is in use by job jobA \\(pid {parent.pid} on host"):
        check_output_dir(run_dir, resuming=True, overwrite=False)
    _record(run_dir, launcher_pid=parent.pid, hostname=socket.gethostname(),
            launcher_create_time=parent.create_time() - 3600)  # the recorded launcher started an hour earlier
    assert check_output_dir(run_dir, resuming=True, overwrite=False).job_id == "jobA"
    _record(run_dir, launcher_pid=parent.pid, hostname=socket.gethostname(), start_time=parent.create_time() - 3600)
    assert check_output_dir(run_dir, resuming=True, overwrite=False).job_id == "jobA"  # state file without it
    # a launcher that recorded its end (stopped, exit 75) while its process is still exiting holds
    # nothing: the dashboard's resume right after a stop must not be refused
    write_json_atomic(run_dir.run_json, {"job_id": "jobA", "state": "stopped", "exit_code": 75,
                                         "launcher_pid": parent.pid, "hostname": socket.gethostname(),
                                         "launcher_create_time": parent.create_time()})
    assert check_output_dir(run_dir, resuming=True, overwrite=False).job_id == "jobA"


def test_a_launcher_on_another_host_is_live_while_its_heartbeat_is_fresh(tmp_path, monkeypatch):
    run_dir = RunDir(tmp_path / "run", node_rank=1)
    _record(run_dir, launcher_pid=1234, hostname="elsewhere.example", slurm_job_id="77")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    write_json_atomic(run_dir.heartbeat, {"job_id": "jobA", "time": time.time() - 5})
    with pytest.raises(OutputDirInUse, match="in use by job jobA \\(pid 1234 on host elsewhere.example\\)"):
        check_output_dir(run_dir, resuming=True, overwrite=True)
    monkeypatch.setenv("SLURM_JOB_ID", "77")  # a requeued start of the same SLURM job: its earlier start is over
    assert check_output_dir(run_dir, resuming=True, overwrite=False).job_id == "jobA"
    monkeypatch.delenv("SLURM_JOB_ID")
    # a replacement pod of the same multi-node job (same derived job id) while the killed pod's heartbeat is fresh
    assert check_output_dir(run_dir, resuming=True, overwrite=False, job_id="jobA").job_id == "jobA"
    with pytest.raises(OutputDirInUse, match="in use by job jobA"):
        check_output_dir(run_dir, resuming=True, overwrite=False, job_id="jobB")
    write_json_atomic(run_dir.heartbeat, {"job_id": "jobA", "time": time.time() - STALE_S - 1})
    assert check_output_dir(run_dir, resuming=True, overwrite=False).job_id == "jobA"
    with pytest.raises(OutputDirInUse, match="holds the run of job jobA .* continue it with --resume"):
        check_output_dir(run_dir, resuming=False, overwrite=False)


def test_a_run_that_left_no_checkpoint_or_export_is_started_again(tmp_path):
    run_dir = RunDir(tmp_path / "run")
    run_dir.root.mkdir()
    write_json_atomic(run_dir.run_json, {"job_id": "jobA", "state": "failed", "exit_code": 2, "launcher_pid": 1,
                                         "hostname": "elsewhere"})
    assert check_output_dir(run_dir, resuming=False, overwrite=False).job_id == "jobA"
    assert check_output_dir(RunDir(tmp_path / "new"), resuming=False, overwrite=False) is None
