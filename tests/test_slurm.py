"""``osft-train slurm-script``: the generated sbatch script, its flag checks, and the script run for
real as a two-node job on this machine (fake ``srun`` and ``scontrol``, real launchers and ranks)."""

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
from helpers import QA, chat, write_jsonl
from osft.trainer.exit_codes import EXIT_STOPPED
from osft.trainer.launch.cli import main
from osft.trainer.cluster.slurm import parse_time_limit

#: Steps of the two-node run: the stop request, sent after step 1, is served within a step or two.
STEPS = 16
TRAIN = ["--model-name-or-path", "/models/m", "--data-path", "/data/train.jsonl", "--output-dir", "/runs/x"]

#: Runs the command after srun's options once per node on this machine, as SLURM runs one task on
#: each node, with SLURM_NODEID set. A signal it receives goes to every process of every task, as
#: slurmstepd signals every process of a job step (its proctrack container): the launchers, the
#: torchrun agents, the ranks. Exit code: the highest of the tasks (128 + N for a task killed by N).
FAKE_SRUN = """#!{python}
import os, signal, subprocess, sys
import psutil

args = sys.argv[1:]
while args and args[0].startswith("--"):
    args.pop(0)
tasks = []

def forward(signum, _frame):
    for task in tasks:
        try:
            family = [task.pid, *(p.pid for p in psutil.Process(task.pid).children(recursive=True))]
        except psutil.NoSuchProcess:
            continue
        for pid in family:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

signal.signal(signal.SIGUSR2, forward)
signal.signal(signal.SIGTERM, forward)
for node in range(int(os.environ["SLURM_NNODES"])):
    tasks.append(subprocess.Popen(args, env={{**os.environ, "SLURM_NODEID": str(node)}}))
codes = [t.wait() for t in tasks]
sys.exit(max(c if c >= 0 else 128 - c for c in codes))
"""

#: ``show hostnames`` lists this machine; ``requeue`` is recorded in $FAKE_SLURM_LOG.
FAKE_SCONTROL = r"""#!/bin/bash
case "$1" in
    show) printf '127.0.0.1\nlocalhost\n' ;;
    requeue) echo "requeue $2" >> "$FAKE_SLURM_LOG" ;;
    *) echo "fake scontrol: unexpected arguments: $*" >&2; exit 1 ;;
esac
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def generate(capsys, *argv):
    code = main(["slurm-script", *argv])
    assert code == 0
    return capsys.readouterr().out


def usage_error(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exc:
        main(["slurm-script", *argv])
    assert exc.value.code == 2
    return capsys.readouterr().err


@pytest.mark.subprocess
def test_script_has_the_sbatch_options_and_is_valid_bash(capsys, tmp_path):
    script = generate(capsys, *TRAIN, "--max-steps", "100", "--nodes", "4", "--gpus-per-node", "8",
                      "--time", "1-00:00:00", "--partition", "gpu", "--account", "proj", "--job-name", "ft")
    directives = [line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH ")]
    assert directives == [
        "--job-name=ft", "--nodes=4", "--ntasks-per-node=1", "--gpus-per-node=8", "--time=1-00:00:00",
        "--signal=B:USR2@360", "--requeue", "--open-mode=append", "--output=/runs/x/logs/slurm-%j.out",
        f"--chdir={Path.cwd()}", "--partition=gpu", "--account=proj",
    ]  # 360 = the default --checkpoint-grace-seconds 300 + 60
    assert "--nproc-per-node 8" in script and "--on-demand-checkpointing" in script and "--resume" in script
    assert "scontrol requeue \"$SLURM_JOB_ID\"" in script and "trap 'forward USR2' USR2" in script
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True).returncode == 0


def test_signal_time_follows_the_grace_period_and_flags_are_quoted(capsys):
    script = generate(capsys, *TRAIN, "--checkpoint-grace-seconds", "100", "--osft-target-patterns", "q_proj$",
                      "a b", "--nodes", "1", "--gpus-per-node", "0", "--time", "30")
    assert "#SBATCH --signal=B:USR2@160" in script
    assert "#SBATCH --gpus-per-node" not in script  # no GPUs requested for G = 0
    assert "--osft-target-patterns 'q_proj$' 'a b'" in script and "--nproc-per-node 1" in script
    script = generate(capsys, *TRAIN, "--nodes", "1", "--gpus-per-node", "2", "--time", "30",
                      "--signal-seconds", "120", "--resume")
    assert "#SBATCH --signal=B:USR2@120" in script
    command = script.split("train=(")[1].split(")")[0]
    assert command.split().count("--resume") == 1 and "--nproc-per-node 2" in command


@pytest.mark.parametrize(("text", "seconds"), [
    ("90", 5400), ("10:30", 630), ("2:00:00", 7200), ("1-0", 86400), ("1-2:30", 95400), ("1-00:00:05", 86405),
])
def test_time_formats(text, seconds):
    assert parse_time_limit(text) == seconds


@pytest.mark.parametrize(("flags", "message"), [
    (["--nodes", "0", "--gpus-per-node", "1", "--time", "60"], "--nodes: expected a positive integer"),
    (["--nodes", "2", "--gpus-per-node", "-1", "--time", "60"], "--gpus-per-node: expected an integer >= 0"),
    (["--nodes", "2", "--gpus-per-node", "1", "--time", "1h"], "--time '1h': expected minutes"),
    (["--nodes", "2", "--gpus-per-node", "1", "--time", "0"], "must be longer than 0"),
    (["--nodes", "2", "--gpus-per-node", "1", "--time", "5"], "--signal-seconds 360 is not shorter than --time 5"),
    (["--nodes", "2", "--gpus-per-node", "1", "--time", "60", "--nnodes", "2"], "--nnodes is set by the generated job"),
    (["--nodes", "2", "--gpus-per-node", "1", "--time", "60", "--rdzv-endpoint", "h:1"], "--rdzv-endpoint is set by"),
    (["--nodes", "2", "--gpus-per-node", "1"], "the following arguments are required: --time"),
])
def test_bad_flags_exit_2(capsys, flags, message):
    assert message in usage_error(capsys, *TRAIN, *flags)


def test_missing_training_flag_exits_2(capsys):
    err = usage_error(capsys, "--data-path", "d", "--output-dir", "o", "--nodes", "1", "--gpus-per-node", "0",
                      "--time", "60")
    assert "--model-name-or-path" in err


def sbatch_arguments(line: str) -> list[str]:
    """The arguments sbatch reads from one ``#SBATCH`` line (after the prefix), by its documented
    rules: whitespace separates, ``'`` and ``"`` group and are removed, a backslash escapes the next
    character, an unquoted ``#`` starts a comment."""
    args, word, quote, escaped, started = [], [], "", False, False
    for ch in line:
        if escaped:
            word.append(ch)
            escaped = False
        elif ch == "\\":
            escaped = started = True
        elif quote:
            if ch == quote:
                quote = ""
            else:
                word.append(ch)
        elif ch in "'\"":
            quote, started = ch, True
        elif ch == "#":
            break
        elif ch.isspace():
            if started:
                args.append("".join(word))
            word, started = [], False
        else:
            word.append(ch)
            started = True
    if started:
        args.append("".join(word))
    return args


#: Stand-ins: srun fails at once; ``id`` leaves a mark, so a value that reached the shell as code shows.
STAND_INS = {
    "srun": "#!/bin/bash\nexit 1\n",
    "scontrol": "#!/bin/bash\n[ \"$1\" = show ] && echo node1\n",
    "id": "#!/bin/bash\ntouch \"$ID_MARK\"\n",
}


@pytest.mark.subprocess
@pytest.mark.parametrize("name", ["exp#1;$(id)", 'a"b`id`$(id)\'c', "x%j 100% $HOME"])
def test_values_are_quoted_in_the_script_and_the_sbatch_lines_and_never_run(capsys, tmp_path, name):
    """Values are data, never shell: the output dir, a job name with a space, a partition with
    quotes are data in every place the script embeds them; the failure branch names the directory
    literally."""
    out = f"{tmp_path}/runs/{name}"
    script = generate(capsys, "--model-name-or-path", "/m", "--data-path", "/d", "--output-dir", out, "--nodes", "1",
                      "--gpus-per-node", "0", "--time", "30", "--job-name", "my job #2", "--partition", 'p "q" \\r')
    directives = dict(sbatch_arguments(line.removeprefix("#SBATCH"))[0].partition("=")[::2]
                      for line in script.splitlines() if line.startswith("#SBATCH "))
    assert directives["--job-name"] == "my job #2" and directives["--partition"] == 'p "q" \\r'
    assert directives["--output"] == out.replace("%", "%%") + "/logs/slurm-%j.out"
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True).returncode == 0
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool, text in STAND_INS.items():
        (bin_dir / tool).write_text(text)
        (bin_dir / tool).chmod(0o755)
    mark = tmp_path / "id-ran"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "ID_MARK": str(mark), "SLURM_JOB_ID": "7",
           "SLURM_JOB_NODELIST": "node1", "SLURM_NNODES": "1"}
    run = subprocess.run(["bash", str(path)], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 1, run.stderr
    assert f"osft: training failed with exit code 1; rank logs under {out}/logs\n" in run.stderr
    assert not mark.exists(), "a value of the command line ran as shell code"


@pytest.mark.parametrize("flags", [["--output-dir", "/runs/x\nid"], ["--job-name", "a\nb"], ["--account", "a\rb"],
                                   ["--osft-target-patterns", "q\n#SBATCH --x"]])
def test_a_value_with_a_line_break_is_refused_before_anything_is_printed(capsys, flags):
    argv = [*TRAIN, "--nodes", "1", "--gpus-per-node", "0", "--time", "30"]
    if flags[0] in argv:
        argv[argv.index(flags[0]) + 1] = flags[1]
    else:
        argv += flags
    with pytest.raises(SystemExit) as exc:
        main(["slurm-script", *argv])
    captured = capsys.readouterr()
    assert exc.value.code == 2 and captured.out == ""
    assert "contains a control character" in captured.err


@pytest.mark.subprocess
def test_torchrun_agent_survives_the_signals_srun_forwards_to_every_process():
    """srun and ``scancel --signal`` signal every process of a job step, torchrun's agent included,
    which has no handler for SIGUSR1, SIGUSR2 or SIGXCPU: the launcher starts it with them ignored."""
    from osft.trainer.launch.launcher import AGENT_IGNORED_SIGNALS, _ignore_agent_signals

    proc = subprocess.Popen(["sleep", "30"], preexec_fn=_ignore_agent_signals)
    try:
        for signum in AGENT_IGNORED_SIGNALS:
            proc.send_signal(signum)
        time.sleep(0.3)
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def _records(out: Path, node: int, event: str) -> list[dict]:
    path = out / "metrics" / f"node{node}.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [r for r in map(json.loads, lines) if r["event"] == event]


def _kill_everything(proc: subprocess.Popen, out: Path) -> None:
    """SIGKILL the batch shell, its children and every process of the run (ranks run in sessions of their own)."""
    family = []
    try:
        family = [proc.pid, *(p.pid for p in psutil.Process(proc.pid).children(recursive=True))]
    except psutil.NoSuchProcess:
        pass
    family += [p.pid for p in psutil.process_iter(["cmdline"]) if str(out) in " ".join(p.info["cmdline"] or [])]
    for pid in family:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.torchrun
@pytest.mark.slow
def test_script_runs_two_nodes_checkpoints_on_usr2_requeues_and_resumes(tiny_model_dir, tmp_path, capsys):
    """The generated script, run by bash as SLURM would run it on the first node of a 2-node job:
    both nodes rendezvous; SIGUSR2 to the batch shell (what --signal=B:USR2@S sends) gives one
    complete checkpoint, exit code 75 and a requeue; the requeued job resumes from that checkpoint
    and completes."""
    data = write_jsonl(tmp_path / "train.jsonl", [chat(q, a) for q, a in QA] * 5)
    out = tmp_path / "run"
    script = tmp_path / "job.sbatch"
    script.write_text(generate(
        capsys, "--model-name-or-path", str(tiny_model_dir), "--data-path", str(data), "--output-dir", str(out),
        "--batch-size", "5", "--max-tokens-per-gpu", "96", "--max-seq-len", "64", "--max-steps", str(STEPS),
        "--learning-rate", "2e-3", "--save-dtype", "float32",
        "--nodes", "2", "--gpus-per-node", "0", "--time", "60", "--rdzv-port", str(free_port())))
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    for name, text in (("srun", FAKE_SRUN.format(python=sys.executable)), ("scontrol", FAKE_SCONTROL)):
        (fake_bin / name).write_text(text)
        (fake_bin / name).chmod(0o755)
    log = tmp_path / "scontrol.log"
    env = {**os.environ, "PATH": f"{fake_bin}:{Path(sys.executable).parent}:{os.environ['PATH']}",
           "SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "node[1-2]", "FAKE_SLURM_LOG": str(log)}
    env.pop("SLURM_RESTART_COUNT", None)

    def start(attempt: int) -> subprocess.Popen:
        with open(tmp_path / f"slurm-4242.{attempt}.out", "w") as stdout:
            return subprocess.Popen(["bash", str(script)], env=env, stdout=stdout, stderr=subprocess.STDOUT)

    def output(attempt: int) -> str:
        return (tmp_path / f"slurm-4242.{attempt}.out").read_text()[-6000:]

    proc = start(0)
    try:
        deadline = time.monotonic() + 300
        while not _records(out, 0, "step") and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _records(out, 0, "step"), output(0)
        proc.send_signal(signal.SIGUSR2)  # to the batch shell only, as --signal=B:USR2@S does
        assert proc.wait(timeout=300) == EXIT_STOPPED, output(0)

        checkpoints = sorted(p.name for p in (out / "full_state_checkpoints").glob("step_*")
                             if (p / "manifest.json").is_file())
        assert len(checkpoints) == 1, checkpoints
        saved = int(checkpoints[0].removeprefix("step_"))
        assert [r["signal"] for r in _records(out, 0, "checkpoint_requested")] == ["SIGUSR2"]
        assert [r["step"] for r in _records(out, 0, "checkpoint_saved")] == [saved]
        assert log.read_text().splitlines() == ["requeue 4242"]
        for node in (0, 1):  # both nodes trained in one world of 2 ranks
            steps = _records(out, node, "step")
            assert steps and {(r["node_rank"], r["world_size"]) for r in steps} == {(node, 2)}
            assert {r["job_id"] for r in _records(out, node, "run_started")} == {"slurm-4242-0"}

        env["SLURM_RESTART_COUNT"] = "1"  # the requeued job: SLURM starts the same script again
        proc = start(1)
        assert proc.wait(timeout=300) == 0, output(1)
        resumed = _records(out, 0, "resumed")
        assert [r["from_step"] for r in resumed] == [saved] and {r["job_id"] for r in resumed} == {"slurm-4242-1"}
        for node in (0, 1):
            assert [r["step"] for r in _records(out, node, "step") if r["job_id"] == "slurm-4242-1"] == \
                list(range(saved + 1, STEPS + 1))
        assert log.read_text().splitlines() == ["requeue 4242"]  # completed: no second requeue
        assert "osft: training completed" in output(1)
    finally:
        if proc.poll() is None:
            _kill_everything(proc, out)
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if str(out) in " ".join(p.info["cmdline"] or [])]
    assert not left, f"processes left behind: {left}"


@pytest.mark.torchrun
@pytest.mark.slow
def test_sigterm_to_every_process_of_a_node_still_stops_with_a_checkpoint(tiny_model_dir, tmp_path):
    """scancel and the time limit send SIGTERM to every process of a SLURM job: the launcher, the
    torchrun agent (which then fails) and the ranks. The ranks save one checkpoint, and the node's
    osft-train exits with code 75, not with the agent's failure."""
    data = write_jsonl(tmp_path / "train.jsonl", [chat(q, a) for q, a in QA] * 5)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "osft.trainer.launch.cli", "--model-name-or-path", str(tiny_model_dir),
           "--data-path", str(data), "--output-dir", str(out), "--batch-size", "5", "--max-tokens-per-gpu", "96",
           "--max-seq-len", "64", "--max-steps", "200", "--nproc-per-node", "2", "--on-demand-checkpointing"]
    with open(tmp_path / "out.log", "w") as stdout:
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while not _records(out, 0, "step") and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _records(out, 0, "step"), (tmp_path / "out.log").read_text()[-3000:]
        family = [proc.pid, *(p.pid for p in psutil.Process(proc.pid).children(recursive=True))]
        assert len(family) >= 4  # launcher, torchrun agent, 2 ranks
        for pid in family:
            os.kill(pid, signal.SIGTERM)
        assert proc.wait(timeout=300) == EXIT_STOPPED, (tmp_path / "out.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            _kill_everything(proc, out)
    saved = [r["step"] for r in _records(out, 0, "checkpoint_saved")]
    assert len(saved) == 1 and (out / "full_state_checkpoints" / f"step_{saved[0]}" / "manifest.json").is_file()
    assert json.loads((out / "run.json").read_text())["state"] == "stopped"
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if str(out) in " ".join(p.info["cmdline"] or [])]
    assert not left, f"processes left behind: {left}"
