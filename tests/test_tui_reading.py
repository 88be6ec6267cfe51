"""osft-tui's reading layer on real files: incremental tails, the run model, the launch command lines."""

from __future__ import annotations

import json
import os
from pathlib import Path

from osft.trainer.checkpoint.manifest import describe_files, write_manifest
from osft.tui.launch import RunSpec, resume_argv
from osft.tui.tail import JsonlTail, LogTail
from osft.tui.watcher import RunWatcher


def _append(path: Path, text: str) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(text)


def test_jsonl_tail_holds_a_partial_line_and_reports_a_malformed_one_once(tmp_path):
    path = tmp_path / "node0.jsonl"
    tail = JsonlTail(path)
    assert tail.poll().records == []  # no file yet
    _append(path, '{"event": "step", "step": 1}\n{"event": "st')
    first = tail.poll()
    assert [r["step"] for r in first.records] == [1] and first.problems == []
    _append(path, 'ep", "step": 2}\nnot json\n[1, 2]\n')
    second = tail.poll()
    assert [r["step"] for r in second.records] == [2]
    assert len(second.problems) == 2
    assert second.problems[0].startswith(f"{path}:3: malformed record skipped")
    assert second.problems[1] == f"{path}:4: malformed record skipped (not a JSON object)"
    _append(path, '{"event": "step", "step": 3}\n')
    third = tail.poll()
    assert [r["step"] for r in third.records] == [3] and third.problems == []  # reported once
    assert tail.records_read == 3


def test_jsonl_tail_reads_a_big_backlog_in_bounded_chunks_without_loss_or_duplicates(tmp_path):
    path = tmp_path / "node0.jsonl"
    path.write_text("".join(json.dumps({"event": "step", "step": i, "pad": "x" * (i % 37)}) + "\n" for i in range(5000)))
    tail = JsonlTail(path, chunk=4096)
    steps, polls = [], 0
    while True:
        batch = tail.poll()
        polls += 1
        if not batch.records:
            break
        steps += [r["step"] for r in batch.records]
    assert steps == list(range(5000))
    assert polls > 50  # a poll never read more than its chunk


def test_jsonl_tail_rereads_a_replaced_file(tmp_path):
    path = tmp_path / "node0.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n')
    tail = JsonlTail(path)
    assert len(tail.poll().records) == 2
    replacement = tmp_path / "new.jsonl"
    replacement.write_text('{"step": 7}\n')
    os.replace(replacement, path)
    assert [r["step"] for r in tail.poll().records] == [7]


def test_log_tail_keeps_the_newest_lines_and_skips_a_flood(tmp_path):
    path = tmp_path / "stderr.log"
    tail = LogTail(path, max_lines=5, chunk=1000)
    _append(path, "".join(f"line {i}\n" for i in range(3)) + "partial")
    assert tail.poll() == ["line 0", "line 1", "line 2"]
    _append(path, " end\n" + "".join(f"flood {i:06d}\n" for i in range(10_000)))
    new = tail.poll()
    assert new == [f"flood {i:06d}" for i in range(9995, 10_000)]
    assert list(tail.lines) == new
    assert tail.skipped_bytes > 100_000  # the flood's older part was skipped, not read
    _append(path, "after\n")
    assert tail.poll() == ["after"]


def _step(node: int, step: int, tps: float, violations: int = 0, total: int = 0, dev: float = 0.01) -> dict:
    return {"ts": 1000.0 + step, "event": "step", "node_rank": node, "rank": node * 2, "local_rank": 0,
            "world_size": 4, "hostname": f"host{node}", "job_id": "j", "step": step, "epoch": 0, "lr": 1e-5,
            "loss": 3.0 - step / 10, "grad_norm": 1.0, "num_tokens": 100, "num_loss_tokens": 80, "num_samples": 4,
            "step_time_s": 2.0, "tokens_per_s": 2 * tps, "node_tokens_per_s": tps, "samples_per_s": 2.0,
            "ortho_violations": violations, "ortho_violations_total": total, "ortho_max_dev_deg": dev,
            "rss_bytes": 10**9, "gpu_mem_bytes": None}


def test_run_watcher_counts_violations_flags_a_straggler_and_estimates_the_eta(tmp_path):
    (tmp_path / "metrics").mkdir()
    (tmp_path / "run.json").write_text(json.dumps({"job_id": "j", "config": {"max_steps": 10}, "state": "running",
                                                   "start_time": 1000.0, "nproc_per_node": 2}))
    node0 = [_step(0, 1, 1000), _step(0, 2, 1000, 3, 3, 2.5), _step(0, 3, 1000, 0, 3)]
    node1 = [_step(1, 1, 1000), _step(1, 2, 700), _step(1, 3, 790)]
    (tmp_path / "metrics" / "node0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in node0))
    (tmp_path / "metrics" / "node1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in node1))
    w = RunWatcher(tmp_path)
    w.poll()
    assert (w.model.step, w.model.max_steps) == (3, 10)
    assert (w.model.violations.this_step, w.model.violations.total, w.model.violations.worst_dev_deg) == (0, 3, 2.5)
    assert w.model.violations.alert and w.model.violations.records_sum == 3
    assert w.model.stragglers() == {1}  # 790 < 0.8 * 1000
    assert w.model.nodes[1].tokens.values == [1000, 700, 790] and w.model.nodes[1].tokens.steps == [1, 2, 3]
    assert w.model.eta_s() == 7 * 2.0
    _append(tmp_path / "metrics" / "node1.jsonl", json.dumps(_step(1, 4, 810)) + "\n")
    w.poll()
    assert w.model.stragglers() == set()  # 810 >= 0.8 * 1000


def test_run_watcher_lists_complete_and_incomplete_checkpoints(tmp_path):
    root = tmp_path / "full_state_checkpoints"
    good = root / "step_4"
    good.mkdir(parents=True)
    (good / "a.bin").write_bytes(b"x" * 1234)
    write_manifest(good, describe_files(good, ["a.bin"], rank=0), step=4)
    broken = root / "step_6"
    broken.mkdir()
    (broken / "a.bin").write_bytes(b"x" * 10)
    write_manifest(broken, describe_files(broken, ["a.bin"], rank=1), step=6)
    (broken / "a.bin").write_bytes(b"x" * 5)  # truncated after the manifest
    (root / "step_8.tmp-job").mkdir()
    (root / "step_8.tmp-job" / "part").write_bytes(b"y" * 7)
    (root / "frozen_job-abc").mkdir()
    w = RunWatcher(tmp_path)
    w.poll()
    listed = [(e.step, e.complete, e.bytes) for e in w.model.checkpoints]
    on_disk = 5 + (broken / "manifest.json").stat().st_size  # an incomplete one counts what is on disk
    assert listed == [(8, False, 7), (6, False, on_disk), (4, True, 1234)]
    assert "being written" in w.model.checkpoints[0].note
    assert "rank 1's file a.bin" in w.model.checkpoints[1].note


def test_launch_command_lines(tmp_path):
    spec = RunSpec(model=str(tmp_path), data=str(tmp_path / "d.jsonl"), output_dir="runs/x", nnodes=2,
                   nproc_per_node=2, urr=0.5, learning_rate=1e-4, max_steps=7)
    (tmp_path / "d.jsonl").write_text("{}\n")
    assert spec.check() == []
    node0, node1 = spec.node_argvs()
    assert node0[:4] == ["--model-name-or-path", str(tmp_path), "--data-path", str(tmp_path / "d.jsonl")]
    assert "--on-demand-checkpointing" in node0
    assert node0[node0.index("--node-rank") + 1] == "0" and node1[node1.index("--node-rank") + 1] == "1"
    assert node0[node0.index("--rdzv-endpoint") + 1] == node1[node1.index("--rdzv-endpoint") + 1]
    bad = RunSpec(model=str(tmp_path / "missing"), data=str(tmp_path / "d.jsonl"), output_dir="x", urr=1.5)
    assert bad.check() == [f"model: {tmp_path / 'missing'} does not exist", "URR: 1.5 is not in (0, 1]"]
    assert RunSpec.demo().is_demo and RunSpec.demo().node_argvs()[0][0] == "demo"
    argv = ["--output-dir", "r", "--resume", "--resume-from-full-state-checkpoint", "old", "--max-steps", "9"]
    assert resume_argv(argv, Path("r/full_state_checkpoints/step_3")) == [
        "--output-dir", "r", "--max-steps", "9", "--resume-from-full-state-checkpoint", "r/full_state_checkpoints/step_3"]


def test_exit_code_of_a_rank_killed_by_a_signal_comes_from_torchruns_report(tmp_path):
    """A rank killed by SIGKILL (the OOM killer) writes nothing; torchrun's failure report, in the
    output of a launcher the dashboard started, has its exit code. The report here is formatted by
    torch's own ChildFailedError, so a change of torchrun's format fails this test."""
    from osft.tui.components.ranks import rank_state
    from osft.tui.processes import ProcStats
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    (tmp_path / "metrics").mkdir()
    (tmp_path / "run.json").write_text(json.dumps({"job_id": "j", "nproc_per_node": 2, "state": "failed"}))
    started = {"ts": 1.0, "event": "run_started", "node_rank": 1, "rank": 3, "local_rank": 1, "world_size": 4,
               "hostname": "h", "job_id": "j", "pid": 12345}
    (tmp_path / "metrics" / "rank3.jsonl").write_text(json.dumps(started) + "\n")
    report = ChildFailedError("osft.trainer.worker", {3: ProcessFailure(local_rank=1, pid=12345, exitcode=-9,
                                                                        error_file="/nonexistent")}).format_msg()
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "launcher.node0.log").write_text("$ osft-train ...\n" + report + "\n")
    w = RunWatcher(tmp_path)
    w.poll()
    assert w.model.ranks[3].exit_code == -9
    state = rank_state(w.model.ranks[3], ProcStats(False))
    assert state.plain == "killed by SIGKILL (exit code -9)" and state.spans[0].end == len("killed by SIGKILL")
    other = dict(started, rank=2, local_rank=0, pid=999)  # a pid the report does not name
    (tmp_path / "metrics" / "node1.jsonl").write_text(json.dumps(other) + "\n")
    w2 = RunWatcher(tmp_path)
    w2.poll()
    assert w2.model.ranks[2].exit_code is None


def test_cli_refuses_a_run_dir_that_does_not_exist(tmp_path, capsys):
    import pytest
    from osft.tui.cli import main

    with pytest.raises(SystemExit) as exc:
        main([str(tmp_path / "nope")])
    assert exc.value.code == 2
    assert f"{tmp_path / 'nope'}: not a directory" in capsys.readouterr().err


def test_a_long_run_is_shown_from_its_end_first_then_whole_with_no_line_twice(tmp_path):
    """5,000 step records of 1 KB: more than the quick look (2 MiB) and than one read of the
    history (4 MiB)."""
    from osft.tui import reader

    (tmp_path / "metrics").mkdir()
    (tmp_path / "run.json").write_text(json.dumps({"job_id": "j", "state": "running", "config": {"max_steps": 9000}}))
    path = tmp_path / "metrics" / "node0.jsonl"
    step = {"event": "step", "node_rank": 0, "rank": 0, "job_id": "j", "loss": 1.0, "step_time_s": 1.0, "pad": "x" * 900}
    with open(path, "w") as f:
        f.write(json.dumps({"event": "warning", "ts": 0.5, "rank": 0, "message": "an early warning"}) + "\n")
        for s in range(1, 5001):
            f.write(json.dumps({**step, "ts": float(s), "step": s}) + "\n")
    history = reader.History(str(tmp_path), poll_s=0.001)  # one read of the history per poll
    model, result = history.poll()
    assert model.step == 5000 and model.curves["loss"].steps[0] > 2500  # the end at once
    assert "reading the run's history" in result.events[0].text and history.quick is not None
    with open(path, "a") as f:  # a save while the history is read
        f.write(json.dumps({"event": "checkpoint_saved", "ts": 6000.0, "rank": 0, "step": 5000, "path": "/c",
                            "bytes": 1, "seconds": 1.0}) + "\n")
    events, records = list(result.events), list(result.checkpoint_records)
    for _ in range(200):
        model, result = history.poll()
        events += result.events
        records += result.checkpoint_records
        if history.quick is None:
            break
    assert history.quick is None and model.curves["loss"].steps[0] < 100  # the whole run
    assert [r["ts"] for r in records] == [6000.0] and model.step == 5000
    texts = [e.text for e in events]
    assert texts[-1].startswith("history read in ") and len(texts) == len(set(texts))
    assert "rank 0: warning: an early warning" not in texts  # history's lines are not events of now


def _long_run(root: Path, steps: int) -> None:
    """A run of ``steps`` step records of about 1 KB (node 0; node 1 every step too, shorter), with
    evaluations, a few steps with orthogonality violations, deviations that peak once early, and a
    resume from step 6,000 that replays steps 6,001 to 7,000."""
    (root / "metrics").mkdir(parents=True)
    (root / "run.json").write_text(json.dumps({"job_id": "j", "state": "running", "config": {"max_steps": steps}}))

    def step(node: int, s: int, segment: int) -> dict:
        return {"ts": 1e9 + s, "event": "step", "node_rank": node, "rank": node, "job_id": "j", "step": s,
                "loss": 3.0 - s / steps + 0.1 * segment, "lr": 1e-4 * (s % 7), "grad_norm": 1.0 + (s % 13) / 10,
                "node_tokens_per_s": 1000.0 + s % 101 + node, "step_time_s": 0.5,
                "ortho_violations": int(s in (777, 15_003)), "ortho_violations_total": (s >= 777) + (s >= 15_003),
                "ortho_max_dev_deg": 0.01 * (s % 17) + (5.0 if s == 3_333 else 0.0), "pad": "x" * 700}

    for node in (0, 1):
        with open(root / "metrics" / f"node{node}.jsonl", "w") as f:
            order = [(s, 0) for s in range(1, 7_001)] + [(s, 1) for s in range(6_001, steps + 1)]
            for s, segment in order:
                if (s, segment) == (6_001, 1):
                    f.write(json.dumps({"ts": 2e9, "event": "resumed", "node_rank": node, "rank": node,
                                        "from_step": 6_000}) + "\n")
                f.write(json.dumps(step(node, s, segment)) + "\n")
                if node == 0 and s % 2_000 == 0:
                    f.write(json.dumps({"ts": 1e9 + s, "event": "eval", "node_rank": 0, "rank": 0, "step": s,
                                        "set": "chat", "eval_loss": 2.0 - s / 1e5, "forgetting": s / 1e6}) + "\n")


def test_a_long_history_thinned_to_what_the_charts_keep_gives_the_full_reads_curves_and_counters(tmp_path):
    """Parsing before the last 2 MiB only the step records at multiples of a power of two (and
    those with violations or a new worst deviation) gives the curves and violation counters a
    read of every record gives, from far fewer records."""
    from osft.tui.reader import QUICK_BYTES

    _long_run(tmp_path, 20_000)

    def read(thin):
        watcher = RunWatcher(tmp_path, thin=thin)
        while True:
            watcher.poll(checkpoints=False)
            if watcher.backlog() == 0:
                return watcher

    full, thinned = read(None), read(QUICK_BYTES)
    assert [t.thinning for t in full._tails.values()] == [None, None]
    assert {t.thinning.every for t in thinned._tails.values()} == {32}
    a, b = full.model, thinned.model
    assert set(a.curves) == set(b.curves) == {"loss", "lr", "grad_norm", "eval_loss chat", "forgetting chat"}
    for name in a.curves:
        assert (a.curves[name].steps, a.curves[name].values) == (b.curves[name].steps, b.curves[name].values), name
    assert a.curves["loss"].stride == 128 and a.curves["loss"].values[-1] == 3.0 - 1 + 0.1  # the replay replaced
    for node in (0, 1):
        assert (a.nodes[node].tokens.steps, a.nodes[node].tokens.values) == \
            (b.nodes[node].tokens.steps, b.nodes[node].tokens.values)
        assert (a.nodes[node].step, a.nodes[node].loss) == (b.nodes[node].step, b.nodes[node].loss) == (20_000, 2.1)
    assert a.violations == b.violations and (b.violations.total, b.violations.last_at) == (2, 15_003)
    assert b.violations.worst_dev_deg == a.violations.worst_dev_deg == 5.0 + 0.01 * (3_333 % 17)
    assert a.step == b.step == 20_000
    # far fewer records parsed: the last 2 MiB of each file, and about one step record in 32 before
    read_full, read_thin = sum(a.records_read.values()), sum(b.records_read.values())
    assert read_full == 2 * 21_000 + 10 + 2 and read_thin < read_full / 4
