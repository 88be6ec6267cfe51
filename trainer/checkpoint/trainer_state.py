"""``trainer_state.json`` of a full-state checkpoint as one typed object, and what must match
between it and the run resuming from it (docs/architecture.md section 5).

The check runs in the launcher before any rank starts and again on every rank
(tests/test_resume.py::test_periodic_checkpoints_retention_vocab_and_bad_checkpoints); the
optimisation settings may change, and the resumed run uses them from its first step
(tests/test_resume_settings.py). The content of the run's inputs (training data, tokenizer, chat
template, evaluation and retention sets) is recorded as a fingerprint (:mod:`..data.fingerprint`)
and must match too, unless ``--resume-accept-changed-inputs`` accepts the change and resets the
state that depends on it (:meth:`TrainerState.accept_inputs`). Standard library only: the
launcher's checks stay free of torch.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import RESUME_SETTINGS, RESUME_WARN_SETTINGS  # each setting's resume rule, declared there
from ..data.fingerprint import INPUT_NAMES, changed_inputs
from .manifest import CheckpointError

if TYPE_CHECKING:
    from ..config import TrainConfig

#: Plain trainer state of a checkpoint (step, counters, scheduler, data position, settings).
TRAINER_STATE = "trainer_state.json"


def _flag(key: str) -> str:
    return f"--{key.replace('_', '-')}"


@dataclass(frozen=True)
class ModelFacts:
    """The model a checkpoint was saved from: its vocabulary size (rows of the input embedding,
    after any resize for the tokenizer) and its ``config.model_type``."""

    vocab_size: int
    model_type: str


@dataclass(frozen=True, kw_only=True)
class TrainerState:
    """The plain (non-tensor) training state after ``step`` optimizer steps, as ``trainer_state.json``
    holds it; the keys of the file are the field names, in this order.

    Attributes:
        step: optimizer steps done (1-based count; 0 before the first).
        epoch: the 0-based epoch of the next step's data position.
        sampler: the data position of the next step (:meth:`..data.sampler.GlobalBatchSampler.state`:
            seed, batch size, sample count, a mixture's sizes and weights and positions,
            ``next_epoch``, ``next_index``).
        counters: ``ortho_violations_total``, ``samples_seen``, ``tokens_seen``.
        scheduler: the LR scheduler's ``state_dict()`` (torch.optim.lr_scheduler.LambdaLR).
        world_size: ranks of the job that saved it.
        total_steps: the run length the schedule was built for (None in checkpoints older than it).
        settings: the saving run's :meth:`..config.TrainConfig.resume_settings`.
        model: :class:`ModelFacts`.
        osft_plan: module name -> :meth:`..osft.plan.ModulePlan.to_dict` (None with ``--no-osft``).
        monitor: the evaluation and divergence state (:meth:`..monitor.RunMonitor.state_dict`;
            None in checkpoints older than it).
        inputs: the fingerprint of the run's inputs (:func:`..data.fingerprint.run_inputs`; None in
            checkpoints older than it: not compared).
    """

    step: int
    epoch: int
    sampler: dict[str, Any]
    counters: dict[str, int]
    scheduler: dict[str, Any]
    world_size: int
    total_steps: int | None = None
    settings: dict[str, Any]
    model: ModelFacts
    osft_plan: dict[str, dict] | None = None
    monitor: dict | None = None
    inputs: dict | None = None

    def to_json(self) -> dict[str, Any]:
        """The content of ``trainer_state.json`` (plain JSON data)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any], source: str | Path = TRAINER_STATE) -> TrainerState:
        """The state from the content of ``trainer_state.json``; keys it does not know are ignored.

        Raises:
            CheckpointError: a required key is missing (``source`` names the file in the message).
        """
        required = [f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.name not in data]
        if required:
            raise CheckpointError(f"{source}: missing {', '.join(required)}")
        known = {f.name for f in dataclasses.fields(cls)}
        fields = {k: v for k, v in data.items() if k in known}
        return cls(**{**fields, "model": ModelFacts(**data["model"])})

    @classmethod
    def read(cls, step_dir: Path) -> TrainerState:
        """``step_dir/trainer_state.json`` (JSON: nothing in it can run code).

        Raises:
            OSError: the file cannot be read. ValueError: it is not JSON.
            CheckpointError: a required key is missing.
        """
        path = Path(step_dir) / TRAINER_STATE
        return cls.from_json(json.loads(path.read_text()), path)

    def write(self, step_dir: Path) -> None:
        """Write ``step_dir/trainer_state.json``."""
        (Path(step_dir) / TRAINER_STATE).write_text(json.dumps(self.to_json(), indent=1))

    def accept_inputs(self, cfg: TrainConfig, inputs: dict | None, path: Path) -> tuple[TrainerState, list[str]]:
        """Compare the checkpoint's input fingerprint with this run's ``inputs`` (None: not known, nothing compared).

        Returns:
            ``(state, warnings)``: this state, or with ``--resume-accept-changed-inputs`` and a
            changed input, the state with what depends on the changed inputs reset (the best
            evaluation and the early-stopping patience after a change of the evaluation set, of
            the tokenizer or chat template, or of the training data with ``--eval-split``; the
            retention baselines after a change of a retention set, tokenizer or chat template: they
            are measured again at the resumed step), and a warning naming every changed input and
            what was reset (none when nothing changed).

        Raises:
            CheckpointError: an input whose content differs, without ``--resume-accept-changed-inputs``;
                the message names each input and what differs.
        """
        changed = changed_inputs(self.inputs, inputs) if inputs is not None else {}
        if not changed:
            return self, []
        what = "; ".join(f"{INPUT_NAMES[k]}: {d}" for k, d in changed.items())
        if not cfg.resume_accept_changed_inputs:
            raise CheckpointError(f"checkpoint {path} was trained with other inputs than this run's: {what}. A resume "
                                  "on them would not reproduce the run: resume with the same inputs, or give "
                                  "--resume-accept-changed-inputs to go on with these from the saved position")
        tokens = bool({"tokenizer", "chat_template"} & set(changed))
        evaluation = dict((self.monitor or {}).get("eval") or {})
        reset = []
        if tokens or "evaluation" in changed or ("training" in changed and cfg.eval_split):
            if evaluation.get("best_loss") is not None:
                reset.append(f"the best evaluation (loss {evaluation['best_loss']:.4f} at step "
                             f"{evaluation['best_step']})")
            reset.append("the early-stopping patience counter")
            evaluation.update(best_loss=None, best_step=None, patience_ref=None, since_improvement=0, last={})
        if (tokens or "retention" in changed) and evaluation.get("baselines"):
            reset.append(f"the retention baselines (forgetting is measured from step {self.step} on)")
            evaluation["baselines"] = {}
        monitor = dict(self.monitor or {}, eval=evaluation) if self.monitor is not None else None
        said = f"; reset: {', '.join(reset)}" if reset else ""
        warning = (f"--resume-accept-changed-inputs: resuming from checkpoint {path} on other inputs: {what}; the "
                   f"resumed run differs from an uninterrupted one{said}")
        return dataclasses.replace(self, monitor=monitor), [warning]

    def check_compatible(self, cfg: TrainConfig, world_size: int, layout: dict, path: Path) -> list[str]:
        """Compare this checkpoint state (of ``path``) with the run about to resume from it.

        Args:
            cfg: the resuming run's config. world_size: its ranks.
            layout: its sampler's ``layout()`` (:mod:`..data.sampler`: the data size, a mixture's
                sizes and weights), which must be the checkpoint's.

        Returns:
            one warning per optimisation setting that changed (:data:`RESUME_WARN_SETTINGS`): it is
            used from the first resumed step on, so the run is no longer bit-identical to an
            uninterrupted one.

        Raises:
            CheckpointError: another world size, batch size, micro-batch budget, seed, data size,
                mixture or OSFT setting; the message gives both values.
        """
        if self.world_size != world_size:
            raise CheckpointError(f"checkpoint {path} was saved with {self.world_size} ranks, now {world_size}: "
                                  "a bit-identical resume needs the same world size")
        if self.sampler["num_samples"] != layout["num_samples"]:
            raise CheckpointError(f"checkpoint {path} was saved with {self.sampler['num_samples']} training samples, "
                                  f"the data now has {layout['num_samples']}: the data position would not match")
        if self.sampler.get("mixture") != layout.get("mixture"):
            raise CheckpointError(f"checkpoint {path} was saved with the mixture (samples, weight per --data-path) "
                                  f"{self.sampler.get('mixture')}, this run has {layout.get('mixture')}: "
                                  "the data positions would not match")
        for key in RESUME_SETTINGS:
            if self.settings.get(key, getattr(cfg, key)) != getattr(cfg, key):
                raise CheckpointError(f"checkpoint {path} was saved with {_flag(key)} {self.settings[key]}, "
                                      f"this run has {getattr(cfg, key)}: resume with the same setting")
        return [f"{_flag(k)} changed from {old} to {new} since checkpoint {path}: used from step "
                f"{self.step + 1} on, so the resumed run differs from an uninterrupted one"
                for k, (old, new) in self.changed_settings(cfg).items()]

    def changed_settings(self, cfg: TrainConfig) -> dict[str, tuple]:
        """``{setting: (checkpoint's value, this run's value)}`` for every optimisation setting of
        :data:`RESUME_WARN_SETTINGS` that differs between this state and ``cfg``."""
        return {k: (self.settings[k], getattr(cfg, k)) for k in RESUME_WARN_SETTINGS
                if self.settings.get(k, getattr(cfg, k)) != getattr(cfg, k)}
