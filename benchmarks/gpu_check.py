"""``make gpu-check``: one prepared check for a CUDA machine (at most about 5 minutes on one GPU).

No set-up step and no download: the machine may have no network and its own PyTorch. The model is
the demo SmolLM2-135M-Instruct when its prepared assets are found (``$OSFT_DEMO_DIR``, the default
demo directory, the test suite's cache), else a random model of SmolLM2's shape with the tests'
small tokenizer and synthetic chats. Then, with ``osft-train`` processes on the device:

1. OSFT in the training dtype (bf16 on CUDA) for 10 steps (the reference), sent SIGUSR1 after step 4:
   a full-state checkpoint, and training goes on;
2. a resume from that checkpoint (``--resume-from-full-state-checkpoint``) to step 10, which must
   equal the reference bit for bit: losses, gradient norms and ``state_sha256`` (every parameter
   and AdamW tensor, CUDA generator states restored);
3. full fine-tuning (``--no-osft``) for 10 steps;
4. ``osft-train estimate-memory``'s training peak per rank (:func:`osft.trainer.tools.memory_plan.estimate`) for the
   OSFT and full fine-tuning runs, against their peak ``gpu_mem_bytes`` (relative error; goal 15 %).

(A served request leaving the trajectory unchanged, and stops with exit code 75, are checked on CPU
by ``tests/test_resume.py``.)

Reported (JSON, ``benchmarks/results/gpu_check.json``): per method the median tokens/s, MFU
(against the GEMM peak the trainer measures at start-up) and the peak GPU memory. PEFT's OSF is
measured by ``bench_step.py``, not here. Without CUDA (or with ``--cpu-smoke``) the same sequence runs
on CPU with a tiny model, as the test suite's pipeline check.

Usage::

    python benchmarks/gpu_check.py                 # CUDA if present, else the CPU smoke run
    python benchmarks/gpu_check.py --cpu-smoke --out /tmp/g.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def importable_osft() -> dict:
    """Make ``osft`` importable without installing it (a machine with its own PyTorch and no set-up
    step): when ``import osft.trainer`` fails, a temporary ``osft`` package of symbolic links to
    ``trainer/`` and ``tui/`` goes on ``sys.path``. Returns the environment for child processes."""
    env = dict(os.environ)
    try:
        import osft.trainer  # noqa: F401
    except ImportError:
        shim = Path(tempfile.mkdtemp(prefix="osft-shim-"))
        (shim / "osft").mkdir()
        (shim / "osft" / "__init__.py").write_text("")
        for part in ("trainer", "tui"):
            (shim / "osft" / part).symlink_to(REPO / part)
        sys.path.insert(0, str(shim))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(shim), env.get("PYTHONPATH")]))
    return env
DEFAULT_OUT = REPO / "benchmarks" / "results" / "gpu_check.json"
#: SmolLM2-135M's shape, for a random model when the demo assets are absent.
SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, max_position_embeddings=2048, tie_word_embeddings=True)
STEPS, STOP_AFTER = 10, 4


from bench_step import TINY_CONFIG, _synthetic_chats  # noqa: E402 (after REPO: the script's own directory)
from machine import machine_info  # noqa: E402


def find_model(root: Path, smoke: bool) -> tuple[Path, Path, str]:
    """(model dir, chat jsonl, description): the prepared demo assets if complete, else a random model."""
    if not smoke:
        from osft.trainer.tools.demo_assets import default_demo_dir, fetch_demo

        for d in (os.environ.get("OSFT_DEMO_DIR"), default_demo_dir(), REPO / ".pytest_cache" / "d" / "osft-demo"):
            if d and (Path(d) / ".complete").exists():  # fetch_demo then only returns the paths
                assets = fetch_demo(Path(d))
                return assets.model_dir, assets.train_path, f"SmolLM2-135M-Instruct from {d}"
    sys.path.insert(0, str(REPO / "tests"))
    from helpers import save_tiny_model  # the project's offline tiny tokenizer and model

    shape = TINY_CONFIG if smoke else SMOLLM2_SHAPE
    data = root / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _synthetic_chats(256, 0)))
    return save_tiny_model(root / "model", **shape), data, f"random model {shape}"


def train(args: list[str], out: Path, env: dict, stop_after: int | None = None) -> tuple[int, list[dict]]:
    """Run ``osft-train`` with ``args`` into ``out``; with ``stop_after``, send SIGUSR1 once that
    step's record is written. Returns (exit code, step records)."""
    from osft.trainer.contract import read_records

    cmd = [sys.executable, "-m", "osft.trainer.launch.cli", *args, "--output-dir", str(out)]
    proc = subprocess.Popen(cmd, env=env, cwd=REPO)
    metrics = out / "metrics" / "node0.jsonl"
    while stop_after is not None and proc.poll() is None:
        steps = [r["step"] for r in read_records(metrics)[0] if r["event"] == "step"] if metrics.exists() else []
        if steps and max(steps) >= stop_after:
            proc.send_signal(signal.SIGUSR1)
            break
        time.sleep(0.05)
    code = proc.wait()
    return code, [r for r in read_records(metrics)[0] if r["event"] == "step"]


def summary(records: list[dict]) -> dict:
    """Median tokens/s and MFU of the steps after the first (warm-up), peak GPU memory (bytes)."""
    timed = records[1:] or records
    mem = [r["gpu_mem_bytes"] for r in records if r.get("gpu_mem_bytes") is not None]
    return dict(steps=len(records), tokens_per_s=statistics.median(r["tokens_per_s"] for r in timed),
                mfu=statistics.median(r["mfu"] for r in timed), flops_per_s=statistics.median(r["flops_per_s"] for r in timed),
                step_time_s=statistics.median(r["step_time_s"] for r in timed), peak_gpu_mem_bytes=max(mem, default=None))


def memory_estimates(model_dir: Path, smoke: bool, runs: dict[str, list[dict]], tokens: int) -> dict:
    """Per method: the estimator's training peak per rank (the step records' ``gpu_mem_bytes``
    measure the steps, not the export), the measured peak ``gpu_mem_bytes`` (None on CPU) and the
    relative error of the estimate."""
    from osft.trainer.tools.memory_plan import estimate

    out = {}
    for method, records in runs.items():
        plan = estimate(str(model_dir), osft=method == "osft", dtype="float32" if smoke else "bfloat16",
                        tokens_per_gpu=tokens, device="cpu" if smoke else "cuda")
        measured = max((r["gpu_mem_bytes"] for r in records if r.get("gpu_mem_bytes") is not None), default=None)
        out[method] = dict(estimated_bytes=plan.training, measured_gpu_mem_bytes=measured,
                           relative_error=(plan.training - measured) / measured if measured else None)
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the check; exit code 0 when the resume is bit-exact, 1 otherwise."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu-smoke", action="store_true", help="tiny model on CPU (automatic without CUDA)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    import torch

    smoke = args.cpu_smoke or not torch.cuda.is_available()
    env = dict(importable_osft(), OSFT_TEST_STATE_HASH="1", CUBLAS_WORKSPACE_CONFIG=":4096:8",
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1" if smoke else "8"))
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        root = Path(tmp)
        model_dir, data, described = find_model(root, smoke)
        common = ["--model-name-or-path", str(model_dir), "--data-path", str(data), "--max-steps", str(STEPS),
                  "--batch-size", "4", "--max-seq-len", "128" if smoke else "512", "--max-tokens-per-gpu",
                  "256" if smoke else "2048", "--device", "cpu" if smoke else "cuda", "--seed", "7"]
        code_ref, ref = train([*common, "--on-demand-checkpointing"], root / "ref", env, stop_after=STOP_AFTER)
        saved = sorted((root / "ref" / "full_state_checkpoints").glob("step_*/manifest.json"))
        saved_at = int(saved[0].parent.name.removeprefix("step_")) if saved else None
        code_res, resumed = (train([*common, "--resume-from-full-state-checkpoint", str(saved[0].parent)],
                                   root / "resumed", env) if saved else (None, []))
        code_full, full = train([*common, "--no-osft"], root / "full", env)
        estimates = memory_estimates(model_dir, smoke, dict(osft=ref, full_ft=full), 256 if smoke else 2048)
    by_step = {r["step"]: r for r in ref}
    after = [r for r in resumed if r["step"] > (saved_at or 0)]
    keys = ("loss", "grad_norm", "state_sha256")
    mismatches = [(r["step"], k) for r in after for k in keys if by_step.get(r["step"], {}).get(k) != r[k]]
    exact = (bool(after) and not mismatches and code_res == code_ref == 0
             and [r["step"] for r in after] == list(range(saved_at + 1, STEPS + 1)))
    result = dict(benchmark="gpu_check", created_unix=time.time(), machine=machine_info(), model=described,
                  device="cpu" if smoke else torch.cuda.get_device_name(0), smoke=smoke,
                  exit_codes=dict(reference=code_ref, resumed=code_res, full_ft=code_full),
                  resume=dict(bit_exact=exact, checkpoint_step=saved_at,
                              steps_compared=[r["step"] for r in after], mismatches=mismatches),
                  methods=dict(osft=summary(ref), full_ft=summary(full) if full else None,
                               peft_osf="measured by benchmarks/bench_step.py"),
                  memory_estimate=estimates)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("device", "model", "resume", "methods", "memory_estimate")}, indent=2))
    return 0 if exact and code_full == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
