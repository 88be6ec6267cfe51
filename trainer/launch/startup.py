"""The start-up plan of a run, one for the launcher (``launcher.preflight``, before any rank starts)
and for each rank (``Trainer.prepare``, also the whole preparation of the in-process path):
tokenize the data, check it against the model and the world size, find and verify the checkpoint
to resume from, check that it fits this run, check the warmup (docs/architecture.md section 1).

Each step returns a typed result; the caller says what it found (the launcher prints, a rank
logs warnings), so both report the same things in the same words.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint.trainer_state import TrainerState
from ..config import CheckpointConfig, TrainConfig
from ..contract import VERIFIED_CHECKPOINT_ENV
from ..data.fingerprint import run_inputs
from ..data.mixture import TrainingData, tokenize_for_run
from ..data.positions import check_positions, position_limit
from ..data.sampler import check_enough_samples, make_sampler
from ..data.specs import parse_data_specs
from ..data.tokenize import TokenizedChat
from ..run.eval_sets import EvalSet, load_eval_sets, split_training_data
from ..rundir import RunDir
from ..run.schedule import check_warmup


@dataclass(frozen=True)
class RunData:
    """The tokenized data of a run.

    Attributes:
        train: the training samples, without the ``--eval-split`` hold-out.
        sets: the evaluation and retention sets, evaluation set first, each cut to ``--eval-max-samples``.
        cache_hit: the training data came from the tokenized-data cache.
    """

    train: TrainingData
    sets: list[EvalSet]
    cache_hit: bool


def load_data(cfg: TrainConfig, tokenizer, warn: Callable[[str], None],
              tokenize_set: Callable[[str], TokenizedChat]) -> RunData:
    """Validate and tokenize the training sources (through the data cache), hold out the
    ``--eval-split`` set, read the evaluation and retention sets, and fingerprint them
    (:attr:`.data.mixture.TrainingData.inputs`).

    Args:
        tokenizer: the model's tokenizer (with ``--chat-template`` applied). warn: reports a
            warning of the tokenization. tokenize_set: path -> one validated, tokenized chat file.

    Raises:
        DataValidationError: every problem of the training files, or of the evaluation and
            retention files, at once. ValueError: an unusable file or split.
    """
    data, hit = tokenize_for_run(cfg, tokenizer, warn)
    train, split = split_training_data(data, cfg.eval_split)
    sets = load_eval_sets(cfg.eval_data_path, cfg.retention_data_path, split, cfg.eval_max_samples, tokenize_set)
    inputs = run_inputs(cfg, tokenizer, [(spec.path, spec.weight) for spec in parse_data_specs(cfg.data_path)])
    return RunData(dataclasses.replace(train, inputs=inputs), sets, hit)


def resume_requested(cfg: CheckpointConfig) -> bool:
    """Whether the run resumes (``--resume`` or ``--resume-from-full-state-checkpoint``)."""
    return bool(cfg.resume or cfg.resume_from_full_state_checkpoint)


@dataclass(frozen=True)
class ResumeChoice:
    """The checkpoint a run resumes from.

    Attributes:
        path: the verified ``step_<N>`` directory; None: start fresh.
        skipped: one message per newer checkpoint directory ``--resume`` skipped, and why.
        note: what to tell when ``--resume`` found no complete checkpoint (else None).
    """

    path: Path | None
    skipped: tuple[str, ...] = ()
    note: str | None = None


def choose_checkpoint(cfg: TrainConfig) -> ResumeChoice:
    """The checkpoint to resume from: ``--resume-from-full-state-checkpoint`` verified with
    checksums (unless it is the one the launcher verified, :data:`.contract.VERIFIED_CHECKPOINT_ENV`),
    or with ``--resume`` the newest ``step_<N>`` that verifies fully (:func:`.checkpoint.store.newest_complete`).
    Reads the disk: one process decides (rank 0 on the ranks).

    Raises:
        CheckpointError: an explicit checkpoint that is incomplete, corrupt or unreadable.
    """
    if not resume_requested(cfg):
        return ResumeChoice(None)
    # torch.distributed.checkpoint only to resume: a launcher starting a fresh worker group never
    # imports it (tests/test_import_graph.py)
    from ..checkpoint.store import newest_complete, verify_checkpoint

    if cfg.resume_from_full_state_checkpoint:
        path = Path(cfg.resume_from_full_state_checkpoint)
        verify_checkpoint(path, checksums=os.environ.get(VERIFIED_CHECKPOINT_ENV) != str(path))
        return ResumeChoice(path)
    root = RunDir(cfg.output_dir).checkpoints
    path, skipped = newest_complete(root)
    note = None if path else f"resume: no complete checkpoint under {root}; starting fresh"
    return ResumeChoice(path, tuple(skipped), note)


@dataclass(frozen=True)
class Resume:
    """A checked resume: the checkpoint, its trainer state (with the evaluation state that depends on
    an input accepted as changed reset: :meth:`.checkpoint.trainer_state.TrainerState.accept_inputs`),
    a warning naming the inputs accepted as changed, and one per optimisation setting that changed since it was saved
    (:meth:`.checkpoint.trainer_state.TrainerState.check_compatible`)."""

    path: Path
    state: TrainerState
    warnings: list[str]


@dataclass(frozen=True)
class DataPlan:
    """The training data checked against the model and the world size.

    Attributes:
        sampler: the run's global batch sampler (:func:`.data.sampler.make_sampler`).
        total_steps: optimizer steps of the whole run.
        positions_warning: samples beyond a rotary model's trained positions (None: none).
        inputs: the fingerprint of the run's inputs (:attr:`.data.mixture.TrainingData.inputs`).
    """

    sampler: object
    total_steps: int
    positions_warning: str | None
    inputs: dict | None = None


def check_data(cfg: TrainConfig, train: TrainingData, world_size: int) -> DataPlan:
    """Check the training samples (:attr:`RunData.train`) against the model's position limit and
    the job's ``world_size``, and make the sampler.

    Raises:
        ValueError: fewer samples than ranks, or samples beyond an absolute-position model's limit.
    """
    positions_warning = check_positions(train, position_limit(cfg.model_name_or_path))
    check_enough_samples(len(train), world_size)
    sampler = make_sampler(train.sizes, train.weights, cfg.batch_size, cfg.seed)
    return DataPlan(sampler, sampler.run_steps(cfg.max_steps, cfg.num_epochs), positions_warning, train.inputs)


@dataclass(frozen=True)
class StartPlan:
    """Where the run starts.

    Attributes:
        resume: the checked resume, or None for a fresh start.
        warmup_warning: a warmup that covers the whole run (None: none).
    """

    resume: Resume | None
    warmup_warning: str | None


def check_start(cfg: TrainConfig, checkpoint: Path | None, world_size: int, data: DataPlan) -> StartPlan:
    """Check the checkpoint to resume from (:attr:`ResumeChoice.path`, verified; None: a fresh
    start) against this run, and the warmup against the steps left.

    Raises:
        CheckpointError: the checkpoint was saved with another world size, batch setting, data or
            OSFT setting, or trained with inputs of another content (unless
            ``--resume-accept-changed-inputs``); the message gives both values.
        ValueError: a warmup that leaves every step at learning rate 0 (:func:`osft.trainer.run.schedule.check_warmup`).
    """
    resume = None
    if checkpoint is not None:
        state, accepted = TrainerState.read(checkpoint).accept_inputs(cfg, data.inputs, checkpoint)
        resume = Resume(checkpoint, state,
                        accepted + state.check_compatible(cfg, world_size, data.sampler.layout(), checkpoint))
    start_step = resume.state.step if resume else 0
    return StartPlan(resume, check_warmup(cfg.warmup_steps, data.total_steps, start_step))
