"""The export size a chained OSFT run adds: ``osft_subspaces.safetensors`` bytes per run, as a
share of the model's bfloat16 size, for SmolLM2-135M (the demo model's config) and the Llama-3-8B
and 70B shapes (configs written here; no weights are read or fetched).

Worst case: every fold adds as many directions as the cap allows (``fold_cap(k_low,
--osft-protect-max-rank-ratio)`` per side, the cap binding in every module), runs 1..4 chained at
the defaults (URR 0.25, cap 0.5), the plan of each run made by :func:`osft.trainer.osft.plan.plan_module`
from the ranks the earlier runs protected. Bytes of the bases, without the safetensors header:
float32 and float16 (the formats before) and 12-bit block codes
(:mod:`osft.trainer.checkpoint.packed12`, :data:`osft.trainer.checkpoint.subspaces.STORAGE`, what an
export writes).

    python benchmarks/chain_export_size.py --out benchmarks/results/chain_export_size.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

SHAPES = {
    "Llama-3-8B": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
    "Llama-3-70B": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                        num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
}


def chain(model_dir: str, runs: int, urr: float, cap: float) -> dict:
    """Per run: directions added and bytes added (float32, float16) over every target, and the model's bf16 bytes."""
    from osft.trainer.checkpoint.packed12 import packed_bytes
    from osft.trainer.model.build import meta_model, target_shapes
    from osft.trainer.osft.plan import plan_module
    from osft.trainer.osft.protect import fold_cap

    shapes = target_shapes(model_dir, None)
    model_bytes = 2 * sum(p.numel() for p in meta_model(model_dir).parameters())
    protected = {name: (0, 0) for name in shapes}
    out = []
    for run in range(1, runs + 1):
        added = elements = packed = 0
        for name, shape in shapes.items():
            experts, (n, m) = (shape[0] if len(shape) == 3 else 0), shape[-2:]
            p_left, p_right = protected[name]
            plan = plan_module(n, m, urr, 4096, p_left, p_right, forward_form="dense", experts=experts)
            r = fold_cap(plan.k_low, cap)
            protected[name] = (p_left + r, p_right + r)
            added += r
            elements += r * (n + m) * max(experts, 1)
            packed += packed_bytes(n, r, experts) + packed_bytes(m, r, experts)
        out.append(dict(run=run, directions_added=added, float32_bytes=4 * elements, float16_bytes=2 * elements,
                        packed12_bytes=packed, float32_share_of_bf16_model=4 * elements / model_bytes,
                        float16_share_of_bf16_model=2 * elements / model_bytes,
                        packed12_share_of_bf16_model=packed / model_bytes))
    return dict(model_bf16_bytes=model_bytes, targets=len(shapes), runs=out)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--urr", type=float, default=0.25)
    parser.add_argument("--cap", type=float, default=0.5)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "chain_export_size.json")
    args = parser.parse_args(argv)
    from transformers import LlamaConfig

    from osft.trainer.tools.demo_assets import default_demo_dir

    models = {}
    smol = default_demo_dir() / "smollm2-135m-instruct"
    if (smol / "config.json").is_file():
        models["SmolLM2-135M"] = chain(str(smol), args.runs, args.urr, args.cap)
    for name, dims in SHAPES.items():
        with tempfile.TemporaryDirectory() as tmp:
            LlamaConfig(**dims).save_pretrained(tmp)
            models[name] = chain(tmp, args.runs, args.urr, args.cap)
    result = dict(benchmark="chain_export_size", urr=args.urr, max_rank_ratio=args.cap, models=models)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for name, m in models.items():
        print(name, " ".join(f"run{r['run']}: {r['packed12_share_of_bf16_model']:.1%} "
                             f"(f16 {r['float16_share_of_bf16_model']:.1%}, f32 {r['float32_share_of_bf16_model']:.1%})"
                             for r in m["runs"]))
    return result


if __name__ == "__main__":
    main()
