"""Start-up cost of the two commands, this checkout against another one (a change to the
architecture must not make start-up slower).

Measured per checkout, with Python's bytecode cache warm (a first import writes it):

- ``import osft.tui.app`` (what ``osft-tui`` imports before its first frame), ``import
  osft.trainer.launch.cli`` and ``osft-train --help``;
- **instructions executed** (valgrind's cachegrind, ``I refs``; hash seed fixed): the same on a busy
  or a quiet machine to about 0.01 %, so a change of 1 % is visible where wall times on this shared
  2-core machine spread by 50 %; skipped when valgrind is not installed;
- **CPU time** (user + system of the child process) and **wall time**, medians of ``--rounds``
  interleaved rounds (the order alternating), for scale.

The other checkout needs its own ``.venv`` whose ``osft`` is that checkout's (an editable install
there); e.g. ``git worktree add /tmp/base afc36ff`` and, in it, ``python3 -m venv .venv`` with the
dependencies and ``pip install --no-deps -e .``.

Usage::

    python benchmarks/bench_startup.py --baseline /tmp/base     # -> results/bench_startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import time
from pathlib import Path

from machine import git_revision, machine_info

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "benchmarks" / "results" / "bench_startup.json"
#: What is measured: name -> the interpreter's arguments.
COMMANDS = {"import osft.tui.app": ["-c", "import osft.tui.app"],
            "import osft.trainer.launch.cli": ["-c", "import osft.trainer.launch.cli"],
            "osft-train --help": ["-m", "osft.trainer.launch.cli", "--help"]}


def in_layout(tree: Path, args: list[str]) -> list[str]:
    """``args`` for the checkout ``tree``: one of the flat layout (before ``trainer/launch/``) has
    ``osft-train``'s module at ``osft.trainer.cli``."""
    if (tree / "trainer" / "launch" / "cli.py").is_file():
        return args
    return [a.replace("osft.trainer.launch.cli", "osft.trainer.cli") for a in args]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}  # a user's cache is warm
    return dict(env, PYTHONHASHSEED="0", OMP_NUM_THREADS="1")


def instructions(tree: Path, args: list[str]) -> int | None:
    """Instructions executed by ``tree``'s interpreter running ``args`` (cachegrind's ``I refs``);
    None without valgrind."""
    if shutil.which("valgrind") is None:
        return None
    out = subprocess.run(["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
                          str(tree / ".venv/bin/python"), *args], cwd=tree, env=_env(), capture_output=True,
                         text=True, check=True).stderr
    line = next(x for x in out.splitlines() if "I" in x and "refs:" in x)
    return int(line.split("refs:")[1].replace(",", "").strip())


def timed(tree: Path, args: list[str]) -> tuple[float, float]:
    """(wall s, CPU s) of one run of ``tree``'s interpreter with ``args``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([str(tree / ".venv/bin/python"), *args], cwd=tree, env=_env(), stdout=subprocess.DEVNULL, check=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", type=Path, required=True, help="the other checkout (with its own .venv)")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    trees = {"this": REPO, "baseline": args.baseline.resolve()}
    for tree in trees.values():  # warm the bytecode caches
        for command in COMMANDS.values():
            subprocess.run([str(tree / ".venv/bin/python"), *in_layout(tree, command)], cwd=tree, env=_env(), stdout=subprocess.DEVNULL,
                           check=True)
    samples = {(t, c): [] for t in trees for c in COMMANDS}
    for r in range(args.rounds):
        for c, command in COMMANDS.items():
            for t in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
                samples[(t, c)].append(timed(trees[t], in_layout(trees[t], command)))
    results = {}
    for c, command in COMMANDS.items():
        row = {}
        for t, tree in trees.items():
            walls, cpus = zip(*samples[(t, c)])
            row[t] = dict(instructions=instructions(tree, in_layout(tree, command)), wall_s=statistics.median(walls),
                          cpu_s=statistics.median(cpus))
        row["ratio"] = {k: row["this"][k] / row["baseline"][k] for k in ("instructions", "wall_s", "cpu_s")
                        if row["this"][k] and row["baseline"][k]}
        results[c] = row
        print(f"{c:24s} " + "  ".join(f"{k} {v:.4f}x" for k, v in row["ratio"].items()))

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(benchmark="bench_startup", created_unix=time.time(), machine=machine_info(), rounds=args.rounds,
                                        revisions={t: git_revision(tree) for t, tree in trees.items()},
                                        load_avg_end=os.getloadavg(), commands=results), indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
