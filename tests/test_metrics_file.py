"""Bounded readers of metrics JSONL files: block-wise in order, from the end, decimated series."""

import json

from osft.trainer.observe import metrics_file
from osft.trainer.contract import read_records
from osft.trainer.observe.metrics_file import decimate, iter_records, tail_records
from osft.trainer.observe.outcome import read_outcome
from osft.trainer.observe.plot import run_series
from osft.trainer.rundir import RunDir


def _write(path, records, bad_at=(), partial=True):
    lines = [json.dumps(r) for r in records]
    for i in bad_at:
        lines.insert(i, "{broken")
    path.write_text("\n".join(lines) + "\n" + ('{"event": "step", "st' if partial else ""))
    return path


def test_block_readers_give_what_the_whole_file_reader_gives(tmp_path, monkeypatch):
    """With blocks far smaller than the file (lines cut by every block boundary), the records in
    order, the malformed lines with their numbers, and the records from the end are exactly
    read_records' (the partly written last line left out)."""
    monkeypatch.setattr(metrics_file, "BLOCK_BYTES", 97)
    records = [{"event": "step", "step": i, "loss": 1.0 / (i + 1), "pad": "x" * (i % 13)} for i in range(300)]
    path = _write(tmp_path / "node0.jsonl", records, bad_at=(5, 200))
    expected, expected_problems = read_records(path)
    problems = []
    assert list(iter_records(path, problems)) == expected == records
    assert problems == expected_problems and [p.split(":")[1] for p in problems] == ["6", "201"]
    assert list(tail_records(path)) == expected[::-1]
    assert list(tail_records(_write(tmp_path / "empty.jsonl", [], partial=True))) == []


def test_decimation_keeps_the_extremes_and_the_ends_within_the_point_budget():
    steps = list(range(1, 100_001))
    values = [((s * 7919) % 1000) / 10 for s in steps]
    values[54_321] = -5.0
    xs, ys = decimate(steps, values, max_points=400)
    assert len(xs) <= 400 and xs == sorted(xs) and xs[0] == 1 and xs[-1] == 100_000
    assert min(ys) == -5.0 and max(ys) == max(values)
    assert all(values[x - 1] == y for x, y in zip(xs, ys, strict=True))
    assert decimate([1, 2], [3.0, 4.0], max_points=400) == ([1, 2], [3.0, 4.0])


def test_a_long_run_is_plotted_decimated_and_its_outcome_read_from_the_end(tmp_path, monkeypatch):
    run = tmp_path / "run"
    (run / "metrics").mkdir(parents=True)
    base = {"ts": 1.0, "node_rank": 0, "job_id": "j2"}
    records = [dict(base, event="run_started", job_id="j1", config={}), dict(base, event="step", job_id="j1", step=1)]
    records += [dict(base, event="run_started", config={})]
    records += [dict(base, event="step", step=s, loss=10.0 - s / 1e4, lr=1e-4, node_tokens_per_s=1.0,
                     ortho_max_dev_deg=None, ortho_violations=0) for s in range(1, 20_001)]
    records += [dict(base, event="checkpoint_saved", step=20_000, path="ck"),
                dict(base, event="run_finished", step=20_000, reason="completed", exit_code=0)]
    path = _write(run / "metrics" / "node0.jsonl", records)
    series = run_series(run)
    assert len(series.loss.steps) <= metrics_file.MAX_POINTS
    assert series.loss.steps[0] == 1 and series.loss.steps[-1] == 20_000 and series.loss.values[-1] == 8.0
    read = []
    monkeypatch.setattr(metrics_file, "_record", lambda line, original=metrics_file._record: read.append(1) or original(line))
    outcome = read_outcome(RunDir(run), "j2", 0, "export")
    assert (outcome.step, outcome.checkpoint, outcome.last_step["step"]) == (20_000, "ck", 20_000)
    assert len(read) == 3 and path.stat().st_size > 2 * metrics_file.BLOCK_BYTES  # the last block only
