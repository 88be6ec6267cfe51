"""The run directory (``--output-dir``): the only interface between a job and its watchers.

Layout and ``run.json`` fields: docs/architecture.md section 3.
"""

from __future__ import annotations

import json
import os
import re
import time
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
        (:class:`.ownership.Heartbeat`), so a launcher on another host can tell it runs."""
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
        """Merge ``fields`` into ``run.json`` (atomically) and return the new content."""
        data = json.loads(self.run_json.read_text()) if self.run_json.exists() else {}
        data.update(fields)
        data["updated_at"] = time.time()
        write_json_atomic(self.run_json, data)
        return data
