"""``osft-train estimate-memory`` against measured peaks: the peak RSS of each rank of real CPU runs.

Runs ``osft-train`` for a few steps (tiny random model and SmolLM2-135M-Instruct from the demo
assets; 1 and 2 ranks; OSFT and ``--no-osft``), samples every 0.05 s the RSS of each worker process
(the ranks, ``osft.trainer.worker``), and compares the largest, over the whole run (the training
steps and the HF export at the end), with :func:`osft.trainer.tools.memory_plan.estimate`'s peak for
the same settings (the larger of its training and export phases; relative error; the goal is 15 %).

    python benchmarks/bench_memory_plan.py --out benchmarks/results/memory_plan.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
TOKENS, SEQ = 512, 256
CASES = [("tiny", 1, True), ("tiny", 1, False), ("tiny", 2, True), ("tiny", 2, False), ("smollm2", 1, True),
         ("smollm2", 1, False), ("smollm2", 2, True), ("smollm2", 2, False)]


def peak_rank_rss(cmd: list[str], env: dict) -> tuple[int, int]:
    """(exit code, largest RSS of any rank process seen, bytes): the worker processes, or the
    process itself where it runs its only rank in-process (no worker process seen)."""
    proc = psutil.Popen(cmd, env=env, stdout=open(os.devnull, "w"), stderr=open(os.devnull, "w"))
    peak = own = 0
    while proc.poll() is None:
        try:
            own = max(own, proc.memory_info().rss)
        except psutil.Error:
            pass
        try:
            children = proc.children(recursive=True)
        except psutil.Error:
            children = []
        for child in children:
            try:
                cmdline = child.cmdline()
                if "osft.trainer.worker" in cmdline and "osft.trainer.launch.agent" not in " ".join(cmdline):
                    peak = max(peak, child.memory_info().rss)
            except psutil.Error:
                pass
        time.sleep(0.05)
    return proc.returncode, peak or own


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=[f"{m}:{w}:{'osft' if o else 'full'}" for m, w, o in CASES])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "memory_plan.json")
    args = parser.parse_args(argv)
    from helpers import QA, chat, save_tiny_model, write_jsonl

    from osft.trainer.tools.demo_assets import fetch_demo
    from osft.trainer.tools.memory_plan import estimate

    results = []
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        tmp = Path(tmp)
        models = {"tiny": save_tiny_model(tmp / "tiny"), "smollm2": fetch_demo().model_dir}
        data = write_jsonl(tmp / "d.jsonl", [chat(q, a) for q, a in QA] * 20)
        for case in args.cases:
            name, world, method = case.split(":")
            world, osft = int(world), method == "osft"
            cmd = [sys.executable, "-m", "osft.trainer.launch.cli", "--model-name-or-path", str(models[name]),
                   "--data-path", str(data), "--output-dir", str(tmp / case.replace(":", "_")), "--max-steps",
                   str(args.steps), "--batch-size", "8", "--max-seq-len", str(SEQ), "--max-tokens-per-gpu", str(TOKENS),
                   "--nproc-per-node", str(world), "--device", "cpu", "--no-data-cache",
                   *([] if osft else ["--no-osft"])]
            load = os.getloadavg()[0]
            code, peak = peak_rank_rss(cmd, dict(os.environ, OMP_NUM_THREADS="1"))
            plan = estimate(str(models[name]), osft=osft, dtype="float32", world_size=world, tokens_per_gpu=TOKENS,
                            device="cpu")
            r = dict(case=case, exit_code=code, measured_peak_rss_bytes=peak, estimated_bytes=plan.total,
                     relative_error=(plan.total - peak) / peak if peak else None, estimated_phase=plan.phase,
                     estimated_training_bytes=plan.training, estimated_export_bytes=plan.export, parts=plan.__dict__,
                     load_avg_1m_before=load)
            print(json.dumps(r), flush=True)
            results.append(r)
            out = dict(benchmark="bench_memory_plan", tokens_per_gpu=TOKENS, max_seq_len=SEQ, results=results)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
