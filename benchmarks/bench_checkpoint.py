"""Full-state checkpoints: size, save time and write throughput vs model size, and launch-to-first-
step time of a fresh start vs a resume.

Part 1 (size): for each model, ``osft-train`` (one rank) trains 2 steps with
``--checkpoint-every-steps 1`` at URR 0.25; from the ``checkpoint_saved`` events:

- ``checkpoint_bytes``: one step's checkpoint (trainable and other parameters, AdamW state, RNG,
  trainer state), the frozen OSFT factors not included;
- ``all_factors_bytes``: what each checkpoint would hold if it stored every factor every time
  (``checkpoint_bytes`` + the frozen store); goal: ratio ≤ 0.6;
- ``save_s`` and ``write_mb_per_s`` of the second save (the first also writes the frozen store),
  next to this disk's sequential write speed measured in the same run (512 MiB, fsync).

Part 2 (startup): wall time from starting ``osft-train`` to the first ``step`` record, fresh start
(load, SVD) vs resume from that run's checkpoint (load, no SVD), rounds interleaved, medians.

Models: tiny random Llamas of growing size (built here) and, when present, the demo model
SmolLM2-135M-Instruct (``$OSFT_DEMO_DIR`` or the ``osft-train fetch-demo`` cache).

``--async-cost`` (alone, its own results file): the step-time cost of a checkpoint without and with
``--async-checkpoint``, side by side on one model (SmolLM2 when present): three one-rank runs of the
same steps, no checkpoint, synchronous and asynchronous checkpoints every ``EVERY`` steps, in turn.
The window from the step after the first checkpoint (which also writes the frozen store, on the
training thread in both modes) to the last step holds the checkpoints compared; a checkpoint's cost
is the window's wall time (between the ``step`` records) minus that of the run without
checkpoints, per checkpoint: what training lost, the writer thread's competition for the CPU
included. Next to it, ``seconds`` and ``blocking_s`` of each ``checkpoint_saved`` record.

Usage::

    python benchmarks/bench_checkpoint.py            # -> benchmarks/results/bench_checkpoint.json
    python benchmarks/bench_checkpoint.py --quick --out /tmp/c.json   # one tiny model, one round (CI)
    python benchmarks/bench_checkpoint.py --async-cost   # -> benchmarks/results/bench_checkpoint_async.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "benchmarks" / "results" / "bench_checkpoint.json"
ASYNC_OUT = REPO / "benchmarks" / "results" / "bench_checkpoint_async.json"
TINY = {"tiny_h128_l2": (128, 2), "tiny_h256_l4": (256, 4), "tiny_h512_l6": (512, 6)}
URR = 0.25
#: How to read part 3 (``--async-cost``) on a machine whose CPUs other jobs keep busy.
SHARED_NOTE = ("one run per mode, in turn; when the machine is shared (machine_shared: a load average above its CPU "
               "count) step times vary by tens of percent between runs, and the writer thread's CPU time comes out of "
               "training's: blocking_s is what the training thread waited for, cost_per_checkpoint_s what the run "
               "lost in all (noise included)")


def disk_write_mb_per_s(directory: Path, mib: int = 512) -> float:
    """Sequential write speed of ``directory``'s disk: ``mib`` MiB in 4 MiB blocks, then fsync (MB/s)."""
    block = os.urandom(4 << 20)
    path = directory / "disk_speed.bin"
    start = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(mib // 4):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    path.unlink()
    return mib * (1 << 20) / 1e6 / seconds


def tiny_model(directory: Path, hidden: int, layers: int) -> Path:
    """A random Llama with ``hidden`` width and ``layers`` blocks plus the test chat tokenizer."""
    sys.path.insert(0, str(REPO / "tests"))
    from helpers import tiny_chat_tokenizer, tiny_llama

    tokenizer = tiny_chat_tokenizer()
    model = tiny_llama(len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                       num_hidden_layers=layers, num_attention_heads=max(hidden // 64, 2), num_key_value_heads=2)
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def demo_model() -> Path | None:
    """The demo model directory when it has been fetched already (never downloads)."""
    from osft.trainer.tools.demo_assets import DEMO_DIR_ENV, MODEL_DIRNAME, default_demo_dir

    model = Path(os.environ.get(DEMO_DIR_ENV) or default_demo_dir()) / MODEL_DIRNAME
    return model if (model / "model.safetensors").is_file() else None


def train(model: Path, data: Path, out: Path, *flags: str) -> tuple[list[dict], float]:
    """Run ``osft-train`` (one rank) and return its metrics records and its start time (unix s)."""
    cmd = [sys.executable, "-m", "osft.trainer.launch.cli", "--model-name-or-path", str(model), "--data-path", str(data),
           "--output-dir", str(out), "--batch-size", "4", "--max-seq-len", "256", "--max-tokens-per-gpu", "1024",
           "--osft-unfreeze-rank-ratio", str(URR), "--save-dtype", "float32", *flags]
    start = time.time()
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    lines = (out / "metrics" / "node0.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines], start


def count_params(model: Path) -> int:
    """Parameters stored in ``model.safetensors``."""
    import math

    from safetensors import safe_open

    with safe_open(model / "model.safetensors", "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def size_row(name: str, model: Path, data: Path, work: Path) -> dict:
    records, _ = train(model, data, work / f"size_{name}", "--max-steps", "2", "--checkpoint-every-steps", "1")
    first, second = [r for r in records if r["event"] == "checkpoint_saved"]
    ckpt, frozen = second["bytes"], first["frozen_bytes"]
    return {
        "model": name, "params": count_params(model), "checkpoint_bytes": ckpt, "frozen_bytes": frozen,
        "all_factors_bytes": ckpt + frozen, "ratio_vs_all_factors": ckpt / (ckpt + frozen),
        "save_s": second["seconds"], "write_mb_per_s": ckpt / 1e6 / second["seconds"],
        "first_save_s": first["seconds"],
    }


def startup_round(model: Path, data: Path, work: Path, tag: str) -> tuple[float, float]:
    """(fresh, resume) seconds from starting ``osft-train`` to its first step record."""
    fresh_dir, resume_dir = work / f"fresh_{tag}", work / f"resume_{tag}"
    records, start = train(model, data, fresh_dir, "--max-steps", "1", "--checkpoint-every-steps", "1")
    fresh = next(r["ts"] for r in records if r["event"] == "step") - start
    ckpt = next(r["path"] for r in records if r["event"] == "checkpoint_saved")
    records, start = train(model, data, resume_dir, "--max-steps", "2", "--resume-from-full-state-checkpoint", ckpt)
    resume = next(r["ts"] for r in records if r["event"] == "step") - start
    return fresh, resume


def async_cost(model: Path, data: Path, work: Path, steps: int, every: int) -> dict:
    """Part 3: the runs without, with synchronous and with asynchronous checkpoints every ``every``
    steps (``steps`` in all); returns each run's window and checkpoints, and each mode's cost."""
    modes = {"none": (), "sync": ("--checkpoint-every-steps", str(every)),
             "async": ("--checkpoint-every-steps", str(every), "--async-checkpoint")}
    first = every + 1  # the window starts after the first checkpoint (it writes the frozen store too)
    runs = {}
    for mode, flags in modes.items():
        records, _ = train(model, data, work / f"async_{mode}", "--max-steps", str(steps), *flags)
        ts = {r["step"]: r["ts"] for r in records if r["event"] == "step"}
        saved = [{k: r[k] for k in ("step", "seconds", "blocking_s")} for r in records
                 if r["event"] == "checkpoint_saved" and first <= r["step"] < steps]
        times = [r["step_time_s"] for r in records if r["event"] == "step" and r["step"] > first]
        runs[mode] = {"window_s": ts[steps] - ts[first], "checkpoints": saved,
                      "median_step_time_s": statistics.median(times)}
        print(f"{mode:>6}: steps {first}-{steps} in {runs[mode]['window_s']:.2f} s, median step "
              f"{runs[mode]['median_step_time_s']:.2f} s, checkpoints "
              + (", ".join(f"step {c['step']}: {c['seconds']:.2f} s, blocking {c['blocking_s']:.2f} s" for c in saved)
                 or "none"), flush=True)
    for mode in ("sync", "async"):
        n = len(runs[mode]["checkpoints"])
        runs[mode]["cost_per_checkpoint_s"] = (runs[mode]["window_s"] - runs["none"]["window_s"]) / n
        runs[mode]["mean_blocking_s"] = statistics.mean(c["blocking_s"] for c in runs[mode]["checkpoints"])
    print(f"step-time cost per checkpoint: sync {runs['sync']['cost_per_checkpoint_s']:.2f} s, "
          f"async {runs['async']['cost_per_checkpoint_s']:.2f} s")
    return {"steps": steps, "every": every, "window": [first, steps], "runs": runs}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smallest tiny model, one startup round (pipeline check)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved fresh/resume rounds")
    parser.add_argument("--async-cost", action="store_true",
                        help="only part 3: step-time cost of a checkpoint, synchronous vs --async-checkpoint")
    parser.add_argument("--out", type=Path, default=None, help=f"default {DEFAULT_OUT} ({ASYNC_OUT} with --async-cost)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO / "tests"))
    from helpers import QA, chat, write_jsonl

    if args.async_cost:
        return _write(args.out or ASYNC_OUT, _async_main(args.quick))

    with tempfile.TemporaryDirectory(prefix="bench_ckpt_") as tmp:
        work = Path(tmp)
        data = write_jsonl(work / "train.jsonl", [chat(q, a) for q, a in QA] * 8)
        models = {name: tiny_model(work / name, *shape) for name, shape in (list(TINY.items())[:1] if args.quick else TINY.items())}
        demo = None if args.quick else demo_model()
        if demo:
            models["SmolLM2-135M-Instruct"] = demo
        disk = disk_write_mb_per_s(work)
        sizes = []
        for name, path in models.items():
            row = size_row(name, path, data, work)
            sizes.append(row)
            print(f"{name:>24}: {row['params'] / 1e6:7.1f} M params  checkpoint {row['checkpoint_bytes'] / 1e6:8.1f} MB "
                  f"(all factors each time {row['all_factors_bytes'] / 1e6:8.1f} MB, ratio {row['ratio_vs_all_factors']:.2f})"
                  f"  save {row['save_s']:6.2f} s = {row['write_mb_per_s']:6.0f} MB/s", flush=True)
        print(f"disk sequential write (512 MiB + fsync): {disk:.0f} MB/s")
        startup_model = list(models.items())[-1]
        rounds = [startup_round(startup_model[1], data, work, str(i)) for i in range(1 if args.quick else args.rounds)]
        fresh = statistics.median(r[0] for r in rounds)
        resume = statistics.median(r[1] for r in rounds)
        print(f"launch to first step ({startup_model[0]}): fresh {fresh:.1f} s, resume {resume:.1f} s "
              f"(resume/fresh {resume / fresh:.2f})")
    result = {
        "benchmark": "bench_checkpoint", "urr": URR, "quick": args.quick, "disk_write_mb_per_s": disk, "sizes": sizes,
        "startup": {"model": startup_model[0], "rounds": [{"fresh_s": f, "resume_s": r} for f, r in rounds],
                    "fresh_s": fresh, "resume_s": resume, "resume_over_fresh": resume / fresh},
    }
    return _write(args.out or DEFAULT_OUT, result)


def _async_main(quick: bool) -> dict:
    """Part 3 on SmolLM2 when present (a tiny model with ``quick``), and the machine it ran on."""
    from helpers import QA, chat, write_jsonl
    from machine import machine_info

    with tempfile.TemporaryDirectory(prefix="bench_ckpt_async_") as tmp:
        work = Path(tmp)
        data = write_jsonl(work / "train.jsonl", [chat(q, a) for q, a in QA] * 8)
        demo = None if quick else demo_model()
        name, model = ("SmolLM2-135M-Instruct", demo) if demo else ("tiny_h128_l2", tiny_model(work / "tiny", *TINY["tiny_h128_l2"]))
        load = os.getloadavg()[0]
        result = async_cost(model, data, work, *((6, 2) if quick else (10, 3)))
    after = os.getloadavg()[0]
    return {"benchmark": "bench_checkpoint_async", "model": name, "urr": URR, "quick": quick, **result,
            "load_avg_1min_before": load, "load_avg_1min_after": after,
            "machine_shared": max(load, after) > (os.cpu_count() or 1), "note": SHARED_NOTE, "machine": machine_info()}


def _write(out: Path, result: dict) -> dict:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
