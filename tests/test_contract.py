"""The run-directory contract (trainer/contract.py): the one JSONL parser every metrics reader
uses, the fields every record carries, and the control files."""

from __future__ import annotations

import json
import signal

from osft.trainer.checkpoint.signals import CONTROL_ACTIONS, Action
from osft.trainer.contract import ALWAYS_RECORDED, CONTROL_FILES, RECORD_FIELDS, Event, parse_lines, read_records
from osft.trainer.distributed import DistEnv
from osft.trainer.observe.metrics import MetricsLogger
from osft.tui.tail import JsonlTail

#: A metrics file as a killed writer leaves it: a blank line, two malformed complete lines and a
#: partly written last line.
TEXT = ('{"event": "step", "step": 1}\n'
        '\n'
        '{"event": "st\n'
        '[1, 2]\n'
        '{"event": "step", "step": 2}\n'
        '{"event": "step", "st')


def test_read_records_leaves_out_a_partial_last_line_and_names_file_and_line_of_a_bad_one(tmp_path):
    path = tmp_path / "node0.jsonl"
    path.write_text(TEXT)
    records, problems = read_records(path)
    assert [r["step"] for r in records] == [1, 2]
    assert len(problems) == 2
    assert problems[0].startswith(f"{path}:3: malformed record skipped (Unterminated string")
    assert problems[1] == f"{path}:4: malformed record skipped (not a JSON object)"
    path.write_text(TEXT + 'ep": 3}\n')  # the writer finished its line
    assert [r["step"] for r in read_records(path)[0]] == [1, 2, 3]


def test_the_dashboards_tail_reports_what_read_records_reports(tmp_path):
    path = tmp_path / "node0.jsonl"
    path.write_text(TEXT)
    whole = read_records(path)
    tail = JsonlTail(path, chunk=7)  # many polls, lines split across them
    records, problems = [], []
    for _ in range(len(TEXT)):
        batch = tail.poll()
        records += batch.records
        problems += batch.problems
    assert (records, problems) == whole


def test_parse_lines_numbers_lines_from_first_line():
    batch = parse_lines([b'{"a": 1}', b"", b"nope", b'"text"'], "f.jsonl", first_line=10)
    assert batch.records == [{"a": 1}]
    assert [p.split(": malformed")[0] for p in batch.problems] == ["f.jsonl:12", "f.jsonl:13"]
    assert batch.problems[1].endswith("(not a JSON object)")


def test_metrics_logger_writes_the_record_fields_first_and_gates_by_local_rank(tmp_path):
    main = MetricsLogger(tmp_path, DistEnv(rank=0, local_rank=0, node_rank=0, world_size=2, hostname="h"), "job")
    other = MetricsLogger(tmp_path, DistEnv(rank=1, local_rank=1, node_rank=0, world_size=2, hostname="h"), "job")
    for logger in (main, other):
        logger.log(Event.STEP, step=1)
        logger.log(Event.WARNING, message="m")
        logger.close()
    node0 = [json.loads(line) for line in (tmp_path / "node0.jsonl").read_text().splitlines()]
    rank1 = [json.loads(line) for line in (tmp_path / "rank1.jsonl").read_text().splitlines()]
    assert [tuple(r)[: len(RECORD_FIELDS)] for r in node0] == [RECORD_FIELDS, RECORD_FIELDS]
    assert [r["event"] for r in node0] == ["step", "warning"]
    assert [r["event"] for r in rank1] == ["warning"] and Event.WARNING in ALWAYS_RECORDED
    assert node0[0]["step"] == 1 and rank1[0]["rank"] == 1 and rank1[0]["job_id"] == "job"


def test_a_control_file_asks_for_what_its_signal_asks_for():
    assert CONTROL_FILES == {signal.SIGUSR1: "checkpoint", signal.SIGUSR2: "checkpoint-and-exit"}
    assert CONTROL_ACTIONS == {"checkpoint": Action.CHECKPOINT, "checkpoint-and-exit": Action.CHECKPOINT_AND_EXIT}
