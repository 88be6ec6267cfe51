"""Data preparation at scale: rows/s and peak memory of validating, rendering and tokenizing a chat file.

The file is the demo's chit-chat ``train.jsonl`` repeated to N rows (written under ``--work-dir`` at
run time, never committed). Each measurement is one fresh process that prepares the file through a
fresh data cache (:func:`osft.trainer.data.cache.tokenize_chat_file_cached`, what a launch does
before the first step) with the demo's SmolLM2 tokenizer and ``--max-seq-len``. Peak RSS is the
largest sum over the process and its children (the shard processes), sampled every 0.1 s, next to
the kernel's ``ru_maxrss`` of the process and of its largest child, and the CPU seconds of both
(on a shared machine, what free cores would take). ``--baseline DIR`` measures another
checkout (its own ``.venv``) side by side in the same run, at the sizes in ``--baseline-rows``.
The machine's load average is recorded with each measurement (the machine may be shared).

    python benchmarks/bench_data.py --rows 30000 300000 1000000 --baseline /work/main \\
        --baseline-rows 30000 300000 --out benchmarks/results/bench_data.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import git_revision

ROOT = Path(__file__).resolve().parent.parent
_CHILD = r"""
import json, resource, sys, time
from pathlib import Path
t0 = time.perf_counter()
from osft.trainer.data.cache import tokenize_chat_file_cached
try:
    from osft.trainer.model.loading import load_tokenizer
except ImportError:  # a baseline checkout of the flat layout before trainer/model/
    from osft.trainer.model_loading import load_tokenizer
path, model, cache, max_seq_len = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
tok = load_tokenizer(model)
t1 = time.perf_counter()
data, hit = tokenize_chat_file_cached(path, tok, max_seq_len, cache_dir=Path(cache))
t2 = time.perf_counter()
assert not hit
cpu = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
          for f in ("ru_utime", "ru_stime"))
print(json.dumps(dict(import_and_tokenizer_s=t1 - t0, prepare_s=t2 - t1, cpu_s=cpu, rows=data.report.rows,
                      samples=len(data), tokens=data.report.total_tokens,
                      ru_maxrss_self_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      ru_maxrss_children_bytes=resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)))
"""


def repeated_file(source: Path, rows: int, dest: Path) -> Path:
    """``source``'s lines repeated (and cut) to ``rows`` lines, written to ``dest``."""
    lines = source.read_bytes().splitlines(keepends=True)
    with open(dest, "wb") as f:
        f.writelines(lines[i % len(lines)] for i in range(rows))
    return dest


def measure(python: Path, cwd: Path, path: Path, model: Path, max_seq_len: int, work: Path) -> dict:
    """One preparation in a fresh process of ``python`` (run in ``cwd``) with a fresh cache."""
    cache = Path(tempfile.mkdtemp(prefix="cache-", dir=work))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    start = time.perf_counter()
    # the output goes to files: a child that writes more than a pipe holds (progress bars, warnings)
    # would block on the pipe while this loop samples it
    out_file, err_file = (open(work / f"child.{n}", "w+") for n in ("out", "err"))
    proc = psutil.Popen([str(python), "-c", _CHILD, str(path), str(model), str(cache), str(max_seq_len)],
                        cwd=cwd, env=env, stdout=out_file, stderr=err_file, text=True)
    peak, loads = 0, []
    while proc.poll() is None:
        total = 0
        try:
            for p in [proc, *proc.children(recursive=True)]:
                total += p.memory_info().rss
        except psutil.Error:
            pass
        peak = max(peak, total)
        loads.append(os.getloadavg()[0])
        time.sleep(0.1)
    wall = time.perf_counter() - start
    proc.wait()
    with out_file, err_file:
        out_file.seek(0)
        err_file.seek(0)
        out, err = out_file.read(), err_file.read()
    subprocess.run(["rm", "-rf", str(cache)], check=False)
    if proc.returncode:
        raise SystemExit(f"{python} failed:\n{err[-3000:]}")
    result = json.loads(out.strip().splitlines()[-1])
    result.update(wall_s=wall, rows_per_s=result["rows"] / result["prepare_s"], peak_tree_rss_bytes=peak,
                  load_avg_1m_mean=sum(loads) / max(len(loads), 1), load_avg_1m_max=max(loads, default=0.0))
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[30_000, 300_000, 1_000_000])
    parser.add_argument("--baseline", type=Path, help="another checkout with its own .venv, measured side by side")
    parser.add_argument("--baseline-rows", type=int, nargs="+", default=[30_000, 300_000])
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--work-dir", type=Path, default=None, help="where the repeated files go (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "bench_data.json")
    args = parser.parse_args(argv)
    from osft.trainer.tools.demo_assets import fetch_demo

    demo = fetch_demo()
    work = Path(tempfile.mkdtemp(prefix="bench-data-", dir=args.work_dir))
    trees = [("this", ROOT)] + ([("baseline", args.baseline.resolve())] if args.baseline else [])
    results = []
    try:
        for rows in sorted(set(args.rows) | (set(args.baseline_rows) if args.baseline else set())):
            path = repeated_file(demo.train_path, rows, work / f"chat_{rows}.jsonl")
            for name, tree in trees:
                if (name == "baseline" and rows not in args.baseline_rows) or (name == "this" and rows not in args.rows):
                    continue
                r = measure(tree / ".venv" / "bin" / "python", tree, path, demo.model_dir, args.max_seq_len, work)
                r.update(tree=name, revision=git_revision(tree), file_bytes=path.stat().st_size)
                print(json.dumps(r), flush=True)
                results.append(r)
                _write(args, demo, results)
            path.unlink()
    finally:
        subprocess.run(["rm", "-rf", str(work)], check=False)
    return _write(args, demo, results)


def _write(args, demo, results: list[dict]) -> dict:
    """Write the results so far to ``--out``."""
    out = dict(benchmark="bench_data", max_seq_len=args.max_seq_len, cpu_cores=len(os.sched_getaffinity(0)),
               source=str(demo.train_path), results=results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
