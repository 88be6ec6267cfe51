"""The event pane and the log view: rank output is not an event, the same warning of several ranks is
one line, a flood of warnings never drops a lifecycle line, the view follows new lines at the bottom
(across a resize and a cleared search) and counts those that arrive while scrolled up, a search and
a level filter choose the lines shown ("no line matches" when none does), and the violation bar
shows recent violations."""

from __future__ import annotations

import asyncio

import pytest
from osft.tui.app import OsftTui
from osft.tui.components.lines import CURRENT_STYLE, LineView
from osft.tui.components.modals import SearchPrompt
from osft.tui.reader import Update
from osft.tui.run_state import RECENT_STEPS, Event, PollResult, RunModel, describe
from rich.text import Text
from textual.app import App, ComposeResult


def on_an_idle_dashboard(tmp_path, check) -> None:
    """Run ``await check(app, pilot)`` on a read-only dashboard (120 x 40) attached to a directory
    that holds no run (its reader process starts and finds nothing)."""
    async def scenario():
        app = OsftTui(tmp_path / "none", readonly=True)
        async with app.run_test(size=(120, 40)) as pilot:
            await check(app, pilot)

    asyncio.run(scenario())


@pytest.mark.tui_process  # the dashboard's reader process
def test_one_line_per_warning_and_no_rank_output_in_the_event_pane(tmp_path):
    async def check(app, pilot):
        dash = app.dashboard
        warning = "step 4: orthogonality violations in ['q_proj']"
        events = [Event(0.0, "warning", f"rank {r}: warning: {warning}") for r in range(4)]
        events += [Event(0.0, "log", f"[rank 0] WARNING {warning}"), Event(0.0, "log", "[rank 0] step 4 loss 1.2")]
        dash._queue_events(Update(RunModel(tmp_path), events=events))
        dash._write_events()
        dash._queue_events(Update(RunModel(tmp_path), events=events[:2]))  # the same again, a second later
        dash._write_events()
        await pilot.pause()
        lines = [t.plain for _, t in dash.query_one(LineView).entries]
        assert lines == [f"ranks 0, 1, 2, 3: warning: {warning}"], lines

    on_an_idle_dashboard(tmp_path, check)


class Lines(App):
    def compose(self) -> ComposeResult:
        yield LineView("events", 1000, id="events")


def test_the_view_follows_only_at_the_bottom_and_counts_new_lines():
    async def scenario():
        app = Lines()
        async with app.run_test(size=(60, 12)) as pilot:
            view = app.query_one(LineView)
            view.add([("info", Text(f"line {i}")) for i in range(50)])
            await pilot.pause()
            assert view.is_vertical_scroll_end and "new lines" not in str(view.border_title)
            view.scroll_home(animate=False)
            await pilot.pause()
            view.add([("info", Text(f"more {i}")) for i in range(3)])
            await pilot.pause()
            assert view.scroll_y == 0, "jumped to the bottom while the user reads above"
            assert "3 new lines below" in str(view.border_title)
            view.scroll_end(animate=False)
            await pilot.pause()
            assert "new lines" not in str(view.border_title)

    asyncio.run(scenario())


@pytest.mark.tui_process  # the dashboard's reader process
def test_search_and_level_filter_choose_the_lines_shown(tmp_path):
    async def check(app, pilot):
        dash = app.dashboard
        view = dash.query_one(LineView)
        view.add([("info", Text("rank 0 started")), ("warning", Text("rank 1: warning: slow")),
                  ("error", Text("rank 2: error: boom"))])
        await pilot.press("v")
        assert [s.text for s in view.lines] == ["rank 1: warning: slow", "rank 2: error: boom"]
        await pilot.press("v")
        assert [s.text for s in view.lines] == ["rank 2: error: boom"]
        await pilot.press("v")  # all again
        await pilot.press("slash")
        await pilot.pause()
        assert isinstance(app.screen, SearchPrompt)
        await pilot.press(*"RANK ")  # filtered as it is typed
        await pilot.pause()
        assert [s.text for s in view.lines] == ["rank 0 started", "rank 1: warning: slow", "rank 2: error: boom"]
        await pilot.press("2")
        await pilot.pause()
        assert [s.text for s in view.lines] == ["rank 2: error: boom"] and "matching 'RANK 2'" in str(view.border_title)
        await pilot.press("escape")  # the search in force before comes back
        await pilot.pause()
        assert len(view.lines) == 3 and view.search == ""
        await pilot.press("slash")
        await pilot.pause()
        await pilot.press(*"STARTED", "enter")
        await pilot.pause()
        assert [s.text for s in view.lines] == ["rank 0 started"] and "matching 'STARTED'" in str(view.border_title)
        # the match is highlighted in the line drawn, whatever its case; the entry itself is unchanged
        marked = "".join(seg.text for seg in view.lines[0] if seg.style and seg.style.reverse and seg.style.bold)
        assert marked == "started"
        assert not next(line for _, line in view.entries if line.plain == "rank 0 started").spans

    on_an_idle_dashboard(tmp_path, check)


def test_a_checkpoint_written_in_the_background_shows_how_long_training_was_blocked():
    saved = {"event": "checkpoint_saved", "ts": 1.0, "step": 6, "path": "/r/step_6", "bytes": 2_000_000, "seconds": 8.5}
    assert describe({**saved, "blocking_s": 0.5}).text == ("checkpoint of step 6 written to /r/step_6 (2.0 MB in 8.5 s, "
                                                           "training blocked 0.5 s)")
    assert describe({**saved, "blocking_s": 8.5}).text == "checkpoint of step 6 written to /r/step_6 (2.0 MB in 8.5 s)"
    assert describe(saved).text == "checkpoint of step 6 written to /r/step_6 (2.0 MB in 8.5 s)"  # an older run


def test_the_view_stays_at_the_bottom_across_a_resize_and_a_cleared_search_and_says_when_nothing_matches():
    async def scenario():
        app = Lines()
        async with app.run_test(size=(60, 12)) as pilot:
            view = app.query_one(LineView)
            view.add([("info", Text(f"line {i}")) for i in range(50)])
            await pilot.pause()
            await pilot.resize_terminal(60, 8)  # shorter: the bottom moves down
            await pilot.pause()
            view.add([("warning", Text("new warning 1"))])
            await pilot.pause()
            assert view.is_vertical_scroll_end and view.lines[-1].text == "new warning 1"
            view.set_filter(search="line 4")  # a short search, then cleared
            await pilot.pause()
            view.set_filter(search="")
            view.add([("warning", Text("new warning 2"))])
            await pilot.pause()
            assert view.is_vertical_scroll_end and view.lines[-1].text == "new warning 2"
            assert "new lines" not in str(view.border_title)
            view.set_filter(search="[/zzz]")
            await pilot.pause()
            assert [s.text for s in view.lines] == ["no line matches (matching '[/zzz]')"]
            view.add([("info", Text("a [/zzz] line"))])
            await pilot.pause()
            assert [s.text for s in view.lines] == ["a [/zzz] line"]

    asyncio.run(scenario())


def test_next_and_previous_match_mark_one_line_of_the_search_and_scroll_to_it():
    async def scenario():
        app = Lines()
        async with app.run_test(size=(60, 12)) as pilot:
            view = app.query_one(LineView)
            assert view.next_match(1) == "no search: / first"
            view.add([("info", Text(f"{'warn' if i % 3 == 0 else 'step'} {i}")) for i in range(100)])
            view.set_filter(search="warn")  # 34 lines: warn 0, warn 3, ..., warn 99
            await pilot.pause()
            view.scroll_home(animate=False, immediate=True)
            assert view.next_match(1) == "match 1/34"  # the first below the top of the view
            await pilot.pause()
            marked = [s.text for s in view.lines if any(seg.style and seg.style.bgcolor
                                                        and seg.style.bgcolor.name == CURRENT_STYLE[3:] for seg in s)]
            assert marked == ["warn 0"] and view.scroll_y == 0
            assert view.next_match(-1) == "match 34/34"  # wraps around to the last
            await pilot.pause()
            assert view.is_vertical_scroll_end and "match 34" in str(view.border_title)
            for expected in ("match 1/34", "match 2/34", "match 3/34"):
                assert view.next_match(1) == expected
            await pilot.pause()
            height = view.scrollable_content_region.height
            top = int(view.scroll_y)
            assert top <= 2 < top + height  # the current match is in view
            view.set_filter(search="warn 9")  # a new search starts again from the top of the view
            assert view.current is None and str(view.border_title).endswith("matching 'warn 9'")
            assert view.next_match(-1) == "match 5/5"  # warn 9, 90, 93, 96, 99: all in view, the last
            view.set_filter(search="zzz")
            assert view.next_match(1) == "no line matches"

    asyncio.run(scenario())


def test_a_flood_of_warnings_never_drops_a_lifecycle_line():
    warnings = [Event(float(i), "warning", f"rank 0: warning: w{i}") for i in range(100)]
    lifecycle = [Event(10.5, "info", "rank 0 started"), Event(50.5, "info", "checkpoint of step 5 written to /r"),
                 Event(90.5, "error", "rank 1: error: boom")]
    update = Update(RunModel("."), events=sorted(warnings + lifecycle, key=lambda e: e.ts)).cap(20)
    assert [e.text for e in update.events if e.level != "warning"] == [e.text for e in lifecycle]
    assert [e.text for e in update.events if e.level == "warning"] == [f"rank 0: warning: w{i}" for i in range(80, 100)]
    assert update.dropped_events == 80 and update.events == sorted(update.events, key=lambda e: e.ts)


def test_the_violation_bar_shows_recent_violations_not_the_total():
    model = RunModel(".")
    for step in range(1, 40):
        model.apply({"event": "step", "node_rank": 0, "rank": 0, "step": step, "ortho_violations": 2 if step == 3 else 0,
                     "ortho_violations_total": 2 if step >= 3 else 0}, PollResult())
        assert model.violations.alert == (3 <= step < 3 + RECENT_STEPS), step
    assert model.violations.total == 2 and model.violations.last_at == 3
