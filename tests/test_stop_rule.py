"""How a run ends (docs/checkpoints.md, "The rule for every request"; docs/architecture.md,
section 6): a stop request is never lost, also while a checkpoint is written; a signal during
start-up is held and served; a dead rank ends with one paragraph, not a traceback, and a resume
with no step left says so. Real launchers, real torchrun worker groups (gloo), real signals, real
DCP files."""

from __future__ import annotations

import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from osft.trainer.exit_codes import EXIT_FAILED, EXIT_STOPPED
from test_resume import complete_checkpoints, job, kill_tree, records, train  # noqa: F401 (job: fixture)

pytestmark = pytest.mark.torchrun


def caught(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (``SigCgt`` of /proc/PID/status)."""
    status = Path(f"/proc/{pid}/status").read_text()
    mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(mask >> (signum - 1) & 1)


def torch_loaded(pid: int) -> bool:
    return "libtorch_cpu" in Path(f"/proc/{pid}/maps").read_text()


def signal_as_soon_as_caught(pid: int, signum: int, timeout: float = 120) -> bool:
    """Send ``signum`` the moment ``pid`` catches it; returns whether torch was loaded by then
    (a handler installed only after the slow imports)."""
    deadline = time.monotonic() + timeout
    while not caught(pid, signum):
        assert time.monotonic() < deadline, f"pid {pid} never caught {signal.Signals(signum).name}"
        time.sleep(0.002)
    loaded = torch_loaded(pid)
    psutil.Process(pid).send_signal(signum)
    return loaded


def wait_for(predicate, proc, what, timeout=300):
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None or time.monotonic() > deadline:
            kill_tree(proc) if proc.poll() is None else None
            pytest.fail(f"{what}: never happened\n{proc.communicate()[0]}")
        time.sleep(0.01)


def finish(proc):
    try:
        output, _ = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        raise
    return proc.returncode, output


def test_a_stop_during_a_checkpoint_is_served_by_it_and_no_step_is_saved_twice(job, tmp_path):
    """A stop during a checkpoint: SIGUSR1 to the launcher at step 2, then SIGUSR2 while step_2 is
    written: exit 75 right after that checkpoint. Resumed, SIGTERM while the periodic step-4
    checkpoint is written: exit 75 with step_4 saved once."""
    out = tmp_path / "run"
    root = out / "full_state_checkpoints"
    proc = train(job, out, "--checkpoint-every-steps", "4", wait=False,
                 env={"OSFT_TEST_SIGNAL_AT": "2:after_step:0:SIGUSR1", "OSFT_TEST_SAVE_DELAY_S": "3@2"})
    wait_for(lambda: list(root.glob("step_2.tmp-*")), proc, "step_2 being written")
    proc.send_signal(signal.SIGUSR2)
    code, output = finish(proc)
    assert code == EXIT_STOPPED, output
    assert complete_checkpoints(out) == ["step_2"]
    assert [r["step"] for r in records(out, "step")] == [1, 2]  # no step after the stop
    assert [r["step"] for r in records(out, "checkpoint_saved")] == [2]
    assert [(r["signal"], r["step"]) for r in records(out, "checkpoint_requested")] == [("SIGUSR1", 2), ("SIGUSR2", 2)]
    finished = records(out, "run_finished")[-1]
    assert (finished["reason"], finished["signal"], finished["step"]) == ("stopped", "SIGUSR2", 2)

    proc = train(job, out, "--resume", "--checkpoint-every-steps", "4", wait=False,
                 env={"OSFT_TEST_SAVE_DELAY_S": "3@4"})
    wait_for(lambda: list(root.glob("step_4.tmp-*")), proc, "step_4 being written")
    proc.send_signal(signal.SIGTERM)
    code, output = finish(proc)
    assert code == EXIT_STOPPED, output
    assert complete_checkpoints(out) == ["step_2", "step_4"]
    assert [r["step"] for r in records(out, "checkpoint_saved")] == [2, 4]  # step 4 once
    assert [r["step"] for r in records(out, "step")] == [1, 2, 3, 4]
    assert records(out, "run_finished")[-1]["step"] == 4


def one_rank(job, out, *flags):
    """``osft-train`` in process (one rank), started without waiting."""
    model, data = job
    cmd = [sys.executable, "-m", "osft.trainer.launch.cli", "--model-name-or-path", str(model), "--data-path", str(data),
           "--output-dir", str(out), "--batch-size", "5", "--max-tokens-per-gpu", "64", "--max-seq-len", "64",
           "--max-steps", "2", "--on-demand-checkpointing", *flags]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_signals_during_start_up_are_held_and_a_resume_with_no_step_left_says_so(job, tmp_path):
    """Signals held at start-up (in-process rank): SIGUSR2 the moment osft-train can take it, long
    before torch is loaded: a complete checkpoint of step 0 and exit 75 (--no-osft: no start-up
    SVDs, so the stop is served at the first safe point; a fresh OSFT run's is agreed during its
    SVDs and saves nothing: tests/test_long_pass_stops.py). Resumed, SIGUSR1 during start-up is
    served by the checkpoint it resumed from (not saved again) and training goes on. A resume with
    no step left says so, not 'last loss nan'."""
    out = tmp_path / "run"
    proc = one_rank(job, out, "--no-osft")
    assert not signal_as_soon_as_caught(proc.pid, signal.SIGUSR2), "handler installed after torch was loaded"
    code, output = finish(proc)
    assert code == EXIT_STOPPED, output
    assert complete_checkpoints(out) == ["step_0"]
    assert [(r["signal"], r["step"]) for r in records(out, "checkpoint_requested")] == [("SIGUSR2", 0)]
    assert not records(out, "step")

    proc = one_rank(job, out, "--no-osft", "--resume", "--checkpoint-every-steps", "2")
    assert not signal_as_soon_as_caught(proc.pid, signal.SIGUSR1), "handler installed after torch was loaded"
    code, output = finish(proc)
    assert code == 0, output
    assert [(r["signal"], r["step"]) for r in records(out, "checkpoint_requested")] == [("SIGUSR2", 0), ("SIGUSR1", 0)]
    assert [r["step"] for r in records(out, "checkpoint_saved")] == [0, 2]  # step 0 not saved again
    assert [r["step"] for r in records(out, "step")] == [1, 2]
    assert "done: 2 steps, last loss" in output

    proc = one_rank(job, out, "--no-osft", "--resume")
    code, output = finish(proc)
    assert code == 0, output
    assert "nan" not in output
    assert "no step left to train: the run was resumed at step 2, its last step" in output


def test_a_dead_rank_ends_with_one_paragraph_and_a_worker_holds_start_up_signals(job, tmp_path):
    """Signals held at start-up (torchrun worker): SIGUSR1 to rank 1 the moment it can take it is
    served at step 0 and training goes on. A dead rank: rank 1 killed with SIGKILL while the step-4
    checkpoint is written: exit 1 and one paragraph naming the rank, the signal, the step, the
    newest complete checkpoint and the resume command; no traceback."""
    out = tmp_path / "run"
    root = out / "full_state_checkpoints"
    proc = train(job, out, "--checkpoint-every-steps", "2", wait=False, env={"OSFT_TEST_SAVE_DELAY_S": "30@4"})
    launcher = psutil.Process(proc.pid)

    def rank(r):
        for p in launcher.children(recursive=True):
            try:
                if "osft.trainer.worker" in p.cmdline() and p.environ().get("RANK") == str(r):
                    return p
            except psutil.NoSuchProcess:
                continue
        return None

    wait_for(lambda: rank(1) is not None, proc, "rank 1 started", timeout=120)
    rank1 = rank(1)
    assert not signal_as_soon_as_caught(rank1.pid, signal.SIGUSR1), "handler installed after torch was loaded"
    wait_for(lambda: list(root.glob("step_4.tmp-*")), proc, "step_4 being written")
    rank1.kill()
    code, output = finish(proc)
    assert code == EXIT_FAILED, output
    assert "Traceback" not in output
    assert [(r["signal"], r["step"]) for r in records(out, "checkpoint_requested")] == [("SIGUSR1", 0)]
    assert complete_checkpoints(out) == ["step_0", "step_2"]
    (paragraph,) = [line for line in output.splitlines() if line.startswith("training failed.")]
    assert f"Rank 1 (local rank 1, pid {rank1.pid}) was killed by SIGKILL." in paragraph
    assert "Last step finished: 4; the checkpoint step_4 was being written and is incomplete." in paragraph
    assert f"Newest complete checkpoint: {root / 'step_2'}. Resume with: " in paragraph
    command = shlex.split(paragraph.split("Resume with: ", 1)[1].split(" (rank logs:", 1)[0])
    assert command[0] == "osft-train" and command[-1] == "--resume"
    assert command[command.index("--output-dir") + 1] == str(out)


@pytest.mark.subprocess
def test_a_rank_that_aborts_in_native_code_leaves_its_python_stack_in_its_log(tmp_path):
    """A C++ ``std::terminate`` (SIGABRT) in a rank writes where the rank was (every thread's
    Python stack) to the stderr that torchrun keeps as the rank's log."""
    data = tmp_path / "train.jsonl"
    data.write_text("{}\n")
    script = ("import os, osft.trainer.run.loop as loop\n"
              "def abort_in_native_code(self, *args, **kwargs):\n"
              "    os.abort()\n"
              "loop.Trainer.__init__ = abort_in_native_code\n"
              "import runpy, sys\n"
              "runpy.run_module('osft.trainer.worker', run_name='__main__')\n")
    flags = ["--model-name-or-path", str(tmp_path), "--data-path", str(data), "--output-dir", str(tmp_path / "run")]
    done = subprocess.run([sys.executable, "-c", script, *flags], capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGABRT
    assert "Fatal Python error: Aborted" in done.stderr
    stack = done.stderr.split("most recent call first", 1)[1]
    assert "in abort_in_native_code" in stack and "worker.py" in stack and "in _main" in stack


def test_the_agent_names_a_rank_killed_by_a_signal_before_peers_that_failed_with_it():
    """How the failure paragraph picks the cause (``agent.cause_first``): seen in the same second,
    a rank killed by SIGKILL comes before the rank whose collective failed because of it (exit 1);
    the agent's own SIGTERM to the remaining ranks marks a follower; an earlier failure comes first."""
    from osft.trainer.launch.agent import cause_first
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    def failure(local_rank, exitcode, timestamp):
        f = ProcessFailure(local_rank=local_rank, pid=100 + local_rank, exitcode=exitcode, error_file="<N/A>")
        f.timestamp = timestamp
        return f

    same_second = {0: failure(0, 1, 50), 1: failure(1, -signal.SIGKILL, 50), 2: failure(2, -signal.SIGTERM, 50)}
    assert [rank for rank, _ in cause_first(same_second)] == [1, 0, 2]
    earlier_error = {0: failure(0, 1, 49), 1: failure(1, -signal.SIGKILL, 50)}
    assert [rank for rank, _ in cause_first(earlier_error)] == [0, 1]
