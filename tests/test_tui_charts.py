"""osft-tui's charts and numbers: whole-run curves that a resume replaces instead
of extending, the metric chart's views, every node's tokens/s on one axis from zero, the straggler
marked on its row, the step time, lr and grad norm columns in fixed formats."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from osft.tui.app import OsftTui
from osft.tui.components.charts import MetricChart, ThroughputChart, nice_ticks
from osft.tui.components.header import RunHeader
from osft.tui.components.nodes import NodeTable
from osft.tui.series import CURVE_POINTS, Curve
from osft.tui.watcher import RunWatcher
from tui_support import wait_until

T0 = 1_790_000_000.0


def loss_at(step: int, segment: int) -> float:
    """The loss the written run logs at ``step`` in its first (0) or resumed (1) segment."""
    return 3.0 - 0.1 * step if segment == 0 else 2.5 - 0.05 * step


def step_record(node: int, step: int, segment: int) -> dict:
    return {"ts": T0 + 10 * step + 1000 * segment, "event": "step", "node_rank": node, "rank": node, "local_rank": 0,
            "hostname": f"host{node}", "job_id": f"job{segment}", "step": step, "loss": loss_at(step, segment),
            "lr": 1e-4 * step / 12, "grad_norm": 2.0 / step, "step_time_s": 0.25 + 0.01 * step,
            "node_tokens_per_s": 1000.0 if node == 0 else 450.0, "samples_per_s": 8.0, "node_mfu": 0.1,
            "ortho_violations": 0, "ortho_violations_total": 0}


def eval_record(step: int, segment: int, name: str, kind: str) -> dict:
    loss = 2.0 + 0.01 * step + segment
    return {"ts": T0 + 10 * step + 1000 * segment, "event": "eval", "node_rank": 0, "rank": 0, "step": step,
            "set": name, "kind": kind, "eval_loss": loss, "forgetting": 0.01 * step + segment if kind == "retention" else None}


def write_resumed_run(root: Path, replayed: bool = True) -> None:
    """A 2-node run: steps 1-10 (evaluations at 5 and 10), then a resume from step 6 that logs
    steps 7-12 again with other losses (and an evaluation at step 12) into the same files (without
    ``replayed``, the files end at the resume's ``resumed`` record). Node 1 runs at 45 % of node
    0's tokens/s. run.json: completed, with its export."""
    (root / "metrics").mkdir(parents=True)
    (root / "run.json").write_text(json.dumps({"job_id": "job1", "state": "completed", "exit_code": 0,
                                               "config": {"max_steps": 12}, "nproc_per_node": 1, "start_time": T0,
                                               "updated_at": T0 + 1200, "export_dir": str(root / "hf_format" / "step_12")}))
    for node in (0, 1):
        lines = []
        for segment, steps in ((0, range(1, 11)), (1, range(7, 13) if replayed else ())):
            lines.append({"ts": T0, "event": "run_started", "node_rank": node, "rank": node, "local_rank": 0,
                          "hostname": f"host{node}", "job_id": f"job{segment}", "pid": 999_999_990 + node})
            if segment == 1:
                lines.append({"ts": T0 + 1000, "event": "resumed", "node_rank": node, "rank": node, "from_step": 6,
                              "path": str(root / "full_state_checkpoints" / "step_6")})
            for step in steps:
                lines.append(step_record(node, step, segment))
                if node == 0 and step in ((5, 10) if segment == 0 else (12,)):
                    lines += [eval_record(step, segment, "chat", "eval"), eval_record(step, segment, "ret", "retention")]
        (root / "metrics" / f"node{node}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def test_a_curve_replaces_replayed_steps_and_keeps_a_long_run_in_bounded_points():
    c = Curve()
    for step in range(1, 11):
        c.add(step, float(step))
    c.cut(6)  # resumed from step 6
    for step in range(7, 13):
        c.add(step, 100.0 + step)
    assert c.steps == list(range(1, 13)) and c.values == [*map(float, range(1, 7)), *(100.0 + s for s in range(7, 13))]
    c.add(9, -1.0)  # a step at or below the last one: a replay without a resumed record
    assert c.steps == list(range(1, 10)) and c.values[-1] == -1.0
    long = Curve()
    for step in range(1, 10_001):
        long.add(step, step / 2)
        assert len(long.steps) <= CURVE_POINTS + 1
    assert long.steps[-1] == 10_000 and long.values[-1] == 5000.0  # the latest step is always there
    assert long.stride == 64 and all(s % 64 == 0 for s in long.steps[:-1])
    assert long.steps == sorted(set(long.steps)) and len(long.steps) > CURVE_POINTS // 2


def test_a_step_window_shows_every_recent_step_of_a_long_run_and_the_kept_points_before():
    long = Curve()
    for step in range(1, 10_001):
        long.add(step, float(step))
    assert long.window(None) is long
    last100 = long.window(100)
    assert last100.steps == list(range(9_901, 10_001)) and last100.values == [float(s) for s in last100.steps]
    assert last100.stride == 1  # at every step, though the whole curve keeps every 64th
    recent = [s for s, _ in long.recent]
    assert CURVE_POINTS <= len(recent) <= 2 * CURVE_POINTS and recent == list(range(recent[0], 10_001))
    last1000 = long.window(1_000)  # older than the recent points: the kept ones, then every recent step
    assert last1000.steps == [s for s in long.steps if 9_000 < s < recent[0]] + recent
    assert last1000.stride == long.stride and last1000.steps == sorted(set(last1000.steps))
    long.cut(9_950)  # a resume from step 9,950 forgets the later recent points too
    assert long.window(100).steps[-1] == 9_950 and [s for s, _ in long.recent][-1] == 9_950
    long.add(9_951, 0.0)
    assert long.window(3).steps == [9_949, 9_950, 9_951]


def test_smoothing_is_a_debiased_moving_average():
    curve = Curve([1, 2, 3], [0.0, 10.0, 10.0])
    assert curve.smoothed(0.0) is curve
    assert [round(v, 3) for v in curve.smoothed(0.5).values] == [0.0, 6.667, 8.571]
    assert curve.smoothed(0.5).steps == [1, 2, 3] and curve.values == [0.0, 10.0, 10.0]


def test_ticks_are_round_and_keep_their_decimals():
    assert nice_ticks(0, 1533) == ([0, 500, 1000, 1500], ["0", "500", "1,000", "1,500"])
    assert nice_ticks(0.9, 1.8) == ([1.0, 1.25, 1.5, 1.75], ["1.00", "1.25", "1.50", "1.75"])
    assert nice_ticks(1, 3, whole=True) == ([1, 2, 3], ["1", "2", "3"])
    assert nice_ticks(0, 5e-5)[1] == ["0.0e+00", "2.0e-05", "4.0e-05"]


def test_the_model_keeps_the_whole_resumed_run_once(tmp_path):
    write_resumed_run(tmp_path / "resuming", replayed=False)
    w = RunWatcher(tmp_path / "resuming")
    w.poll()  # resumed from step 6, no step logged since: what came after step 6 is gone
    assert w.model.curves["loss"].steps == list(range(1, 7)) and w.model.nodes[1].tokens.steps == list(range(1, 7))
    assert w.model.curves["eval_loss chat"].steps == [5]
    write_resumed_run(tmp_path)
    w = RunWatcher(tmp_path)
    w.poll()
    m = w.model
    loss = m.curves["loss"]
    assert loss.steps == list(range(1, 13))
    assert loss.values == [loss_at(s, 0) for s in range(1, 7)] + [loss_at(s, 1) for s in range(7, 13)]
    assert m.curves["lr"].steps == list(range(1, 13)) and m.curves["grad_norm"].values[-1] == 2.0 / 12
    # the evaluation at step 10 belonged to the segment the resume from step 6 replaced
    assert m.curves["eval_loss chat"].steps == [5, 12] and m.curves["eval_loss chat"].values == [2.05, 3.12]
    assert m.curves["forgetting ret"].values == [0.05, 1.12]
    assert "eval_loss ret" in m.curves and "forgetting chat" not in m.curves  # an eval set has no forgetting
    for node, rate in ((0, 1000.0), (1, 450.0)):
        assert m.nodes[node].tokens.steps == list(range(1, 13)) and set(m.nodes[node].tokens.values) == {rate}
    assert m.export_dir == str(tmp_path / "hf_format" / "step_12")


@pytest.mark.tui_process  # the dashboard's reader process
def test_the_charts_show_the_whole_resumed_run_on_shared_axes_and_the_straggler_on_its_row(tmp_path):
    write_resumed_run(tmp_path)

    async def main():
        app = OsftTui(tmp_path, poll_s=0.1)
        async with app.run_test(size=(120, 40)) as pilot:
            dash = app.dashboard
            metric, tokens = dash.query_one(MetricChart), dash.query_one(ThroughputChart)
            await wait_until(pilot, lambda: len(tokens.curves) == 2 and metric.curves
                             and metric.curves[0][1].steps[-1] == 12, 20, "the charts")
            (label, loss), *evals = metric.curves
            assert label == "train" and loss.steps == list(range(1, 13))  # replayed steps replaced, not appended
            assert loss.values[6] == loss_at(7, 1) and loss.values[5] == loss_at(6, 0)
            assert [name for name, _ in evals] == ["eval_loss chat", "eval_loss ret"]
            assert "loss, nats/token" in str(metric.border_title) and "━ train" in str(metric.border_title)
            # every node on one axis from zero: node 1 is drawn at 45 % of node 0's height
            assert [name for name, _ in tokens.curves] == ["node 0", "node 1"] and tokens.value_range == (0.0, 1000.0)
            seen = []
            for _ in range(4):
                await pilot.press("g")
                seen.append((metric.view, [name for name, _ in metric.curves]))
            assert seen == [("lr", ["lr"]), ("grad_norm", ["grad_norm"]), ("forgetting", ["forgetting ret"]),
                            ("loss", ["train", "eval_loss chat", "eval_loss ret"])]
            await pilot.press("m")  # smoothed: the same steps, each point an average of those before
            (label, smooth), *_ = metric.curves
            assert "smoothed 0.6" in str(metric.border_title) and smooth.steps == loss.steps
            assert smooth.values == Curve(loss.steps, loss.values).smoothed(0.6).values != loss.values
            await pilot.press("m", "m")  # 0.9, then none
            assert metric.curves[0][1].values == loss.values
            await pilot.press("w", "w", "w")  # 10,000 steps, 1,000, then the last 100: the same 12 steps
            assert "last 100 steps" in str(metric.border_title) and metric.curves[0][1].steps == loss.steps
            metric.window = 5  # a range shorter than the run: its last 5 steps
            metric.show(dash.run)
            assert metric.curves[0][1].steps == list(range(8, 13))
            metric.window = 100
            await pilot.press("w")  # all steps again
            assert metric.window is None and metric.curves[0][1].steps == loss.steps
            assert "steps" not in str(metric.border_title).split("(")[0]
            table = dash.query_one(NodeTable)
            await wait_until(pilot, lambda: "node1" in table.rows, 10, "node 1's row")
            assert str(table.get_cell("node0", "node")) == "0" and str(table.get_cell("node1", "node")) == "[b red]1 slow[/]"
            assert str(table.get_cell("node1", "tokens/s")) == "[b red]450[/]"
            assert [str(table.get_cell("node0", c)) for c in ("step time", "lr", "grad norm", "loss")] == \
                ["0.37 s", "1.00e-04", "0.167", "1.9000"]
            assert "samples/s" not in [str(c.label) for c in table.columns.values()]  # the job's value: once,
            assert str(dash.query_one(RunHeader).render()).endswith("  8.00 samples/s")  # in the run line
            # a click on a header sorts by its column: ascending, descending, then the table's order
            order = []
            for _ in range(3):
                await pilot.click(NodeTable, offset=(33, 0))  # the tokens/s header (node 11 + host 12 + step 8)
                await pilot.pause()
                order.append([str(r.key.value) for r in table.ordered_rows])
            assert order == [["node1", "node0"], ["node0", "node1"], ["node0", "node1"]]
            assert table.sorted_by is None and [str(c.label) for c in table.columns.values()][3] == "tokens/s"
            await pilot.click(NodeTable, offset=(1, 0))  # node: ascending, then descending
            await pilot.click(NodeTable, offset=(1, 0))
            await pilot.pause()
            assert [str(r.key.value) for r in table.ordered_rows] == ["node1", "node0"] and table.sorted_by == ("node", True)
            assert str(table.columns[next(iter(table.columns))].label) == "node ▼"

    asyncio.run(main())


def test_under_the_help_nothing_is_drawn_and_closing_it_draws_what_came_meanwhile(tmp_path):
    """While the help covers the dashboard the polls take records in but draw no pane; the frame
    that closes the help shows the panes as they were, and the steps written meanwhile follow
    right after it."""
    from osft.tui.components.modals import HelpScreen

    root = tmp_path / "run"
    write_resumed_run(root, replayed=False)

    async def main():
        app = OsftTui(root, poll_s=0.1)
        async with app.run_test(size=(140, 40)) as pilot:
            dash = app.dashboard
            table = dash.query_one(NodeTable)
            await wait_until(pilot, lambda: "node0" in table.rows and str(table.get_cell("node0", "step")) == "10", 20,
                             "step 10 on node 0's row")
            await pilot.press("question_mark")
            await wait_until(pilot, lambda: isinstance(app.screen, HelpScreen), 5, "the help")
            with open(root / "metrics" / "node0.jsonl", "a") as f:
                f.writelines(json.dumps(step_record(0, step, 0)) + "\n" for step in (11, 12))
            await wait_until(pilot, lambda: dash.run.nodes[0].step == 12, 20, "the records read")
            await pilot.pause(1.5)  # polls, slow tier included, with the help on top
            assert str(table.get_cell("node0", "step")) == "10" and dash._stale
            await pilot.press("escape")
            await wait_until(pilot, lambda: str(table.get_cell("node0", "step")) == "12", 5, "step 12 drawn")
            assert not dash._stale

    asyncio.run(main())
