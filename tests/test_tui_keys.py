"""osft-tui's keys are safe (issue 20): one request per kind until its checkpoint is written (a
pending checkpoint never blocks a stop), the checkpoint cursor moves only when the user moves it.
Pilot tests against the fake trainer (tests/fake_trainer.py)."""

from __future__ import annotations

import sys

import pytest
from osft.tui.components.checkpoints import CheckpointTable
from textual.widgets import Button
from test_tui_pilot import checkpoint, launch, records, run, signals_received
from tui_support import wait_until

pytestmark = [pytest.mark.tui_process,
              pytest.mark.skipif(sys.platform != "linux", reason="signals and /proc: Linux only")]


def written(app) -> list[str]:
    """Titles of the notifications that a checkpoint was written."""
    return [n.title for n in app._notifications if "written to" in n.message]


def test_c_pressed_again_while_its_request_is_pending_sends_nothing_and_s_still_stops(tmp_path):
    async def scenario(app, pilot, out):
        await launch(app, pilot, tmp_path, out, extra="--fake-step-seconds 1.0")
        dash = app.dashboard
        await pilot.press("c")
        await pilot.press("c")
        await wait_until(pilot, lambda: dash.query_one("#button-checkpoint", Button).disabled, 5, "the dimmed button")
        await wait_until(pilot, lambda: written(app), 20, "the checkpoint's notification")
        assert signals_received(out) == ["SIGUSR1"] and len(records(out, event="checkpoint_saved")) == 1
        assert written(app) == ["checkpoint"]
        assert any("already requested" in n.message for n in app._notifications)
        await wait_until(pilot, lambda: not dash.query_one("#button-checkpoint", Button).disabled, 5, "the button back")

        await pilot.press("c")
        await pilot.press("s")  # a pending checkpoint never blocks a stop
        await wait_until(pilot, lambda: dash.run.state == "stopped", 30, "the stop")
        assert signals_received(out) == ["SIGUSR1", "SIGUSR1", "SIGUSR2"]
        await wait_until(pilot, lambda: written(app)[-1:] == ["checkpoint and stop"], 10, "the stop's notification")
        assert not dash.controls.pending.steps

    run(tmp_path, scenario)


def test_the_checkpoint_cursor_stays_where_the_user_put_it(tmp_path):
    async def scenario(app, pilot, out):
        await launch(app, pilot, tmp_path, out)
        dash = app.dashboard
        table = dash.query_one(CheckpointTable)
        first = (await checkpoint(app, pilot, out))["step"]
        await checkpoint(app, pilot, out)
        await wait_until(pilot, lambda: len(table.rows) == 2, 10, "both listed")
        table.focus()
        await pilot.press("down")  # newest first: the first checkpoint is the second row
        assert table.selected().step == first
        await pilot.press("c")
        await wait_until(pilot, lambda: len(table.rows) == 3, 20, "the third checkpoint listed")
        await pilot.pause(0.5)
        assert table.selected().step == first

    run(tmp_path, scenario)
