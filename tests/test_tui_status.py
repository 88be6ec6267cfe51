"""osft-tui tells the truth about a run's state (issue 20): a launch that fails at once, a launcher
that has not written its run.json yet, an unreadable run.json, a run that died without a word, a
run whose steps stall. Pilot tests against the fake trainer and hand-written run directories."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from osft.tui.app import OsftTui
from osft.tui.components.header import RunHeader
from osft.tui.components.modals import Choice
from osft.tui.components.new_run import NewRunScreen
from osft.tui.run_state import NodeStats, RunModel
from osft.tui.status import judge
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
        assert "launch failed" in header(app) and "exited with code 2" in header(app)
        assert "invalid float value: 'abc'" in events(app)  # the end of logs/launcher.node0.log

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
        for s in dash.controls.started:
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
    model.set_launcher(0, {"state": "running", "start_time": 1000.0})
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
