"""Structured metrics: one JSON object per line, appended and flushed per record (docs/architecture.md section 4).

Each node's LOCAL_RANK 0 writes ``metrics/node<N>.jsonl``; any other rank writes only its warnings
and errors, to ``metrics/rank<R>.jsonl``, so no two processes share a file and nothing a non-zero
local rank reports is swallowed by the gate
(tests/test_distributed.py::test_projection_modes_give_the_same_parameters_and_local_rank_1_warnings_reach_the_run_dir).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from ..contract import ALWAYS_RECORDED, Event
from ..distributed import DistEnv
from ..rundir import metrics_file_name

if TYPE_CHECKING:
    from .trackers import Tracker


def _clean(value: Any) -> Any:
    """Non-finite floats become null (JSON has no NaN); everything else passes through."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLogger:
    """Appends metrics records for one process.

    Args:
        metrics_dir: ``<output_dir>/metrics``.
        dist: this process's place in the job.
        job_id: identifier shared by every rank of the job.
        sinks: experiment trackers (:mod:`osft.trainer.observe.trackers`) that get every record written, closed with the logger.
    """

    def __init__(self, metrics_dir: Path, dist: DistEnv, job_id: str, sinks: Sequence[Tracker] = ()) -> None:
        self.dist = dist
        self.job_id = job_id
        self.sinks = list(sinks)
        metrics_dir.mkdir(parents=True, exist_ok=True)
        self.path = metrics_dir / metrics_file_name(dist.node_rank, None if dist.is_local_main else dist.rank)
        self._file: IO[str] | None = None

    def log(self, event: str, **fields: Any) -> None:
        """Append one record and hand it to the sinks; on a non-zero local rank only
        :data:`.contract.ALWAYS_RECORDED` events are kept. The record starts with
        :data:`.contract.RECORD_FIELDS`."""
        if not self.dist.is_local_main and event not in ALWAYS_RECORDED:
            return
        record = {
            "ts": time.time(),
            "event": event,
            "node_rank": self.dist.node_rank,
            "rank": self.dist.rank,
            "local_rank": self.dist.local_rank,
            "world_size": self.dist.world_size,
            "hostname": self.dist.hostname,
            "job_id": self.job_id,
        }
        record.update({k: _clean(v) for k, v in fields.items()})
        if self._file is None:
            self._file = open(self.path, "a", encoding="utf-8")
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        for sink in self.sinks:
            sink.record(record)

    def close(self) -> None:
        """Close the file and the sinks (idempotent)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        for sink in self.sinks:
            sink.close()
        self.sinks = []



@dataclass(frozen=True)
class Reporter:
    """How a component of a run speaks, without holding the trainer.

    ``say(message)``: one console line, printed by each node's local rank 0; ``warn(message)``: a
    ``warning`` record (:data:`.contract.Event.WARNING`, every rank keeps its own) and a console
    line; ``log(event, **fields)``: one metrics record (:meth:`MetricsLogger.log`); ``show(renderable)``:
    a rich table on this process's console (the caller decides which ranks show it).
    """

    say: Callable[[str], None]
    warn: Callable[[str], None]
    log: Callable[..., None]
    show: Callable[[Any], None]


def console_reporter(console, metrics: MetricsLogger) -> Reporter:
    """The :class:`Reporter` of one rank on a rich ``console``: ``say`` prints on each node's local
    rank 0 only (plain text, no markup), ``warn`` records the warning and prints it on every rank."""
    from rich.markup import escape

    def say(message: str) -> None:
        if metrics.dist.is_local_main:
            console.print(message, markup=False, highlight=False, soft_wrap=True)

    def warn(message: str) -> None:
        metrics.log(Event.WARNING, message=message)
        console.print("[yellow]warning:[/yellow]", escape(message), soft_wrap=True)

    return Reporter(say, warn, metrics.log, console.print)
