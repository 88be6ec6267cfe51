"""Retention benchmark: does OSFT forget less than full fine-tuning when it learns a second task?

SmolLM2-135M-Instruct learns two tasks one after the other, every arm with the same data, batches
(same sampler seed), steps, AdamW settings and schedule; only the method and task B's learning rate
(matched learning, ``--pilot``) differ:

- task A, a skill the base model lacks: trivia questions cued ``Quiz: <question>`` answered
  ``Answer: [[<answer>]]`` (the ``red-discordbot==3.5.24`` wheel's trivia lists, GPL-3.0; built at
  run time under ``--data-dir``, never committed). Forgetting of A = compliance with the format on
  held-out cued questions (greedy) after A - after B, in points;
- task B, another domain without the cue: "What is X in computing?" -> FOLDOC's definition (Debian
  ``dict-foldoc``, GFDL). Learning of B = held-out loss on B, base model - after B;
- probes no arm trains on: R1, the tuned model's loss minus the base model's on the base model's own
  greedy replies to held-out chit-chat prompts (``osft-train make-retention-set``); R2, WordNet
  4-way multiple choice (accuracy); R3, WordNet definition loss (Debian ``wordnet-base``).

Arms (``continual_learning/methods.py``): full FT -> full FT; OSFT 0.25 -> 0.25 and 0.25 -> 0.15
(training_hub's recipe) without protection; OSFT 0.25 -> 0.25 with the protected subspaces task A's
export carries (update-based, and input-activation right bases); PEFT's OSF 0.25 -> 0.25. Each seed
runs every task-A run once and every arm's task B from it. Intervals: paired bootstrap over items and
seeds (``continual_learning/stats.py``).

Outputs: a table on the console (and Markdown with ``--markdown``), JSON (``--out``, per-item
results by index, never the data's text) and a PNG (``--plot``). ``--quick`` runs every arm and 2
seeds on a tiny random model in under a minute (a pipeline check; its numbers mean nothing).
``--pilot`` tries task-B learning rates per arm on a short run and prints the matched ones.

Usage::

    python benchmarks/continual.py                       # results/continual.json and continual.png
    python benchmarks/continual.py --quick --out /tmp/c.json --plot /tmp/c.png
    python benchmarks/continual.py --pilot               # results/continual_pilot.json
    python benchmarks/continual.py --arms full_ft osft_same --seeds 0
    # the two seeds side by side, one core each, then one result:
    OMP_NUM_THREADS=1 python benchmarks/continual.py --seeds 0 --out s0.json --plot s0.png &
    OMP_NUM_THREADS=1 python benchmarks/continual.py --seeds 1 --out s1.json --plot s1.png; wait
    python benchmarks/continual.py --merge s0.json s1.json
"""

from __future__ import annotations

import argparse
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
QUICK_SIZES = dict(steps_a=2, steps_b=2, batch_a=4, batch_b=4, eval_a=8, eval_b=8, r1_rows=3, eval_r2=8, eval_r3=8,
                   max_new_tokens=6, r1_max_new_tokens=8, bootstrap=200, pilot_steps=1, pilot_rates=[1e-4, 1e-3])


def build_parser() -> argparse.ArgumentParser:
    """Command-line flags (sizes default to the full run; ``--quick`` replaces them)."""
    from continual_learning.methods import ARMS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny random model, 2 steps per task, tiny eval sets")
    p.add_argument("--pilot", action="store_true", help="choose task B's learning rate per arm (matched learning)")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON results (default results/continual[_quick|_pilot].json)")
    p.add_argument("--plot", type=Path, default=None, help="PNG plot (default results/continual[_quick].png)")
    p.add_argument("--markdown", type=Path, default=None, help="also write the table as Markdown here")
    p.add_argument("--demo-dir", type=Path, default=None,
                   help="demo assets (default: $OSFT_DEMO_DIR, the test cache or the user cache)")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="where trivia, FOLDOC and WordNet are built (default: user cache dir osft/continual)")
    p.add_argument("--wordnet-dir", type=Path, default=None,
                   help="a directory with WordNet 3.0's data.{noun,verb,adj,adv}")
    p.add_argument("--foldoc-dir", type=Path, default=None, help="a directory with foldoc.index and foldoc.dict.dz")
    p.add_argument("--work-dir", type=Path, default=None, help="models between phases (default: a temp dir, removed)")
    p.add_argument("--arms", nargs="+", choices=[a.name for a in ARMS], default=None, help="a subset of the arms")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1], help="training seeds (data order and init)")
    p.add_argument("--steps-a", type=int, default=10)
    p.add_argument("--steps-b", type=int, default=10)
    p.add_argument("--batch-a", type=int, default=8)
    p.add_argument("--batch-b", type=int, default=8)
    p.add_argument("--max-seq-len", type=int, default=128, help="tokens per sample (longer ones truncated)")
    p.add_argument("--max-tokens", type=int, default=1024, help="tokens per packed micro-batch (training)")
    p.add_argument("--eval-max-tokens", type=int, default=1024, help="tokens per packed forward (evaluation)")
    p.add_argument("--lr-scheduler", default="constant")
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--eval-a", type=int, default=64, help="held-out cued trivia questions")
    p.add_argument("--eval-b", type=int, default=64, help="held-out FOLDOC definitions")
    p.add_argument("--r1-rows", type=int, default=14,
                   help="held-out chit-chat rows whose user turns make R1 (~48 prompts)")
    p.add_argument("--eval-r2", type=int, default=48, help="WordNet multiple-choice items")
    p.add_argument("--eval-r3", type=int, default=64, help="WordNet definition texts")
    p.add_argument("--max-new-tokens", type=int, default=16, help="greedy reply length for task A's compliance")
    p.add_argument("--r1-max-new-tokens", type=int, default=32, help="length of the base model's R1 replies")
    p.add_argument("--gen-batch", type=int, default=32)
    p.add_argument("--bootstrap", type=int, default=2000, help="bootstrap replicates")
    p.add_argument("--pilot-steps", type=int, default=5, help="task B steps of a pilot run")
    p.add_argument("--pilot-rates", nargs="+", type=float, default=[1e-4, 2e-4, 4e-4, 8e-4],
                   help="task B learning rates the pilot tries for every arm but full FT")
    p.add_argument("--from-json", type=Path, default=None,
                   help="redraw the table and plot of an earlier run's JSON (writes only --plot and --markdown)")
    p.add_argument("--merge", type=Path, nargs="+", default=None,
                   help="combine the JSONs of runs of the same settings on different --seeds (run side by side, "
                        "one per core) into one result: --out, --plot, --markdown")
    return p


def _by_hash(items: list, key, n: int) -> list:
    """The first ``n`` of ``items`` ordered by SHA-256 of ``key(item)``: a fixed sample across machines."""
    import hashlib

    return sorted(items, key=lambda x: hashlib.sha256(key(x).encode()).digest())[:n]


def _quick_model(root: Path) -> Path:
    sys.path.insert(0, str(REPO / "tests"))
    from helpers import save_tiny_model  # the project's own offline test helpers

    return save_tiny_model(root / "tiny-llama", generation_ids=True, **QUICK_MODEL)


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def prepare_data(args, work: Path, console) -> dict:
    """Build the task files (data dir), write the eval subsets into ``work``; returns paths, texts, stats."""
    import platformdirs
    from assets import demo_assets
    from continual_learning import foldoc, trivia, wordnet

    from osft.trainer.tools.retention_set import chat_prompts

    data_dir = args.data_dir or Path(platformdirs.user_cache_dir("osft")) / "continual"
    assets = demo_assets(args.demo_dir)
    with console.status(f"building trivia from {trivia.TRIVIA_PACKAGE} ..."):
        tri = trivia.build_trivia(data_dir)
    with console.status("building FOLDOC definitions ..."):
        fol = foldoc.build_foldoc(data_dir, args.foldoc_dir)
    with console.status("reading WordNet ..."):
        wn_dir = args.wordnet_dir or wordnet.locate_wordnet(data_dir)
        texts_r3, choices = wordnet.probes(wn_dir, args.eval_r3, args.eval_r2)
    qa = [json.loads(line) for line in tri.answers_path.read_text(encoding="utf-8").splitlines()]
    qa = _by_hash(qa, lambda r: r["question"], args.eval_a)
    a_rows = [trivia.chat_row(trivia.TriviaItem(r["question"], tuple(r["answers"]), r["source"])) for r in qa]
    b_rows = _by_hash([json.loads(line) for line in fol.eval_path.read_text(encoding="utf-8").splitlines()],
                      lambda r: r["messages"][0]["content"], args.eval_b)
    r1_prompts, r1_lines = chat_prompts(assets.eval_path, args.r1_rows)

    def train_subset(path: Path, steps: int, batch: int, name: str) -> Path:  # 4x the samples a run draws
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
        return _write_jsonl(work / name, _by_hash(rows, lambda r: r["messages"][0]["content"], 4 * steps * batch))

    return {"paths": {"a_train": train_subset(tri.train_path, args.steps_a, args.batch_a, "a_train.jsonl"),
                      "b_train": train_subset(fol.train_path, args.steps_b, args.batch_b, "b_train.jsonl"),
                      "a_eval": _write_jsonl(work / "a_eval.jsonl", a_rows),
                      "b_eval": _write_jsonl(work / "b_eval.jsonl", b_rows)},
            "model_dir": assets.model_dir, "a_prompts": [r["messages"][0]["content"] for r in a_rows],
            "a_answers": [r["answers"] for r in qa], "r1_prompts": r1_prompts, "texts_r3": texts_r3, "choices": choices,
            "sources": {"A": trivia.TRIVIA_PACKAGE, "trivia_stats": tri.stats, "B": fol.stats["source"],
                        "foldoc_stats": fol.stats,
                        "R1": f"{assets.eval_path} lines {r1_lines} (chitchat-dataset==0.9.0)",
                        "R2_R3": f"Debian wordnet-base ({wn_dir})"}}


def make_probes(data: dict, base_dir: Path, work: Path, args):
    """Make the R1 retention set with the base model and tokenize every probe once."""
    from continual_learning.evaluate import Probes, choice_samples, text_samples

    from osft.trainer.data.tokenize import tokenize_chat_file
    from osft.trainer.model.loading import load_tokenizer
    from osft.trainer.tools.retention_set import make_retention_set

    made = make_retention_set(base_dir, work / "r1.jsonl", data["r1_prompts"], args.r1_max_new_tokens,
                              args.gen_batch, seed=0)
    tokenizer = load_tokenizer(base_dir)

    def chat(path):
        tok = tokenize_chat_file(path, tokenizer, args.max_seq_len, "truncate")
        return [tok[i] for i in range(len(tok))]

    probes = Probes(chat(data["paths"]["a_eval"]), data["a_prompts"], data["a_answers"], chat(data["paths"]["b_eval"]),
                    chat(made.out_path), [choice_samples(tokenizer, c.word, c.options) for c in data["choices"]],
                    [c.answer for c in data["choices"]], text_samples(tokenizer, data["texts_r3"]))
    sizes = {"a": len(probes.a_chat), "b": len(probes.b_chat), "r1": len(probes.r1_chat),
             "r2": len(probes.r2_answers), "r3": len(probes.r3_text)}
    return probes, sizes, {"r1_rows": made.rows, "r1_dropped_empty": made.dropped_empty}


def measure(model_dir: Path, probes, parts: tuple[str, ...], args) -> dict:
    """Load a dense model directory and measure ``parts`` on it (seconds in ``eval_s``)."""
    import torch
    from continual_learning.evaluate import evaluate

    from osft.trainer.model.loading import load_model, load_tokenizer

    start = time.perf_counter()
    model = load_model(model_dir, torch.float32, "cpu")
    out = evaluate(model, load_tokenizer(model_dir), probes, parts, args.eval_max_tokens, args.max_new_tokens,
                   args.gen_batch)
    del model
    return dict(out, eval_s=time.perf_counter() - start)


def _phases(data: dict, args, seed: int, steps_b: int | None = None) -> dict:
    from continual_learning.methods import Phase

    common = dict(max_seq_len=args.max_seq_len, max_tokens=args.max_tokens, lr_scheduler=args.lr_scheduler,
                  warmup_steps=args.warmup_steps, seed=seed)
    return {"A": Phase("A", data["paths"]["a_train"], args.steps_a, args.batch_a, **common),
            "B": Phase("B", data["paths"]["b_train"], steps_b or args.steps_b, args.batch_b, **common)}


def _selected_arms(args) -> list:
    from continual_learning.methods import ARMS

    return [a for a in ARMS if args.arms is None or a.name in args.arms]


def _nll_mean(result: dict) -> float:
    return sum(result["nll"]) / sum(result["tokens"])


def run(args, console) -> dict:
    """The benchmark (or, with ``args.pilot``, the learning-rate pilot); returns the JSON dict."""
    from continual_learning.methods import TASK_A_RUNS, train_phase

    started = time.time()
    arms = _selected_arms(args)
    seeds = args.seeds[:1] if args.pilot else args.seeds
    work = Path(tempfile.mkdtemp(prefix="osft-continual-", dir=args.work_dir))
    evals: dict = {}
    phases: dict = {}
    pilot: dict = {}
    try:
        data = prepare_data(args, work, console)
        base_dir = _quick_model(work) if args.quick else data["model_dir"]
        console.print("[bold]base model[/]: retention set and evaluation")
        probes, sizes, r1_stats = make_probes(data, base_dir, work, args)
        evals["base"] = measure(base_dir, probes, ("b",) if args.pilot else ("a", "b", "r"), args)
        for seed in seeds:
            key = str(seed)
            evals[key], phases[key] = {}, {}
            ph = _phases(data, args, seed, args.pilot_steps if args.pilot else None)
            a_dirs = {}
            for run_name in dict.fromkeys(a.a_run for a in arms):
                out = train_phase(TASK_A_RUNS[run_name], ph["A"], base_dir, work / f"A-{run_name}", work / "cache")
                a_dirs[run_name] = out.pop("model_dir")
                phases[key][f"A:{run_name}"] = out
                if not args.pilot:
                    evals[key][f"A:{run_name}"] = e = measure(a_dirs[run_name], probes, ("a",), args)
                    compliance = 100 * sum(e["a_comply"]) / len(e["a_comply"])
                    console.print(f"seed {seed}, task A {run_name}: compliance {compliance:.0f} % "
                                  f"({out['setup_s'] + out['train_s']:.0f} s training, {e['eval_s']:.0f} s eval)")
            for arm in arms:
                rates = [arm.b.learning_rate] if not args.pilot or arm.name == "full_ft" else args.pilot_rates
                for lr in rates:
                    out = train_phase(arm.b, ph["B"], a_dirs[arm.a_run], work / f"B-{arm.name}", work / "cache", lr)
                    e = measure(out.pop("model_dir"), probes, ("b",) if args.pilot else ("a", "b", "r"), args)
                    shutil.rmtree(work / f"B-{arm.name}")
                    learning = _nll_mean(evals["base"]["b_nll"]) - _nll_mean(e["b_nll"])
                    console.print(f"seed {seed}, {arm.label}, lr {lr:g}: learning of B {learning:+.3f} nats/token "
                                  f"({out['setup_s'] + out['train_s']:.0f} s training, {e['eval_s']:.0f} s eval)")
                    if args.pilot:
                        pilot.setdefault(arm.name, {})[f"{lr:g}"] = learning
                    else:
                        phases[key][f"B:{arm.name}"], evals[key][f"B:{arm.name}"] = out, e
            for run_name in a_dirs:
                shutil.rmtree(work / f"A-{run_name}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    result = dict(benchmark="continual_pilot" if args.pilot else "continual", created_unix=started,
                  wall_s=time.time() - started, machine=machine_info(),
                  model="tiny random Llama " + json.dumps(QUICK_MODEL) if args.quick else "SmolLM2-135M-Instruct",
                  settings=settings, data=dict(data["sources"], **r1_stats), sizes=sizes,
                  task_a_runs={n: {"kind": s.kind, "config": s.config, "learning_rate": s.learning_rate}
                               for n, s in TASK_A_RUNS.items() if n in {a.a_run for a in arms}},
                  arms=[{"name": a.name, "label": a.label, "a_run": a.a_run, "kind": a.b.kind, "config_b": a.b.config,
                         "learning_rate_b": a.b.learning_rate} for a in arms],
                  seeds=[str(s) for s in seeds], phases=phases, evals=evals)
    if args.pilot:
        return dict(result, pilot=pilot, chosen=_choose_rates(pilot))
    return dict(result, timing=_timing(phases, evals), **_summary(result))


def merge(paths: list[Path]) -> dict:
    """One result from the JSONs of runs that differ only in their seeds (e.g. two processes with
    ``OMP_NUM_THREADS=1``, one per core, which finish sooner than one process with two threads).

    Raises:
        ValueError: the runs differ in anything but their seeds (model, data, sizes, arms, rates,
            settings, the base model's evaluation), share a seed, or one is a pilot.
    """
    parts = [json.loads(p.read_text()) for p in paths]
    first = parts[0]
    ignored = {"seeds", "out", "plot", "markdown", "work_dir", "merge"}
    for path, part in zip(paths[1:], parts[1:]):
        for key in ("benchmark", "model", "data", "sizes", "task_a_runs", "arms"):
            if part[key] != first[key]:
                raise ValueError(f"{path}: {key} differs from {paths[0]}'s")
        settings = {k: v for k, v in part["settings"].items() if k not in ignored}
        if settings != {k: v for k, v in first["settings"].items() if k not in ignored}:
            raise ValueError(f"{path}: settings differ from {paths[0]}'s")
        if {k: v for k, v in part["evals"]["base"].items() if k != "eval_s"} != \
                {k: v for k, v in first["evals"]["base"].items() if k != "eval_s"}:
            raise ValueError(f"{path}: the base model's evaluation differs from {paths[0]}'s")
    if first["benchmark"] != "continual":
        raise ValueError(f"{paths[0]}: only full runs merge, not {first['benchmark']}")
    seeds = [s for part in parts for s in part["seeds"]]
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"the runs share a seed: {seeds}")
    evals = {"base": first["evals"]["base"], **{s: part["evals"][s] for part in parts for s in part["seeds"]}}
    phases = {s: part["phases"][s] for part in parts for s in part["seeds"]}
    result = dict(first, seeds=seeds, evals=evals, phases=phases, created_unix=min(p["created_unix"] for p in parts),
                  wall_s=max(p["created_unix"] + p["wall_s"] for p in parts) - min(p["created_unix"] for p in parts),
                  settings=dict(first["settings"], seeds=[int(s) for s in seeds]), merged_from=[str(p) for p in paths])
    return dict(result, timing=_timing(phases, evals), **_summary(result))


def _choose_rates(pilot: dict) -> dict:
    """Per arm, the tried rate whose learning of B is closest to full FT's (full FT keeps its own)."""
    target = next(iter(pilot["full_ft"].values())) if "full_ft" in pilot else None
    if target is None:
        return {}
    return {arm: float(min(tried, key=lambda lr: abs(tried[lr] - target))) for arm, tried in pilot.items()}


def _timing(phases: dict, evals: dict) -> dict:
    """Mean seconds per phase kind: task-A run, task-B run, evaluation (to size the full run)."""
    def mean(xs):
        return sum(xs) / len(xs) if xs else None

    runs = [p for seed in phases.values() for p in seed.items()]
    return {"task_a_s": mean([p["setup_s"] + p["train_s"] for k, p in runs if k.startswith("A:")]),
            "task_b_s": mean([p["setup_s"] + p["train_s"] for k, p in runs if k.startswith("B:")]),
            "eval_s": mean([e["eval_s"] for seed, per in evals.items() if seed != "base" for e in per.values()]),
            "base_eval_s": evals["base"]["eval_s"]}


def _summary(result: dict) -> dict:
    from continual_learning.report import goals
    from continual_learning.stats import summarize

    summary = summarize(result["evals"], result["seeds"], result["arms"], result["sizes"],
                        result["settings"]["bootstrap"])
    return {"summary": summary, "goals": goals(summary)}


def main(argv: list[str] | None = None) -> int:
    from continual_learning.report import markdown_table, plot, print_pilot, print_table
    from rich.console import Console

    args = build_parser().parse_args(argv)
    if args.quick:
        for key, value in QUICK_SIZES.items():
            setattr(args, key, value)
    stem = "continual" + ("_quick" if args.quick else "") + ("_pilot" if args.pilot else "")
    args.out = args.out or RESULTS / f"{stem}.json"
    args.plot = args.plot or RESULTS / f"{stem}.png"
    console = Console(stderr=True)
    if args.from_json:
        result = json.loads(args.from_json.read_text())
    elif args.merge:
        result = merge(args.merge)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    else:
        result = run(args, console)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    wide = Console(width=max(Console().width, 170))
    if result["benchmark"] == "continual_pilot":
        print_pilot(result, wide)
        console.print(f"wrote {args.out} ({result['wall_s'] / 60:.1f} min)")
        return 0
    print_table(result, wide)
    if args.markdown:
        args.markdown.write_text(markdown_table(result) + "\n")
    plot(result, args.plot)
    written = "" if args.from_json else f"{args.out} and "
    console.print(f"wrote {written}{args.plot} ({result['wall_s'] / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
