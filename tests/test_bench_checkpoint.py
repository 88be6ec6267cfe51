"""The checkpoint benchmark's pipeline (``benchmarks/bench_checkpoint.py --quick``)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.bench
def test_bench_checkpoint_quick_measures_sizes_and_startup(tmp_path):
    out = tmp_path / "c.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_checkpoint.py"), "--quick", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    (row,) = result["sizes"]
    assert row["frozen_bytes"] > 0 and row["all_factors_bytes"] == row["checkpoint_bytes"] + row["frozen_bytes"]
    assert 0 < row["ratio_vs_all_factors"] < 1 and row["save_s"] > 0 and row["write_mb_per_s"] > 0
    assert result["disk_write_mb_per_s"] > 0
    assert result["startup"]["fresh_s"] > 0 and result["startup"]["resume_s"] > 0
