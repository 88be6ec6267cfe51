"""Where a training step's CPU time goes: ``torch.profiler`` over real steps.

Each method of ``bench_step.py`` (our full fine-tuning, OSFT, the plain transformers steps) runs its
runner in this process, one method after the other, on the same batch: two warm-up steps (OSFT's
second step forms the deviation bound's basis Gram matrices, once per run), then
``--steps`` profiled steps (``torch.profiler.profile``, CPU activity). The profile's self CPU time
(us, summed over the threads torch ran the op on, as ``key_averages`` reports it) is grouped into
categories by ATen op name, so what is not matmul shows at a glance:

- ``matmul``: ``aten::mm``, ``addmm``, ``bmm``, ``baddbmm`` and their in-place forms (the GEMMs of every linear layer, the LM
  head and the OSFT factors and projections);
- ``attention``: the scaled-dot-product attention kernels and their backward;
- ``loss``: log-softmax, NLL and cross-entropy, forward and backward;
- ``optimizer``: every op run inside ``Optimizer.step`` (the profiler's own range, attributed by
  walking each event's parents);
- ``copies``: ``copy_``, ``cat``, ``index``/``gather``/``scatter`` variants, ``contiguous``, ``to``;
- ``elementwise``: the remaining arithmetic and activation ops outside the optimizer;
- ``other``.

Results (per method: step wall time, the achieved model FLOP/s and MFU against the fp32 GEMM peak
measured in the same process before and after the methods, the higher kept, the category shares and the top ops) go to
``results/profile_step.json``; ``--trace DIR`` also writes each method's Chrome trace.

Usage::

    python benchmarks/profile_step.py                        # smollm2: full_ft, osft, hf_unpacked, hf_packed
    python benchmarks/profile_step.py --models tiny --steps 1 --out /tmp/p.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from pathlib import Path

from bench_step import METHOD_LABELS, MODELS, gemm_peak, make_runner, pick_batch, prepare_smollm2, prepare_tiny
from machine import machine_info

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "benchmarks" / "results" / "profile_step.json"
PROFILED = ("full_ft", "osft", "hf_unpacked", "hf_packed")

MATMUL = {"aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm", "aten::baddbmm_", "aten::_addmm_activation"}
LOSS_MARKERS = ("log_softmax", "nll_loss", "cross_entropy")
COPY_MARKERS = ("copy_", "aten::cat", "aten::index", "gather", "scatter", "aten::contiguous", "aten::to",
                "aten::_to_copy", "aten::clone", "aten::fill_", "aten::zero_", "aten::empty", "aten::resize_")
ELEMENTWISE_MARKERS = ("aten::add", "aten::sub", "aten::mul", "aten::div", "aten::neg", "aten::pow", "aten::sqrt",
                       "aten::rsqrt", "aten::mean", "aten::sum", "aten::silu", "aten::sigmoid", "aten::exp",
                       "aten::lerp", "aten::addcmul", "aten::addcdiv", "aten::where", "aten::cos", "aten::sin",
                       "aten::norm", "aten::linalg_vector_norm", "aten::clamp", "aten::maximum", "aten::rsub",
                       "aten::_foreach", "aten::embedding", "aten::threshold", "aten::max", "aten::abs")


def category(name: str, in_optimizer: bool) -> str:
    """The category of an ATen op (``name`` as the profiler records it) for the tables above."""
    if name in MATMUL:
        return "matmul"
    if "scaled_dot_product" in name or "flash_attention" in name:
        return "attention"
    if any(m in name for m in LOSS_MARKERS):
        return "loss"
    if in_optimizer:
        return "optimizer"
    if any(m in name for m in COPY_MARKERS):
        return "copies"
    if any(name.startswith(m) for m in ELEMENTWISE_MARKERS):
        return "elementwise"
    return "other"


def _inside_optimizer(event) -> bool:
    """Whether a profiler event ran inside ``Optimizer.step`` (the range torch.optim records)."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("Optimizer.step"):
            return True
        parent = parent.cpu_parent
    return False


def summarize(events, steps: int, top: int) -> dict:
    """Self CPU time (ms per step) by category and the ``top`` ops, from ``prof.events()``.

    Only ATen ops (names ``aten::*``) count, so user ranges (``Optimizer.step``, ``ProfilerStep``) never
    count their children twice; their shares are of the ATen total."""
    by_cat: dict[str, float] = {}
    by_op: dict[str, list] = {}
    for e in events:
        if not e.name.startswith("aten::"):
            continue
        us = e.self_cpu_time_total
        cat = category(e.name, _inside_optimizer(e))
        by_cat[cat] = by_cat.get(cat, 0.0) + us
        entry = by_op.setdefault(e.name, [0.0, 0, cat])
        entry[0] += us
        entry[1] += 1
    total = sum(by_cat.values()) or 1.0
    ops = sorted(by_op.items(), key=lambda kv: -kv[1][0])[:top]
    return dict(
        aten_self_cpu_ms_per_step=total / 1e3 / steps,
        categories={c: dict(ms_per_step=us / 1e3 / steps, share=us / total)
                    for c, us in sorted(by_cat.items(), key=lambda kv: -kv[1])},
        top_ops=[dict(op=name, category=cat, ms_per_step=us / 1e3 / steps, calls_per_step=n / steps, share=us / total)
                 for name, (us, n, cat) in ops],
    )


def profile_method(method: str, spec: dict, steps: int, top: int, trace_dir: Path | None) -> dict:
    """Two warm-up steps, then ``steps`` profiled steps of ``method``; its summary and wall times (s)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    spec = dict(spec, method=method)
    runner = make_runner(method, spec)
    indices = pick_batch(runner.lengths, spec["batch_size"])
    runner.step(1, indices)
    runner.step(2, indices)
    walls = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for step in range(3, steps + 3):
            t = time.perf_counter()
            runner.step(step, indices)
            walls.append(time.perf_counter() - t)
    if trace_dir is not None:
        trace_dir.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace_dir / f"{method}.json"))
    summary = summarize(prof.events(), steps, top)
    lengths = [int(runner.lengths[i]) for i in indices]
    del runner, prof
    gc.collect()
    return dict(label=METHOD_LABELS[method], step_wall_s=walls, torch_threads=torch.get_num_threads(),
                sample_lengths=lengths, **summary)


def main(argv: list[str] | None = None) -> int:
    """Profile every method of ``--methods`` on each model of ``--models``; returns the exit code."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="smollm2", help=f"comma-separated, from {','.join(MODELS)}")
    p.add_argument("--methods", default=",".join(PROFILED), help=f"comma-separated, from {','.join(PROFILED)}")
    p.add_argument("--steps", type=int, default=2, help="profiled steps per method (after two warm-up steps)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--max-seq-len", type=int, default=256)
    p.add_argument("--max-tokens-per-gpu", type=int, default=1024)
    p.add_argument("--data-lines", type=int, default=400)
    p.add_argument("--urr", type=float, default=0.25)
    p.add_argument("--top", type=int, default=15, help="ops listed per method")
    p.add_argument("--demo-dir", default=None)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--trace", type=Path, default=None, help="also write each method's Chrome trace here")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    bad = [m for m in methods if m not in PROFILED] + [m for m in args.models.split(",") if m not in MODELS]
    if bad:
        raise SystemExit(f"unknown model or method: {bad}")
    from rich.console import Console
    from rich.table import Table

    from osft.trainer.observe.flops import flop_model, mfu
    from osft.trainer.model.loading import load_config

    console = Console()
    started = time.time()
    result = dict(benchmark="profile_step", created_unix=started, machine=machine_info(), load_avg_start=os.getloadavg(),
                  settings=dict(vars(args), trace=str(args.trace) if args.trace else None, out=str(args.out)),
                  models={})
    with tempfile.TemporaryDirectory(prefix="profile_step-") as tmp:
        for name in args.models.split(","):
            root = Path(tmp) / name
            root.mkdir()
            model_dir, data_path, model_info = (prepare_tiny(root, args.seed) if name == "tiny" else
                                                prepare_smollm2(root, args.demo_dir, args.data_lines))
            peaks = [gemm_peak(None)]
            section = dict(model=model_info, methods={})
            for method in methods:
                spec = dict(model_dir=str(model_dir), data_path=str(data_path), run_dir=str(root / f"run-{method}"),
                            max_seq_len=args.max_seq_len, batch_size=args.batch_size,
                            max_tokens_per_gpu=args.max_tokens_per_gpu, urr=args.urr, seed=args.seed)
                console.print(f"\\[{name}] profiling {METHOD_LABELS[method]} ...")
                section["methods"][method] = profile_method(method, spec, args.steps, args.top,
                                                            args.trace / name if args.trace else None)
            # the peak before and after the methods, the higher kept: the least disturbed measurement
            peaks.append(gemm_peak(None))
            section["gemm_peak_flops_per_s"], section["gemm_peak_samples_flops_per_s"] = max(peaks), peaks
            for m in section["methods"].values():
                # achieved model FLOP/s and MFU of the profiled steps (the profiler's overhead included)
                step_flops = flop_model(load_config(model_dir)).step_flops(m["sample_lengths"])
                m["flops_per_s"] = step_flops * len(m["step_wall_s"]) / sum(m["step_wall_s"])
                m["mfu"] = mfu(step_flops, sum(m["step_wall_s"]) / len(m["step_wall_s"]), max(peaks))
                table = Table(title=f"{name}, {m['label']}: {sum(m['step_wall_s']) / len(m['step_wall_s']):.2f} s "
                                    f"per step (MFU {m['mfu']:.1%} under the profiler), ATen self CPU "
                                    f"{m['aten_self_cpu_ms_per_step']:.0f} ms per step")
                for col in ("category / op", "ms per step", "share"):
                    table.add_column(col, justify="left" if col.startswith("cat") else "right")
                for cat, c in m["categories"].items():
                    table.add_row(f"[b]{cat}[/b]", f"{c['ms_per_step']:.0f}", f"{c['share']:.1%}")
                for op in m["top_ops"]:
                    table.add_row(f"  {op['op']} ({op['category']})", f"{op['ms_per_step']:.0f}", f"{op['share']:.1%}")
                console.print(table)
            result["models"][name] = section
    result["wall_s"] = time.time() - started
    result["load_avg_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"wrote {args.out} ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
