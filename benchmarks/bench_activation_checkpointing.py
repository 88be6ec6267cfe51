"""Peak memory and step time of one training step with and without ``--activation-checkpointing``.

For each method (``osft``: our trainer, OSFT on; ``full_ft``: ``--no-osft``) and each setting (off,
on), a worker subprocess prepares the trainer (``Trainer.prepare()``: load, decompose, AdamW) and
runs one real ``Trainer.train_step`` on one packed micro-batch of up to ``--tokens`` tokens (the
first samples of the data that fit, in file order: the same batch in every worker). Measured in
the worker, fp32 on CPU:

- ``step_peak_rss_bytes``: the highest resident set size during the step. The kernel's high-water
  mark (``VmHWM``) is reset to the current RSS just before the step (``/proc/self/clear_refs``,
  value 5) and read after it, so start-up peaks (loading, SVD) do not hide the step's own.
- ``rss_before_step_bytes`` (psutil) and ``step_peak_increase_bytes``: the peak minus it.
- ``process_peak_rss_bytes``: ``resource.getrusage(...).ru_maxrss`` at the end (whole process).
- ``step_time_s``: wall time of the step (the first step of the process: forward, backward with
  the recompute, projections, AdamW).
- ``loss`` and ``grad_norm``: equal with and without (the recompute changes no value).
- ``flops_per_s`` and ``mfu``: the step record's model FLOP/s and MFU (``osft.trainer.observe.flops``, PaLM
  appendix B; the recompute's FLOPs are not model FLOPs) against the fp32 GEMM peak the trainer
  measured in the same worker at start-up (``gemm_peak_flops_per_s``).

Usage::

    python benchmarks/bench_activation_checkpointing.py   # SmolLM2, 4,096 tokens: results/activation_checkpointing.json
    python benchmarks/bench_activation_checkpointing.py --quick --out /tmp/a.json   # pipeline check, tiny model

The workers run one after the other (``--quick``: at once). Internally ``--worker SPEC_FILE`` runs one
worker, which writes its JSON result to ``SPEC_FILE.out``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_step import prepare_smollm2, prepare_tiny
from machine import machine_info

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "benchmarks" / "results" / "activation_checkpointing.json"
METHODS = ("osft", "full_ft")


def _vm_hwm_bytes() -> int:
    """This process's resident-set high-water mark (``VmHWM`` of /proc/self/status), bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def _first_that_fit(lengths, tokens: int) -> list[int]:
    """Indices of the samples taken in file order while their total stays within ``tokens``."""
    chosen, total = [], 0
    for i, n in enumerate(lengths):
        if total + int(n) <= tokens:
            chosen.append(i)
            total += int(n)
    return chosen


def worker_main(spec_path: str) -> int:
    """One trainer, one step; writes the measurements to ``spec_path + '.out'``."""
    import psutil
    from rich.console import Console

    from osft.trainer.config import TrainConfig
    from osft.trainer.data.packing import plan_micro_batches
    from osft.trainer.run.loop import Trainer

    spec = json.loads(Path(spec_path).read_text())
    cfg = TrainConfig(spec["model_dir"], spec["data_path"], spec["run_dir"], max_seq_len=spec["tokens"],
                      max_tokens_per_gpu=spec["tokens"], osft=spec["method"] == "osft",
                      activation_checkpointing=spec["activation_checkpointing"], device="cpu", dtype="float32",
                      data_cache_dir=spec["cache_dir"])
    trainer = Trainer(cfg, console=Console(stderr=True), job_id="bench-actckpt")
    trainer.prepare()
    indices = _first_that_fit(trainer.lengths, spec["tokens"])
    if len(plan_micro_batches(trainer.lengths[indices], spec["tokens"], 1)[0]) != 1:
        raise RuntimeError("the batch does not pack into one micro-batch")
    rss_before = psutil.Process().memory_info().rss
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
    start = time.perf_counter()
    record = trainer.train_step(1, indices)
    step_time = time.perf_counter() - start
    peak = _vm_hwm_bytes()
    Path(spec_path + ".out").write_text(json.dumps(dict(
        step_time_s=step_time, step_peak_rss_bytes=peak, rss_before_step_bytes=rss_before,
        step_peak_increase_bytes=peak - rss_before,
        process_peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        num_tokens=record["num_tokens"], num_samples=len(indices), loss=record["loss"], grad_norm=record["grad_norm"],
        model_flops=record["model_flops"], flops_per_s=record["flops_per_s"], mfu=record["mfu"],
        gemm_peak_flops_per_s=sum(trainer.steps.utilization.peaks))))
    return 0


def start_worker(spec: dict, root: Path, verbose: bool) -> tuple[Path, subprocess.Popen]:
    """Start one worker subprocess on ``spec``; returns its spec file and process."""
    path = root / f"{spec['method']}-{spec['setting']}.json"
    path.write_text(json.dumps(spec))
    return path, subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", str(path)], cwd=REPO,
                                  stdout=None if verbose else subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish_worker(path: Path, proc: subprocess.Popen) -> dict:
    """Wait for a worker; returns its measurements.

    Raises:
        SystemExit: the worker failed (with the end of its output).
    """
    output, _ = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"worker {path.name} failed ({proc.returncode}):\n{(output or '')[-3000:]}")
    return json.loads(Path(str(path) + ".out").read_text())


def bench(args: argparse.Namespace, root: Path) -> dict:
    """Every method with activation checkpointing off and on, one worker each: one after the other
    (with ``--quick`` all at once: their times then overlap, their memory does not)."""
    if args.quick:
        model_dir, data_path, model_info = prepare_tiny(root, seed=0)
    else:
        model_dir, data_path, model_info = prepare_smollm2(root, args.demo_dir, args.data_lines)
    specs = [dict(model_dir=str(model_dir), data_path=str(data_path), run_dir=str(root / f"run-{method}-{setting}"),
                  cache_dir=str(root / f"cache-{method}-{setting}"), tokens=args.tokens, method=method,
                  setting=setting, activation_checkpointing=setting == "on")
             for method in args.methods for setting in ("off", "on")]
    started = [start_worker(spec, root, args.verbose) for spec in specs] if args.quick else []
    methods: dict[str, dict] = {}
    for n, spec in enumerate(specs):
        r = finish_worker(*(started[n] if started else start_worker(spec, root, args.verbose)))
        methods.setdefault(spec["method"], {})[spec["setting"]] = r
        print(f"{spec['method']}, activation checkpointing {spec['setting']}: step peak RSS "
              f"{r['step_peak_rss_bytes'] / 2**30:.2f} GiB (+{r['step_peak_increase_bytes'] / 2**30:.2f} GiB in the "
              f"step), step {r['step_time_s']:.1f} s (MFU {r['mfu']:.1%}), {r['num_tokens']} tokens", flush=True)
    for runs in methods.values():
        off, on = runs["off"], runs["on"]
        ratio = {key: on[f"{key}_bytes"] / off[f"{key}_bytes"] for key in ("step_peak_rss", "step_peak_increase")}
        runs.update(ratios_on_vs_off=dict(ratio, step_time=on["step_time_s"] / off["step_time_s"]),
                    step_peak_saved_bytes=off["step_peak_rss_bytes"] - on["step_peak_rss_bytes"],
                    same_loss_and_grad_norm=(off["loss"], off["grad_norm"]) == (on["loss"], on["grad_norm"]))
    return dict(model=model_info, methods=methods)


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096, help="tokens of the packed micro-batch (at most)")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument("--data-lines", type=int, default=400, help="chit-chat conversations tokenized (SmolLM2)")
    p.add_argument("--demo-dir", default=None, help="demo assets dir (default: $OSFT_DEMO_DIR, the pytest cache, "
                                                    "else fetch_demo's default)")
    p.add_argument("--quick", action="store_true",
                   help="pipeline check for CI: the tiny random Llama, 512-token micro-batch, OSFT only")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON result path")
    p.add_argument("--verbose", action="store_true", help="show the workers' logs")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (or, with ``--worker``, one worker). Returns the exit code."""
    args = build_parser().parse_args(argv)
    if args.worker:
        return worker_main(args.worker)
    if args.quick:
        args.tokens, args.methods = 512, ["osft"]
    started, load_avg_start = time.time(), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench_actckpt-") as tmp:
        measured = bench(args, Path(tmp))
    result = dict(benchmark="bench_activation_checkpointing", created_unix=started, machine=machine_info(),
                  load_avg_start=load_avg_start, load_avg_end=os.getloadavg(),
                  settings=dict(tokens_per_micro_batch=args.tokens, methods=args.methods, quick=args.quick,
                                dtype="float32", device="cpu", steps_per_worker=1, workers_at_once=args.quick),
                  **measured, wall_s=time.time() - started)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out} ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
