"""Every ``osft-train`` setting, declared once: one config section per component, each field
carrying its flag's help, allowed values and resume rule (:func:`.setting.setting`), and what is
generated from them: the argparse parser (:func:`build_parser`), the flags of a config
(:func:`config_to_argv`), the range checks of a config made in code (:func:`check_config`) and the
resume rules (:data:`RESUME_SETTINGS`, :data:`RESUME_WARN_SETTINGS`). The YAML reader
(:mod:`.config_file`) takes its keys and checks from the same parser.

:class:`TrainConfig` is every section at once, flat (``cfg.learning_rate``), and the only class
made with ``__init__``, ``__repr__`` and ``__eq__`` (a section holds fields only); it is an instance
of each section class, so a component may declare the section it reads (``cfg: OptimizerConfig``).
A new setting is one :func:`.setting.setting` field in its section plus the code that uses it.
Flag names follow the older mini_trainer where one exists (``--model-name-or-path``,
``--data-path``, ``--output-dir``, ``--max-tokens-per-gpu``, ``--osft-unfreeze-rank-ratio``, ...),
so its users can switch. Bad values are rejected by the parser with one line, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from .data.shapes import DATA_FORMATS
from .run.schedule import SCHEDULES
from .setting import (
    DataPaths,
    HelpFormatter,
    IntAtLeast,
    Interval,
    RepeatableList,
    Resume,
    add_flag,
    flags_of,
    setting,
    setting_of,
    value_error,
)
from .observe.trackers import REPORT_TO_CHOICES, check_available

INF = float("inf")
#: argparse types of an integer >= 1 and >= 0 (``argparse.ArgumentTypeError`` on other text).
positive_int = IntAtLeast(1)
non_negative_int = IntAtLeast(0)
_UNIT = Interval(0, 1, lo_open=True)  # (0, 1]
_FRACTION = Interval(0, 1, hi_open=True)  # [0, 1)
_POSITIVE = Interval(0, INF, lo_open=True, hi_open=True)
_NON_NEGATIVE = Interval(0, INF, hi_open=True)
SAME, WARN = Resume.SAME, Resume.WARN


@dataclass(init=False, repr=False, eq=False)  # fields only: TrainConfig makes the methods
class DataConfig:
    """The model, the training data and how samples are made of it (units: tokens)."""

    TITLE: ClassVar[str] = "model and data"
    model_name_or_path: str = setting(help="HF model directory or a .gguf file", required=True)
    data_path: list[str] = setting(
        help="training data: .jsonl/.json, .parquet, .arrow or a save_to_disk directory; several paths (repeat the "
        "flag or list them) are one dataset, or with weights (a.jsonl:0.8 b.parquet:0.2) a mixture drawn by weight "
        "in every batch", required=True, many=True, action=DataPaths, metavar="PATH[:WEIGHT]")
    data_format: str = setting(
        "auto", "row shape: messages, sharegpt (conversations of from/value), alpaca (instruction/input/output), "
        "prompt-completion; auto detects it from each source's first row", choices=DATA_FORMATS, resume=SAME)
    output_dir: str = setting(help="run directory (metrics, exports, checkpoints)", required=True)
    max_seq_len: int = setting(2048, "longest sample, tokens", values=positive_int, resume=SAME)
    overlong: str = setting("drop", "what to do with samples longer than --max-seq-len (always reported)",
                            choices=("drop", "error", "truncate"), resume=SAME)
    train_on_all: bool = setting(False, "train on every token, not only assistant turns", resume=SAME)
    train_reasoning: bool = setting(
        True, "do not train the reasoning_content of assistant turns (nor its tags), only what follows it",
        resume=SAME)
    train_last_turn_only: bool = setting(
        False, "train only the last assistant turn of each conversation (a message's \"train\": true|false "
        "overrides, with or without this flag)", resume=SAME)
    chat_template: str | None = setting(
        None, "Jinja chat template that replaces the tokenizer's (for the data and in the export)", metavar="FILE",
        resume=SAME)
    data_cache_dir: str | None = setting(
        None, "cache of tokenized data (default: $OSFT_DATA_CACHE or the user cache dir)")
    data_cache: bool = setting(True, "always re-tokenize")


@dataclass(init=False, repr=False, eq=False)  # fields only: TrainConfig makes the methods
class BatchConfig:
    """How many samples make a step and how they are packed (units: samples, tokens)."""

    TITLE: ClassVar[str] = "batching"
    batch_size: int = setting(16, "global batch size, samples per optimizer step", values=positive_int, resume=SAME)
    max_tokens_per_gpu: int = setting(
        4096, "token budget of one packed micro-batch; the step accumulates as many as needed", values=positive_int,
        resume=SAME)


@dataclass(init=False, repr=False, eq=False)  # fields only: TrainConfig makes the methods
class OptimizerConfig:
    """AdamW, its learning-rate schedule and the length of the run (units: steps)."""

    TITLE: ClassVar[str] = "optimisation (AdamW)"
    learning_rate: float = setting(2e-5, "peak learning rate", values=_POSITIVE, resume=WARN)
    beta1: float = setting(0.9, "AdamW beta1", values=_FRACTION, resume=WARN)
    beta2: float = setting(0.95, "AdamW beta2", values=_FRACTION, resume=WARN)
    eps: float = setting(1e-8, "AdamW epsilon", values=_POSITIVE, resume=WARN)
    weight_decay: float = setting(0.0, "decoupled weight decay on every trainable parameter", values=_NON_NEGATIVE,
                                  resume=WARN)
    lr_scheduler: str = setting("constant", "learning-rate schedule after warmup (warmup applies to each)",
                                choices=SCHEDULES, resume=WARN)
    warmup_steps: int = setting(0, "linear warmup from 0, steps", values=non_negative_int, resume=WARN)
    max_grad_norm: float = setting(1.0, "clip the global gradient norm to this", values=_POSITIVE, resume=WARN)
    num_epochs: int = setting(1, "passes over the data (unless --max-steps)", values=positive_int, resume=WARN)
    max_steps: int | None = setting(None, "optimizer steps to train; overrides --num-epochs", values=positive_int,
                                    resume=WARN)
    seed: int = setting(42, "seed of the data order and every RNG", values=int, resume=SAME)


@dataclass(init=False, repr=False, eq=False)  # fields only: TrainConfig makes the methods
class OSFTConfig:
    """OSFT's targets, ranks, projection and orthogonality checks (units: degrees, steps, samples)."""

    TITLE: ClassVar[str] = "OSFT"
    osft: bool = setting(True, "plain full fine-tuning (the baseline)", resume=SAME)
    osft_unfreeze_rank_ratio: float = setting(
        0.25, "URR: share of each target's rank that trains; k_high = floor(rank*(1-URR))", values=_UNIT, resume=SAME)
    osft_target_patterns: list[str] | None = setting(
        None, "regular expressions selecting target modules (default: built in per architecture)", many=True,
        metavar="REGEX", resume=SAME)
    osft_v_projection: str = setting("factored", "V-side projection: factored (dV V_high^T) V_high, or the M x M "
                                     "Gram form", choices=("factored", "gram"))
    osft_cache_v_high: bool | None = setting(
        None, "keep the all-gathered V bases after their first use; never checkpointed. Default: on CPU ranks "
        "(gloo), whose gathers cost more than the copy's host memory, off under NCCL (also OSFT_CACHE_V=1 or 0)",
        no_help="gather each V basis at every use, also on CPU ranks", env="OSFT_CACHE_V")
    osft_forward: str = setting(
        "auto", "forward formulation per module (dense: rebuilt W and its weight gradient; hybrid: rebuilt W, factor "
        "gradients formed directly; split: no rebuild); auto picks the one with fewer FLOPs",
        choices=("auto", "dense", "hybrid", "split"))
    freeze_non_target: bool | None = setting(
        None, "train only the OSFT targets' low-rank factors and biases: embeddings, LM head (tied or not), norms "
        "and every other parameter stay frozen (not with --no-osft). Default: frozen in a run that protects the "
        "subspaces of an earlier run (a chained run), trained otherwise",
        no_help="train the non-target parameters also in a chained run", resume=SAME)
    freeze_router: bool = setting(
        False, "MoE models: keep every router (the gate choosing the experts of each token) as it is; the experts "
        "still train (an error for a model without MoE blocks)", resume=SAME)
    osft_rank_schedule: str = setting(
        "uniform", "uniform: every target uses --osft-unfreeze-rank-ratio; importance: each decoder block's frozen "
        "fraction follows its input/output cosine similarity on the first training samples (Nayak et al. 2025), "
        "between --osft-min-frozen-ratio and --osft-max-frozen-ratio", choices=("uniform", "importance"), resume=SAME)
    osft_importance_samples: int = setting(
        32, "training samples (the first N, packed) that score the blocks for --osft-rank-schedule importance",
        values=positive_int, resume=SAME)
    osft_min_frozen_ratio: float = setting(
        0.5, "frozen fraction (1 - URR) of the block that changes its input most (importance schedule)",
        values=_FRACTION, resume=SAME)
    osft_max_frozen_ratio: float = setting(
        0.9, "frozen fraction (1 - URR) of the block whose output stays closest to its input (importance schedule)",
        values=_FRACTION, resume=SAME)
    ortho_margin_deg: float = setting(1.0, "a deviation from 90 degrees above this is an orthogonality "
                                      "violation", values=Interval(0, 90, lo_open=True))
    ortho_check_every: int = setting(
        10, "steps between full orthogonality checks and forgetting indicators (also on step 1); every other step "
        "bounds the deviation from the projection's own numbers and runs the full check only when that bound "
        "exceeds --ortho-margin-deg", values=positive_int)


@dataclass(init=False, repr=False, eq=False)  # fields only: TrainConfig makes the methods
class ProtectionConfig:
    """Protected subspaces of earlier OSFT runs (sequential OSFT): what is read and what the export adds."""

    TITLE: ClassVar[str] = "protected subspaces (chained OSFT runs; see docs/osft.md, Chaining runs)"
    osft_protect_subspaces: bool = setting(
        True, "do not protect the subspaces of earlier runs stored in the model directory "
        "(osft_subspaces.safetensors); by default they are frozen", resume=SAME)
    osft_protect_energy: float = setting(
        0.9, "tau: at export, protect the fewest update directions holding this share of the run's squared update "
        "norm ||dW||_F^2", values=_UNIT)
    osft_protect_max_rank_ratio: float = setting(
        0.5, "cap: at most floor(cap * k_low) new protected directions per module and side", values=_UNIT)
    osft_protect_basis: str = setting(
        "auto", "right-side (input) directions to protect: from the update dW, or from this run's layer inputs "
        "(top eigenvectors of X X^T); auto: inputs where they apply, the update for expert banks and modules whose "
        "Gram matrix exceeds --osft-protect-input-memory-gb (named at start)", choices=("auto", "update", "inputs"))
    osft_protect_input_criterion: str = setting(
        "total", "input energy to reach: total (GPM: ||Q^T X||^2 of the old basis plus the new directions reach "
        "epsilon of ||X||^2) or residual (epsilon of the energy outside the old basis)", choices=("total", "residual"))
    osft_frozen_rank: str = setting(
        "reduced", "frozen top directions of a module with protected subspaces: reduced, k_high = floor(R*(1-URR)) "
        "of the reduced rank R = min(N - p_L, M - p_R); keep, as many as a fresh run at this URR freezes "
        "(floor(min(N, M)*(1-URR)): the pretrained block stays frozen, the protected ranks come out of k_low)",
        choices=("reduced", "keep"), resume=SAME)
    osft_protect_input_energy: float = setting(
        0.95, "epsilon: share of the layer inputs' energy to protect (--osft-protect-basis inputs)", values=_UNIT)
    osft_protect_input_samples: int = setting(
        64, "training samples whose layer inputs are collected at export, drawn with --seed over the whole training "
        "data (every source of a mixture by its weight); --osft-protect-basis auto or inputs", values=positive_int)
    osft_protect_input_memory_gb: float = setting(
        4.0, "most GB of input Gram matrices (8*M^2 bytes per distinct module input) held at once on each rank; "
        "more than fit take one calibration pass per group (--osft-protect-basis inputs)", values=_POSITIVE)


@dataclass(init=False, repr=False, eq=False)  # fields only: TrainConfig makes the methods
class PrecisionConfig:
    """Device, dtypes, compilation and memory trades, and the outputs written while training."""

    TITLE: ClassVar[str] = "precision, device and outputs"
    device: str = setting("auto", choices=("auto", "cpu", "cuda"))
    dtype: str = setting("auto", "training dtype; auto = float32 on CPU, bfloat16 on GPU",
                         choices=("auto", "float32", "bfloat16"))
    save_dtype: str = setting("bfloat16", "dtype of the HF export", choices=("float32", "bfloat16", "float16"))
    compile: bool = setting(False, "torch.compile each decoder block's forward (OSFT modules included; the gradient "
                            "and parameter projections run outside the compiled code)")
    activation_checkpointing: bool = setting(
        False, "recompute each decoder block's activations in the backward pass instead of keeping them (less "
        "memory, about one more forward per step; gradients unchanged, bit for bit on CPU)")
    hf_export_every_steps: int = setting(0, "also export hf_format/step_N every N steps (0: only at the end)",
                                         values=non_negative_int)
    logging_steps: int = setting(1, "console update interval, steps", values=positive_int)
    report_to: list[str] | None = setting(
        None, "global rank 0 also sends the metrics to these trackers: none, tensorboard (<output_dir>/tensorboard; "
        "pip install 'osft[tensorboard]'), wandb (offline run in <output_dir>/wandb; pip install 'osft[wandb]')",
        many=True, choices=REPORT_TO_CHOICES, metavar="TRACKER")


@dataclass(init=False, repr=False, eq=False)  # fields only: TrainConfig makes the methods
class CheckpointConfig:
    """Full-state checkpoints: when they are written, kept and resumed from (docs/architecture.md sections 5, 6)."""

    TITLE: ClassVar[str] = "full-state checkpoints (model shards, optimizer, scheduler, data position, RNG)"
    on_demand_checkpointing: bool = setting(
        False, "save a full-state checkpoint when a signal asks for one: SIGUSR1 (see --sigusr1-action), or SIGTERM, "
        "SIGINT, SIGUSR2, SIGXCPU, SIGHUP, SIGQUIT (checkpoint, then exit with code 75)")
    sigusr1_action: str = setting(
        "checkpoint", "what SIGUSR1 asks for; checkpoint-and-exit suits schedulers that send it before preemption",
        choices=("checkpoint", "checkpoint-and-exit"))
    checkpoint_every_steps: int = setting(
        0, "also save a full-state checkpoint every N optimizer steps (0: never)", values=non_negative_int)
    checkpoint_keep_last: int = setting(
        0, "keep only the newest K complete checkpoints (0: keep all; the newest is never removed)",
        values=non_negative_int)
    async_checkpoint: bool = setting(
        False, "write periodic and SIGUSR1 checkpoints in the background while training goes on (the training thread "
        "only copies the state to CPU memory); a checkpoint counts once its manifest is written, a stop waits for the "
        "write in flight")
    checkpoint_grace_seconds: int = setting(
        300, "after a stop request, how long the launcher waits for the checkpoint before it kills the ranks, s",
        values=positive_int)
    resume_from_full_state_checkpoint: str | None = setting(
        None, "resume from this checkpoint (a full_state_checkpoints/step_N directory)", metavar="STEP_DIR")
    resume: bool = setting(False, "resume from the newest complete checkpoint under --output-dir, if there is one")
    resume_accept_changed_inputs: bool = setting(
        False, "resume even though the training data, tokenizer, chat template, evaluation or retention sets differ in "
        "content from the checkpoint's (refused otherwise): training goes on from the saved data position, and the "
        "evaluation state that depends on a changed input is reset")
    overwrite_output_dir: bool = setting(
        False, "start a new run in an --output-dir an earlier run (no longer running) left, removing its "
        "checkpoints, exports and metrics (ignored with --resume)", one_time=True)

    @property
    def checkpointing(self) -> bool:
        """True when this run may write full-state checkpoints (on demand or every N steps)."""
        return self.on_demand_checkpointing or self.checkpoint_every_steps > 0


@dataclass(init=False, repr=False, eq=False)  # fields only: TrainConfig makes the methods
class EvaluationConfig:
    """Evaluation and retention sets, the forgetting budget, early stopping and divergence (units: nats per token)."""

    TITLE: ClassVar[str] = "evaluation, forgetting budget, early stopping, divergence (see docs/evaluation.md)"
    eval_data_path: str | None = setting(
        None, "evaluation data (chat jsonl, validated like the training data); its loss is the exact token mean "
        "over all ranks, without gradients", metavar="FILE")
    eval_split: float | None = setting(
        None, "hold out this fraction of the training samples (rows spread evenly over the file) as the evaluation "
        "set instead of --eval-data-path", values=Interval(0, 1, lo_open=True, hi_open=True), metavar="FRACTION",
        resume=SAME)
    eval_every_steps: int = setting(
        0, "evaluate every N optimizer steps (0: only at the start and the end; always at both)",
        values=non_negative_int, metavar="N")
    eval_max_samples: int | None = setting(
        None, "evaluate at most N samples of each evaluation and retention set (spread evenly)", values=positive_int,
        metavar="N")
    retention_data_path: list[str] | None = setting(
        None, "retention set (chat jsonl, repeatable; e.g. from `osft-train make-retention-set`): its loss minus its "
        "loss at step 0 is the forgetting, nats per token", many=True, action=RepeatableList, metavar="FILE")
    max_forgetting: float | None = setting(
        None, "forgetting budget: the first evaluation where any retention set forgot more ends the run (exit 0); "
        "the best evaluation within budget is kept exported in hf_format/best", values=_NON_NEGATIVE, metavar="NATS")
    save_best_eval: bool = setting(
        False, "keep hf_format/best: the model of the lowest evaluation loss (within the budget when set)")
    early_stopping_patience: int = setting(
        0, "end the run (exit 0) after N evaluations without an improvement of the evaluation loss (0: never)",
        values=non_negative_int, metavar="N")
    early_stopping_threshold: float = setting(
        0.0, "smallest decrease of the evaluation loss that counts as an improvement, nats per token",
        values=_NON_NEGATIVE, metavar="NATS")
    loss_spike_factor: float | None = setting(
        None, "a training loss above this factor times the median of the last losses is a divergence (default: off; "
        "a non-finite loss or gradient norm always is)", values=Interval(1, INF, lo_open=True, hi_open=True),
        metavar="F")
    on_divergence: str = setting(
        "stop", "stop: checkpoint the last good step and exit 1; rollback: reload the newest complete checkpoint, "
        "skip the offending batch and go on (stop when there is none)", choices=("stop", "rollback"))
    max_rollbacks: int = setting(3, "rollbacks allowed in one run; the divergence after them stops the run",
                                 values=non_negative_int, metavar="N")

    @property
    def evaluating(self) -> bool:
        """True when this run has an evaluation or retention set to evaluate."""
        return bool(self.eval_data_path or self.eval_split or self.retention_data_path)


@dataclass(init=False, repr=False, eq=False)  # fields only: TrainConfig makes the methods
class LaunchConfig:
    """The torchrun worker group (read by the launcher; a worker ignores them)."""

    TITLE: ClassVar[str] = "distributed launch (torchrun worker group; FSDP2, gloo on CPU, NCCL on GPU)"
    nproc_per_node: int = setting(1, "ranks on this node; 1 (with --nnodes 1) trains in this process",
                                  values=positive_int)
    nnodes: int = setting(1, "number of nodes", values=positive_int)
    node_rank: int = setting(0, "this node's index", values=non_negative_int)
    rdzv_endpoint: str | None = setting(
        None, "c10d rendezvous endpoint shared by all nodes (required with --nnodes > 1)", metavar="HOST:PORT")


#: The sections in ``--help`` order, which is also the order of the fields of :class:`TrainConfig`
#: (``config.yaml``, ``run.json``'s ``config``).
SECTIONS = (DataConfig, BatchConfig, OptimizerConfig, OSFTConfig, ProtectionConfig, PrecisionConfig,
            CheckpointConfig, EvaluationConfig, LaunchConfig)


@dataclass
class TrainConfig(*reversed(SECTIONS)):  # a dataclass takes the fields of its last base first
    """Resolved training configuration: every field of every section (units: tokens, steps, samples, degrees).

    ``TrainConfig(model, data_path, output_dir, **settings)``; ``data_path`` may be one path.
    """

    def __post_init__(self) -> None:
        if isinstance(self.data_path, str):  # one source, as callers in code may give it
            self.data_path = [self.data_path]

    def to_json(self) -> dict:
        """Plain-data view for ``run.json``."""
        return dataclasses.asdict(self)

    def resume_settings(self) -> dict:
        """The settings every full-state checkpoint records (``trainer_state.json`` ``settings``):
        those of :data:`RESUME_SETTINGS` and :data:`RESUME_WARN_SETTINGS`, by name."""
        return {k: getattr(self, k) for k in RESUME_SETTINGS + RESUME_WARN_SETTINGS}


FIELDS = dataclasses.fields(TrainConfig)
#: Settings a bit-identical resume needs unchanged (trainer_state.json "settings").
RESUME_SETTINGS = tuple(f.name for f in FIELDS if setting_of(f).resume is Resume.SAME)
#: Settings that may change on resume: the resumed run uses this run's values from its first step
#: (AdamW's hyperparameters through :func:`.checkpoint.full_state.with_run_hyperparameters`, the schedule
#: through :func:`osft.trainer.run.schedule.restore_position`, the clipping threshold and length read every step), with a
#: warning that the trajectory then differs from an uninterrupted run.
RESUME_WARN_SETTINGS = tuple(f.name for f in FIELDS if setting_of(f).resume is Resume.WARN)
#: Fields that are one-time actions of a launch, not settings of the run: never written to a config
#: file, so replaying ``<run>/config.yaml`` cannot remove the run's checkpoints again.
ONE_TIME_FIELDS = tuple(f.name for f in FIELDS if setting_of(f).one_time)


def build_parser(prog: str = "osft-train", require_paths: bool = True) -> argparse.ArgumentParser:
    """The ``osft-train`` training parser: the config-file flags, then one group per section of :data:`SECTIONS`.

    ``require_paths=False`` makes model, data and output dir optional (``osft-train demo`` fills them).
    """
    paths = "--model-name-or-path MODEL --data-path DATA --output-dir DIR " if require_paths else ""
    p = argparse.ArgumentParser(
        prog=prog,
        usage=f"%(prog)s {paths}[options]\n       osft-train COMMAND --help",
        description="Fine-tune a Hugging Face causal LM on chat data (messages jsonl) with Orthogonal "
        "Subspace Fine-Tuning (OSFT). Other commands: `osft-train fetch-demo`, `osft-train demo`, "
        "`osft-train plot RUN_DIR`, `osft-train make-retention-set` (a model's greedy replies as a retention "
        "set), `osft-train protect-base` (a base model that protects its input directions on general data in "
        "chained runs), `osft-train slurm-script`, `osft-train k8s-manifest` (multi-node jobs), `osft-train estimate-memory "
        "MODEL` (peak memory per rank before launching).",
        formatter_class=HelpFormatter,
        allow_abbrev=False,  # a truncated or misspelt flag is an error, never silently another flag
    )
    g = p.add_argument_group("config file")
    g.add_argument("--config", metavar="FILE",
                   help="YAML file of flag values, keyed by flag name with underscores (learning_rate: 1e-5, "
                   "osft: false); flags given on the command line override it")
    g.add_argument("--print-config", action="store_true",
                   help="print the resolved config as YAML (a --config file) and exit without training")
    for section in SECTIONS:
        g = p.add_argument_group(section.TITLE)
        for field in dataclasses.fields(section):
            add_flag(g, field, require_paths)
    return p


def config_to_argv(cfg: TrainConfig) -> list[str]:
    """Command-line flags that parse back into ``cfg`` with :func:`build_parser`."""
    return [word for f in FIELDS for word in flags_of(f, getattr(cfg, f.name))]


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Build a :class:`TrainConfig` from parsed arguments."""
    names = {f.name for f in FIELDS}
    return TrainConfig(**{k: v for k, v in vars(args).items() if k in names})


def check_config(cfg: TrainConfig) -> None:
    """Range and choice checks of every field (for a config made in code; parsed flags passed them
    already) and the cross-flag checks the parser cannot do alone.

    Raises:
        ValueError: a value outside its field's range or choices; a sample could not fit into one
            micro-batch, an input path is missing, ``--freeze-non-target`` with ``--no-osft``, a
            ``--report-to`` tracker is not installed, ``--osft-min-frozen-ratio`` exceeds
            ``--osft-max-frozen-ratio``, ``--osft-rank-schedule importance`` goes with ``--no-osft``,
            ``--async-checkpoint`` without periodic or on-demand checkpoints, or an evaluation flag
            does not fit the others (:func:`check_eval_config`).
    """
    for field in FIELDS:
        reason = value_error(field, getattr(cfg, field.name))
        if reason:
            raise ValueError(reason)
    if cfg.freeze_non_target and not cfg.osft:
        raise ValueError("--freeze-non-target with --no-osft would leave nothing to train: it freezes every "
                         "parameter that is not an OSFT target, and --no-osft has no targets; drop one of them")
    if cfg.nnodes > 1 and not cfg.rdzv_endpoint:
        raise ValueError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the same on every node)")
    if cfg.node_rank >= cfg.nnodes:
        raise ValueError(f"--node-rank {cfg.node_rank} must be smaller than --nnodes {cfg.nnodes}")
    if cfg.max_seq_len > cfg.max_tokens_per_gpu:
        raise ValueError(
            f"--max-seq-len {cfg.max_seq_len} exceeds --max-tokens-per-gpu {cfg.max_tokens_per_gpu}: "
            "a sample must fit into one micro-batch"
        )
    if cfg.osft_min_frozen_ratio > cfg.osft_max_frozen_ratio:
        raise ValueError(f"--osft-min-frozen-ratio {cfg.osft_min_frozen_ratio} exceeds --osft-max-frozen-ratio "
                         f"{cfg.osft_max_frozen_ratio}")
    if cfg.osft_rank_schedule == "importance" and not cfg.osft:
        raise ValueError("--osft-rank-schedule importance sets OSFT ranks: it cannot go with --no-osft")
    from .data.specs import check_sources  # imported when first needed: `osft-train --help` start-up

    check_sources(cfg.data_path)
    if cfg.chat_template is not None and not Path(cfg.chat_template).is_file():
        raise ValueError(f"--chat-template {cfg.chat_template}: no such file")
    check_eval_config(cfg)
    if cfg.async_checkpoint and not cfg.checkpointing:
        raise ValueError("--async-checkpoint writes periodic and on-demand checkpoints in the background: it needs "
                         "--checkpoint-every-steps N or --on-demand-checkpointing")
    if cfg.resume and cfg.resume_from_full_state_checkpoint:
        raise ValueError("--resume and --resume-from-full-state-checkpoint exclude each other: pick one")
    if cfg.resume_from_full_state_checkpoint and not Path(cfg.resume_from_full_state_checkpoint).is_dir():
        raise ValueError(f"--resume-from-full-state-checkpoint {cfg.resume_from_full_state_checkpoint}: no such directory")
    if not Path(cfg.model_name_or_path).exists():
        raise ValueError(f"--model-name-or-path {cfg.model_name_or_path}: no such file or directory (models load from disk only)")
    check_available(cfg.report_to)


def check_eval_config(cfg: TrainConfig) -> None:
    """Cross-flag checks of the evaluation flags.

    Raises:
        ValueError: ``--eval-data-path`` with ``--eval-split``; an evaluation or retention file
            that does not exist; ``--max-forgetting`` without a retention set; ``--save-best-eval``
            or ``--early-stopping-patience`` without an evaluation set; ``--eval-every-steps``
            without any set to evaluate.
    """
    if cfg.eval_data_path and cfg.eval_split:
        raise ValueError("--eval-data-path and --eval-split exclude each other: pick one evaluation set")
    for flag, path in [("--eval-data-path", cfg.eval_data_path), *(("--retention-data-path", p) for p in
                                                                  cfg.retention_data_path or [])]:
        if path and not Path(path).is_file():
            raise ValueError(f"{flag} {path}: no such file")
    if cfg.max_forgetting is not None and not cfg.retention_data_path:
        raise ValueError("--max-forgetting needs a retention set to measure forgetting on (--retention-data-path)")
    has_eval = bool(cfg.eval_data_path or cfg.eval_split)
    for flag, on in (("--save-best-eval", cfg.save_best_eval),
                     ("--early-stopping-patience", cfg.early_stopping_patience)):
        if on and not has_eval:
            raise ValueError(f"{flag} needs an evaluation set (--eval-data-path or --eval-split)")
    if cfg.eval_every_steps and not cfg.evaluating:
        raise ValueError("--eval-every-steps needs an evaluation or retention set (--eval-data-path, --eval-split "
                         "or --retention-data-path)")
