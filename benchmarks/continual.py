"""Continual-learning benchmark: does OSFT forget less than full fine-tuning, on real data, on CPU?

SmolLM2-135M-Instruct learns two tasks one after the other, with every method given the same data,
batches (same sampler seed), steps, AdamW settings and learning-rate schedule:

- task A, chit-chat: the demo's BYU chit-chat windows (``osft-train fetch-demo``);
- task B, trivia: question -> answer pairs from the ``red-discordbot==3.5.24`` wheel's trivia
  lists (GPL-3.0; built at run time under ``--data-dir``, never committed; see
  ``continual_learning/trivia.py``);
- C, untouched by both: WordNet 3.0 word definitions (Debian's ``wordnet-base``).

Methods: OSFT at several unfreeze rank ratios (URR), full fine-tuning (``--no-osft``), and through
``peft`` LoRA and PEFT's own OSF (``OSFConfig``) at our rank split. Each is measured on held-out
data after A and after B (``continual_learning/report.py`` defines forgetting and learning).

Outputs: a table on the console, JSON (``--out``) and a PNG plot (``--plot``). The default sizes
run in about 25 minutes on 2 CPU cores. ``--quick`` checks the pipeline in about a minute with a
tiny random model (same data, 2 steps per task, small eval sets) and says nothing about quality.

Usage::

    python benchmarks/continual.py                    # results/continual.json and continual.png
    python benchmarks/continual.py --quick --out /tmp/c.json --plot /tmp/c.png
    python benchmarks/continual.py --kinds osft full_ft --urrs 0.25   # a subset
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from machine import machine_info

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
#: Quick mode's tiny random Llama (with the test suite's tiny byte-level chat tokenizer).
QUICK_MODEL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2)


def build_parser() -> argparse.ArgumentParser:
    """Command-line flags (sizes default to the full run; ``--quick`` replaces them)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny random model, 2 steps per task, small eval sets")
    p.add_argument("--out", type=Path, default=None, help="JSON results (default results/continual[_quick].json)")
    p.add_argument("--plot", type=Path, default=None, help="PNG plot (default results/continual[_quick].png)")
    p.add_argument("--demo-dir", type=Path, default=None, help="demo assets (default: the test cache, else $OSFT_DEMO_DIR or the user cache)")
    p.add_argument("--data-dir", type=Path, default=None, help="where the trivia and WordNet data are built (default: user cache dir osft/continual)")
    p.add_argument("--wordnet-dir", type=Path, default=None, help="a directory with WordNet 3.0's data.{noun,verb,adj,adv}")
    p.add_argument("--work-dir", type=Path, default=None, help="models between phases (default: a temp dir, removed)")
    p.add_argument("--kinds", nargs="+", choices=["osft", "full_ft", "lora", "peft_osf"], default=None)
    p.add_argument("--urrs", nargs="+", type=float, default=[0.1, 0.25, 0.5], help="OSFT unfreeze rank ratios")
    p.add_argument("--peft-urr", type=float, default=0.25, help="URR of PEFT's OSF (its effective_rank = 1 - URR)")
    p.add_argument("--lora-rank", type=int, default=16, help="LoRA r (alpha = 2r)")
    p.add_argument("--steps-a", type=int, default=5)
    p.add_argument("--steps-b", type=int, default=8)
    p.add_argument("--batch-a", type=int, default=6)
    p.add_argument("--batch-b", type=int, default=12)
    p.add_argument("--max-seq-len", type=int, default=128, help="tokens per sample (longer chit-chat windows truncated)")
    p.add_argument("--max-tokens", type=int, default=1024, help="tokens per packed micro-batch (training)")
    p.add_argument("--eval-max-tokens", type=int, default=512, help="tokens per packed forward (evaluation)")
    p.add_argument("--learning-rate", type=float, default=5e-5)
    p.add_argument("--lr-scheduler", default="cosine")
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--eval-a", type=int, default=16, help="held-out chit-chat windows")
    p.add_argument("--eval-b", type=int, default=64, help="held-out trivia questions (loss and exact match)")
    p.add_argument("--eval-c", type=int, default=64, help="WordNet definitions")
    p.add_argument("--max-new-tokens", type=int, default=12, help="greedy answer length for exact match")
    p.add_argument("--gen-batch", type=int, default=32)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--from-json", type=Path, default=None,
                   help="redraw the table and plot of an earlier run's JSON (writes only --plot)")
    return p


QUICK_SIZES = dict(steps_a=2, steps_b=2, batch_a=4, batch_b=4, eval_a=8, eval_b=8, eval_c=8, max_new_tokens=4,
                   urrs=[0.1, 0.25, 0.5], lora_rank=4)


def _spread(lines: list[str], n: int) -> list[str]:
    """``n`` lines evenly spaced over ``lines`` (held-out windows come in runs of one conversation)."""
    if n >= len(lines):
        return lines
    return [lines[i * len(lines) // n] for i in range(n)]


def _by_hash(items: list, key, n: int) -> list:
    """The first ``n`` of ``items`` ordered by SHA-256 of ``key(item)``: a fixed sample across lists."""
    return sorted(items, key=lambda x: hashlib.sha256(key(x).encode()).digest())[:n]


def _quick_model(root: Path) -> Path:
    sys.path.insert(0, str(REPO / "tests"))
    from helpers import save_tiny_model  # the project's own offline test helpers

    return save_tiny_model(root / "tiny-llama", generation_ids=True, **QUICK_MODEL)


def prepare_data(args, work: Path, console) -> dict:
    """Write the task files into ``work`` and gather the eval texts; returns paths, texts and stats."""
    import platformdirs
    from assets import demo_assets
    from continual_learning import trivia, wordnet

    data_dir = args.data_dir or Path(platformdirs.user_cache_dir("osft")) / "continual"
    assets = demo_assets(args.demo_dir)
    with open(assets.train_path, encoding="utf-8") as fh:
        a_train = [line for _, line in zip(range(4 * args.steps_a * args.batch_a), fh)]
    a_eval = _spread(assets.eval_path.read_text(encoding="utf-8").splitlines(keepends=True), args.eval_a)
    with console.status(f"building trivia from {trivia.TRIVIA_PACKAGE} ..."):
        tri = trivia.build_trivia(data_dir)
    qa = [json.loads(line) for line in tri.answers_path.read_text(encoding="utf-8").splitlines()]
    qa = _by_hash(qa, lambda r: r["question"], args.eval_b)
    b_eval = [json.dumps({"messages": [{"role": "user", "content": r["question"]},
                                       {"role": "assistant", "content": r["answers"][0]}]}) + "\n" for r in qa]
    with console.status("reading WordNet definitions ..."):
        wn_dir = args.wordnet_dir or wordnet.locate_wordnet(data_dir)
        texts_c = wordnet.definitions(wn_dir, args.eval_c)
    paths = {"a_train": work / "a_train.jsonl", "a_eval": work / "a_eval.jsonl", "b_eval": work / "b_eval.jsonl"}
    for key, lines in (("a_train", a_train), ("a_eval", a_eval), ("b_eval", b_eval)):
        paths[key].write_text("".join(lines), encoding="utf-8")
    paths["b_train"] = tri.train_path
    return {"paths": paths, "model_dir": assets.model_dir, "questions": [r["question"] for r in qa],
            "answers": [r["answers"] for r in qa], "texts_c": texts_c,
            "sources": {"A": f"chitchat-dataset==0.9.0 via {assets.train_path}", "B": trivia.TRIVIA_PACKAGE,
                        "C": f"Debian wordnet-base ({wn_dir})", "trivia_stats": tri.stats,
                        "a_train_windows": len(a_train), "a_eval_windows": len(a_eval)}}


def eval_sets(data: dict, tokenizer, max_seq_len: int):
    """Tokenize the held-out sets once (every model shares the base tokenizer)."""
    from continual_learning.evaluate import EvalSets, text_samples

    from osft.trainer.data.tokenize import tokenize_chat_file

    def chat(path):
        tok = tokenize_chat_file(path, tokenizer, max_seq_len, "truncate")
        return [tok[i] for i in range(len(tok))]

    return EvalSets(chat(data["paths"]["a_eval"]), chat(data["paths"]["b_eval"]),
                    text_samples(tokenizer, data["texts_c"]), data["questions"], data["answers"])


def measure(model_dir: Path, sets, args, with_c: bool = True) -> dict:
    """Load a dense model directory and run the evaluations on it (s in ``eval_s``); the loss on C
    is only needed for the base model and after the last task."""
    import torch
    from continual_learning.evaluate import evaluate

    from osft.trainer.model_loading import load_model, load_tokenizer

    start = time.perf_counter()
    model = load_model(model_dir, torch.float32, "cpu")
    out = evaluate(model, load_tokenizer(model_dir), sets, args.eval_max_tokens, args.max_new_tokens, args.gen_batch,
                   with_c)
    del model
    return dict(out, eval_s=time.perf_counter() - start)


def run(args, console) -> dict:
    """The whole benchmark; returns the result dict written as JSON."""
    from continual_learning.methods import Phase, make_methods, train_phase
    from continual_learning.report import summarize

    from osft.trainer.model_loading import load_tokenizer

    started = time.time()
    work = Path(tempfile.mkdtemp(prefix="osft-continual-", dir=args.work_dir))
    try:
        data = prepare_data(args, work, console)
        base_dir = _quick_model(work) if args.quick else data["model_dir"]
        sets = eval_sets(data, load_tokenizer(base_dir), args.max_seq_len)
        common = dict(max_seq_len=args.max_seq_len, max_tokens=args.max_tokens, learning_rate=args.learning_rate,
                      lr_scheduler=args.lr_scheduler, warmup_steps=args.warmup_steps, seed=args.seed)
        phases = {"A": Phase("A", data["paths"]["a_train"], args.steps_a, args.batch_a, **common),
                  "B": Phase("B", data["paths"]["b_train"], args.steps_b, args.batch_b, **common)}
        console.print("[bold]base model[/]: evaluating")
        base = measure(base_dir, sets, args)
        results = []
        for method in make_methods(args.urrs, args.peft_urr, args.lora_rank, args.kinds):
            entry = {"name": method.name, "label": method.label, "kind": method.kind, "urr": method.urr,
                     "lora_rank": method.lora_rank, "phases": {}}
            model_dir = base_dir
            for task, phase in phases.items():
                console.print(f"[bold]{method.label}[/]: task {task}, {phase.steps} steps")
                out = train_phase(method, phase, model_dir, work / method.name / task, work / "data-cache")
                entry[f"after_{task.lower()}"] = measure(out["model_dir"], sets, args, with_c=task == "B")
                if task != "A":  # task A's model is no longer needed
                    shutil.rmtree(work / method.name / "A")
                model_dir = out.pop("model_dir")
                entry["phases"][task] = out
                e = entry[f"after_{task.lower()}"]
                loss_c = "" if e["loss_c"] is None else f"loss C {e['loss_c']:.3f}, "
                console.print(f"  after {task}: loss A {e['loss_a']:.3f}, loss B {e['loss_b']:.3f}, {loss_c}"
                              f"exact match B {100 * e['exact_match_b']:.0f} % ({out['setup_s']:.0f} s setup, "
                              f"{out['train_s']:.0f} s training, {e['eval_s']:.0f} s eval)", soft_wrap=True)
            shutil.rmtree(work / method.name)
            results.append(entry)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    return dict(benchmark="continual", created_unix=started, wall_s=time.time() - started, machine=machine_info(),
                model="tiny random Llama " + json.dumps(QUICK_MODEL) if args.quick else "SmolLM2-135M-Instruct",
                settings=settings, data=data["sources"], base=base, methods=results,
                summary=summarize(base, results))


def main(argv: list[str] | None = None) -> int:
    from continual_learning.report import plot, print_table
    from rich.console import Console

    args = build_parser().parse_args(argv)
    if args.quick:
        for key, value in QUICK_SIZES.items():
            setattr(args, key, value)
    stem = "continual_quick" if args.quick else "continual"
    args.out = args.out or RESULTS / f"{stem}.json"
    args.plot = args.plot or RESULTS / f"{stem}.png"
    console = Console(stderr=True)
    if args.from_json:
        result = json.loads(args.from_json.read_text())
    else:
        result = run(args, console)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print_table(result["summary"], result["base"], Console(width=max(Console().width, 170)))
    s = result["settings"]
    title = (f"{result['model']} on {result['machine']['cpu_count']} CPU cores: A = chit-chat ({s['steps_a']} steps x "
             f"{s['batch_a']}), then B = trivia ({s['steps_b']} steps x {s['batch_b']}); lr {s['learning_rate']} "
             f"{s['lr_scheduler']}; {result['wall_s'] / 60:.0f} min")
    plot(result["summary"], result["base"], args.plot, title)
    console.print(f"wrote {'' if args.from_json else f'{args.out} and '}{args.plot} ({result['wall_s'] / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
