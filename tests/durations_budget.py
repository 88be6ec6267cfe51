"""How long the test suite took, by kind and by file, against its time budget.

``tests/conftest.py`` records every test's time (setup + call + teardown, s), its CPU seconds (the
test's process and every process it started and reaped, with theirs: ``cpu_s``), when it started
and ended (``start_s``, ``end_s``: s after the session's start) on which xdist worker, and its kind, and
writes them to ``.pytest_cache/osft-durations.json`` at the end of each pytest session; at the
end of the run it prints :func:`report` in pytest's summary. Run this file to print the report of
the last session again::

    .venv/bin/python tests/durations_budget.py [--top 30] [--file .pytest_cache/osft-durations.json]

It only warns: timings are noisy on a shared machine, so speed is measured here, never asserted.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

DEFAULT_FILE = Path(__file__).resolve().parents[1] / ".pytest_cache" / "osft-durations.json"

#: Wall-clock budget of one pytest session per tier, s (make test, make test-unit), on 2 cores.
BUDGET_S = {"full": 12 * 60, "unit": 2 * 60}

#: Test kinds, by marker (the first that a test carries), as in tests/README.md.
KINDS = ("long", "demo", "bench", "torchrun", "tui_process", "subprocess", "unit")


def kind_of(markers: set[str]) -> str:
    """The kind of a test with these marker names: the first of :data:`KINDS` it carries, else unit."""
    return next((k for k in KINDS[:-1] if k in markers), "unit")


def report(data: dict, top: int = 8) -> list[str]:
    """Lines of the report for one session's recorded ``data`` (see the conftest hook): the total
    against the tier's budget, seconds per kind, the slowest files and the slowest tests."""
    tests = data["tests"]
    tier = data.get("tier", "full")
    budget = BUDGET_S.get(tier, BUDGET_S["full"])
    wall = data["wall_s"]
    lines = [f"osft test time: {wall:.0f} s wall for {len(tests)} tests, budget {budget} s ({tier} tier)"
             + (f" -- OVER BUDGET by {wall - budget:.0f} s: share runs between tests (tests/README.md)" if wall > budget else "")]
    by_kind: dict[str, list[float]] = defaultdict(list)
    cpu_by_kind: dict[str, float] = defaultdict(float)
    by_file: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for t in tests:
        cpu = t.get("cpu_s", 0.0)
        by_kind[t["kind"]].append(t["seconds"])
        cpu_by_kind[t["kind"]] += cpu
        by_file[t["nodeid"].split("::")[0]][0] += t["seconds"]
        by_file[t["nodeid"].split("::")[0]][1] += cpu
    lines.append("  by kind:       " + ", ".join(f"{k} {sum(v):.0f} s ({len(v)} tests, {cpu_by_kind[k]:.0f} CPU-s)"
                                                 for k, v in sorted(by_kind.items(), key=lambda kv: -sum(kv[1]))))
    lines.append(f"  CPU: {sum(cpu_by_kind.values()):.0f} CPU-s in tests and the processes they started")
    ends: dict[str, float] = defaultdict(float)
    for t in tests:
        if "worker" in t:
            ends[t["worker"]] = max(ends[t["worker"]], t["end_s"])
    if len(ends) > 1:
        lines.append("  workers' last test ended at " + ", ".join(f"{w} {e:.0f} s" for w, e in sorted(ends.items()))
                     + f" (one worker alone for the last {max(ends.values()) - min(ends.values()):.0f} s)")
    lines.append("  slowest files (wall s, CPU-s):")
    lines += [f"    {s:7.1f} s {c:7.1f}  {f}" for f, (s, c) in sorted(by_file.items(), key=lambda kv: -kv[1][0])[:top]]
    lines.append("  slowest tests (wall s, CPU-s):")
    lines += [f"    {t['seconds']:7.1f} s {t.get('cpu_s', 0.0):7.1f}  {t['kind']:<11}  {t['nodeid']}"
              for t in sorted(tests, key=lambda t: -t["seconds"])[:top]]
    return lines


def main(argv: list[str] | None = None) -> int:
    """Print the report of the last recorded session (always exit code 0)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--file", type=Path, default=DEFAULT_FILE)
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args(argv)
    if not args.file.is_file():
        print(f"no recorded test durations at {args.file}: run pytest first")
        return 0
    print("\n".join(report(json.loads(args.file.read_text()), top=args.top)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
