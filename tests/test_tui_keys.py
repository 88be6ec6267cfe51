"""osft-tui's keys are safe: one request per press that is not pending (a held key's auto-repeat is
ignored, a pending checkpoint never blocks a stop), the checkpoint cursor moves only when the user moves it.
Pilot tests against the fake trainer (tests/fake_trainer.py)."""

from __future__ import annotations

import asyncio
import sys

import pytest
from osft.tui.components.checkpoints import CheckpointTable
from osft.tui.keys import REPEAT_S
from test_tui_pilot import checkpoint, launch, records, run, signals_received
from textual.widgets import Button
from tui_support import wait_until

pytestmark = [pytest.mark.tui_process,
              pytest.mark.skipif(sys.platform != "linux", reason="signals and /proc: Linux only")]


def written(app) -> list[str]:
    """Titles of the notifications that a checkpoint was written."""
    return [n.title for n in app._notifications if "written to" in n.message]


def test_held_c_on_two_nodes_is_one_signal_one_checkpoint_one_toast_and_s_still_stops(tmp_path):
    """A held ``c`` (30 presses in 0.7 s, a terminal's auto-repeat) on a 2-node run sends one SIGUSR1
    to one launcher and gives one checkpoint; a press while it is pending sends nothing and says so
    once; a pending checkpoint never blocks a stop."""
    async def scenario(app, pilot, out):
        await launch(app, pilot, tmp_path, out, nnodes=2, nproc=1, extra="--fake-step-seconds 0.5 --fake-save-seconds 1.5")
        dash = app.dashboard

        async def after_a_step() -> None:  # then a request waits a step and a save (1.5 s) for its checkpoint
            step = dash.run.step
            await wait_until(pilot, lambda: dash.run.step > step, 10, "a step", step=0.05)

        await after_a_step()
        for _ in range(30):
            await pilot.press("c")
            await asyncio.sleep(0.023)
        await wait_until(pilot, lambda: written(app), 20, "the checkpoint's notification")
        await pilot.pause(0.3)
        assert signals_received(out, 0) + signals_received(out, 1) == ["SIGUSR1"]
        assert len(records(out, event="checkpoint_saved")) == 1 and written(app) == ["checkpoint"]
        assert not [n for n in app._notifications if "already requested" in n.message]

        await pilot.pause(REPEAT_S)  # a new press, not the hold's auto-repeat (ignored whole)
        await after_a_step()
        await pilot.press("c")
        await wait_until(pilot, lambda: dash.controls.requests.pending.steps, 5, "the request pending")
        for _ in range(2):  # pressed again, twice, while it is pending: said once
            await pilot.pause(REPEAT_S)
            await pilot.press("c")
        await wait_until(pilot, lambda: len(written(app)) == 2, 20, "the second checkpoint's notification")
        assert signals_received(out, 0) + signals_received(out, 1) == ["SIGUSR1", "SIGUSR1"]
        assert len([n for n in app._notifications if "already requested" in n.message]) == 1
        await wait_until(pilot, lambda: not dash.query_one("#button-checkpoint", Button).disabled, 5, "the button back")

        await pilot.pause(REPEAT_S)
        await pilot.press("c")
        await pilot.press("s")  # a pending checkpoint never blocks a stop
        await wait_until(pilot, lambda: dash.run.state == "stopped", 30, "the stop")
        assert signals_received(out, 0) + signals_received(out, 1) == ["SIGUSR1"] * 3 + ["SIGUSR2"]
        await wait_until(pilot, lambda: written(app)[-1:] == ["checkpoint and stop"], 10, "the stop's notification")
        assert not dash.controls.requests.pending.steps

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
        await pilot.pause(REPEAT_S)  # a press, not the auto-repeat of the second checkpoint's
        await pilot.press("c")
        await wait_until(pilot, lambda: len(table.rows) == 3, 20, "the third checkpoint listed")
        await pilot.pause(0.5)
        assert table.selected().step == first

    run(tmp_path, scenario)
