"""The V-projection benchmark's pipeline (``benchmarks/bench_v_proj.py --quick``) on 2 gloo ranks."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.bench
@pytest.mark.slow
def test_bench_v_proj_quick_measures_three_modes_that_agree(tmp_path):
    out = tmp_path / "v.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_v_proj.py"), "--quick", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    shapes = json.loads(out.read_text())["projection"]["shapes"]
    r = shapes["smollm2_q_proj"]
    assert r["k_high"] == 288  # 576 at URR 0.5
    assert r["bytes_ratio_gram_vs_factored"] == 2.0
    assert r["v_bytes_per_projection"]["gram"] == 2 * r["v_bytes_per_projection"]["factored"]
    assert r["v_bytes_per_projection"]["cached"] == 0
    assert set(r["time_s_median"]) == {"gram", "factored", "cached"} and all(t > 0 for t in r["time_s_median"].values())
    assert max(r["max_abs_diff_vs_factored"].values()) < 1e-4
    local = json.loads(out.read_text())["projection_only_one_block"]  # part 3 on one SmolLM2 block
    assert local["modules"] == 7 and set(local["time_s_median"]) == {"per_module", "batched", "check", "indicators", "bound"}
    assert local["batched_max_abs_diff_vs_per_module"] < 1e-5
    assert local["measured_max_dev_deg"] <= local["bound_deg"] < 1.0
