"""Where the wall time of a short two-rank ``osft-train`` run goes, outside training itself, this
checkout against another one.

A tiny random Llama (built here), 25 chat rows, ``--nproc-per-node 2`` on CPU, ``--max-steps 2``:
the fixed cost every launch pays (and every torchrun test of the suite pays several times over).
Phases, from the launcher's output lines (timed as they arrive) and the ranks' metrics records:

- ``preflight_s``: start to ``data: N samples validated`` (the launcher's imports, data check);
- ``ranks_start_s``: from there to the ``run_started`` record (torchrun's agent and the ranks
  start: their imports, the process group);
- ``run_s``: ``run_started`` to ``run_finished`` (model load, SVD, steps, export);
- ``ranks_end_s``: ``run_finished`` to the launcher's ``done`` line (ranks and agent exit);
- ``launcher_end_s``: ``done`` to the launcher's exit;
- ``total_s``.

Medians of ``--rounds`` rounds, the two checkouts alternating within a round (this machine is
shared and noisy: compare the ratios, not the seconds). The other checkout needs its own ``.venv``
whose ``osft`` is that checkout's, as for ``bench_startup.py``.

Usage::

    python benchmarks/bench_launch.py --baseline /tmp/base     # -> results/bench_launch.json
    python benchmarks/bench_launch.py --rounds 1 --out /tmp/l.json   # this checkout only (CI)
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

from machine import git_revision, machine_info

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "benchmarks" / "results" / "bench_launch.json"
PHASES = ("preflight_s", "ranks_start_s", "run_s", "ranks_end_s", "launcher_end_s", "total_s")


def make_job(work: Path) -> tuple[Path, Path]:
    """The tiny model (hidden 64, 2 blocks, the test chat tokenizer) and its data file."""
    sys.path.insert(0, str(REPO / "tests"))
    from helpers import QA, chat, tiny_chat_tokenizer, tiny_llama, write_jsonl

    tokenizer = tiny_chat_tokenizer()
    model = tiny_llama(len(tokenizer), hidden_size=64, intermediate_size=128)
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(work / "model")
    tokenizer.save_pretrained(work / "model")
    return work / "model", write_jsonl(work / "train.jsonl", [chat(q, a) for q, a in QA] * 5)


def launch_phases(tree: Path, model: Path, data: Path, out: Path) -> dict[str, float]:
    """One run of ``tree``'s ``osft-train`` (its ``.venv``); the phases in seconds.

    Raises:
        RuntimeError: the run failed or printed none of the lines a phase ends on.
    """
    cmd = [str(tree / ".venv/bin/python"), "-m", "osft.trainer.launch.cli", "--model-name-or-path", str(model),
           "--data-path", str(data), "--output-dir", str(out), "--batch-size", "5", "--max-tokens-per-gpu", "64",
           "--max-seq-len", "64", "--max-steps", "2", "--nproc-per-node", "2", "--overwrite-output-dir"]
    start = time.time()
    proc = subprocess.Popen(cmd, cwd=tree, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    marks, lines = {}, []
    for line in proc.stdout:
        lines.append(line)
        now = time.time()
        if "samples validated" in line:
            marks.setdefault("validated", now)
        elif line.startswith("done"):
            marks.setdefault("done", now)
    proc.wait()
    end = time.time()
    if proc.returncode != 0 or set(marks) != {"validated", "done"}:
        raise RuntimeError(f"{' '.join(cmd)} ended {proc.returncode}:\n{''.join(lines)[-3000:]}")
    records = [json.loads(x) for x in (out / "metrics" / "node0.jsonl").read_text().splitlines()]
    started = next(r["ts"] for r in records if r["event"] == "run_started")
    finished = next(r["ts"] for r in records if r["event"] == "run_finished")
    return dict(preflight_s=marks["validated"] - start, ranks_start_s=started - marks["validated"], run_s=finished - started, ranks_end_s=marks["done"] - finished,
                launcher_end_s=end - marks["done"], total_s=end - start)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", type=Path, default=None, help="the other checkout (with its own .venv)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    trees = {"this": REPO, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
    samples = {t: [] for t in trees}
    with tempfile.TemporaryDirectory(prefix="bench_launch_") as tmp:
        work = Path(tmp)
        model, data = make_job(work)
        for r in range(args.rounds):
            for t in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
                samples[t].append(launch_phases(trees[t], model, data, work / f"run_{t}"))
                print(t, "  ".join(f"{k} {v:.2f}" for k, v in samples[t][-1].items()), flush=True)
    medians = {t: {k: statistics.median(s[k] for s in runs) for k in PHASES} for t, runs in samples.items()}
    result = dict(benchmark="bench_launch", created_unix=time.time(), machine=machine_info(), rounds=args.rounds,
                  revisions={t: git_revision(tree) for t, tree in trees.items()}, load_avg_end=os.getloadavg(),
                  samples=samples, medians=medians)
    if args.baseline:
        result["ratio"] = {k: medians["this"][k] / medians["baseline"][k] for k in PHASES}
        print("this/baseline  " + "  ".join(f"{k} {v:.3f}x" for k, v in result["ratio"].items()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
