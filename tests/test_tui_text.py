"""Text from the user or the run is shown as it is: a run directory, a path, a host name, a message or
a search holding square brackets (``x[/y]run``, ``demo[red]run``) is not read as markup in any title,
label, notification or table cell, and nothing crashes; a dashboard that dies of an exception exits 1.
Pilot tests on hand-written run directories, read-only."""

from __future__ import annotations

import asyncio
import functools
import json
import time
from pathlib import Path

import pytest
from osft.tui import cli
from osft.tui.app import OsftTui
from osft.tui.components.checkpoints import CheckpointTable
from osft.tui.components.lines import LineView
from osft.tui.components.modals import LogScreen, SearchPrompt
from osft.tui.components.nodes import NodeTable
from osft.tui.components.ranks import RankTable
from osft.tui.dashboard import Dashboard
from textual.content import Content
from textual.widgets import Input
from textual.widgets._toast import Toast
from tui_support import screen_text, wait_until

#: Lines a run may write that look like markup (and one that is long).
MARKUP_LIKE = ["[/usr/bin/gnome-shell] started", "[bold red]x[/bold red]", "[/dim]", "family 👨‍👩‍👧 done",
               "z" * 20_000]
HOST = "node[/b]7"


def write_run(root: Path) -> Path:
    """A completed one-rank run in ``root`` (its export, an incomplete checkpoint, a warning and rank
    output that look like markup); returns the rank's stderr.log."""
    now = time.time()
    export = root / "hf_format" / "final"
    (root / "metrics").mkdir(parents=True)
    (root / "full_state_checkpoints" / "step_2").mkdir(parents=True)
    (root / "full_state_checkpoints" / "step_2" / "manifest.json").write_text("{")  # its note names its path
    (root / "run.json").write_text(json.dumps(
        {"job_id": "j[1]", "state": "completed", "launcher_pid": 999_999_999, "hostname": HOST, "exit_code": 0,
         "start_time": now - 60, "updated_at": now - 50, "export_dir": str(export), "config": {"max_steps": 3}}))
    common = {"node_rank": 0, "rank": 0, "local_rank": 0, "world_size": 1, "hostname": HOST, "job_id": "j[1]"}
    records = [{"ts": now - 59, "event": "run_started", "pid": 999_999_999, **common},
               {"ts": now - 58, "event": "step", "step": 3, "loss": 1.0, "step_time_s": 1.0, **common},
               {"ts": now - 57, "event": "warning", "message": MARKUP_LIKE[1], **common}]
    (root / "metrics" / "node0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    rank_dir = root / "logs" / "node0" / "abc_[x]" / "attempt_0" / "0"
    rank_dir.mkdir(parents=True)
    (rank_dir / "stdout.log").write_text("hello\n")
    (rank_dir / "stderr.log").write_text("".join(line + "\n" for line in MARKUP_LIKE))
    return rank_dir / "stderr.log"


def toasts(app) -> list[str]:
    """The plain text of every toast on screen (title and message), as drawn."""
    return [t.render().plain for t in app.screen.query(Toast)]


@pytest.mark.tui_process  # the dashboard's reader process
@pytest.mark.parametrize("parts", [("x[", "y]run"), ("demo[red]run",)], ids=["closing-tag", "opening-tag"])
def test_paths_hosts_messages_and_searches_show_their_brackets(tmp_path, parts):
    root = tmp_path.joinpath(*parts)
    stderr = write_run(root)

    async def scenario():
        app = OsftTui(root, readonly=True, poll_s=0.1)
        async with app.run_test(size=(120, 40), notifications=True) as pilot:
            dash = app.dashboard
            ranks = dash.query_one(RankTable)
            await wait_until(pilot, lambda: dash.run.checkpoints and "rank0" in ranks.rows, 20, "the run drawn")
            text = screen_text(app)
            assert f"run {root}" in text and "completed" in text
            assert str(dash.query_one(NodeTable).get_cell("node0", "host")) == HOST
            assert str(ranks.get_cell("rank0", "host")) == HOST
            note = str(dash.query_one(CheckpointTable).get_row(str(root / "full_state_checkpoints" / "step_2"))[4])
            assert note.startswith(f"{root}/full_state_checkpoints/step_2/manifest.json: not a valid manifest")
            assert f"rank 0: warning: {MARKUP_LIKE[1]}" in text

            await pilot.press("y")  # the export's path, in a toast
            await pilot.pause(0.3)
            assert app.clipboard == dash.run.export_dir
            assert f"copied the export path\n{dash.run.export_dir}" in toasts(app)

            await pilot.press("slash")  # a search that looks like a closing tag
            await wait_until(pilot, lambda: isinstance(app.screen, SearchPrompt), 10, "the search prompt")
            app.screen.query_one(Input).value = "[/dim]"
            await pilot.press("enter")
            await wait_until(pilot, lambda: app.screen is dash, 10, "the dashboard")
            events = dash.query_one(LineView)
            assert Content.from_markup(events.border_title).plain.endswith("matching '[/dim]'")
            await pilot.press("right_square_bracket")  # ] steps through the event search: none holds it
            await pilot.pause(0.2)
            assert "events: no line matches" in toasts(app), toasts(app)

            await pilot.press("l")
            logs = await wait_until(pilot, lambda: isinstance(app.screen, LogScreen) and app.screen, 10, "the logs")
            view = logs.query_one(LineView)
            await wait_until(pilot, lambda: len(view.entries) == 6, 10, "every log line")
            title = Content.from_markup(view.border_title).plain
            assert title == f"{stderr.with_name('stdout.log')} · {stderr}"
            assert [t.plain for _, t in view.entries][1:] == [f"err│ {line}" for line in MARKUP_LIKE]
            await pilot.pause(0.2)
            text = screen_text(app)
            for line in MARKUP_LIKE[:4]:
                assert f"err│ {line}" in text
            assert f"{root}/logs/node0/abc_[x]" in text  # the border title, cut at 120 columns

            await pilot.press("slash")  # three lines hold "[/"; n and N step through them
            await wait_until(pilot, lambda: isinstance(app.screen, SearchPrompt), 10, "the search prompt")
            app.screen.query_one(Input).value = "[/"
            await pilot.press("enter")
            await wait_until(pilot, lambda: app.screen is logs, 10, "the logs")
            await pilot.press("n")
            await pilot.pause(0.2)
            assert "match 1/3" in toasts(app) and view.current == 0
            await pilot.press("N")
            await pilot.pause(0.2)
            assert "match 3/3" in toasts(app) and view.current == 2
            assert str(view.border_title).endswith("matching '[/' · match 3")

    asyncio.run(scenario())


def test_a_dashboard_that_dies_of_an_exception_exits_1(tmp_path, monkeypatch, capsys):
    def broken(self):
        raise RuntimeError("a fault on mount")

    monkeypatch.setattr(Dashboard, "on_mount", broken)
    monkeypatch.setattr(OsftTui, "run", functools.partialmethod(OsftTui.run, headless=True))
    assert cli.main([str(tmp_path), "--readonly"]) == 1
