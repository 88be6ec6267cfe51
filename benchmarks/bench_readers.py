"""Readers of long runs: seconds and peak RSS of ``osft-train plot`` and of the run's outcome on a
metrics file of N step records, and the seconds osft-tui's reader (``tui/reader.py::History``)
takes to show the latest step and then the charts of the whole run.

The run directory is written at run time (never committed): one ``run_started``, N ``step``
records of about 1 KB each (the fields the loop writes, with OSFT indicators), a checkpoint every
1000 steps and a ``run_finished``. Each measurement is one fresh process (its ``ru_maxrss``, wall
and CPU seconds: on a shared machine the CPU seconds are what one free core would take);
``--baseline DIR`` measures another checkout (its own ``.venv``) side by side at
``--baseline-records``. The machine's load average is recorded beside each time.

    python benchmarks/bench_readers.py --records 20000 200000 --baseline /work/main \\
        --baseline-records 20000 --out benchmarks/results/bench_readers.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import git_revision

ROOT = Path(__file__).resolve().parent.parent
#: The dashboard's reader on the run: its first poll (the latest step), then polls of 1 s until
#: the whole history is read (what the charts then show: their points and first step).
_ATTACH = r"""
import json, sys, time
from osft.tui.reader import History
t0, c0 = time.perf_counter(), time.process_time()
history = History(sys.argv[1], poll_s=1.0)
model, _ = history.poll()
t1 = time.perf_counter()
assert model.step == int(sys.argv[2])
while history.quick is not None:
    model, _ = history.poll()
t2, c2 = time.perf_counter(), time.process_time()
loss = model.curves["loss"]
print(json.dumps(dict(attach_latest_s=t1 - t0, attach_history_s=t2 - t0, attach_cpu_s=c2 - c0,
                      chart_points=len(loss.steps), chart_first_step=loss.steps[0], chart_last_step=loss.steps[-1])))
"""
_CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
from osft.trainer.observe.plot import plot_run
from osft.trainer.observe.outcome import read_outcome
from osft.trainer.rundir import RunDir
run = sys.argv[1]
t1, c1 = time.perf_counter(), time.process_time()
plot_run(run)
t2, c2 = time.perf_counter(), time.process_time()
outcome = read_outcome(RunDir(run), "job", 0, None)
t3, c3 = time.perf_counter(), time.process_time()
assert outcome.step == int(sys.argv[2])
print(json.dumps(dict(import_s=t1 - t0, plot_s=t2 - t1, plot_cpu_s=c2 - c1, outcome_s=t3 - t2, outcome_cpu_s=c3 - c2,
                      ru_maxrss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)))
"""


def step_record(step: int) -> dict:
    """One step record of about 1 KB, shaped like the loop's."""
    indicators = {f"forgetting_{name}": 0.01 * (step % 97) for name in
                  ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")}
    return dict(ts=1.7e9 + step, event="step", node_rank=0, rank=0, local_rank=0, world_size=8,
                hostname="node-0.cluster.example", job_id="job", step=step, epoch=step // 5000,
                loss=2.0 + 1.0 / (1 + step / 1000) + 0.05 * ((step * 7919) % 13) / 13, grad_norm=0.8 + (step % 31) / 100,
                lr=2e-5 * min(1.0, step / 1000), num_tokens=524288, num_loss_tokens=301234, num_samples=256,
                step_time_s=1.234567, tokens_per_s=424867.123, node_tokens_per_s=53108.39, samples_per_s=207.4,
                mfu=0.4123, model_flops_per_s=1.234e15, matmul_peak_flops_per_s=3.0e15, padding_fraction=0.0123,
                micro_batches=8, max_micro_batch_tokens=65536, ortho_violations=int(step % 5000 == 0),
                ortho_max_dev_deg=1e-4 * (1 + step % 17) if step % 10 == 0 else None,
                memory_allocated_bytes=61234567890, memory_reserved_bytes=71234567890, **indicators)


def write_run(root: Path, records: int) -> Path:
    """A run directory with ``records`` step records in ``metrics/node0.jsonl``."""
    (root / "metrics").mkdir(parents=True)
    with open(root / "metrics" / "node0.jsonl", "w") as f:
        f.write(json.dumps(dict(ts=1.7e9, event="run_started", job_id="job", config={"ortho_margin_deg": 1.0})) + "\n")
        for step in range(1, records + 1):
            f.write(json.dumps(step_record(step)) + "\n")
            if step % 1000 == 0:
                f.write(json.dumps(dict(ts=1.7e9 + step, event="checkpoint_saved", job_id="job", step=step,
                                        path=f"checkpoints/step_{step}", bytes=1, seconds=1.0)) + "\n")
        f.write(json.dumps(dict(ts=1.8e9, event="run_finished", job_id="job", step=records, reason="completed",
                                exit_code=0)) + "\n")
    return root


def measure(python: Path, cwd: Path, run: Path, records: int) -> dict:
    before = os.getloadavg()[0]
    result = {}
    for child in (_CHILD, _ATTACH):  # one process each: the plot's peak RSS is its own
        done = subprocess.run([str(python), "-c", child, str(run), str(records)], cwd=cwd, capture_output=True,
                              text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), check=False)
        if done.returncode:
            raise SystemExit(f"{python} failed:\n{done.stderr[-3000:]}")
        result.update(json.loads(done.stdout.strip().splitlines()[-1]))
    result.update(load_avg_1m_before=before, load_avg_1m_after=os.getloadavg()[0])
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, nargs="+", default=[20_000, 200_000])
    parser.add_argument("--baseline", type=Path)
    parser.add_argument("--baseline-records", type=int, nargs="+", default=[20_000])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "bench_readers.json")
    args = parser.parse_args(argv)
    trees = [("this", ROOT)] + ([("baseline", args.baseline.resolve())] if args.baseline else [])
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-readers-") as tmp:
        for records in sorted(set(args.records) | (set(args.baseline_records) if args.baseline else set())):
            run = write_run(Path(tmp) / f"run{records}", records)
            size = (run / "metrics" / "node0.jsonl").stat().st_size
            for name, tree in trees:
                if records not in (args.baseline_records if name == "baseline" else args.records):
                    continue
                r = measure(tree / ".venv" / "bin" / "python", tree, run, records)
                r.update(tree=name, revision=git_revision(tree), records=records, file_bytes=size)
                print(json.dumps(r), flush=True)
                results.append(r)
    out = dict(benchmark="bench_readers", results=results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
