"""osft-tui through Textual's Pilot against the fake trainer (tests/fake_trainer.py): real
processes, real signals, real run-directory files; nothing about signals or files is mocked.

Each test launches the fake run from the new-run form (the dashboard's launcher command is the
fake trainer), then drives the dashboard with key presses and checks the screen's widgets and
the run directory.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
from pathlib import Path

import psutil
import pytest
from osft.trainer.exit_codes import EXIT_STOPPED
from osft.tui.app import OsftTui
from osft.tui.components.charts import ThroughputChart
from osft.tui.components.checkpoints import CheckpointTable
from osft.tui.components.header import RunHeader
from osft.tui.components.lines import LineView
from osft.tui.components.modals import Choice, LogScreen
from osft.tui.components.new_run import NewRunScreen
from osft.tui.components.nodes import NodeTable
from osft.tui.components.ranks import RankTable
from osft.tui.components.violations import ViolationCounters
from osft.tui.keys import REPEAT_S
from osft.tui.format import fmt_compact
from textual.command import CommandList
from textual.widgets import Button, Input, RichLog
from tui_support import kill_run, no_processes_left, wait_until

FAKE = Path(__file__).with_name("fake_trainer.py")

pytestmark = [pytest.mark.tui_process,
              pytest.mark.skipif(sys.platform != "linux", reason="signals and /proc: Linux only")]


def records(out: Path, name: str = "node0", event: str | None = None) -> list[dict]:
    path = out / "metrics" / f"{name}.jsonl"
    if not path.is_file():
        return []
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    return [r for r in recs if event is None or r["event"] == event]


def signals_received(out: Path, node: int = 0) -> list[str]:
    path = out / f"fake_signals.node{node}.log"
    return [line.split()[0] for line in path.read_text().splitlines()] if path.is_file() else []


def run_json(out: Path) -> dict:
    return json.loads((out / "run.json").read_text())


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def run(tmp_path: Path, scenario) -> None:
    """Run ``scenario(app, pilot, out)`` in a dashboard with the fake trainer as its launcher, and
    kill whatever of the run is left afterwards. ``app.bells`` counts the terminal bells rung."""
    out = tmp_path / "run"

    async def main():
        app = OsftTui(None, launcher=[sys.executable, str(FAKE)], poll_s=0.1)
        app.bells = []
        app.NOTIFICATION_TIMEOUT = 600  # the toasts the tests read stay, however slow the machine
        app.bell = lambda: app.bells.append(app.dashboard.run.state)
        async with app.run_test(size=(140, 42)) as pilot:
            await scenario(app, pilot, out)

    try:
        asyncio.run(main())
    finally:
        kill_run(out)


async def fill_form(app, pilot, tmp_path: Path, out: Path, nnodes=1, nproc=2, max_steps=300, extra="") -> None:
    """Fill the new-run form (fake model and data in ``tmp_path``) and launch (ctrl+l)."""
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "train.jsonl").write_text("{}\n")
    form = await wait_until(pilot, lambda: isinstance(app.screen, NewRunScreen) and app.screen, 10, "the form")
    values = {"model": str(tmp_path / "model"), "data": str(tmp_path / "train.jsonl"), "output_dir": str(out),
              "nnodes": str(nnodes), "nproc_per_node": str(nproc), "max_steps": str(max_steps),
              "extra_args": f"--fake-step-seconds 0.1 --checkpoint-grace-seconds 20 {extra}"}
    for name, value in values.items():
        form.query_one(f"#field-{name}", Input).value = value
    await pilot.press("ctrl+l")


async def launch(app, pilot, tmp_path: Path, out: Path, nnodes=1, nproc=2, max_steps=300, extra="") -> None:
    """Fill the new-run form and launch (ctrl+l); wait for the dashboard and the first step."""
    await fill_form(app, pilot, tmp_path, out, nnodes, nproc, max_steps, extra)
    dash = app.dashboard
    await wait_until(pilot, lambda: app.screen is dash and dash.run and dash.run.step, 30, "the first step")


async def checkpoint(app, pilot, out: Path) -> dict:
    """After the next step, press ``c`` and wait until the dashboard has taken in the save (its
    request answered); returns the ``checkpoint_saved`` record."""
    dash = app.dashboard
    done = len(records(out, event="checkpoint_saved"))
    step = dash.run.step
    await wait_until(pilot, lambda: dash.run.step > step, 20, "a step")
    await pilot.pause(REPEAT_S)  # a press, not the auto-repeat of the one before
    await pilot.press("c")
    await wait_until(pilot, lambda: len(records(out, event="checkpoint_saved")) > done
                     and not dash.controls.requests.pending.steps, 20, "a checkpoint")
    return records(out, event="checkpoint_saved")[done]


def test_tables_and_counters_show_the_values_written(tmp_path):
    async def scenario(app, pilot, out):
        await launch(app, pilot, tmp_path, out, nnodes=2, nproc=2, max_steps=6,
                     extra="--fake-violations-at 3 --fake-slow-node 1 --fake-slow-factor 0.5 --fake-gpus")
        dash = app.dashboard
        await wait_until(pilot, lambda: dash.run.finished and dash.run.step == 6
                         and dash.run.nodes[1].step == 6, 60, "the end of the run")
        await pilot.pause(0.3)
        table = dash.query_one(NodeTable)
        for node in (0, 1):
            last = records(out, f"node{node}", "step")[-1]
            def cell(column: str) -> str:
                return str(table.get_cell(f"node{node}", column))

            tokens = fmt_compact(last["node_tokens_per_s"])
            assert cell("node") == ("[b red]1 slow[/]" if node == 1 else "0")  # the straggler, on its row
            assert cell("ranks") == ("0-1" if node == 0 else "2-3") and cell("step") == "6"
            assert cell("tokens/s") == (f"[b red]{tokens}[/]" if node == 1 else tokens)
            assert cell("MFU") == f"{last['node_mfu']:.0%}" and cell("loss") == f"{last['loss']:.4f}"
            assert cell("step time") == f"{last['step_time_s']:.2f} s" and cell("lr") == f"{last['lr']:.2e}"
            assert cell("grad norm") == f"{last['grad_norm']:.3f}"
        steps = records(out, "node0", "step")
        total = steps[-1]["ortho_violations_total"]
        assert total > 0 and total == sum(r["ortho_violations"] for r in steps)
        counters = dash.query_one(ViolationCounters)
        assert counters.has_class("alert")
        assert f"total [b]{total}[/b]" in str(counters.content)
        worst = max(r["ortho_max_dev_deg"] for r in steps)
        assert f"{worst:.3f}°" in str(counters.content)
        ranks = dash.query_one(RankTable)
        assert len(ranks.rows) == 4
        # each rank's GPU, from its node's step records: local rank L at 40 + 10·L % and (L + 1) GB
        assert [(str(ranks.get_cell(f"rank{r}", "GPU %")), str(ranks.get_cell(f"rank{r}", "GPU mem")))
                for r in range(4)] == [("40", "1.0 GB"), ("50", "2.0 GB")] * 2
        assert dash.run.state == "completed"
        # a rank that wrote no exit record of its own ended with its node, cleanly
        def states() -> list[str]:
            return [str(ranks.get_cell(f"rank{r}", "state")) for r in range(4)]

        clean = ("exited (code 0)", "ended (node code 0)")
        await wait_until(pilot, lambda: all(x in clean for x in states()), 10, f"every rank row in {clean}")

        # the end rang the bell once (never "dead" on the way: a sample that finds the launchers gone
        # before run.json's end was read waits for the reader) and said where the export is; y copies it
        export = run_json(out)["export_dir"]
        assert export and len(app.bells) == 1, app.bells
        done = [n for n in app._notifications if n.title == "run completed"]
        assert len(done) == 1 and done[0].message == f"export: {export} (y copies it)"
        await pilot.press("y")
        assert app.clipboard == export
        assert any(n.title == "copied the export path" and n.message == export for n in app._notifications)

        # another run: every pane forgets this one; the form has the values of the last launch
        await pilot.press("n")
        form = await wait_until(pilot, lambda: isinstance(app.screen, NewRunScreen) and app.screen, 10, "the form")
        assert form.query_one("#field-output_dir", Input).value == str(out)
        assert form.query_one("#field-nnodes", Input).value == "2"
        await fill_form(app, pilot, tmp_path, tmp_path / "second", nnodes=1, nproc=1, max_steps=300)
        await wait_until(pilot, lambda: app.screen is dash and dash.run.root == tmp_path / "second"
                         and dash.run.step, 30, "the second run's first step")
        await pilot.pause(1.2)  # a slow redraw (rank table, charts)
        assert set(table.rows) == {"node0"} and set(ranks.rows) == {"rank0"}
        assert [label for label, _ in dash.query_one(ThroughputChart).curves] == ["node 0"]
        events = "\n".join(line.text for line in dash.query_one("#events", RichLog).lines)
        assert "rank 3 started" not in events and not counters.has_class("alert")
        kill_run(tmp_path / "second")

    run(tmp_path, scenario)


def test_c_sends_exactly_one_sigusr1_and_the_checkpoint_is_listed_then_s_stops(tmp_path):
    """`c` with the focus on the rank table, then the Checkpoint button, then `s`."""
    async def scenario(app, pilot, out):
        await launch(app, pilot, tmp_path, out)
        dash = app.dashboard
        await wait_until(pilot, lambda: dash.run.step >= 2, 20, "step 2")
        dash.query_one(RankTable).focus()  # keys work whatever has the focus
        await pilot.press("c")
        await wait_until(pilot, lambda: any(e.complete for e in dash.run.checkpoints), 20, "a checkpoint")
        saved = records(out, event="checkpoint_saved")
        assert len(saved) == 1
        await pilot.pause(0.5)
        assert signals_received(out) == ["SIGUSR1"]
        table = dash.query_one(CheckpointTable)
        assert table.get_row(saved[0]["path"])[0] == str(saved[0]["step"])
        assert table.get_row(saved[0]["path"])[1] == "complete"
        await pilot.press("y")  # no export yet: the selected checkpoint
        assert app.clipboard == saved[0]["path"]
        assert any(n.title == f"copied the checkpoint of step {saved[0]['step']} path" for n in app._notifications)
        written = f"checkpoint of step {saved[0]['step']} written to {saved[0]['path']}"
        def events_with_save() -> str | None:
            text = "\n".join(line.text for line in dash.query_one("#events", RichLog).lines)
            return text if written in text else None

        log_text = await wait_until(pilot, events_with_save, 10, "the event line of the save")
        assert "checkpoint requested at step" in log_text and "SIGUSR1 sent to launcher of node 0" in log_text
        launcher = run_json(out)["launcher_pid"]
        step = dash.run.step
        await wait_until(pilot, lambda: dash.run.step >= step + 2, 20, "training to go on")
        assert alive(launcher) and dash.run.state == "running"

        await pilot.click("#button-checkpoint")  # the same through its button
        await wait_until(pilot, lambda: len(records(out, event="checkpoint_saved")) == 2, 20, "the second checkpoint")
        assert signals_received(out) == ["SIGUSR1", "SIGUSR1"]

        await pilot.press("s")
        await wait_until(pilot, lambda: dash.run.state == "stopped", 30, "the stop")
        assert signals_received(out) == ["SIGUSR1", "SIGUSR1", "SIGUSR2"]
        assert run_json(out)["exit_code"] == EXIT_STOPPED
        assert await no_processes_left(out)

    run(tmp_path, scenario)


def test_r_resumes_from_the_selected_checkpoint_with_the_resume_flag(tmp_path):
    async def scenario(app, pilot, out):
        await launch(app, pilot, tmp_path, out)
        dash = app.dashboard
        table = dash.query_one(CheckpointTable)
        first = await checkpoint(app, pilot, out)  # two checkpoints; the older one is resumed from
        await checkpoint(app, pilot, out)
        await wait_until(pilot, lambda: sum(e.complete for e in dash.run.checkpoints) == 2, 10, "both listed")
        await wait_until(pilot, lambda: table.select_step(first["step"]), 10, "the first checkpoint listed")
        old_launcher = run_json(out)["launcher_pid"]

        await pilot.press("r")  # the run is live: confirmation first
        modal = await wait_until(pilot, lambda: isinstance(app.screen, Choice) and app.screen, 10, "the confirmation")
        body = str(modal.query_one(".dialog-body Static").content)
        assert f"SIGUSR2 (checkpoint and stop) to pid {old_launcher}" in body
        second = records(out, event="checkpoint_saved")[1]["step"]
        assert f"Newer checkpoints stay (step {second}, and the one the stop writes)" in body
        assert signals_received(out) == ["SIGUSR1", "SIGUSR1"]  # nothing sent before the answer
        await pilot.click("#resume")
        resumed = await wait_until(pilot, lambda: records(out, event="resumed"), 40, "the resumed run")
        assert signals_received(out) == ["SIGUSR1", "SIGUSR1", "SIGUSR2"]
        assert resumed[0]["from_step"] == first["step"] and resumed[0]["path"] == first["path"]
        argv = run_json(out)["argv"]
        assert argv[argv.index("--resume-from-full-state-checkpoint") + 1] == first["path"]
        assert run_json(out)["launcher_pid"] != old_launcher
        job = resumed[0]["job_id"]
        after = await wait_until(pilot, lambda: [r["step"] for r in records(out, event="step") if r["job_id"] == job],
                                 20, "steps after the resume")
        assert after[0] == first["step"] + 1
        # never dead on the way (launch, stop, relaunch): no red line of it, no bell
        await wait_until(pilot, lambda: f"resumed from step {first['step']}" in "\n".join(
            t.plain for _, t in dash.query_one(LineView).entries), 10, "the resume's event line")
        assert not [t.plain for _, t in dash.query_one(LineView).entries if t.plain.startswith("dead")]
        assert app.bells == []

    run(tmp_path, scenario)


def test_q_detach_leaves_the_run_running(tmp_path):
    pids = {}

    async def scenario(app, pilot, out):
        await launch(app, pilot, tmp_path, out)
        dash = app.dashboard
        await wait_until(pilot, lambda: len(dash.run.ranks) == 2, 10, "both ranks")
        pids["all"] = [run_json(out)["launcher_pid"], *(r.pid for r in dash.run.ranks.values())]
        await pilot.press("q")
        modal = await wait_until(pilot, lambda: isinstance(app.screen, Choice) and app.screen, 10, "the question")
        assert [b.id for b in modal.query(Button)] == ["detach", "stop", "kill", "cancel"]
        await pilot.press("enter")  # detach has the focus
        await pilot.pause(0.2)

    out = tmp_path / "run"
    try:
        async def main():
            app = OsftTui(None, launcher=[sys.executable, str(FAKE)], poll_s=0.1)
            async with app.run_test(size=(140, 42)) as pilot:
                await scenario(app, pilot, out)
            assert app.return_value == 0
            step = records(out, event="step")[-1]["step"]
            await asyncio.sleep(1.0)
            assert all(alive(pid) for pid in pids["all"])  # the dashboard is gone, the run is not
            assert records(out, event="step")[-1]["step"] > step
            os.kill(pids["all"][0], signal.SIGUSR2)
            assert await no_processes_left(out)

        asyncio.run(main())
    finally:
        kill_run(out)


def test_kill_lists_every_pid_and_leaves_no_process(tmp_path):
    async def scenario(app, pilot, out):
        await launch(app, pilot, tmp_path, out, nproc=2)
        dash = app.dashboard
        await wait_until(pilot, lambda: len(dash.run.ranks) == 2, 10, "both ranks")
        pids = [run_json(out)["launcher_pid"], *(r.pid for r in dash.run.ranks.values())]
        await pilot.press("K")
        modal = await wait_until(pilot, lambda: isinstance(app.screen, Choice) and app.screen, 10, "the confirmation")
        body = str(modal.query_one(".dialog-body Static").content)
        for pid in pids:
            assert f"SIGKILL to pid {pid}" in body
        assert all(alive(pid) for pid in pids)
        await pilot.click("#kill")
        await wait_until(pilot, lambda: not any(alive(pid) for pid in pids), 10, "every process to go")
        assert await no_processes_left(out)
        assert signals_received(out) == []  # SIGKILL cannot be caught: nothing else was sent

    run(tmp_path, scenario)


def test_readonly_removes_every_key_that_signals(tmp_path):
    out = tmp_path / "run"
    proc = psutil.Popen([sys.executable, str(FAKE), "--output-dir", str(out), "--nproc-per-node", "1",
                         "--max-steps", "300", "--fake-step-seconds", "0.1", "--on-demand-checkpointing"],
                        start_new_session=True)

    async def main():
        app = OsftTui(out, readonly=True, poll_s=0.1)
        async with app.run_test(size=(140, 42)) as pilot:
            dash = app.dashboard
            await wait_until(pilot, lambda: dash.run.step, 20, "the first step")
            for key in ("c", "s", "e", "K", "r", "n"):
                await pilot.press(key)
            await pilot.pause(0.5)
            assert signals_received(out) == [] and isinstance(app.screen, type(dash))
            assert not (out / "control" / "evaluate").exists()
            shown = {key for key, active in app.screen.active_bindings.items() if active.enabled}
            assert {"c", "s", "e", "K", "r", "n"}.isdisjoint(shown) and {"l", "q"} <= shown
            assert "read-only" in str(dash.query_one(RunHeader).content)
            buttons = {b.id for b in dash.query(Button)}
            assert "button-checkpoint" not in buttons and "button-logs" in buttons
            titles = {c.title for c in app.get_system_commands(dash)}
            assert "Checkpoint" not in titles and "Evaluate" not in titles and "Rank logs" in titles
            await pilot.press("q")  # readonly: quits at once, the run goes on
        assert proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE

    try:
        asyncio.run(main())
    finally:
        proc.send_signal(signal.SIGUSR2)
        proc.wait(30)
        kill_run(out)


def test_a_run_on_another_host_is_asked_through_the_control_directory(tmp_path):
    out = tmp_path / "remote"
    (out / "metrics").mkdir(parents=True)
    (out / "run.json").write_text(json.dumps({"job_id": "j", "launcher_pid": os.getpid(), "hostname": "gpu-node-7.example",
                                              "state": "running", "start_time": 1.0, "config": {"max_steps": 10},
                                              "argv": ["osft-train", "--output-dir", str(out)]}))
    (out / "full_state_checkpoints" / "step_2").mkdir(parents=True)
    (out / "full_state_checkpoints" / "step_2" / "manifest.json").write_text(json.dumps({"format": 1, "files": {}}))
    (out / "metrics" / "node0.jsonl").write_text(json.dumps(
        {"ts": 2.0, "event": "run_started", "node_rank": 0, "rank": 0, "local_rank": 0, "world_size": 1,
         "hostname": "gpu-node-7.example", "job_id": "j", "pid": os.getpid()}) + "\n")

    async def main():
        app = OsftTui(out, poll_s=0.1)
        async with app.run_test(size=(140, 42)) as pilot:
            await pilot.pause(0.3)
            await pilot.press("c")
            await pilot.pause(0.2)
            assert (out / "control" / "checkpoint").is_file()
            await pilot.press("s")
            await pilot.pause(0.2)
            assert (out / "control" / "checkpoint-and-exit").is_file()
            log_text = "\n".join(line.text for line in app.dashboard.query_one("#events", RichLog).lines)
            assert f"no process of the run on this host: wrote {out / 'control' / 'checkpoint'}" in log_text
            await pilot.press("e")
            await pilot.pause(0.2)
            assert (out / "control" / "evaluate").is_file()
            log_text = "\n".join(line.text for line in app.dashboard.query_one("#events", RichLog).lines)
            assert f"evaluation requested at step 0: wrote {out / 'control' / 'evaluate'}" in log_text
            await pilot.press("K")
            await pilot.pause(0.2)
            assert not isinstance(app.screen, Choice)  # nothing of the run is here to kill
            await pilot.press("r")  # live on its host: a relaunch here would be a second job
            await wait_until(pilot, lambda: any(n.message.startswith("cannot resume: the run is live on "
                                                                      "gpu-node-7.example: stop it first")
                                                for n in app._notifications), 10, "r's reason")
            assert not app.dashboard.controls.launches.started and not isinstance(app.screen, Choice)
            assert "running" in str(app.dashboard.query_one(RunHeader).content)

    asyncio.run(main())


def test_a_crashed_rank_shows_its_exit_code_and_stderr(tmp_path):
    async def scenario(app, pilot, out):
        await launch(app, pilot, tmp_path, out, nproc=2, max_steps=50, extra="--fake-crash-rank 1 --fake-crash-step 3")
        dash = app.dashboard
        await wait_until(pilot, lambda: dash.run.state == "failed", 30, "the failure")
        await wait_until(pilot, lambda: app.bells, 10, "the bell")
        ranks = dash.query_one(RankTable)
        # the run's state and the rank rows come from different files: on a busy machine the failure
        # can be read a poll before rank 1's row appears
        # the table redraws once per sample (1 s): wait until rank 1's row shows its end, then check it
        await wait_until(pilot, lambda: "rank1" in ranks.rows and "exit code" in str(ranks.get_cell("rank1", "state")), 30,
                         "rank 1's row to show its exit")
        state = ranks.get_cell("rank1", "state")
        assert state.plain.startswith("failed (exit code 3): RuntimeError: fake crash of rank 1 at step 3")
        assert state.spans[0].style == "b red" and state.spans[0].end == len("failed (exit code 3)")
        ranks.focus()
        ranks.move_cursor(row=1)
        await pilot.press("l")
        screen = await wait_until(pilot, lambda: isinstance(app.screen, LogScreen) and app.screen, 10, "the logs")
        assert screen.title_text.endswith("exit code 3")
        lines = await wait_until(pilot, lambda: [t.plain for _, t in screen.query_one(LineView).entries], 10, "lines")
        assert any(line.startswith("err│ RuntimeError: fake crash of rank 1 at step 3") for line in lines)
        assert any("Traceback (most recent call last)" in line for line in lines)
        assert "out│ rank 1 (node 0, local rank 1) started" in "\n".join(lines)  # stdout too
        await pilot.press("escape")
        assert await no_processes_left(out)

    run(tmp_path, scenario)


def test_a_node_that_crashes_mid_training_fails_the_run_with_its_step_and_error(tmp_path):
    """2 nodes of 1 rank: node 1's rank crashes in step 3 and its launcher exits 1; node 0 hangs
    waiting for it. The run line says which step and rank failed, with the elapsed time, not
    "launch failed"."""
    async def scenario(app, pilot, out):
        await launch(app, pilot, tmp_path, out, nnodes=2, nproc=1, max_steps=50,
                     extra="--fake-crash-rank 1 --fake-crash-step 3")
        dash = app.dashboard
        lines = []
        await wait_until(pilot, lambda: lines.append(str(dash.query_one(RunHeader).content))
                         or " failed " in lines[-1] and "rank 1:" in lines[-1], 30, "the failure", step=0.05)
        assert not [line for line in lines if "launch failed" in line], lines
        assert "at step 3 (rank 1: RuntimeError: fake crash of rank 1 at step 3" in lines[-1]
        assert re.search(r"elapsed \d+s", lines[-1])

    run(tmp_path, scenario)


def test_the_command_palette_stops_the_run(tmp_path):
    async def scenario(app, pilot, out):
        await launch(app, pilot, tmp_path, out, nproc=1)
        dash = app.dashboard
        await pilot.press("ctrl+p")
        await pilot.pause(0.3)
        await pilot.press(*"checkpoint & stop")

        def first() -> str:  # the palette searches in the background
            options = app.screen.query_one(CommandList)
            return str(options.get_option_at_index(0).prompt) if options.option_count else ""

        await wait_until(pilot, lambda: first().startswith("Checkpoint & stop"), 10, "the command found")
        await pilot.press("enter")
        await wait_until(pilot, lambda: dash.run.state == "stopped", 30, "the stop")
        assert signals_received(out) == ["SIGUSR2"]
        assert run_json(out)["exit_code"] == EXIT_STOPPED

    run(tmp_path, scenario)
