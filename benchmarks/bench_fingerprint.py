"""Cost of the input fingerprint a full-state checkpoint records (``osft.trainer.data.fingerprint``)
against the data preparation it is part of, on the demo data (SmolLM2-135M-Instruct's tokenizer,
the chit-chat ``train.jsonl`` and ``eval.jsonl``).

Measured in one process as a start does it, each start with the fingerprint's memory of what it
read cleared (a fresh process):

- **data preparation**: what ``startup.load_data`` does before the fingerprint, i.e. validating and
  tokenizing the training file (``tokenize_for_run``) and the evaluation file, without the data
  cache (``--no-data-cache``, the slowest case), into a cold data cache, and from a warm data cache
  (a rerun; the median of ``--rounds`` starts);
- **fingerprint**: ``run_inputs`` right after it (SHA-256 of both files' bytes, of the serialized
  tokenizer and of the chat template; what the data cache key already read is not read again).

The goal is a fingerprint of at most 2 % of the data preparation in every mode. Wall and CPU
(process) times, s.

Usage::

    OMP_NUM_THREADS=1 nice python benchmarks/bench_fingerprint.py   # -> results/bench_fingerprint.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from assets import demo_assets
from machine import git_revision, machine_info

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "benchmarks" / "results" / "bench_fingerprint.json"
GOAL = 0.02


def timed(call) -> tuple[object, float, float]:
    """``(result, wall s, CPU s)`` of ``call()``."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = call()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--demo-dir", default=None, help="the demo assets (default: benchmarks/assets.py's lookup)")
    parser.add_argument("--rounds", type=int, default=5, help="warm-cache starts (median)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)

    from osft.trainer.config import TrainConfig
    from osft.trainer.data import fingerprint as fp
    from osft.trainer.data.cache import tokenize_source
    from osft.trainer.data.mixture import tokenize_for_run
    from osft.trainer.model.loading import load_tokenizer

    demo = demo_assets(args.demo_dir)
    tokenizer = load_tokenizer(demo.model_dir)

    def start(cfg) -> tuple[float, float, float, float]:
        """One start's (preparation wall, CPU, fingerprint wall, CPU) s, as a fresh process."""
        fp._content_digest.cache_clear()
        fp._TOKENIZER_DIGESTS.clear()

        def prepare():
            tokenize_for_run(cfg, tokenizer, print)
            tokenize_source(cfg, cfg.eval_data_path, tokenizer, print)

        _, wall, cpu = timed(prepare)
        _, f_wall, f_cpu = timed(lambda: fp.run_inputs(cfg, tokenizer, [(str(demo.train_path), None)]))
        return wall, cpu, f_wall, f_cpu

    results = {}
    with tempfile.TemporaryDirectory(prefix="osft-bench-fingerprint-") as cache:
        for mode, cached, rounds in (("no data cache", False, 1), ("data cache, cold", True, 1),
                                     ("data cache, warm", True, args.rounds)):
            cfg = TrainConfig(str(demo.model_dir), [str(demo.train_path)], cache, eval_data_path=str(demo.eval_path),
                              data_cache=cached, data_cache_dir=cache)
            runs = [start(cfg) for _ in range(rounds)]
            wall, cpu, f_wall, f_cpu = (statistics.median(r[i] for r in runs) for i in range(4))
            results[mode] = {"wall_s": round(wall, 4), "cpu_s": round(cpu, 4), "rounds": rounds,
                             "fingerprint_wall_s": round(f_wall, 5), "fingerprint_cpu_s": round(f_cpu, 5)}
    ratios = {mode: round(r["fingerprint_wall_s"] / r["wall_s"], 5) for mode, r in results.items()}
    report = {
        "benchmark": "bench_fingerprint", "revision": git_revision(REPO), "machine": machine_info(),
        "data": {"train": str(demo.train_path), "train_bytes": demo.train_path.stat().st_size,
                 "eval": str(demo.eval_path), "eval_bytes": demo.eval_path.stat().st_size},
        "data_preparation": results,
        "fingerprint_share_of_preparation": ratios, "goal": GOAL,
        "goal_met": all(r <= GOAL for r in ratios.values()),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for mode, r in results.items():
        print(f"data preparation ({mode}): {r['wall_s']:.3f} s wall, {r['cpu_s']:.3f} s CPU; "
              f"fingerprint {r['fingerprint_wall_s']:.4f} s, {100 * ratios[mode]:.2f} % of it")
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
