"""The benchmarks' pipelines (``bench_step.py --quick`` and others): each runs and writes its JSON.

Speed is never asserted here; the numbers on a shared CI machine mean nothing.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytest.importorskip("peft")


@pytest.mark.bench
@pytest.mark.slow
def test_bench_step_quick_writes_every_method_on_the_same_tokens(tmp_path):
    out = tmp_path / "bench_step.json"
    proc = subprocess.run(
        # this checkout as its own --baseline: the extra worker runs the same code through the baseline path
        [sys.executable, str(REPO / "benchmarks" / "bench_step.py"), "--quick", "--out", str(out),
         "--baseline", str(REPO), "--baseline-python", sys.executable],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["machine"]["cpu_count"] >= 1 and result["machine"]["torch_version"]
    section = result["models"]["tiny"]
    assert set(section["methods"]) == {"osft", "full_ft", "peft_osf", "hf_unpacked", "hf_packed", "osft_baseline"}
    assert result["settings"]["baseline"]["path"] == str(REPO.resolve())
    assert section["methods"]["osft_baseline"]["first_loss"] == section["methods"]["osft"]["first_loss"]
    assert section["methods"]["osft_baseline"]["last_loss"] == section["methods"]["osft"]["last_loss"]
    assert section["osft_vs_baseline"]["step_time"] == pytest.approx(
        section["methods"]["osft"]["step_time_s"] / section["methods"]["osft_baseline"]["step_time_s"])
    # the plain transformers steps see the same tokens and labels: the same loss before any update
    full_loss = section["methods"]["full_ft"]["first_loss"]
    for name in ("hf_unpacked", "hf_packed", "osft"):
        assert section["methods"][name]["first_loss"] == pytest.approx(full_loss, rel=1e-4), name
    for name, m in section["methods"].items():
        assert len(m["step_time_samples_s"]) == 2, name
        assert all(t > 0 for t in m["step_time_samples_s"]), name
        assert 0 < m["mfu"] == pytest.approx(m["flops_per_s"] / section["gemm_peak_flops_per_s"]), name
        for key in ("step_time_s", "tokens_per_s", "flops_per_s", "peak_rss_bytes", "first_step_s"):
            assert m[key] > 0, (name, key)
        assert (m["svd_s"] is None) == (name in ("full_ft", "hf_unpacked", "hf_packed")), name
        assert m["svd_s"] is None or m["svd_s"] > 0
        assert section["ratios_vs_full_ft"][name]["step_time"] > 0
    assert section["ratios_vs_full_ft"]["full_ft"]["step_time"] == 1.0
    assert section["batch"]["num_tokens"] > 0


@pytest.mark.bench
@pytest.mark.slow
def test_gpu_check_cpu_smoke_resumes_bit_exact(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--cpu-smoke", "--out", str(out)],
                          cwd=REPO / "benchmarks", capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["smoke"] and result["resume"]["bit_exact"] and result["resume"]["steps_compared"]
    assert result["exit_codes"] == {"reference": 0, "resumed": 0, "full_ft": 0}
    assert result["resume"]["checkpoint_step"] >= 4 and result["resume"]["steps_compared"][-1] == 10
    for method in ("osft", "full_ft"):
        assert result["methods"][method]["tokens_per_s"] > 0 and 0 < result["methods"][method]["mfu"]
        estimate = result["memory_estimate"][method]  # on CPU there is no gpu_mem_bytes to compare with
        assert estimate["estimated_bytes"] > 0 and estimate["measured_gpu_mem_bytes"] is None


@pytest.mark.bench
def test_bench_activation_checkpointing_quick_measures_both_settings(tmp_path):
    """One worker per setting, the same micro-batch: the same loss and gradient norm, memory and
    time measured (their sizes are never asserted)."""
    out = tmp_path / "actckpt.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_activation_checkpointing.py"), "--quick",
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    osft = result["methods"]["osft"]
    off, on = osft["off"], osft["on"]
    assert 0 < off["num_tokens"] == on["num_tokens"] <= result["settings"]["tokens_per_micro_batch"] == 512
    assert osft["same_loss_and_grad_norm"] and off["loss"] == on["loss"] > 0
    for r in (off, on):
        assert r["step_time_s"] > 0 and r["step_peak_rss_bytes"] >= r["rss_before_step_bytes"] > 0
        assert r["process_peak_rss_bytes"] >= r["step_peak_rss_bytes"] * 0.99  # ru_maxrss: kB granularity
        assert r["flops_per_s"] == pytest.approx(r["model_flops"] / r["step_time_s"], rel=0.25)  # timed inside the step
        assert 0 < r["mfu"] == pytest.approx(r["flops_per_s"] / r["gemm_peak_flops_per_s"])
    assert osft["ratios_on_vs_off"]["step_peak_rss"] == on["step_peak_rss_bytes"] / off["step_peak_rss_bytes"]


@pytest.mark.bench
def test_bench_startup_compares_this_checkout_with_a_baseline(tmp_path):
    """Against itself: every ratio near 1; without valgrind on PATH no instruction counts."""
    bin_dir = tmp_path / "bin"  # git only: valgrind (a minute of the suite) stays out of reach
    bin_dir.mkdir()
    (bin_dir / "git").symlink_to(shutil.which("git"))
    out = tmp_path / "startup.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_startup.py"), "--baseline", str(REPO),
                           "--rounds", "1", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300, env=dict(os.environ, PATH=str(bin_dir)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["revisions"]["this"] == result["revisions"]["baseline"]
    assert set(result["commands"]) == {"import osft.tui.app", "import osft.trainer.launch.cli", "osft-train --help"}
    for name, row in result["commands"].items():
        assert row["this"]["instructions"] is None and set(row["ratio"]) == {"wall_s", "cpu_s"}, name
        assert row["this"]["cpu_s"] > 0 and 0.2 < row["ratio"]["cpu_s"] < 5, name


def test_bench_startup_runs_a_flat_layout_baseline_by_its_module_names(tmp_path):
    """A baseline from before ``trainer/launch/`` has ``osft-train``'s module at ``osft.trainer.cli``."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from bench_startup import COMMANDS, in_layout

    assert in_layout(REPO, COMMANDS["osft-train --help"]) == ["-m", "osft.trainer.launch.cli", "--help"]
    (tmp_path / "trainer").mkdir()
    assert in_layout(tmp_path, COMMANDS["osft-train --help"]) == ["-m", "osft.trainer.cli", "--help"]
    assert in_layout(tmp_path, COMMANDS["import osft.tui.app"]) == ["-c", "import osft.tui.app"]


@pytest.mark.bench
def test_bench_forward_forms_quick_times_every_form_against_a_dense_linear(tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    import bench_forward_forms

    from osft.trainer.osft.plan import choose_forward_form

    out = tmp_path / "forward_forms.json"
    assert bench_forward_forms.main(["--quick", "--threads", "0", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(r["n"], r["m"], r["tokens"]) for r in result["shapes"]] == [(48, 32, 64), (16, 32, 64)]
    for r in result["shapes"]:
        assert set(r["median_s"]) == {"linear", "dense", "hybrid", "split"} and all(t > 0 for t in r["median_s"].values())
        assert r["vs_linear"]["hybrid"] == pytest.approx(r["median_s"]["hybrid"] / r["median_s"]["linear"])
        assert r["fastest"] == min(r["vs_linear"], key=r["vs_linear"].get)
        assert r["chosen"] == choose_forward_form(r["n"], r["m"], r["k_low"], r["tokens"])


@pytest.mark.bench
def test_bench_launch_times_the_phases_of_a_two_rank_run(tmp_path):
    """One round, this checkout only: every phase measured (each positive: the lines and records
    it ends on came in the order of a launch), this checkout's revision recorded."""
    out = tmp_path / "launch.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_launch.py"), "--rounds", "1", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    (run,) = result["samples"]["this"]
    assert set(result["samples"]) == set(result["medians"]) == {"this"} and "ratio" not in result
    assert list(run) == list(result["medians"]["this"]) == [
        "preflight_s", "ranks_start_s", "run_s", "ranks_end_s", "launcher_end_s", "total_s"]
    assert all(v > 0 for v in run.values()), run
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    assert result["revisions"] == {"this": head}


@pytest.mark.bench
def test_stress_test_records_every_run_and_keeps_a_failed_one(tmp_path):
    """``stress_test.py``: a passing test twice (two records, exit 0), then a test that does not
    exist (pytest's exit 4: counted failed, its output kept, the script's exit 1)."""
    script = [sys.executable, str(REPO / "benchmarks" / "stress_test.py")]
    passing = "tests/test_config_sections.py::test_a_read_outside_the_declared_section_is_found"
    out = tmp_path / "stress.json"
    proc = subprocess.run([*script, "--runs", "2", "--out", str(out), "--keep", str(tmp_path / "kept"), passing],
                          cwd=REPO / "benchmarks", capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert [r["exit_code"] for r in result["runs"]] == [0, 0] and result["test"] == passing
    assert result["summary"]["runs"] == 2 and result["summary"]["failed"] == result["summary"]["crashed"] == 0
    assert not (tmp_path / "kept").exists()
    proc = subprocess.run([*script, "--runs", "1", "--out", str(out), "--keep", str(tmp_path / "kept"),
                           "tests/test_config_sections.py::no_such_test"],
                          cwd=REPO / "benchmarks", capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    result = json.loads(out.read_text())
    assert result["runs"][0]["exit_code"] == 4 and result["summary"]["failed"] == 1 and result["summary"]["crashed"] == 0
    assert "no_such_test" in (tmp_path / "kept" / "run1.txt").read_text()
