"""The run directory (``--output-dir``): the only interface between a job and its watchers, and
the one reader and writer of a launcher's state file (``run.json``, :class:`LauncherRecord`).

Layout and ``run.json`` fields: docs/architecture.md section 3.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .contract import CONTROL_EVALUATE

#: Name of a complete checkpoint directory under :attr:`RunDir.checkpoints` (docs/architecture.md section 5);
#: group 1 is the optimizer step it was saved after.
STEP_DIR = re.compile(r"^step_(\d+)$")
#: Name of a node's metrics file under :attr:`RunDir.metrics` (:func:`metrics_file_name`); group 1 is the node rank.
NODE_METRICS = re.compile(r"^node(\d+)\.jsonl$")


def metrics_file_name(node_rank: int, rank: int | None = None) -> str:
    """The metrics file of a writer (docs/architecture.md section 4): ``node<N>.jsonl`` for node N's
    local rank 0 (``rank`` None), ``rank<R>.jsonl`` for global rank R, any other rank."""
    return f"node{node_rank}.jsonl" if rank is None else f"rank{rank}.jsonl"


def write_text_atomic(path: Path, text: str) -> None:
    """Write UTF-8 ``text`` to ``path`` through a temporary sibling and ``os.replace``, so readers never
    see a half-written file."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON to ``path`` atomically (see :func:`write_text_atomic`)."""
    write_text_atomic(path, json.dumps(data, indent=2, default=str) + "\n")


@dataclass(kw_only=True, eq=False)
class LauncherRecord:
    """One launcher's state file, ``run.json`` (node 0) or ``run.node<N>.json``: each field is a key
    of the file, None where the file has none yet. Written piecewise by :meth:`RunDir.update_run_json`
    (``trainer/launch/cli.py::run_training``, the launcher), read by the ownership check and the dashboard.
    Units: unix seconds."""

    argv: list[str] | None = None  # the launcher's command line, program first (the dashboard relaunches it)
    config: dict | None = None  # TrainConfig.to_json()
    job_id: str | None = None
    launcher_pid: int | None = None
    hostname: str | None = None
    torchrun_pids: list[int] | None = None  # [] until torchrun started (and for an in-process run)
    nnodes: int | None = None
    nproc_per_node: int | None = None
    start_time: float | None = None
    state: str | None = None  # a contract.RunState
    exit_code: int | None = None
    launcher_create_time: float | None = None  # with launcher_pid: tells a live launcher from a reused pid
    slurm_job_id: str | None = None
    torchrun_cmd: list[str] | None = None
    export_dir: str | None = None  # the final export, with state completed
    reason: str | None = None  # run_finished's reason
    updated_at: float | None = None  # set on every write

    @classmethod
    def from_json(cls, data: dict) -> LauncherRecord:
        """The record of a state file's object (keys this version does not know are ignored)."""
        return cls(**{k: data[k] for k in _RECORD_KEYS if k in data})


_RECORD_KEYS = tuple(f.name for f in dataclasses.fields(LauncherRecord))


def read_state_file(path: Path) -> dict:
    """The JSON object of a launcher's state file, as written.

    Raises:
        OSError: it cannot be read (FileNotFoundError: not written yet).
        ValueError: it is not JSON (``json.JSONDecodeError``), or not an object.
    """
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"not a JSON object but {type(data).__name__}")
    return data


def read_launcher_record(path: Path) -> LauncherRecord:
    """:func:`read_state_file` as a :class:`LauncherRecord` (raises as it does)."""
    return LauncherRecord.from_json(read_state_file(path))


class RunDir:
    """Paths inside a run directory, created on demand.

    ``node_rank`` selects the launcher's own state file: node 0 writes ``run.json``, node N > 0
    ``run.node<N>.json``, so launchers of a multi-node job sharing the directory never overwrite
    each other.
    """

    def __init__(self, root: str | Path, node_rank: int = 0) -> None:
        self.root = Path(root)
        self.node_rank = node_rank

    @property
    def run_json(self) -> Path:
        return self.root / ("run.json" if self.node_rank == 0 else f"run.node{self.node_rank}.json")

    @property
    def heartbeat(self) -> Path:
        """``.heartbeat.node<N>.json``: rewritten by this node's running launcher every few seconds
        (:class:`osft.trainer.launch.ownership.Heartbeat`), so a launcher on another host can tell it runs."""
        return self.root / f".heartbeat.node{self.node_rank}.json"

    @property
    def config_yaml(self) -> Path:
        """``config.yaml``: the resolved config of the latest launch, written by node 0's launcher;
        ``osft-train --config <run>/config.yaml`` launches the same run again."""
        return self.root / "config.yaml"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics"

    def node_metrics(self, node_rank: int | None = None) -> Path:
        """``metrics/node<N>.jsonl`` of node ``node_rank`` (default: this node's)."""
        return self.metrics / metrics_file_name(self.node_rank if node_rank is None else node_rank)

    @property
    def checkpoints(self) -> Path:
        """``full_state_checkpoints/``: ``step_<N>`` directories, complete only with a manifest."""
        return self.root / "full_state_checkpoints"

    def hf_export(self, step: int) -> Path:
        """``hf_format/step_<N>``: dense Hugging Face export after optimizer step N."""
        return self.root / "hf_format" / f"step_{step}"

    @property
    def hf_best(self) -> Path:
        """``hf_format/best``: the export of the best evaluation (``--save-best-eval``, ``--max-forgetting``)."""
        return self.root / "hf_format" / "best"

    @property
    def control(self) -> Path:
        """``control/``: requests from a watcher on another host (docs/architecture.md section 6)."""
        return self.root / "control"

    @property
    def evaluate_request(self) -> Path:
        """``control/evaluate``: asks the run to evaluate at its next step boundary (then removed)."""
        return self.control / CONTROL_EVALUATE

    def worker_config(self, job_id: str) -> Path:
        """``logs/node<N>/config-<job>.yaml``: the resolved config this node's launcher of job ``job``
        hands its torchrun worker group (``osft.trainer.worker --config``)."""
        return self.root / "logs" / f"node{self.node_rank}" / f"config-{job_id}.yaml"

    def launcher_log(self, node_rank: int) -> Path:
        """``logs/launcher.node<N>.log``: the output of node N's launcher when osft-tui started it
        (torchrun's report of failed ranks included)."""
        return self.root / "logs" / f"launcher.node{node_rank}.log"

    @property
    def data_report(self) -> Path:
        """``data_report.json``: validation and overlong-policy counts of the training data."""
        return self.root / "data_report.json"

    def create(self) -> None:
        """Create the root, ``metrics/`` and ``control/``."""
        self.metrics.mkdir(parents=True, exist_ok=True)
        self.control.mkdir(exist_ok=True)

    def update_run_json(self, **fields: Any) -> dict:
        """Merge ``fields`` (:class:`LauncherRecord` field names) into this node's state file
        (atomically; keys not given keep their values) and return the new content.

        Raises:
            TypeError: a name that is no :class:`LauncherRecord` field.
        """
        unknown = set(fields) - set(_RECORD_KEYS)
        if unknown:
            raise TypeError(f"not a run.json field: {', '.join(sorted(unknown))}")
        data = read_state_file(self.run_json) if self.run_json.exists() else {}
        data.update(fields)
        data["updated_at"] = time.time()
        write_json_atomic(self.run_json, data)
        return data
