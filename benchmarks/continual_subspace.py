"""Why OSFT can forget the task it learned just before: the subspace check behind the README's
continual-learning explanation.

Trains the previous ``continual.py``'s task A (chit-chat windows of the demo, with the settings it
had before chained runs kept protected subspaces: docs/osft.md, "Chaining runs: protected
subspaces") with OSFT at each URR, then, for every target module, compares the SVD of the dense
weight after A with the split it started from:

- ``low_part_below_frozen``: modules whose trained low part U_low·diag(S_low)·V_low has a largest
  singular value below the smallest frozen one (then the top k_high directions of the new weight
  are the frozen ones again);
- ``overlap_min`` / ``overlap_mean``: ‖U_topᵀ U_frozen‖_F² / k_high between the top k_high left
  singular vectors of the weight after A and those of W_high (1 = the same subspace);
- ``gap_ratio_min``: smallest (smallest frozen singular value / largest low-part singular value).

If every module keeps its split, a second OSFT run at the same URR (task B) decomposes the weight
into the same frozen part and trains exactly the subspace that holds all of task A's update.

Usage::

    python benchmarks/continual_subspace.py                 # URR 0.25 and 0.5 -> results/continual_subspace.json
    python benchmarks/continual_subspace.py --urrs 0.1 --steps 5
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from assets import demo_assets
from machine import machine_info

REPO = Path(__file__).resolve().parents[1]


def check_module(module) -> tuple[float, float]:
    """``(overlap, gap_ratio)`` of one trained ``OSFTLinear`` (float64 SVDs, see the module docstring)."""
    import torch

    with torch.no_grad():
        w_high = module.W_high.double()
        k_high = min(w_high.shape) - module.k_low
        u_frozen, s_frozen, _ = torch.linalg.svd(w_high, full_matrices=False)
        u_after = torch.linalg.svd(module.dense_weight().double(), full_matrices=False)[0]
        overlap = float(torch.linalg.matrix_norm(u_after[:, :k_high].T @ u_frozen[:, :k_high]) ** 2 / k_high)
        low = (module.U_low * module.S_low).double() @ module.V_low.double()
        return overlap, float(s_frozen[k_high - 1] / torch.linalg.svdvals(low)[0])


def run_urr(urr: float, args, data_path: Path, model_dir: Path, work: Path) -> dict:
    """Task A with OSFT at ``urr`` (``Trainer.train_step`` over the sampler's batches), then the check."""
    from rich.console import Console

    from osft.trainer.config import TrainConfig
    from osft.trainer.run.loop import Trainer

    cfg = TrainConfig(model_name_or_path=str(model_dir), data_path=str(data_path), output_dir=str(work / f"urr{urr}"),
                      max_seq_len=args.max_seq_len, overlong="truncate", batch_size=args.batch, max_tokens_per_gpu=1024,
                      learning_rate=args.learning_rate, lr_scheduler="cosine", max_steps=args.steps,
                      osft_unfreeze_rank_ratio=urr, device="cpu", dtype="float32", seed=args.seed)
    trainer = Trainer(cfg, console=Console(stderr=True), job_id=f"subspace-{urr}")
    trainer.prepare()
    for step in range(args.steps):
        trainer.train_step(step + 1, trainer.sampler.batch(0, step))
    checks = [check_module(m) for _, m in trainer.osft.modules]
    return {"urr": urr, "modules": len(checks), "low_part_below_frozen": sum(g > 1 for _, g in checks),
            "overlap_min": min(o for o, _ in checks), "overlap_mean": sum(o for o, _ in checks) / len(checks),
            "gap_ratio_min": min(g for _, g in checks)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--urrs", nargs="+", type=float, default=[0.25, 0.5])
    p.add_argument("--steps", type=int, default=5, help="task A steps (the previous continual.py's default)")
    p.add_argument("--batch", type=int, default=6)
    p.add_argument("--max-seq-len", type=int, default=128)
    p.add_argument("--learning-rate", type=float, default=5e-5)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--demo-dir", type=Path, default=None)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "continual_subspace.json")
    args = p.parse_args(argv)
    assets = demo_assets(args.demo_dir)
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="osft-subspace-") as tmp:
        data = Path(tmp) / "a_train.jsonl"
        with open(assets.train_path, encoding="utf-8") as fh:  # the windows the previous continual.py trained on
            data.write_text("".join(line for _, line in zip(range(4 * args.steps * args.batch), fh)), encoding="utf-8")
        results = [run_urr(u, args, data, assets.model_dir, Path(tmp)) for u in args.urrs]
    for r in results:
        print(json.dumps(r))
    args.out.write_text(json.dumps({"benchmark": "continual_subspace", "created_unix": started, "machine": machine_info(),
                                    "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                                    "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
