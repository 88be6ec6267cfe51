"""Forward + backward of one OSFT module in each forward form against a dense linear layer.

For each of SmolLM2-135M's target shapes (URR 0.25 by default) and each token count T, one
:class:`osft.trainer.osft.decomposition.OSFTLinear` per form (``dense``, ``hybrid``, ``split``, see
:func:`~osft.trainer.osft.plan.choose_forward_form`) and a plain linear layer of the same
weight with its weight gradient (what full fine-tuning computes) run forward and backward on the
same input; the variants are interleaved round by round. Reported per shape and T: the median time
(s) of each, each form's median relative to the dense linear, the fastest form measured and the
form ``choose_forward_form`` picks for that shape and T.

Usage::

    python benchmarks/bench_forward_forms.py                  # -> results/forward_forms.json
    python benchmarks/bench_forward_forms.py --quick --out /tmp/f.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "benchmarks" / "results" / "forward_forms.json"
FORMS = ("dense", "hybrid", "split")
#: SmolLM2-135M's distinct target shapes (out×in): q/o, k/v, gate/up, down.
SMOLLM2_SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536)]


def bench_shape(n: int, m: int, tokens: int, urr: float, rounds: int, seed: int) -> dict:
    """Median seconds of forward + backward for each form and the dense linear, for one N×M shape
    and T = ``tokens``."""
    import torch
    import torch.nn.functional as F

    from osft.trainer.osft.decomposition import OSFTLinear
    from osft.trainer.osft.plan import choose_forward_form

    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, m, generator=g) / m ** 0.5
    mods = {f: OSFTLinear.from_weight(weight, None, urr=urr, max_tokens_per_micro_batch=tokens, forward_form=f)
            for f in FORMS}
    dense_weight = weight.clone().requires_grad_(True)
    x = torch.randn(tokens, m, generator=g).requires_grad_(True)
    dy = torch.randn(tokens, n, generator=g)
    runs = {"linear": lambda: F.linear(x, dense_weight).backward(dy)}
    runs |= {f: (lambda mod=mod: mod(x).backward(dy)) for f, mod in mods.items()}
    for fn in runs.values():  # warm-up: allocations, the first gradient accumulation
        fn(), fn()
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(rounds):
        for name, fn in runs.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    median = {k: statistics.median(v) for k, v in times.items()}
    ratio = {f: median[f] / median["linear"] for f in FORMS}
    k_low = mods["dense"].k_low
    return dict(n=n, m=m, tokens=tokens, k_low=k_low, median_s=median, vs_linear=ratio,
                fastest=min(ratio, key=ratio.get), chosen=choose_forward_form(n, m, k_low, tokens))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="128,1024", help="comma-separated token counts T per micro-batch")
    p.add_argument("--urr", type=float, default=0.25)
    p.add_argument("--rounds", type=int, default=25)
    p.add_argument("--threads", type=int, default=2, help="torch threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="small shapes, 3 rounds: a pipeline check")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    import torch
    from rich.console import Console
    from rich.table import Table

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine import machine_info

    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = [(48, 32), (16, 32)] if args.quick else SMOLLM2_SHAPES
    tokens = [64] if args.quick else [int(t) for t in args.tokens.split(",")]
    rounds = 3 if args.quick else args.rounds
    start = time.time()
    results = [bench_shape(n, m, t, args.urr, rounds, args.seed) for t in tokens for n, m in shapes]
    table = Table(title=f"forward + backward vs a dense linear layer (URR {args.urr}, {rounds} rounds)")
    for col in ("N×M", "T", "k_low", *FORMS, "fastest", "chosen"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(f"{r['n']}×{r['m']}", str(r["tokens"]), str(r["k_low"]), *(f"{r['vs_linear'][f]:.3f}" for f in FORMS),
                      r["fastest"], r["chosen"])
    Console().print(table)
    out = dict(benchmark="forward_forms", created_unix=time.time(), machine=machine_info(),
               settings=dict(urr=args.urr, rounds=rounds, threads=torch.get_num_threads(), quick=args.quick,
                             seed=args.seed),
               shapes=results, wall_s=time.time() - start)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
