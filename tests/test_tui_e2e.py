"""osft-tui with the real trainer: a tiny model on 2 CPU ranks (gloo), launched from the new-run
form; `c` checkpoints while training goes on, `s` stops after a checkpoint, and `r` resumes from
the chosen checkpoint, all through the real launcher, signals and run directory."""

from __future__ import annotations

import asyncio
import json

import pytest
from helpers import QA, chat, tiny_chat_tokenizer, tiny_llama, write_jsonl
from osft.trainer.observe.plot import run_series
from osft.tui.app import OsftTui
from osft.tui.components.charts import MetricChart
from osft.tui.components.checkpoints import CheckpointTable
from osft.tui.components.new_run import NewRunScreen
from textual.widgets import Input
from tui_support import kill_run, no_processes_left, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.torchrun]


def _records(out, event):
    path = out / "metrics" / "node0.jsonl"
    if not path.is_file():
        return []
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    return [r for r in recs if r["event"] == event]


def test_launch_checkpoint_stop_and_resume_from_the_dashboard(tmp_path, monkeypatch):
    tokenizer = tiny_chat_tokenizer()
    model = tiny_llama(len(tokenizer), hidden_size=64, intermediate_size=128)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    data = write_jsonl(tmp_path / "train.jsonl", [chat(q, a) for q, a in QA] * 5)
    out = tmp_path / "run"
    monkeypatch.chdir(tmp_path)
    try:
        asyncio.run(_scenario(tmp_path, data, out))
    finally:
        kill_run(out)


async def _scenario(tmp_path, data, out):
    app = OsftTui(None, poll_s=0.2)
    async with app.run_test(size=(140, 42)) as pilot:
        form = await wait_until(pilot, lambda: isinstance(app.screen, NewRunScreen) and app.screen, 10, "the form")
        values = {"model": str(tmp_path / "model"), "data": str(data), "output_dir": str(out), "nnodes": "1",
                  "nproc_per_node": "2", "max_steps": "400", "learning_rate": "0.002",
                  "extra_args": "--batch-size 5 --max-tokens-per-gpu 64 --max-seq-len 64"}
        for name, value in values.items():
            form.query_one(f"#field-{name}", Input).value = value
        await pilot.press("ctrl+l")
        dash = app.dashboard
        await wait_until(pilot, lambda: app.screen is dash and (dash.run.step or 0) >= 2, 120, "step 2")
        assert len(dash.run.ranks) == 2 and {r.node_rank for r in dash.run.ranks.values()} == {0}
        assert dash.run.nodes[0].tokens_per_s > 0

        await pilot.press("c")
        saved = await wait_until(pilot, lambda: _records(out, "checkpoint_saved"), 60, "the checkpoint")
        ckpt_step = saved[0]["step"]
        entry = await wait_until(pilot, lambda: next((e for e in dash.run.checkpoints
                                                      if e.step == ckpt_step and e.complete), None), 10, "the list")
        assert entry.path == out / "full_state_checkpoints" / f"step_{ckpt_step}"
        assert saved[0]["path"] == str(entry.path)
        assert _records(out, "checkpoint_requested")[0]["signal"] == "SIGUSR1"
        await wait_until(pilot, lambda: dash.run.step >= ckpt_step + 2, 60, "training to go on")
        assert dash.view.any_alive()

        await pilot.press("s")
        await wait_until(pilot, lambda: dash.run.state == "stopped" and not dash.view.any_alive(), 90,
                         "the stop")
        assert json.loads((out / "run.json").read_text())["exit_code"] == 75
        stop_step = _records(out, "checkpoint_saved")[-1]["step"]
        assert stop_step > ckpt_step

        table = dash.query_one(CheckpointTable)
        await wait_until(pilot, lambda: table.select_step(ckpt_step), 10, "the first checkpoint in the list")
        await pilot.press("r")  # nothing runs any more: relaunches at once
        resumed = await wait_until(pilot, lambda: _records(out, "resumed"), 120, "the resumed event")
        assert resumed[0]["from_step"] == ckpt_step
        assert resumed[0]["path"] == str(entry.path)
        await wait_until(pilot, lambda: dash.run.step is not None and dash.run.step > stop_step, 60,
                         "steps after the resume")
        steps = [r["step"] for r in _records(out, "step")]
        first_after = steps[steps.index(stop_step) + 1]
        assert first_after == ckpt_step + 1  # the resumed run continues from the chosen step
        run = json.loads((out / "run.json").read_text())
        assert "--resume-from-full-state-checkpoint" in run["argv"]
        assert run["argv"][run["argv"].index("--resume-from-full-state-checkpoint") + 1] == str(entry.path)

        await pilot.press("s")
        await wait_until(pilot, lambda: dash.run.state == "stopped" and not dash.view.any_alive(), 90,
                         "the second stop")
        # the loss chart holds the whole run once, as osft-train plot reads it (the resumed segment
        # replaced the steps after the checkpoint it resumed from)
        series, chart = run_series(out), dash.query_one(MetricChart)
        assert series.loss.steps == list(range(1, series.loss.steps[-1] + 1))
        await wait_until(pilot, lambda: chart.curves and chart.curves[0][1].steps == series.loss.steps, 10,
                         "the chart of the whole run")
        assert chart.curves[0][1].values == series.loss.values and dash.run.curves["lr"].values == series.lr.values
        await pilot.press("q")  # nothing runs: quits at once
    assert await no_processes_left(out)
