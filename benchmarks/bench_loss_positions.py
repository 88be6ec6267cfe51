"""The training loss computed only where a label is trained (docs/training.md, "Loss and gradient
norm"): the LM head and the cross-entropy on the trained positions of a packed micro-batch
(``logits_to_keep`` with the positions) against the head on every position, side by side in one
process.

Model: SmolLM2-135M-Instruct from the demo assets (``$OSFT_DEMO_DIR`` or the default demo
directory), full fine-tuning in float32 on CPU; data: chit-chat training rows packed into one
micro-batch of up to ``--tokens`` tokens, labels as the trainer makes them (assistant turns only).
Each round times one forward + backward of each variant (interleaved, the order alternating), after
one warm-up each. Reported: median step time of each, the ratio, the share of trained positions,
and the largest difference of the two losses and gradients (they must agree to float32 rounding).

Usage::

    OSFT_DEMO_DIR=/work/demo-assets python benchmarks/bench_loss_positions.py   # -> results/loss_positions.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "benchmarks" / "results" / "loss_positions.json"


def packed_batch(assets, tokens: int) -> dict:
    """One packed micro-batch of the demo's training rows, at most ``tokens`` tokens."""
    from osft.trainer.data.collate import collate_packed
    from osft.trainer.data.tokenize import tokenize_chat_file
    from osft.trainer.model.loading import load_tokenizer

    data = tokenize_chat_file(assets.train_path, load_tokenizer(assets.model_dir), 256)
    chosen, total = [], 0
    for i in range(len(data)):
        n = len(data[i]["input_ids"])
        if total + n > tokens:
            break
        chosen.append(data[i])
        total += n
    return collate_packed(chosen)


def loss_all_positions(model, batch) -> torch.Tensor:
    """The head on every position, as before: V-wide float32 logits for the whole row."""
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    return F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), batch["labels"].view(-1), ignore_index=-100,
                           reduction="sum")


def loss_trained_positions(model, batch) -> torch.Tensor:
    """The head only on the trained positions (what ``osft.trainer.run.micro_batch_loss.MicroBatchLoss`` does)."""
    keep = (batch["labels"][0] != -100).nonzero().squeeze(1)
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False,
                   logits_to_keep=keep).logits
    return F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), batch["labels"][0, keep], reduction="sum")


def main() -> None:
    from osft.trainer.tools.demo_assets import fetch_demo
    from rich.console import Console
    from transformers import AutoModelForCausalLM

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=1024, help="tokens of the packed micro-batch")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args()
    torch.manual_seed(0)
    demo_dir = os.environ.get("OSFT_DEMO_DIR")
    assets = fetch_demo(Path(demo_dir) if demo_dir else None, Console(stderr=True))
    model = AutoModelForCausalLM.from_pretrained(assets.model_dir, dtype=torch.float32).train()
    batch = packed_batch(assets, args.tokens)
    variants = {"all_positions": loss_all_positions, "trained_positions": loss_trained_positions}
    times: dict[str, list[float]] = {k: [] for k in variants}
    grads, losses = {}, {}
    for r in range(args.rounds + 1):  # round 0 warms up
        for name in (list(variants) if r % 2 else list(reversed(variants))):
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            loss = variants[name](model, batch)
            loss.backward()
            elapsed = time.perf_counter() - start
            if r:
                times[name].append(elapsed)
            losses[name] = float(loss.detach())
            grads[name] = [q.grad.clone() for q in model.parameters() if q.grad is not None]
    diff = max((a - b).abs().max().item() for a, b in zip(grads["all_positions"], grads["trained_positions"]))
    med = {k: statistics.median(v) for k, v in times.items()}
    trained = int((batch["labels"] != -100).sum())
    result = {
        "benchmark": "bench_loss_positions", "model": "SmolLM2-135M-Instruct", "dtype": "float32",
        "threads": torch.get_num_threads(), "tokens": int(batch["input_ids"].shape[1]), "trained_tokens": trained,
        "rounds": args.rounds, "step_time_s_median": med, "step_time_s_all": times,
        "ratio_trained_vs_all": med["trained_positions"] / med["all_positions"],
        "loss": losses, "max_abs_grad_diff": diff,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{result['tokens']} tokens, {trained} trained: all positions {med['all_positions']:.2f} s, "
          f"trained positions {med['trained_positions']:.2f} s ({result['ratio_trained_vs_all']:.2f}x); "
          f"loss {losses['all_positions']:.4f} vs {losses['trained_positions']:.4f}, max grad diff {diff:.1e}")


if __name__ == "__main__":
    main()
