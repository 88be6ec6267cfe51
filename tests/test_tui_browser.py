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
from osft.tui.runs import Listing, RunSummary, run_dirs, summarize
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


def _summary(name: str, state: str, step: int | None, loss: float | None, age_s: float | None) -> RunSummary:
    return RunSummary(Path("/runs") / name, state, step, loss, age_s)


RUNS = [_summary("b-sft", "completed", 200, 0.9, 86400 * 3), _summary("a-chain", "running", 40, 1.7, 4.0),
        _summary("c-crash", "failed", 12, 2.5, 7200.0), _summary("d-new", "starting", None, None, 30.0),
        _summary("e-gone", "dead", 3, 3.1, 600.0), _summary("f-old", "stopped", 90, 1.1, None)]


def names(listing: Listing) -> list[str]:
    return [s.path.name for s in listing.apply(RUNS)]


def test_a_listing_sorts_by_each_column_with_unknowns_last_and_filters_by_state_age_and_name():
    assert names(Listing()) == ["a-chain", "b-sft", "c-crash", "d-new", "e-gone", "f-old"]
    assert names(Listing("run", descending=True)) == ["f-old", "e-gone", "d-new", "c-crash", "b-sft", "a-chain"]
    # live first, then what needs a look, then the ended
    assert names(Listing("state")) == ["d-new", "a-chain", "e-gone", "c-crash", "f-old", "b-sft"]
    assert names(Listing("step")) == ["e-gone", "c-crash", "a-chain", "f-old", "b-sft", "d-new"]
    assert names(Listing("step", descending=True)) == ["b-sft", "f-old", "a-chain", "c-crash", "e-gone", "d-new"]
    assert names(Listing("last loss"))[-1] == "d-new" and names(Listing("last loss"))[0] == "b-sft"
    assert names(Listing("age")) == ["a-chain", "d-new", "e-gone", "c-crash", "b-sft", "f-old"]
    assert names(Listing("age", descending=True)) == ["b-sft", "c-crash", "e-gone", "d-new", "a-chain", "f-old"]
    assert names(Listing(states="live")) == ["a-chain", "d-new"]
    assert names(Listing(states="failed")) == ["c-crash", "e-gone"]
    assert names(Listing(states="ended")) == ["b-sft", "f-old"]
    assert names(Listing(age="1 h")) == ["a-chain", "d-new", "e-gone"]  # a run without an age is not recent
    assert names(Listing(age="1 day", states="failed")) == ["c-crash", "e-gone"]
    assert names(Listing(text="C")) == ["a-chain", "c-crash"]
    assert Listing("age", True, "failed", "1 day", "c").describe() == (
        "sorted by age ▼ · state: failed · active within 1 day · name holds 'c'")


@pytest.mark.tui_process
def test_the_browser_sorts_and_filters_by_key_header_and_name_and_says_when_nothing_matches(tmp_path):
    now = time.time()
    write_runs(tmp_path, now)
    write_run(tmp_path / "c-crash", "failed", 12, now - 7200)

    async def main():
        app = OsftTui(tmp_path, poll_s=0.1)
        async with app.run_test(size=(100, 30)) as pilot:
            browser = await wait_until(pilot, lambda: isinstance(app.screen, RunBrowser) and app.screen, 10, "the browser")
            table = browser.query_one(DataTable)

            def shown() -> list[str]:
                return [str(table.get_row_at(i)[0]) for i in range(table.row_count)]

            def line() -> str:
                return str(browser.query_one("#run-listing").render())

            assert shown() == ["a-done", "b-live", "c-crash"] and line() == "3 runs, sorted by run ▲"
            await pilot.press("down")  # the cursor on b-live follows it through every change
            await pilot.press("s", "s", "s", "s")  # state, step, last loss, age
            assert shown() == ["b-live", "a-done", "c-crash"] and "sorted by age ▲" in line()
            assert str(table.columns["age"].label) == "age ▲" and str(table.columns["run"].label) == "run"
            await pilot.press("d")
            assert shown() == ["c-crash", "a-done", "b-live"] and table.cursor_row == 2
            await pilot.click("#runs", offset=(28, 0))  # the state column's header
            assert shown() == ["b-live", "c-crash", "a-done"] and "sorted by state ▲" in line()
            await pilot.press("f")  # live
            assert shown() == ["b-live"] and line() == "1 of 3 runs, sorted by state ▲ · state: live"
            await pilot.press("f", "a")  # failed, active within 1 h: none
            assert shown() == [] and line().endswith("no run matches: f, a and / change the filters")
            await pilot.press("a", "a", "a", "f", "f")  # any age, all states
            await pilot.press("slash", "d", "o")
            assert shown() == ["a-done"] and "name holds 'do'" in line()
            await pilot.press("enter")  # the filter is kept, the table has the keys again
            assert table.has_focus and shown() == ["a-done"]
            await pilot.press("slash", "escape")  # cleared; the cursor stays on the run it was on
            assert shown() == ["b-live", "c-crash", "a-done"] and table.has_focus and table.cursor_row == 2
            await pilot.press("enter")
            await wait_until(pilot, lambda: app.screen is app.dashboard and app.dashboard.run.root == tmp_path / "a-done",
                             10, "the run under the cursor attached")

    asyncio.run(main())
