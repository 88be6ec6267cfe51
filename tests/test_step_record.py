"""The memory fields of the ``step`` record: this process's, and on CUDA every GPU of the node
(``gpus``, what the dashboard's rank table shows). This machine has no GPU: the CUDA reads
(``gpu_sample``) are stood in for, and the ranks' ``all_gather`` (``gather_rows``) where the
test needs several ranks; NVML's refusal is real (a CPU build of torch cannot read it)."""

from __future__ import annotations

import torch

from osft.trainer.observe import step_record
from osft.trainer.observe.step_record import StepRecorder


class Recorded:
    """What the recorder uses of a :class:`osft.trainer.observe.metrics.Reporter`, kept."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.records: list[tuple[str, dict]] = []

    def say(self, message: str) -> None:
        self.lines.append(message)

    def log(self, event: str, **fields) -> None:
        self.records.append((event, fields))


#: Global ranks 0, 1 on node 0 and 2, 3 on node 1: (local rank, peak bytes, utilisation, -1: none).
ROWS = [[0, 1e9, 20.0], [1, 2e9, 30.0], [0, 3e9, 57.0], [1, 4e9, -1.0]]


def test_a_cuda_step_record_lists_every_gpu_of_its_node(monkeypatch):
    monkeypatch.setattr(step_record, "nvml_readable", lambda device: None)
    monkeypatch.setattr(step_record, "gpu_sample", lambda device, utilization: (3 * 10**9, 57.0))
    sent = []
    monkeypatch.setattr(step_record, "gather_rows", lambda row: sent.append(row) or ROWS)
    report = Recorded()
    recorder = StepRecorder(None, [0, 0, 1, 1], 1, 0, torch.device("cuda"), report)  # rank 2: node 1, local rank 0
    recorder.log(5, 0, 0, {"loss": 1.0})
    assert sent == [[0, 3 * 10**9, 57.0]]
    (event, fields), = report.records
    assert event == "step" and fields["gpu_mem_bytes"] == 3 * 10**9 and fields["loss"] == 1.0
    assert fields["gpus"] == [{"rank": 2, "local_rank": 0, "mem_bytes": 3 * 10**9, "util_pct": 57.0},
                              {"rank": 3, "local_rank": 1, "mem_bytes": 4 * 10**9, "util_pct": None}]
    assert report.lines == []


def test_without_nvml_the_utilisation_is_none_and_said_once(monkeypatch):
    monkeypatch.setattr(step_record, "gpu_sample", lambda device, utilization: (10**9, 1.0 if utilization else None))
    report = Recorded()
    recorder = StepRecorder(None, [0], 0, 0, torch.device("cuda"), report)
    recorder.log(1, 0, 0, {})
    recorder.log(2, 0, 0, {})
    assert len(report.lines) == 1 and report.lines[0].startswith("GPU utilisation not recorded (")
    assert "pip install 'osft[gpu]'" in report.lines[0]
    assert [f["gpus"] for _, f in report.records] == [[{"rank": 0, "local_rank": 0, "mem_bytes": 10**9,
                                                        "util_pct": None}]] * 2


def test_a_cpu_step_record_has_no_gpu_fields():
    report = Recorded()
    StepRecorder(None, [0], 0, 0, torch.device("cpu"), report).log(1, 0, 0, {})
    (_, fields), = report.records
    assert fields["gpus"] is None and fields["gpu_mem_bytes"] is None and fields["rss_bytes"] > 0
    assert report.lines == []
