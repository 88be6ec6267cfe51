"""osft-tui's run browser: ``osft-tui DIR`` on a directory of run directories
lists them (state, step, last loss, age) and opens the one chosen; a directory with neither a
run.json nor run directories is attached and waited for, as before."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from pathlib import Path

import psutil
import pytest
from osft.tui.app import OsftTui
from osft.tui.components.browser import RunBrowser
from osft.tui.runs import run_dirs, summarize
from textual.widgets import DataTable
from tui_support import wait_until


def write_run(root: Path, state: str, steps: int, updated_at: float, **launcher) -> None:
    """A run directory whose node-0 metrics end with ``steps`` step records and a partial line;
    ``launcher``: more fields of its run.json (pid, host)."""
    (root / "metrics").mkdir(parents=True)
    (root / "run.json").write_text(json.dumps({"job_id": root.name, "state": state, "updated_at": updated_at,
                                               "config": {"max_steps": 50}, **launcher}))
    lines = [json.dumps({"event": "run_started", "ts": updated_at - 100, "rank": 0, "node_rank": 0, "local_rank": 0,
                         "job_id": root.name, "pid": 999_999_999, "hostname": "h"})]
    lines += [json.dumps({"event": "step", "ts": updated_at - steps + s, "step": s, "node_rank": 0, "rank": 0,
                          "loss": 3.0 - s / 10}) for s in range(1, steps + 1)]
    lines.append(json.dumps({"event": "warning", "ts": updated_at, "rank": 0, "message": "w"}))
    (root / "metrics" / "node0.jsonl").write_text("\n".join(lines) + '\n{"event": "step", "st')


def write_runs(root: Path, now: float) -> None:
    """A completed run and a live one (its launcher: this test's process)."""
    write_run(root / "a-done", "completed", 20, now - 3600)
    write_run(root / "b-live", "running", 7, now - 5, launcher_pid=os.getpid(), hostname=socket.gethostname(),
              start_time=psutil.Process().create_time())
    (root / "not-a-run").mkdir()
    (root / "notes.txt").write_text("x")


def test_run_dirs_and_their_summaries(tmp_path):
    now = time.time()
    write_runs(tmp_path, now)
    assert run_dirs(tmp_path) == [tmp_path / "a-done", tmp_path / "b-live"]
    assert run_dirs(tmp_path / "a-done") == []  # a run itself
    assert run_dirs(tmp_path / "not-a-run") == []
    done = summarize(tmp_path / "a-done", now)
    assert (done.state, done.step, done.loss, done.age_s) == ("completed", 20, 1.0, 3600.0)
    live = summarize(tmp_path / "b-live", now)
    assert (live.state, live.step, round(live.loss, 6), live.age_s) == ("running", 7, 2.3, 5.0)
    (tmp_path / "b-live" / "run.json").write_text('{"state": "runn')
    assert summarize(tmp_path / "b-live", now).state == "unreadable run.json"
    # run.json says running, but its launcher is gone from this host, or its host has been silent long
    write_run(tmp_path / "c-killed", "running", 3, now - 5, launcher_pid=2**22 + 1, hostname=socket.gethostname())
    assert summarize(tmp_path / "c-killed", now).state == "dead"
    write_run(tmp_path / "d-remote", "running", 3, now - 5, launcher_pid=os.getpid(), hostname="gpu-9.example")
    assert summarize(tmp_path / "d-remote", now).state == "running"
    assert summarize(tmp_path / "d-remote", now + 3600).state == "stale"


@pytest.mark.tui_process  # the dashboard's reader process, once a run is opened
def test_the_browser_lists_the_runs_and_enter_opens_one(tmp_path):
    now = time.time()
    write_runs(tmp_path, now)

    async def main():
        app = OsftTui(tmp_path, poll_s=0.1)
        async with app.run_test(size=(80, 24)) as pilot:
            browser = await wait_until(pilot, lambda: isinstance(app.screen, RunBrowser) and app.screen, 10, "the browser")
            assert app.dashboard.reader is None  # nothing attached to the directory of runs
            table = browser.query_one(DataTable)
            rows = [[str(c) for c in table.get_row_at(i)] for i in range(table.row_count)]
            assert [r[:4] for r in rows] == [["a-done", "completed", "20", "1.0000"],
                                             ["b-live", "running", "7", "2.3000"]]
            assert table.get_row_at(0)[1].style == "green"
            assert rows[0][4] in ("1h00m00s ago", "1h00m01s ago") and rows[1][4].endswith("s ago")  # a slow start
            await pilot.press("down", "enter")
            dash = app.dashboard
            await wait_until(pilot, lambda: app.screen is dash and dash.run.root == tmp_path / "b-live"
                             and dash.run.step == 7, 10, "the chosen run attached")
            await pilot.press("escape")  # back to the runs, and another one
            browser = await wait_until(pilot, lambda: isinstance(app.screen, RunBrowser) and app.screen, 10, "back")
            await pilot.press("enter")
            await wait_until(pilot, lambda: app.screen is dash and dash.run.root == tmp_path / "a-done"
                             and dash.run.step == 20, 10, "the other run attached")

    asyncio.run(main())


@pytest.mark.tui_process
def test_a_directory_without_runs_is_attached_and_waited_for(tmp_path):
    async def main():
        app = OsftTui(tmp_path, poll_s=0.1)
        async with app.run_test(size=(80, 24)) as pilot:
            dash = app.dashboard
            await wait_until(pilot, lambda: app.screen is dash and dash.reader is not None, 10, "the dashboard")
            write_run(tmp_path / "later", "running", 3, time.time())  # a run directory appearing later
            await pilot.pause(0.5)
            assert app.screen is dash and dash.run.root == tmp_path and dash.run.state == "no run.json"

    asyncio.run(main())
