"""Experiment trackers (``--report-to``): global rank 0 sends every metrics record it writes to
TensorBoard, Weights & Biases and/or MLflow as well.

:class:`osft.trainer.observe.metrics.MetricsLogger` hands each record it writes to its sinks (:class:`Tracker`
instances, opened by :func:`open_trackers` on global rank 0 only), so the trackers get exactly the
JSONL records of docs/architecture.md section 4: ``step`` and ``eval`` records become scalars, every
other event a text entry. Neither package is a dependency; :func:`check_available` names the extra to install,
and imports what each tracker uses, so a broken install is refused before any rank starts.
"""

from __future__ import annotations

import json
import os
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from ..contract import RECORD_FIELDS, Event

#: ``--report-to`` choices: tracker name -> module that must be installed.
TRACKER_MODULES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
#: tracker name -> (module, attribute or None) the tracker imports when it opens.
TRACKER_IMPORTS = {"tensorboard": ("torch.utils.tensorboard", "SummaryWriter"), "wandb": ("wandb", None),
                   "mlflow": ("mlflow.tracking", "MlflowClient")}
REPORT_TO_CHOICES = ("none", *TRACKER_MODULES)

#: ``step`` record field -> tracker scalar name (the node's tokens/s is added per node).
STEP_SCALARS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "train/tokens_per_s",
    "ortho_violations": "osft/ortho_violations",
    "ortho_max_dev_deg": "osft/ortho_max_dev_deg",
    "osft_dw_rel_max": "osft/dw_rel_max",
    "osft_dw_rel_median": "osft/dw_rel_median",
    "osft_gap_max": "osft/gap_max",
    "osft_gap_median": "osft/gap_median",
}


def requested(report_to: list[str] | None) -> list[str]:
    """The trackers asked for by ``--report-to`` (``none`` and None mean none)."""
    return [name for name in dict.fromkeys(report_to or []) if name != "none"]


def check_available(report_to: list[str] | None) -> None:
    """Check that every requested tracker can be used: its package is installed, and what the
    tracker uses (:data:`TRACKER_IMPORTS`) imports.

    Raises:
        ValueError: ``none`` given with a tracker; a tracker's package is not installed (the
            message names the extra to install, e.g. ``pip install 'osft[tensorboard]'``), or it is
            installed but importing it fails (the message gives the exception).
    """
    import importlib

    names = requested(report_to)
    if names and "none" in (report_to or []):
        raise ValueError(f"--report-to none excludes other trackers, got {' '.join(report_to)}")
    for name in names:
        if find_spec(TRACKER_MODULES[name]) is None:
            raise ValueError(f"--report-to {name}: the {TRACKER_MODULES[name]} package is not installed; "
                             f"install it with: pip install 'osft[{name}]'")
        module, attribute = TRACKER_IMPORTS[name]
        try:
            loaded = importlib.import_module(module)
            if attribute:
                getattr(loaded, attribute)
        except Exception as exc:  # noqa: BLE001 - any failure of a broken install is the user's to fix
            raise ValueError(f"--report-to {name}: {TRACKER_MODULES[name]} is installed but cannot be imported "
                             f"({module}): {type(exc).__name__}: {exc}; repair it, e.g. pip install "
                             f"--force-reinstall 'osft[{name}]'") from None


def step_scalars(record: dict) -> dict[str, float]:
    """Scalars of one ``step`` record: :data:`STEP_SCALARS` plus ``train/node<N>_tokens_per_s``
    (tokens/s of the node that wrote the record); null fields are left out."""
    scalars = {name: record.get(field) for field, name in STEP_SCALARS.items()}
    scalars[f"train/node{record.get('node_rank', 0)}_tokens_per_s"] = record.get("node_tokens_per_s")
    return {name: float(value) for name, value in scalars.items() if value is not None}


def eval_scalars(record: dict) -> dict[str, float]:
    """Scalars of one ``eval`` record: ``eval/<set>/loss`` for the evaluation set,
    ``retention/<set>/loss`` and ``retention/<set>/forgetting`` for a retention set (nats per token);
    null fields are left out."""
    prefix = f"{'eval' if record.get('kind') == 'eval' else 'retention'}/{record.get('set')}"
    scalars = {f"{prefix}/loss": record.get("eval_loss"), f"{prefix}/forgetting": record.get("forgetting")}
    return {name: float(value) for name, value in scalars.items() if value is not None}


class Tracker:
    """A sink of metrics records; subclasses implement :meth:`scalars`, :meth:`event` and :meth:`close`.

    ``eval`` records become scalars at their step; other records than ``step`` are placed at their
    own ``step`` (``from_step`` for ``resumed``), else at the latest step seen.
    """

    def __init__(self) -> None:
        self.last_step = 0

    def record(self, record: dict) -> None:
        """Send one metrics record (a dict as written to the JSONL) to the tracker."""
        event = record["event"]
        if event == Event.STEP:
            self.last_step = int(record["step"])
            self.scalars(self.last_step, step_scalars(record), record["ts"])
            return
        if event == Event.EVAL:
            self.scalars(int(record["step"]), eval_scalars(record), record["ts"])
            return
        step = record.get("step", record.get("from_step"))
        fields = {k: v for k, v in record.items() if k not in RECORD_FIELDS}  # left out of event text
        self.event(self.last_step if step is None else int(step), event, fields, record["ts"])

    def scalars(self, step: int, values: dict[str, float], ts: float) -> None:
        """Record ``values`` at optimizer step ``step`` (``ts``: unix time, s)."""
        raise NotImplementedError

    def event(self, step: int, event: str, fields: dict[str, Any], ts: float) -> None:
        """Record a non-step event with its fields at ``step`` (``ts``: unix time, s)."""
        raise NotImplementedError

    def close(self) -> None:
        """Flush and close the tracker."""
        raise NotImplementedError


class TensorBoardTracker(Tracker):
    """Writes ``<output_dir>/tensorboard/`` with ``torch.utils.tensorboard.SummaryWriter``, flushed
    after every record. Events are text entries ``events/<event>``. On ``resumed`` it starts a new
    event file that purges the steps after the resumed one, so TensorBoard shows the replayed steps
    of the resumed run only (as ``osft-train plot`` does)."""

    def __init__(self, output_dir: str | Path) -> None:
        super().__init__()
        self.log_dir = Path(output_dir) / "tensorboard"
        self.writer = self._open(purge_step=None)

    def _open(self, purge_step: int | None):
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(str(self.log_dir), purge_step=purge_step)

    def scalars(self, step: int, values: dict[str, float], ts: float) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, global_step=step, walltime=ts)
        self.writer.flush()

    def event(self, step: int, event: str, fields: dict[str, Any], ts: float) -> None:
        if event == Event.RESUMED:
            self.writer.close()
            self.writer = self._open(purge_step=step + 1)
        self.writer.add_text(f"events/{event}", f"`{json.dumps(fields, sort_keys=True)}`", global_step=step, walltime=ts)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker(Tracker):
    """An offline Weights & Biases run in ``<output_dir>/wandb/`` (``wandb sync`` uploads it),
    with the training config as its config. Events are logged as JSON strings ``events/<event>``;
    steps never go back within a W&B run, so an event is placed at the latest step at least."""

    def __init__(self, output_dir: str | Path, config: dict, name: str | None = None) -> None:
        import wandb

        super().__init__()
        self.run = wandb.init(mode="offline", dir=str(output_dir), project="osft", name=name, config=config)
        self._logged_step = 0

    def _log(self, step: int, values: dict[str, Any]) -> None:
        self._logged_step = max(self._logged_step, step)
        self.run.log(values, step=self._logged_step)

    def scalars(self, step: int, values: dict[str, float], ts: float) -> None:
        self._log(step, values)

    def event(self, step: int, event: str, fields: dict[str, Any], ts: float) -> None:
        self._log(step, {f"events/{event}": json.dumps(fields, sort_keys=True)})

    def close(self) -> None:
        self.run.finish()


class MlflowTracker(Tracker):
    """An MLflow run in the local file store ``<output_dir>/mlruns`` (experiment ``osft``; point
    ``mlflow ui --backend-store-uri`` at it, or copy it to a tracking server), named by the job id,
    with the training config as its parameters. Scalars are metrics at their step (a resumed job is
    a run of its own); events are lines of the run's ``events.jsonl`` artifact. MLflow 3 keeps the
    file store in maintenance mode behind ``MLFLOW_ALLOW_FILE_STORE``, which is set to ``true`` here
    unless the environment sets it."""

    def __init__(self, output_dir: str | Path, config: dict, name: str | None = None) -> None:
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        super().__init__()
        self.store = Path(output_dir) / "mlruns"
        self.client = MlflowClient(tracking_uri=self.store.resolve().as_uri())
        experiment = self.client.get_experiment_by_name("osft")
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment("osft")
        self.run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
        self.events: list[str] = []

        params = [Param(key, json.dumps(value) if not isinstance(value, str) else value) for key, value in config.items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters a batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def scalars(self, step: int, values: dict[str, float], ts: float) -> None:
        from mlflow.entities import Metric

        self.client.log_batch(self.run_id, metrics=[Metric(k, v, int(ts * 1000), step) for k, v in values.items()])

    def event(self, step: int, event: str, fields: dict[str, Any], ts: float) -> None:
        self.events.append(json.dumps({"step": step, "event": event, "ts": ts, **fields}, sort_keys=True))
        self.client.log_text(self.run_id, "\n".join(self.events) + "\n", "events.jsonl")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


_TRACKERS = {"tensorboard": lambda out, config, name: TensorBoardTracker(out), "wandb": WandbTracker,
             "mlflow": MlflowTracker}


def open_trackers(report_to: list[str] | None, output_dir: str | Path, config: dict,
                  name: str | None = None) -> list[Tracker]:
    """Open the trackers asked for by ``--report-to`` (call on global rank 0 only).

    Args:
        report_to: tracker names (``none`` and None: no tracker).
        output_dir: the run directory; each tracker writes under it.
        config: the training config (``TrainConfig.to_json()``), kept by W&B and MLflow.
        name: run name shown by W&B and MLflow (the job id).

    Raises:
        ValueError: see :func:`check_available`.
    """
    check_available(report_to)
    trackers: list[Tracker] = []
    for tracker in requested(report_to):
        trackers.append(_TRACKERS[tracker](output_dir, config, name))
    return trackers
