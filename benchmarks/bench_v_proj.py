"""Distributed V-side projection of OSFT: Gram vs factored vs cached, on 2 ranks.

Part 1 (``--part proj``, run under torchrun by this script): for each weight shape, OSFT modules
with random orthonormal bases are sharded with FSDP2 (``fully_shard``) and the gradient projection
(:meth:`osft.trainer.osft.projection.Projector.project_gradients`) is timed in each mode, the
modes interleaved round by round. Reported per shape and mode: bytes moved per projection by the V
side (Gram: all-reduce of the M×M fp32 Gram matrix; factored: all-gather of the k_high×M fp32
V_high; cached: nothing after the first step), the median time per projection (s) and the maximum
difference between the projected gradients of each mode and the factored one. The expected bytes
ratio Gram/factored is M/k_high: 2× for a square weight at URR 0.5, 7× for Llama-8B's down_proj
(4096×14336: M = 14336, k_high = 2048).

Part 2 (``--part e2e``): end-to-end tokens/s of SmolLM2-135M OSFT on 2 ranks (``osft-train
--nproc-per-node 2``) with each mode, from the runs' metrics (median over the timed steps).

Part 3 (``--projection-only``, one process, no model): the per-step projection work of OSFT on
SmolLM2-135M's 210 target shapes (30 blocks × q, k, v, o, gate, up, down at URR 0.25, random
orthonormal bases, random factors and gradients), each variant timed in interleaved rounds:
``per_module`` is the trainer's projection of gradients and parameters (``project_gradients``,
``project_parameters``), ``batched`` the same as one ``torch.bmm`` pair per group of same-shaped
modules (bases stacked once at set-up, factors stacked and copied back per call; a candidate for
the trainer, kept here only: not faster on CPU), ``check`` the full orthogonality check,
``indicators`` the forgetting indicators (both on the steps of a full check) and ``bound``
:meth:`Projector.deviation_bound` (the other steps), each after the per-module projection.
Reported: median seconds, medians of the per-round ratios (batched /
per-module projection; projection + bound over projection + check, and over projection + check +
indicators: the OSFT work of a step between full checks against one with them; bound / check), the one-time cost of the bound's basis Gram matrices, the bound and the measured deviation
(degrees), and the largest difference of the batched results from the per-module ones. Also the
projection's matrix-product FLOPs (per module and side, 4 × dim × basis × k_low per call, two calls
per step) and its achieved FLOP/s against the fp32 GEMM peak measured in the same process with
the same threads, before and after the rounds (the higher kept).

Shapes: SmolLM2's (576×576, 1536×576, 576×1536) and Llama-8B's square and down_proj shapes scaled
by 1/4 per side (1024×1024, 1024×3584: same M/k_high ratios, 16× less memory), URR 0.5.

Usage::

    python benchmarks/bench_v_proj.py                  # both parts -> results/bench_v_proj.json
    python benchmarks/bench_v_proj.py --part proj --quick --out /tmp/v.json
    python benchmarks/bench_v_proj.py --projection-only --rounds 10   # -> results/bench_projection.json
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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "benchmarks" / "results" / "bench_v_proj.json"
PROJECTION_OUT = REPO / "benchmarks" / "results" / "bench_projection.json"
#: SmolLM2-135M's targets of one decoder block (out×in) and the number of blocks.
SMOLLM2_BLOCK = {"q_proj": (576, 576), "k_proj": (192, 576), "v_proj": (192, 576), "o_proj": (576, 576),
                 "gate_proj": (1536, 576), "up_proj": (1536, 576), "down_proj": (576, 1536)}
SMOLLM2_BLOCKS = 30
SHAPES = {
    "smollm2_q_proj": (576, 576),
    "smollm2_gate_proj": (1536, 576),
    "smollm2_down_proj": (576, 1536),
    "llama8b_square_div4": (1024, 1024),
    "llama8b_down_proj_div4": (1024, 3584),
}
MODES = {"gram": ("gram", False), "factored": ("factored", False), "cached": ("factored", True)}


def _orthonormal(rows: int, cols: int, gen) -> "torch.Tensor":
    import torch

    q, _ = torch.linalg.qr(torch.randn(max(rows, cols), min(rows, cols), generator=gen))
    return q if rows >= cols else q.t().contiguous()


def _modules(n: int, m: int, urr: float, count: int, seed: int):
    """``count`` OSFT modules of shape N×M with random orthonormal factors and random gradients."""
    import torch

    from osft.trainer.osft.decomposition import OSFTLinear

    gen = torch.Generator().manual_seed(seed)
    mods = []
    for _ in range(count):
        mod = OSFTLinear.empty(n, m, False, urr=urr, max_tokens_per_micro_batch=1024, forward_form="dense", device="cpu")
        with torch.no_grad():
            for p in mod.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))
            mod.U_basis.copy_(_orthonormal(*mod.U_basis.shape, gen))
            mod.V_basis.copy_(_orthonormal(*mod.V_basis.shape, gen))
        mods.append(mod)
    grads = [(torch.randn(m.U_low.shape, generator=gen), torch.randn(m.V_low.shape, generator=gen)) for m in mods]
    return mods, grads


def proj_worker(args) -> None:
    """torchrun entry: time the projection modes on FSDP2-sharded modules; rank 0 writes JSON."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    from osft.trainer.distributed import shutdown_distributed
    from osft.trainer.osft.projection import Projector

    dist.init_process_group("gloo")
    world = dist.get_world_size()

    results = {}
    for name, (n, m) in SHAPES.items():
        if args.quick and name != "smollm2_q_proj":
            continue
        mods, grads = _modules(n, m, args.urr, args.modules, seed=0)
        fully_shard(nn.Sequential(*mods))  # one FSDP2 root over the modules
        k_high = mods[0].V_basis.shape[0]
        projectors = {mode: Projector([(f"m{i}", x) for i, x in enumerate(mods)], v_projection, cache_v_basis=cache)
                      for mode, (v_projection, cache) in MODES.items()}
        times = {mode: [] for mode in MODES}
        outputs = {}
        for r in range(args.rounds + 1):  # round 0 warms up (and fills the cache)
            for mode, projector in projectors.items():
                for mod, (gu, gv) in zip(mods, grads):
                    mod.U_low.grad = distribute_tensor(gu, mod.U_low.device_mesh, mod.U_low.placements)
                    mod.V_low.grad = distribute_tensor(gv, mod.V_low.device_mesh, mod.V_low.placements)
                dist.barrier()
                start = time.perf_counter()
                projector.project_gradients()
                dist.barrier()
                if r:
                    times[mode].append(time.perf_counter() - start)
                outputs[mode] = [x.V_low.grad.full_tensor() for x in mods]
        diff = {mode: max((a - b).abs().max().item() for a, b in zip(outputs[mode], outputs["factored"])) for mode in MODES}
        bytes_per_module = {"gram": 4 * m * m, "factored": 4 * k_high * m, "cached": 0}
        results[name] = {
            "shape": [n, m], "k_high": k_high, "modules": args.modules,
            "v_bytes_per_projection": {k: v * args.modules for k, v in bytes_per_module.items()},
            "bytes_ratio_gram_vs_factored": m / k_high,
            "time_s_median": {mode: statistics.median(t) for mode, t in times.items()},
            "time_s_all": times,
            "time_ratio_vs_gram": {mode: statistics.median(times["gram"]) / statistics.median(t) for mode, t in times.items()},
            "max_abs_diff_vs_factored": diff,
        }
        if dist.get_rank() == 0:
            print(f"{name}: {results[name]['time_s_median']}", flush=True)
    if dist.get_rank() == 0:
        Path(args.worker_out).write_text(json.dumps({"world_size": world, "backend": "gloo", "shapes": results}))
    shutdown_distributed()


def run_proj(args) -> dict:
    """Part 1 through torchrun (2 ranks)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "proj.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__,
               "--proj-worker", "--worker-out", str(out), "--rounds", str(args.rounds), "--modules", str(args.modules),
               "--urr", str(args.urr)] + (["--quick"] if args.quick else [])
        subprocess.run(cmd, check=True, cwd=REPO)
        return json.loads(out.read_text())


def run_e2e(args) -> dict:
    """Part 2: SmolLM2 OSFT on 2 ranks with each mode; tokens/s from the metrics."""
    from osft.trainer.tools.demo_assets import fetch_demo

    assets = fetch_demo(Path(args.demo_dir) if args.demo_dir else None)
    flags = {"gram": ["--osft-v-projection", "gram"], "factored": ["--no-osft-cache-v-high"], "cached": ["--osft-cache-v-high"]}
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode, extra in flags.items():
            run_dir = Path(tmp) / mode
            cmd = [str(Path(sys.executable).with_name("osft-train")), "--model-name-or-path", str(assets.model_dir),
                   "--data-path", str(assets.train_path), "--output-dir", str(run_dir), "--nproc-per-node", "2",
                   "--batch-size", "8", "--max-seq-len", "256", "--max-tokens-per-gpu", "1024",
                   "--max-steps", str(args.e2e_steps), "--osft-unfreeze-rank-ratio", str(args.urr), *extra]
            subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
            steps = [json.loads(line) for line in (run_dir / "metrics" / "node0.jsonl").read_text().splitlines()]
            steps = [r for r in steps if r["event"] == "step"][1:]  # the first step warms up
            out[mode] = {"tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in steps),
                         "step_time_s_median": statistics.median(r["step_time_s"] for r in steps),
                         "final_loss": steps[-1]["loss"] if steps else None}
    gram = out["gram"]["tokens_per_s_median"]
    for mode in out:
        out[mode]["ratio_vs_gram"] = out[mode]["tokens_per_s_median"] / gram
    out["reference_granite_8b_older_tool_tokens_per_s"] = {"gram": 1728, "factored": 1936, "cached": 2160,
                                                           "ratio_vs_gram": {"factored": 1.12, "cached": 1.25}}
    return out


class _Batched:
    """The candidate batched projection: one ``torch.bmm`` pair per group of modules whose U and V
    sides have the same shapes and modes, the bases stacked once here."""

    def __init__(self, mods) -> None:
        import torch

        groups = {}
        for mod in mods:
            key = (tuple(mod.U_basis.shape), tuple(mod.V_basis.shape), mod.u_keep, mod.v_keep)
            groups.setdefault(key, []).append(mod)
        self.groups = [(g, torch.stack([m.U_basis for m in g]), torch.stack([m.V_basis for m in g]))
                       for g in groups.values()]

    def project(self, tensors) -> None:
        """Project ``tensors(module)`` = (U-side tensor, V-side tensor) of every module in place."""
        import torch

        for mods, u_basis, v_basis in self.groups:
            pairs = [tensors(m) for m in mods]
            u = torch.stack([p[0] for p in pairs])
            c = torch.bmm(u_basis.mT, u)
            u = torch.bmm(u_basis, c) if mods[0].u_keep else u.sub_(torch.bmm(u_basis, c))
            v = torch.stack([p[1] for p in pairs])
            c = torch.bmm(v, v_basis.mT)
            v = torch.bmm(c, v_basis) if mods[0].v_keep else v.sub_(torch.bmm(c, v_basis))
            for (pu, pv), nu, nv in zip(pairs, u.unbind(), v.unbind()):
                pu.copy_(nu)
                pv.copy_(nv)


def run_projection_only(args, blocks: int = SMOLLM2_BLOCKS) -> dict:
    """Part 3 (see the module docstring) on ``blocks`` decoder blocks' targets, in this process."""
    import torch

    from osft.trainer.osft.projection import Projector

    mods = []
    for seed, (n, m) in enumerate(SMOLLM2_BLOCK.values()):
        made, _ = _modules(n, m, args.urr, blocks, seed=seed)
        mods += made
    gen = torch.Generator().manual_seed(1)
    grads = [(torch.randn(x.U_low.shape, generator=gen), torch.randn(x.V_low.shape, generator=gen)) for x in mods]
    params = [(x.U_low.detach().clone(), x.V_low.detach().clone()) for x in mods]
    projector, batched = Projector([(f"m{i}", x) for i, x in enumerate(mods)]), _Batched(mods)

    def reset() -> None:
        with torch.no_grad():
            for x, (gu, gv), (pu, pv) in zip(mods, grads, params):
                x.U_low.grad, x.V_low.grad = gu.clone(), gv.clone()
                x.U_low.copy_(pu)
                x.V_low.copy_(pv)

    def per_module() -> None:
        projector.project_gradients()
        projector.project_parameters()

    def batched_projection() -> None:
        with torch.no_grad():
            batched.project(lambda x: (x.U_low.grad, x.V_low.grad))
            batched.project(lambda x: (x.U_low, x.V_low))

    def timed(fn) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    from bench_step import gemm_peak

    peaks = [gemm_peak(None)]  # with this process's threads
    # matrix products of one project_gradients + project_parameters: per side, X·basis (or basisᵀ·X)
    # then the reconstruction, 2·dim·basis·k_low FLOPs each
    step_flops = 2 * sum(4 * x.plan.k_low * (x.plan.n * x.plan.u_basis_cols + x.plan.m * x.plan.v_basis_rows)
                         for x in mods)
    reset()
    projector.project_parameters()
    gram_s = timed(projector.deviation_bound)  # forms the bases' Gram matrices once
    times = {name: [] for name in ("per_module", "batched", "check", "indicators", "bound")}
    outputs = {}
    def run_batched() -> dict:
        reset()
        spent = {"batched": timed(batched_projection)}
        outputs["batched"] = [t.detach().clone() for x in mods for t in (x.U_low, x.V_low, x.U_low.grad, x.V_low.grad)]
        return spent

    def run_per_module() -> dict:
        reset()
        spent = {"per_module": timed(per_module)}
        outputs["per_module"] = [t.detach().clone() for x in mods for t in (x.U_low, x.V_low, x.U_low.grad, x.V_low.grad)]
        spent["check"] = timed(lambda: projector.check(1.0))
        spent["indicators"] = timed(projector.indicators)
        spent["bound"] = timed(projector.deviation_bound)
        return spent

    for r in range(args.rounds + 1):  # round 0 warms up; the order alternates
        spent = {**run_batched(), **run_per_module()} if r % 2 else {**run_per_module(), **run_batched()}
        if r:
            for name in times:
                times[name].append(spent[name])
    peaks.append(gemm_peak(None))
    medians = {name: statistics.median(t) for name, t in times.items()}
    diff = max((a - b).abs().max().item() for a, b in zip(outputs["batched"], outputs["per_module"]))
    rounds = list(zip(*times.values()))
    ratios = {  # medians of the per-round ratios
        "batched_vs_per_module_projection": statistics.median(b / p for p, b, _, _, _ in rounds),
        "projection_and_bound_vs_projection_and_check": statistics.median((p + d) / (p + c) for p, _, c, _, d in rounds),
        "projection_and_bound_vs_projection_check_and_indicators":
            statistics.median((p + d) / (p + c + i) for p, _, c, i, d in rounds),
        "bound_vs_check": statistics.median(d / c for _, _, c, _, d in rounds),
    }
    return {
        "benchmark": "bench_v_proj --projection-only", "modules": len(mods), "urr": args.urr,
        "threads": torch.get_num_threads(), "rounds": args.rounds, "cpu_count": os.cpu_count(),
        "time_s_median": medians,
        "ratio_median": ratios, "time_s_all": times,
        "bound_gram_setup_s": gram_s, "bound_deg": projector.deviation_bound(),
        "measured_max_dev_deg": projector.check(1.0).max_dev_deg,
        "batched_max_abs_diff_vs_per_module": diff,
        "projection_flops_per_step": step_flops,
        "gemm_peak_flops_per_s": max(peaks), "gemm_peak_samples_flops_per_s": peaks,
        "projection_flops_per_s": step_flops / medians["per_module"],
        "projection_share_of_gemm_peak": step_flops / medians["per_module"] / max(peaks),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=["all", "proj", "e2e"], default="all")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--modules", type=int, default=4, help="modules per shape (projected together)")
    p.add_argument("--urr", type=float, help="unfreeze rank ratio (default 0.5; 0.25, the trainer's, with --projection-only)")
    p.add_argument("--e2e-steps", type=int, default=4)
    p.add_argument("--demo-dir", default=os.environ.get("OSFT_DEMO_DIR"))
    p.add_argument("--quick", action="store_true",
                   help="one small shape, 1 round, no e2e, part 3 on one block (pipeline check)")
    p.add_argument("--projection-only", action="store_true",
                   help="part 3 only: one process, SmolLM2's 210 target shapes (default --out results/bench_projection.json)")
    p.add_argument("--out")
    p.add_argument("--proj-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.proj_worker:
        from osft.trainer.distributed import exit_rank

        proj_worker(args)
        exit_rank(0)  # no interpreter finalization: it can race gloo's threads
    if args.projection_only:
        args.urr = args.urr or 0.25
        result = run_projection_only(args)
        out = Path(args.out or PROJECTION_OUT)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        print("  ".join(f"{k} {v:.3f} s" for k, v in result["time_s_median"].items()))
        print("  ".join(f"{k} {v:.3f}x" for k, v in result["ratio_median"].items()))
        print(f"projection {result['projection_flops_per_step'] / 1e9:.1f} GFLOP per step, "
              f"{result['projection_flops_per_s'] / 1e9:.1f} GFLOP/s = {result['projection_share_of_gemm_peak']:.0%} "
              f"of the {result['gemm_peak_flops_per_s'] / 1e9:.1f} GFLOP/s GEMM peak")
        print(f"bound {result['bound_deg']:.3g} deg, measured {result['measured_max_dev_deg']:.3g} deg; "
              f"bound set-up {result['bound_gram_setup_s']:.2f} s; wrote {out}")
        return
    args.out, args.urr = args.out or str(DEFAULT_OUT), args.urr or 0.5
    if args.quick:
        args.rounds, args.part = 1, "proj"
    result = {"benchmark": "bench_v_proj", "urr": args.urr, "cpu_count": os.cpu_count()}
    if args.part in ("all", "proj"):
        result["projection"] = run_proj(args)
    if args.part in ("all", "e2e"):
        result["end_to_end_smollm2_2_ranks"] = run_e2e(args)
    if args.quick:
        result["projection_only_one_block"] = run_projection_only(args, blocks=1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for name, r in result.get("projection", {}).get("shapes", {}).items():
        print(f"{name:24s} bytes gram/factored {r['bytes_ratio_gram_vs_factored']:.1f}x  "
              + "  ".join(f"{k} {v * 1e3:.1f} ms" for k, v in r["time_s_median"].items())
              + f"  max diff {max(r['max_abs_diff_vs_factored'].values()):.1e}")
    for mode, r in result.get("end_to_end_smollm2_2_ranks", {}).items():
        if "tokens_per_s_median" in r:
            print(f"e2e {mode:9s} {r['tokens_per_s_median']:.0f} tok/s  ({r['ratio_vs_gram']:.2f}x gram)")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
