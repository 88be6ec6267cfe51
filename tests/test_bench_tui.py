"""The osft-tui flood benchmark's pipeline (``benchmarks/bench_tui.py --quick``): 4 writer processes
flood a run directory while the dashboard runs headless; every record written is counted once.

Latency and CPU are never asserted here; on a shared CI machine they mean nothing.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.bench
@pytest.mark.slow
def test_bench_tui_quick_counts_every_record_once(tmp_path):
    out = tmp_path / "t.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_tui.py"), "--quick", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["quick"] and result["params"]["ranks"] == 4
    (run,) = result["runs"]
    assert run["ranks_per_node"] == 2 and len(run["writers"]) == 4
    counts = run["counts"]
    assert set(counts["files"]) == {"node0.jsonl", "rank1.jsonl", "node1.jsonl", "rank3.jsonl"}
    for name, f in counts["files"].items():
        assert f["written"] > 0 and f["read"] == f["written"], name
    assert set(counts["steps_per_node"]) == {"0", "1"}
    for node, s in counts["steps_per_node"].items():
        assert s["written"] > 0 and s["seen"] == s["written"] and s["last_step"] == s["written"], node
    v = counts["violations"]
    assert v["records_sum_written"] > 0
    assert v["records_sum_read"] == v["records_sum_written"] and v["total_read"] == v["total_written"]
    w = counts["warnings"]
    assert w["written"] > 0 and w["events"] == w["written"] and w["problems"] == 0
    assert counts["throughput_correct"] and len(counts["tokens_per_s_shown"]) == 2
    assert counts["no_loss_or_duplicates"]
    bounded = run["memory_bounded"]
    assert bounded["ok"] and bounded["event_pane_lines"] <= bounded["event_pane_max_lines"]
    assert run["exception"] is None and all(run["checks"].values())
    assert run["presses"] and run["latency_ms"]["n"] == len(run["presses"])
    assert run["achieved"]["log_lines_total"] > 0 and run["dashboard"]["peak_rss_bytes"] > 0
