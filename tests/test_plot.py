"""`osft-train plot RUN_DIR`: a PNG of a run's metrics, the latest segment of a resumed run winning."""

import json
import struct
import sys

from osft.trainer.launch.cli import main
from osft.trainer.observe.plot import run_series


def record(event, node, **fields):
    return {"ts": 1.0, "event": event, "node_rank": node, "rank": 2 * node, "local_rank": 0, "world_size": 4,
            "hostname": f"host{node}", "job_id": "j", **fields}


def step(node, n, loss, violations=0, dev=1e-4):
    return record("step", node, step=n, epoch=0, lr=1e-4 * n, loss=loss, grad_norm=1.0, num_tokens=100,
                  node_tokens_per_s=1000.0 * (node + 1) + n, tokens_per_s=3000.0 + n, ortho_violations=violations,
                  ortho_max_dev_deg=dev)


def segments(node):
    """Segment 1: steps 1-6, a checkpoint of step 3, then a crash. Segment 2: resumed from step 3,
    steps 4-5 (new values), a checkpoint of step 5, stopped: segment 1's step 6 is superseded too."""
    first = [record("run_started", node, pid=1, config={"ortho_margin_deg": 1.0})]
    first += [step(node, n, 10.0 - n) for n in (1, 2, 3)]
    first += [record("checkpoint_saved", node, step=3, path="p3", bytes=1, seconds=0.1)]
    first += [step(node, 4, 6.0, violations=2, dev=1.5), step(node, 5, 5.0), step(node, 6, 4.0, dev=None)]
    second = [record("run_started", node, pid=2, config={"ortho_margin_deg": 1.0}),
              record("resumed", node, from_step=3, path="p3"),
              step(node, 4, 6.5), step(node, 5, 5.5, violations=1, dev=2.0),
              record("checkpoint_saved", node, step=5, path="p5", bytes=1, seconds=0.1),
              record("run_finished", node, reason="stopped", exit_code=75, step=5)]
    return first + second


def write_run(root):
    metrics = root / "metrics"
    metrics.mkdir(parents=True)
    for node in (0, 1):
        lines = [json.dumps(r) for r in segments(node)]
        if node == 1:
            lines.insert(2, "{not json")
        text = "\n".join(lines) + "\n"
        if node == 1:
            text += '{"event": "step", "step": 9'  # partly written last line: left out, not reported
        (metrics / f"node{node}.jsonl").write_text(text)
    (metrics / "rank1.jsonl").write_text(json.dumps(record("warning", 0, message="w")) + "\n")
    return root


def png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_plot_draws_the_latest_segment_with_checkpoints_and_resumes(tmp_path, capsys):
    run = write_run(tmp_path / "run")
    assert main(["plot", str(run)]) == 0
    assert png_size(run / "plot.png") == (1000, 1000)
    err = capsys.readouterr().err
    assert f"{run / 'metrics' / 'node1.jsonl'}:3: malformed record skipped" in err and "plot.png" in err

    data = run_series(run)
    assert data.loss.steps == [1, 2, 3, 4, 5]
    assert data.loss.values == [9.0, 8.0, 7.0, 6.5, 5.5]
    assert data.lr.values == [1e-4 * n for n in (1, 2, 3, 4, 5)]
    assert sorted(data.node_tokens_per_s) == [0, 1]
    assert data.node_tokens_per_s[1].steps == [1, 2, 3, 4, 5]
    assert data.node_tokens_per_s[1].values == [2001.0, 2002.0, 2003.0, 2004.0, 2005.0]
    assert data.ortho_max_dev_deg.values == [1e-4, 1e-4, 1e-4, 1e-4, 2.0]
    assert data.violation_steps == [5]  # segment 1's violations at step 4 were superseded
    assert data.checkpoints == [3, 5] and data.resumes == [3]
    assert data.ortho_margin_deg == 1.0
    assert len(data.problems) == 1

    out = tmp_path / "pictures" / "x.png"
    assert main(["plot", str(run), "--out", str(out)]) == 0
    assert png_size(out) == (1000, 1000)


def test_plot_errors_are_input_errors(tmp_path, capsys, monkeypatch):
    assert main(["plot", str(tmp_path / "missing")]) == 2
    assert "not a directory" in capsys.readouterr().err
    (tmp_path / "empty" / "metrics").mkdir(parents=True)
    (tmp_path / "empty" / "metrics" / "node0.jsonl").write_text(json.dumps(record("run_started", 0)) + "\n")
    assert main(["plot", str(tmp_path / "empty")]) == 2
    assert "no step records" in capsys.readouterr().err
    run = write_run(tmp_path / "run")
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert main(["plot", str(run)]) == 2
    assert "pip install 'osft[plot]'" in capsys.readouterr().err
    assert not (run / "plot.png").exists()


def test_plot_draws_evaluation_loss_and_forgetting_of_the_latest_segment(tmp_path):
    """Evaluations at steps 0, 2 and 4 of segment 1; the resume from step 3 supersedes step 4's."""
    def evaluation(n, name, kind, loss, forgetting=None):
        return record("eval", 0, step=n, set=name, kind=kind, eval_loss=loss, forgetting=forgetting)

    rows = segments(0)
    for started in (r for r in rows if r["event"] == "run_started"):
        started["config"]["max_forgetting"] = 0.5
    at = rows.index(next(r for r in rows if r["event"] == "resumed"))
    first = [evaluation(n, "eval", "eval", 3.0 - n / 10) for n in (0, 2, 4)]
    first += [evaluation(n, "chat", "retention", 2.0 + n / 10, n / 10) for n in (0, 2, 4)]
    rows = rows[:1] + first + rows[1:at + 1] + [evaluation(4, "eval", "eval", 2.5)] + rows[at + 1:]
    metrics = tmp_path / "run" / "metrics"
    metrics.mkdir(parents=True)
    (metrics / "node0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = run_series(tmp_path / "run")
    assert (data.eval_loss["eval"].steps, data.eval_loss["eval"].values) == ([0, 2, 4], [3.0, 2.8, 2.5])
    assert (data.forgetting["chat"].steps, data.forgetting["chat"].values) == ([0, 2], [0.0, 0.2])
    assert data.max_forgetting == 0.5
    assert main(["plot", str(tmp_path / "run")]) == 0
    assert png_size(tmp_path / "run" / "plot.png") == (1000, 1000)
