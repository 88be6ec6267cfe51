"""Snapshot tests of osft-tui: the new-run form and the dashboard of a two-node run at 80x24,
120x40 and 200x60, and the alert state of the violation counters, compared with SVG screenshots under ``tests/snapshots/``.

The screenshots are Textual's own (``App.export_screenshot``). A run directory written by the test
with fixed times, hosts and pids (none alive here) makes the screen the same on every machine.
``OSFT_UPDATE_SNAPSHOTS=1 pytest tests/test_tui_snapshots.py`` rewrites them after an intended
change; review the SVGs (any browser shows them) before committing.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import pytest
from osft.trainer.checkpoint.manifest import describe_files, write_manifest
from osft.tui.app import OsftTui
from osft.tui.components.charts import ThroughputChart
from osft.tui.components.new_run import NewRunScreen
from osft.tui.components.ranks import RankTable
from osft.tui.components.violations import ViolationCounters
from osft.tui.dashboard import SAMPLE_S
from textual.widgets import Input, RichLog
from tui_support import wait_until

SNAPSHOTS = Path(__file__).with_name("snapshots")
#: Terminal sizes of the form and dashboard snapshots: the smallest supported, two common ones.
SIZES = [(80, 24), (120, 40), (200, 60)]
#: The size of the other snapshots.
SIZE = (140, 40)
T0 = 1_790_000_000.0  # a fixed start time (unix s)


@pytest.fixture
def fixed_clock(monkeypatch, tmp_path):
    """UTC clock times, a fixed demo directory, and the test's temp dir as working directory."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    monkeypatch.setenv("OSFT_DEMO_DIR", "/opt/osft-demo")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))  # no theme saved by a session of the user
    monkeypatch.chdir(tmp_path)
    yield
    monkeypatch.undo()
    time.tzset()


def assert_snapshot(svg: str, name: str, tmp_path: Path) -> None:
    """Compare ``svg`` with ``tests/snapshots/<name>.svg`` (or rewrite it, see the module doc)."""
    expected = SNAPSHOTS / f"{name}.svg"
    if os.environ.get("OSFT_UPDATE_SNAPSHOTS") == "1":
        SNAPSHOTS.mkdir(exist_ok=True)
        expected.write_text(svg)
        return
    actual = tmp_path / f"{name}.actual.svg"
    actual.write_text(svg)
    assert expected.is_file(), f"no snapshot {expected}; see the module docstring ({actual} is the screen now)"
    assert svg == expected.read_text(), f"screen differs from {expected}; the screen now is in {actual}"


async def settled_screenshot(app, pilot, must_show: str) -> str:
    """The SVG screenshot once it shows ``must_show`` and two in a row, taken longer apart than the
    dashboard's slow redraw tier (SAMPLE_S), are equal: the footer, tables, sparklines and event
    pane render a moment after the data they show arrives."""
    last = None
    for _ in range(20):
        svg = app.export_screenshot()
        if svg == last and must_show in svg:
            return svg
        last = svg
        await pilot.pause(SAMPLE_S + 0.3)
    raise AssertionError(f"the screen did not settle showing {must_show!r}")


def _step(node: int, step: int, violations: int, total: int, dev: float) -> dict:
    tps = 1480.0 - 20 * step if node == 0 else 1050.0 - 15 * step
    return {"ts": T0 + 10 * step, "event": "step", "node_rank": node, "rank": 2 * node, "local_rank": 0,
            "world_size": 4, "hostname": f"node-{'ab'[node]}", "job_id": "3f9c2a7b1d04", "step": step, "epoch": 0,
            "lr": 5e-5, "loss": 2.9 - 0.12 * step + (0.05 if step % 3 == 0 else 0), "grad_norm": 1.2,
            "num_tokens": 4096, "num_loss_tokens": 3100, "num_samples": 16, "step_time_s": 10.0,
            "tokens_per_s": 2400.0, "node_tokens_per_s": tps, "node_mfu": tps / 4000, "samples_per_s": 1.6, "ortho_violations": violations,
            "ortho_violations_total": total, "ortho_max_dev_deg": dev, "rss_bytes": 1_730_000_000,
            "gpu_mem_bytes": 31_200_000_000 + node * 400_000_000,
            "gpus": [{"rank": 2 * node + local, "local_rank": local, "mem_bytes": 31_200_000_000 + (2 * node + local) * 400_000_000,
                      "util_pct": 93.0 - 7 * node - local} for local in (0, 1)]}


def write_two_node_run(root: Path, violation_at: int | None) -> None:
    """A finished 2-node, 4-rank run of 12 steps with checkpoints at steps 4 and 8 and a half-written
    one at step 12; with ``violation_at``, 3 orthogonality violations in that step."""
    (root / "metrics").mkdir(parents=True)
    common = {"argv": ["osft-train", "--output-dir", "run"], "config": {"max_steps": 20}, "job_id": "3f9c2a7b1d04",
              "nnodes": 2, "nproc_per_node": 2, "start_time": T0, "torchrun_pids": []}
    for node in (0, 1):
        name = "run.json" if node == 0 else "run.node1.json"
        (root / name).write_text(json.dumps({**common, "launcher_pid": 4_000_000 + node, "hostname": f"node-{'ab'[node]}",
                                             "state": "stopped", "exit_code": 75, "updated_at": T0 + 125}))
        lines = []
        for local in (0, 1):
            lines.append({"ts": T0 + 1, "event": "run_started", "node_rank": node, "rank": 2 * node + local,
                          "local_rank": local, "world_size": 4, "hostname": f"node-{'ab'[node]}",
                          "job_id": "3f9c2a7b1d04", "pid": 4_100_000 + 2 * node + local})
        total = 0
        for step in range(1, 13):
            v = 3 if step == violation_at else 0
            total += v
            lines.append(_step(node, step, v, total, 1.734 if v else 0.004 + step / 1000))
        with open(root / "metrics" / (f"node{node}.jsonl" if node == 0 else "node1.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in lines if r["local_rank"] == 0)
        with open(root / "metrics" / f"rank{2 * node + 1}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in lines if r["local_rank"] == 1)
    ckpts = root / "full_state_checkpoints"
    for step in (4, 8):
        d = ckpts / f"step_{step}"
        d.mkdir(parents=True)
        (d / "model.bin").write_bytes(b"\0" * (93_000 * step))
        write_manifest(d, describe_files(d, ["model.bin"], rank=0), step=step)
        os.utime(d / "manifest.json", (T0 + 10 * step + 3, T0 + 10 * step + 3))
    partial = ckpts / "step_12.tmp-3f9c2a7b1d04"
    partial.mkdir()
    (partial / "model.bin").write_bytes(b"\0" * 50_000)
    os.utime(partial, (T0 + 123, T0 + 123))


async def _dashboard_svg(root: Path, size: tuple[int, int] = SIZE) -> tuple[str, bool]:
    app = OsftTui(root, poll_s=0.1)
    async with app.run_test(size=size) as pilot:
        dash = app.dashboard
        await wait_until(pilot, lambda: dash.run.step == 12 and dash.run.nodes.get(1)
                         and len(dash.query_one(ThroughputChart).curves) == 2
                         and len(dash.query_one(RankTable).rows) == 4 and dash.query_one("#events", RichLog).lines,
                         10, "every panel drawn")
        alert = app.dashboard.query_one(ViolationCounters).has_class("alert")
        return await settled_screenshot(app, pilot, "quit"), alert  # q is in the footer at every size


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_new_run_form(fixed_clock, tmp_path, size):
    async def main():
        app = OsftTui(None)
        async with app.run_test(size=size) as pilot:
            await wait_until(pilot, lambda: isinstance(app.screen, NewRunScreen), 10, "the form")
            for field in app.screen.query(Input):
                field.cursor_blink = False
            return await settled_screenshot(app, pilot, "palette")

    assert_snapshot(asyncio.run(main()), f"new_run_form_{size[0]}x{size[1]}", tmp_path)


@pytest.mark.tui_process
@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_dashboard_with_two_nodes(fixed_clock, tmp_path, size):
    write_two_node_run(Path("run"), violation_at=None)
    svg, alert = asyncio.run(_dashboard_svg(Path("run"), size))
    assert not alert
    assert_snapshot(svg, f"dashboard_two_nodes_{size[0]}x{size[1]}", tmp_path)


@pytest.mark.tui_process
def test_violation_counters_alert(fixed_clock, tmp_path):
    write_two_node_run(Path("run"), violation_at=12)
    svg, alert = asyncio.run(_dashboard_svg(Path("run")))
    assert alert
    assert_snapshot(svg, "dashboard_violation_alert", tmp_path)
