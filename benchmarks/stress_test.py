"""Run one test many times, each in a fresh pytest process, and record how each run ended: a crash
that shows once in many suite runs (a native fault beside the collectives of a background
checkpoint) needs many runs to be seen, and a record of the runs that did not show it.

Each run: ``pytest -q -x -p no:cacheprovider TEST`` in its own temporary directory with core files
allowed (``ulimit -c unlimited``); its exit code, wall time and the machine's load average, and
whether a core file or a fatal-signal line (``Fatal Python error``, ``SIGSEGV``, ``SIGABRT``,
``malloc(): ``) appeared. The output of a failed run is kept under ``--keep``.

Usage::

    python benchmarks/stress_test.py --runs 50 --out benchmarks/results/stress_async_resume.json \\
        tests/test_resume.py::test_async_checkpoints_let_training_go_on_a_stop_waits_and_the_resume_is_bit_identical
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import git_revision, machine_info

REPO = Path(__file__).resolve().parents[1]
FATAL = re.compile(r"Fatal Python error|SIGSEGV|SIGABRT|malloc\(\): |double free|core dumped")


def allow_cores() -> None:
    """In the child: core files of any size (the machine's ``core_pattern`` decides where)."""
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def one_run(test: str, keep: Path, i: int) -> dict:
    """Run ``test`` once in a fresh directory; its record (the output kept under ``keep`` if it failed)."""
    work = Path(tempfile.mkdtemp(prefix=f"stress-{i}-"))
    start = time.time()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "--rootdir", str(REPO),
                           "--basetemp", str(work / "tmp"), test], cwd=work, capture_output=True, text=True,
                          preexec_fn=allow_cores)
    output = done.stdout + done.stderr
    cores = [str(p) for p in work.rglob("core*") if p.is_file()]
    record = {"run": i, "exit_code": done.returncode, "seconds": round(time.time() - start, 1),
              "loadavg_1min": round(os.getloadavg()[0], 2), "fatal_line": bool(FATAL.search(output)), "cores": cores}
    if done.returncode != 0 or cores or record["fatal_line"]:
        keep.mkdir(parents=True, exist_ok=True)
        (keep / f"run{i}.txt").write_text(output)
        for core in cores:
            shutil.move(core, keep / f"run{i}.{Path(core).name}")
    shutil.rmtree(work, ignore_errors=True)
    return record


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("test", help="a pytest node id, relative to the repository")
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--keep", type=Path, default=Path(tempfile.gettempdir()) / "osft-stress", help="failed runs' output")
    args = p.parse_args(argv)
    runs: list[dict] = []
    bad = 0
    for i in range(1, args.runs + 1):
        runs.append(one_run(str(REPO / args.test), args.keep, i))
        r = runs[-1]
        print(f"run {i}: exit {r['exit_code']} in {r['seconds']} s, load {r['loadavg_1min']}"
              + (" FATAL" if r["fatal_line"] or r["cores"] else ""), flush=True)
        bad = write_results(args.out, args.test, args.runs, runs)  # after every run: a cut-short series keeps its record
    print(f"{len(runs)} runs, {bad} failed; wrote {args.out}")
    return 1 if bad else 0


def write_results(out: Path, test: str, planned: int, runs: list[dict]) -> int:
    """Write the record of ``runs`` (of ``planned``) to ``out``; returns how many failed."""
    bad = [r for r in runs if r["exit_code"] != 0 or r["fatal_line"] or r["cores"]]
    seconds = sorted(r["seconds"] for r in runs)
    record = {"benchmark": "stress_test", "test": test, "rev": git_revision(REPO), "machine": machine_info(),
              "runs": runs, "summary": {"runs": len(runs), "planned": planned, "failed": len(bad),
                                        "crashed": sum(r["fatal_line"] or bool(r["cores"]) for r in runs),
                                        "median_s": seconds[len(seconds) // 2],
                                        "median_loadavg": sorted(r["loadavg_1min"] for r in runs)[len(runs) // 2]}}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    return len(bad)


if __name__ == "__main__":
    sys.exit(main())
