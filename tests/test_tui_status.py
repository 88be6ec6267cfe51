"""osft-tui tells the truth about a run's state: a launch that fails at once, a launcher
that has not written its run.json yet, an unreadable run.json, a run that died without a word, a
run whose steps stall. Pilot tests against the fake trainer and hand-written run directories."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from osft.trainer.rundir import LauncherRecord
from osft.tui.app import OsftTui
from osft.tui.components.browser import RunBrowser
from osft.tui.components.header import RunHeader
from osft.tui.components.lines import LineView
from osft.tui.components.modals import Choice
from osft.tui.components.new_run import NewRunScreen
from osft.tui.run_state import NodeStats, RankInfo, RunModel
from osft.tui.status import LaunchFailure, judge, stalled_nodes
from test_tui_pilot import FAKE, fill_form
from textual.widgets import Input, RichLog
from tui_support import kill_run, wait_until

linux = pytest.mark.skipif(sys.platform != "linux", reason="signals and /proc: Linux only")


def header(app) -> str:
    return str(app.dashboard.query_one(RunHeader).content)


def events(app) -> str:
    return "\n".join(line.text for line in app.dashboard.query_one("#events", RichLog).lines)


def titles(app) -> list[str]:
    return [n.title for n in app._notifications]


def in_app(run_dir: Path | None, scenario, launcher: list[str] | None = None, size=(140, 42)) -> None:
    async def main():
        app = OsftTui(run_dir, launcher=launcher or [sys.executable, str(FAKE)], poll_s=0.1)
        async with app.run_test(size=size) as pilot:
            await scenario(app, pilot)

    asyncio.run(main())


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@linux
@pytest.mark.tui_process
def test_a_launch_that_fails_at_once_is_shown_and_the_form_comes_back_with_its_values(tmp_path):
    out = tmp_path / "run"

    async def scenario(app, pilot):
        first = await wait_until(pilot, lambda: isinstance(app.screen, NewRunScreen) and app.screen, 10, "the form")
        await fill_form(app, pilot, tmp_path, out, extra="--fake-step-seconds abc")  # argparse: exit code 2
        form = await wait_until(pilot, lambda: isinstance(app.screen, NewRunScreen) and app.screen is not first
                                and app.screen, 30, "the form again")
        assert form.query_one("#field-output_dir", Input).value == str(out)
        assert "--fake-step-seconds abc" in form.query_one("#field-extra_args", Input).value
        assert "launcher exited with code 2" in titles(app)
        await pilot.press("escape")  # back to the dashboard: it says why, in the run line and the events
        await wait_until(pilot, lambda: app.screen is app.dashboard and "launch failed" in header(app), 10,
                         "the dashboard's run line")
        assert "exited with code 2" in header(app)
        await wait_until(pilot, lambda: "invalid float value: 'abc'" in events(app), 10,
                         "the end of logs/launcher.node0.log in the events")

    try:
        in_app(None, scenario)
    finally:
        kill_run(out)


@linux
@pytest.mark.tui_process
def test_a_launcher_that_has_not_written_run_json_yet_is_starting(tmp_path):
    out = tmp_path / "run"

    async def scenario(app, pilot):
        await fill_form(app, pilot, tmp_path, out)
        dash = app.dashboard
        await wait_until(pilot, lambda: app.screen is dash and "starting" in header(app), 20, "the starting state")
        assert "no run.json" not in header(app)
        for s in dash.controls.launches.started:
            s.proc.kill()

    in_app(None, scenario, launcher=["sh", "-c", "exec sleep 60"])


@linux
@pytest.mark.tui_process
def test_an_unreadable_run_json_is_reported_with_its_json_error(tmp_path):
    (tmp_path / "run.json").write_text('{"job_id": "j", "state": "runn')  # cut short

    async def scenario(app, pilot):
        await wait_until(pilot, lambda: "unreadable run.json" in header(app), 20, "the report")
        assert "run.json: Unterminated string" in header(app)
        assert "run.json: Unterminated string" in events(app)
        await pilot.press("r")
        await wait_until(pilot, lambda: any("run.json: Unterminated string" in n.message for n in app._notifications),
                         10, "r's reason")

    in_app(tmp_path, scenario)


@linux
@pytest.mark.tui_process
def test_a_run_that_died_without_a_word_is_dead_with_its_clock_stopped(tmp_path):
    now = time.time()
    (tmp_path / "run.json").write_text(json.dumps(
        {"job_id": "j", "state": "running", "launcher_pid": dead_pid(), "hostname": socket.gethostname(),
         "start_time": now - 100, "updated_at": now - 95, "config": {"max_steps": 50}, "exit_code": None}))
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "node0.jsonl").write_text(json.dumps(
        {"ts": now - 90, "event": "step", "node_rank": 0, "rank": 0, "local_rank": 0, "world_size": 1,
         "hostname": socket.gethostname(), "job_id": "j", "step": 3, "loss": 1.0, "step_time_s": 1.0}) + "\n")

    async def scenario(app, pilot):
        await wait_until(pilot, lambda: " dead " in header(app), 20, "the dead state")
        line = header(app)
        assert "elapsed 10s" in line and "ETA" not in line and "no process of the run is left" in line
        await pilot.pause(1.2)
        assert "elapsed 10s" in header(app)  # the clock stopped at the last sign of life
        await pilot.press("c")  # nothing to ask: refused with the reason, no control/ file
        await wait_until(pilot, lambda: any("nothing sent: no process of the run is alive" in n.message
                                            for n in app._notifications), 10, "c's reason")
        assert not (tmp_path / "control").exists()

    in_app(tmp_path, scenario)


def test_a_running_run_whose_last_step_is_old_is_stalled(tmp_path):
    model = RunModel(tmp_path)
    model.set_launcher(0, LauncherRecord(state="running", start_time=1000.0))
    node = model.nodes[0] = NodeStats(0, step=5, last_ts=1100.0)
    node.step_times.extend([1.0, 1.2, 0.9])
    assert not judge(model, True, False, None, 1105.0).stalled  # within 10 s
    late = judge(model, True, False, None, 1130.0)
    assert late.stalled and late.last_step_age_s == 30.0 and late.state == "running"
    node.step_times.extend([20.0] * 5)  # slow steps: 30 s is within 5 median step times
    assert not judge(model, True, False, None, 1130.0).stalled


@linux
@pytest.mark.tui_process
def test_a_directory_an_earlier_run_left_outputs_in_asks_before_launching(tmp_path):
    out = tmp_path / "run"
    (out / "full_state_checkpoints" / "step_2").mkdir(parents=True)
    (out / "full_state_checkpoints" / "step_2" / "model.bin").write_bytes(b"\0")
    (out / "run.json").write_text(json.dumps({"job_id": "old", "state": "completed", "exit_code": 0,
                                              "launcher_pid": dead_pid(), "hostname": socket.gethostname(),
                                              "start_time": time.time() - 60}))

    async def scenario(app, pilot):
        await fill_form(app, pilot, tmp_path, out)
        choice = await wait_until(pilot, lambda: isinstance(app.screen, Choice) and app.screen, 10, "the question")
        assert "--resume" in str(choice.query_one(".dialog-body Static").content)
        await pilot.click("#edit")
        form = await wait_until(pilot, lambda: isinstance(app.screen, NewRunScreen) and app.screen, 10, "the form")
        assert form.query_one("#field-output_dir", Input).value == str(out)
        await pilot.press("ctrl+l")
        await wait_until(pilot, lambda: isinstance(app.screen, Choice), 10, "the question again")
        await pilot.click("#overwrite")
        dash = app.dashboard
        await wait_until(pilot, lambda: app.screen is dash and dash.run.step, 30, "the new run's first step")
        assert "--overwrite-output-dir" in json.loads((out / "run.json").read_text())["argv"]

    try:
        in_app(None, scenario)
    finally:
        kill_run(out)


def test_while_a_resume_loads_its_model_the_old_jobs_step_eta_and_stall_are_not_shown(tmp_path):
    model = RunModel(tmp_path)
    model.set_launcher(0, LauncherRecord(state="running", start_time=1000.0, job_id="new", config={"max_steps": 50}))
    model.step = 5
    node = model.nodes[0] = NodeStats(0, step=5, last_ts=900.0, job_id="old")  # the job the resume replaces
    node.step_times.extend([1.0, 1.0])
    status = judge(model, True, False, None, 1100.0)
    assert status.state == "running" and status.step is None and status.eta_s is None and not status.stalled
    assert status.last_step_age_s is None and status.detail.startswith("loading: no step of this job yet")
    node.job_id, node.last_ts = "new", 1099.0  # its first step
    status = judge(model, True, False, None, 1100.0)
    assert status.step == 5 and status.eta_s == 45.0 and status.detail == ""


def test_a_node_that_failed_mid_training_is_the_runs_failure_and_the_hung_node_is_stalled(tmp_path):
    """2 nodes: node 1's rank 1 failed in step 4 and its launcher ended; node 0 still runs, hung."""
    model = RunModel(tmp_path)
    model.set_launcher(0, LauncherRecord(state="running", start_time=1000.0, job_id="j", launcher_pid=10,
                                         config={"max_steps": 50}))
    model.set_launcher(1, LauncherRecord(state="failed", job_id="j", launcher_pid=11, exit_code=1))
    for n in (0, 1):  # node 0 finished step 3 and waits for node 1, whose rank failed in step 3
        node = model.nodes[n] = NodeStats(n, step=3 - n, last_ts=1003.0 - n, job_id="j")
        node.step_times.extend([1.0, 1.0, 1.0])
    model.step = 3
    model.ranks[1] = RankInfo(1, 1, 0, 11, "h", "j", 1000.0, error="RuntimeError: boom [/x]", exit_code=3)
    failure = LaunchFailure(11, 1, 1, ("the end of its log",))  # the launcher this dashboard started
    status = judge(model, True, False, failure, 1030.0)
    assert status.state == "failed" and status.detail == "at step 3 (rank 1: RuntimeError: boom [/x])"
    assert status.elapsed_s == 3.0  # to the last sign of life
    assert stalled_nodes(model, 1030.0) == {0} and stalled_nodes(model, 1005.0) == set()
    # a launcher started here that never wrote a state file, beside a run that is live: not its state
    assert judge(model, True, False, LaunchFailure(99, 0, 2, ()), 1030.0).state == "failed"
    model.set_launcher(1, LauncherRecord(state="running", job_id="j", launcher_pid=11))
    assert judge(model, True, False, LaunchFailure(99, 0, 2, ()), 1030.0).state == "running"
    model.launchers.clear()
    assert judge(model, None, False, LaunchFailure(99, 0, 2, ()), 1030.0).state == "launch failed"


def write_completed_run(root: Path) -> None:
    """A completed one-rank run of this host (its processes gone) with a complete checkpoint."""
    now = time.time()
    (root / "metrics").mkdir(parents=True)
    ckpt = root / "full_state_checkpoints" / "step_3"
    ckpt.mkdir(parents=True)
    (ckpt / "manifest.json").write_text(json.dumps({"format": 1, "files": {}}))
    (root / "run.json").write_text(json.dumps(
        {"job_id": "j", "state": "completed", "launcher_pid": dead_pid(), "hostname": socket.gethostname(),
         "exit_code": 0, "start_time": now - 60, "updated_at": now - 50, "export_dir": str(root / "hf_format"),
         "argv": ["osft-train", "--output-dir", str(root)], "config": {"max_steps": 3}}))
    (root / "metrics" / "node0.jsonl").write_text(json.dumps(
        {"ts": now - 55, "event": "step", "node_rank": 0, "rank": 0, "local_rank": 0, "world_size": 1,
         "hostname": socket.gethostname(), "job_id": "j", "step": 3, "loss": 1.0, "step_time_s": 1.0}) + "\n")


@linux
@pytest.mark.tui_process
def test_a_deleted_run_directory_is_said_and_the_keys_that_need_it_say_why(tmp_path):
    root = tmp_path / "run"
    write_completed_run(root)

    async def scenario(app, pilot):
        dash = app.dashboard
        await wait_until(pilot, lambda: dash.run.checkpoints and "completed" in header(app), 20, "the run")
        shutil.rmtree(root)
        await wait_until(pilot, lambda: f"run directory {root} no longer exists" in header(app), 10, "the deletion")
        said = f"run directory {root} no longer exists"
        for key, answer in (("y", "nothing to copy: "), ("r", "cannot resume: "), ("l", "no logs: ")):
            await pilot.press(key)
            await wait_until(pilot, lambda a=answer: any(n.message == a + said for n in app._notifications), 10, key)
        assert app.clipboard == "" and app.screen is dash and not dash.controls.launches.started
        assert not root.exists()

    in_app(root, scenario)


@linux
@pytest.mark.tui_process
def test_attaching_to_a_live_run_never_shows_it_dead_nor_rings(tmp_path):
    """Chosen in the run browser: liveness is unknown until the processes the run names are
    sampled, so the run is not dead meanwhile (a red event line, a bell)."""
    out = tmp_path / "runs" / "live"
    proc = subprocess.Popen([sys.executable, str(FAKE), "--output-dir", str(out), "--nproc-per-node", "1",
                             "--max-steps", "300", "--fake-step-seconds", "0.1", "--on-demand-checkpointing"],
                            start_new_session=True)
    deadline = time.monotonic() + 20
    while not (out / "metrics" / "node0.jsonl").is_file() and time.monotonic() < deadline:
        time.sleep(0.05)
    bells = []

    async def scenario(app, pilot):
        app.bell = lambda: bells.append(header(app))
        await wait_until(pilot, lambda: isinstance(app.screen, RunBrowser), 10, "the browser")
        await pilot.press("enter")
        dash = app.dashboard
        await wait_until(pilot, lambda: app.screen is dash and (dash.run.step or 0) >= 3, 20, "steps")
        view = dash.query_one(LineView)
        await wait_until(pilot, lambda: any("rank 0 started" in t.plain for _, t in view.entries), 10, "the events")
        lines = [t.plain for _, t in view.entries]
        assert not [line for line in lines if line.startswith("dead")] and not bells, (lines, bells)
        assert " running " in header(app)

    try:
        in_app(tmp_path / "runs", scenario)
    finally:
        proc.kill()
        kill_run(out)


@linux
@pytest.mark.tui_process
def test_a_run_that_ends_while_the_reader_lags_is_never_dead(tmp_path):
    """The run writes its last word and its processes exit; the dashboard's process sample finds
    none left before the reader's next poll has read that word: the run stays as it was (not dead,
    no bell) until the word arrives."""
    launcher = subprocess.Popen(["sleep", "60"])
    now = time.time()
    state = {"job_id": "j", "state": "running", "launcher_pid": launcher.pid, "hostname": socket.gethostname(),
             "start_time": now, "updated_at": now, "config": {"max_steps": 50}, "exit_code": None}
    (tmp_path / "run.json").write_text(json.dumps(state))
    bells, seen = [], []

    async def scenario(app, pilot):
        from osft.tui.reader import Reader

        app.bell = lambda: bells.append(header(app))
        dash = app.dashboard
        await wait_until(pilot, lambda: " running " in header(app), 20, "the running state")
        dash.reader.close()
        dash.reader = reader = Reader(tmp_path, 4.0)  # the reader lags the 1 s process samples by up to 4 s
        arrived, receive = [], reader.receive

        def receive_and_note():
            update = receive()
            if update is not None:
                arrived.append(time.time())
            return update

        reader.receive = receive_and_note
        read = await wait_until(pilot, lambda: arrived and arrived[0], 10, "an update of the lagging reader")
        (tmp_path / "run.json").write_text(json.dumps({**state, "state": "stopped", "exit_code": 0}))
        launcher.kill()
        launcher.wait()
        while " stopped " not in header(app):
            seen.append(header(app))
            assert time.time() < read + 15, seen[-1]
            await pilot.pause(0.05)
        assert len(arrived) >= 2
        assert not [s for s in seen if " dead " in s] and "dead" not in events(app) and not bells, (seen, bells)
        assert any(" running " in s for s in seen[-5:])  # the sample found no process before the word came

    try:
        in_app(tmp_path, scenario)
    finally:
        launcher.kill()
