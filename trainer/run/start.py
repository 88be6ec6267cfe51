"""A rank's start of a run, said on its console: the tokenized data and its checks, and where the
run starts (a checked resume or step 0). The plan itself is :mod:`osft.trainer.launch.startup`'s, which the
launcher also checks before any rank starts; this module carries it out on one rank and reports
what it found (each node's local rank 0 says, rank 0 warns once for the job).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..config import TrainConfig
from ..data.cache import tokenize_source
from ..data.mixture import TrainingData
from ..data.tokenize import IGNORE_INDEX
from ..distributed import DistEnv, agree, barrier
from .eval_sets import EVAL, EvalSet
from ..observe.metrics import Reporter
from ..model.loading import load_tokenizer
from ..rundir import RunDir, write_json_atomic
from ..launch.startup import DataPlan, ResumeChoice, StartPlan, check_data, check_start, choose_checkpoint, load_data, resume_requested


def shifted_loss_tokens(labels: list[list[int]]) -> np.ndarray:
    """Per sample, the tokens that carry loss after the next-token shift: trained labels at
    positions 1..L-1 (the first token has no prediction). int64 array [num_samples]."""
    return np.fromiter((sum(1 for t in lab[1:] if t != IGNORE_INDEX) for lab in labels), dtype=np.int64, count=len(labels))


@dataclass(frozen=True)
class RunInputs:
    """What a rank trains on: the tokenizer, the training data (:class:`.data.mixture.TrainingData`),
    its plan (sampler, total steps), the evaluation and retention sets, and the loss tokens of
    each training sample (:func:`shifted_loss_tokens`)."""

    tokenizer: object
    data: TrainingData
    plan: DataPlan
    sets: list[EvalSet]
    loss_tokens: np.ndarray


def prepare_inputs(cfg: TrainConfig, dist: DistEnv, run_dir: RunDir, report: Reporter) -> RunInputs:
    """Tokenize the training data and the evaluation and retention sets (each node's local rank 0
    first, its peers then hit the cache), check them (:func:`osft.trainer.launch.startup.check_data`), write
    ``data_report.json`` (rank 0) and say what was read.

    Raises:
        DataValidationError: every problem of the files at once. ValueError: an unusable file,
            split or data plan.
    """
    tokenizer = load_tokenizer(cfg.model_name_or_path, chat_template=cfg.chat_template)

    def tokenize_set(path: str):
        data, hit = tokenize_source(cfg, path, tokenizer, report.warn)
        if hit:
            report.say(f"data: tokenized {path} loaded from the cache")
        return data

    if not dist.is_local_main:
        barrier()
    loaded = load_data(cfg, tokenizer, report.warn, tokenize_set)
    if dist.is_local_main:
        barrier()
    if loaded.cache_hit:
        report.say("data: tokenized data loaded from the cache")
    for s in loaded.sets:
        report.say(f"{s.kind} set {s.name}: {len(s)} samples of {s.path}"
                   + (" (held out from training)" if s.kind == EVAL and cfg.eval_split else ""))
    data = loaded.train
    plan = check_data(cfg, data, dist.world_size)
    if dist.rank == 0:
        write_json_atomic(run_dir.data_report, data.report_dict())
    for line in data.summary_lines():
        report.say(line)
    if data.dropped and dist.rank == 0:  # every rank sees the same data: one warning is enough
        report.warn(f"{data.dropped} sample(s) of {', '.join(data.names)} dropped; see {run_dir.data_report}")
    if plan.positions_warning and dist.rank == 0:
        report.warn(plan.positions_warning)
    return RunInputs(tokenizer, data, plan, loaded.sets, shifted_loss_tokens(data.dataset["labels"]))


def choose_start(cfg: TrainConfig, dist: DistEnv, plan: DataPlan, report: Reporter) -> StartPlan:
    """Where the run starts (:func:`osft.trainer.launch.startup.check_start`): with ``--resume`` or a checkpoint path,
    the checkpoint rank 0 chose (every rank gets its answer), checked; its warnings on rank 0.

    Raises:
        CheckpointError: the checkpoint does not fit this run.
    """
    choice = agree(lambda: choose_checkpoint(cfg), dist.rank) if resume_requested(cfg) else ResumeChoice(None)
    if dist.rank == 0:
        for message in choice.skipped:
            report.warn(message)
    if choice.note:
        report.say(choice.note)
    start = check_start(cfg, choice.path, dist.world_size, plan)
    if dist.rank == 0:
        for message in (start.resume.warnings if start.resume else []) + [start.warmup_warning]:
            if message:
                report.warn(message)
    return start
