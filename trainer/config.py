"""Every ``osft-train`` flag: the :class:`TrainConfig` dataclass and its argparse parser.

Flag names follow the older mini_trainer where one exists (``--model-name-or-path``,
``--data-path``, ``--output-dir``, ``--max-tokens-per-gpu``, ``--osft-unfreeze-rank-ratio``, ...),
so its users can switch. Bad values are rejected by the parser with one line, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path

from .data.shapes import DATA_FORMATS
from .schedule import SCHEDULES
from .trackers import REPORT_TO_CHOICES, check_available


@dataclass
class TrainConfig:
    """Resolved training configuration (units: tokens, steps, samples, degrees)."""

    model_name_or_path: str
    data_path: list[str]
    output_dir: str
    # data
    data_format: str = "auto"
    max_seq_len: int = 2048
    overlong: str = "drop"
    train_on_all: bool = False
    train_reasoning: bool = True
    train_last_turn_only: bool = False
    chat_template: str | None = None
    data_cache_dir: str | None = None
    data_cache: bool = True
    # batching
    batch_size: int = 16
    max_tokens_per_gpu: int = 4096
    # optimisation
    learning_rate: float = 2e-5
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.0
    lr_scheduler: str = "constant"
    warmup_steps: int = 0
    max_grad_norm: float = 1.0
    num_epochs: int = 1
    max_steps: int | None = None
    seed: int = 42
    # OSFT
    osft: bool = True
    osft_unfreeze_rank_ratio: float = 0.25
    osft_target_patterns: list[str] | None = None
    osft_v_projection: str = "factored"
    osft_cache_v_high: bool | None = None
    osft_forward: str = "auto"
    freeze_non_target: bool = False
    freeze_router: bool = False
    osft_rank_schedule: str = "uniform"
    osft_importance_samples: int = 32
    osft_min_frozen_ratio: float = 0.5
    osft_max_frozen_ratio: float = 0.9
    ortho_margin_deg: float = 1.0
    ortho_check_every: int = 10
    # protected subspaces of earlier OSFT runs (sequential OSFT)
    osft_protect_subspaces: bool = True
    osft_protect_energy: float = 0.9
    osft_protect_max_rank_ratio: float = 0.5
    osft_protect_basis: str = "update"
    osft_protect_input_energy: float = 0.95
    osft_protect_input_samples: int = 256
    osft_protect_input_memory_gb: float = 4.0
    # precision and device
    device: str = "auto"
    dtype: str = "auto"
    save_dtype: str = "bfloat16"
    compile: bool = False
    activation_checkpointing: bool = False
    # outputs
    hf_export_every_steps: int = 0
    logging_steps: int = 1
    report_to: list[str] | None = None
    # full-state checkpoints (docs/architecture.md sections 5 and 6)
    on_demand_checkpointing: bool = False
    resume_from_full_state_checkpoint: str | None = None
    resume: bool = False
    resume_accept_changed_inputs: bool = False
    overwrite_output_dir: bool = False
    checkpoint_every_steps: int = 0
    checkpoint_keep_last: int = 0
    checkpoint_grace_seconds: int = 300
    sigusr1_action: str = "checkpoint"
    async_checkpoint: bool = False
    # evaluation, forgetting budget, early stopping, divergence (README "Evaluation and forgetting")
    eval_data_path: str | None = None
    eval_split: float | None = None
    eval_every_steps: int = 0
    eval_max_samples: int | None = None
    retention_data_path: list[str] | None = None
    max_forgetting: float | None = None
    save_best_eval: bool = False
    early_stopping_patience: int = 0
    early_stopping_threshold: float = 0.0
    loss_spike_factor: float | None = None
    on_divergence: str = "stop"
    max_rollbacks: int = 3
    # launch (read by the launcher; a worker ignores them)
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.data_path, str):  # one source, as callers in code may give it
            self.data_path = [self.data_path]

    @property
    def evaluating(self) -> bool:
        """True when this run has an evaluation or retention set to evaluate."""
        return bool(self.eval_data_path or self.eval_split or self.retention_data_path)

    @property
    def checkpointing(self) -> bool:
        """True when this run may write full-state checkpoints (on demand or every N steps)."""
        return self.on_demand_checkpointing or self.checkpoint_every_steps > 0

    def to_json(self) -> dict:
        """Plain-data view for ``run.json``."""
        return dataclasses.asdict(self)


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (raises ``argparse.ArgumentTypeError`` otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0 (raises ``argparse.ArgumentTypeError`` otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def _float_in(lo: float, hi: float, lo_open: bool = False, hi_open: bool = False):
    lo_b, hi_b = "(" if lo_open else "[", ")" if hi_open else "]"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        ok = math.isfinite(value) and (value > lo if lo_open else value >= lo) and (value < hi if hi_open else value <= hi)
        if not ok:
            raise argparse.ArgumentTypeError(f"must be in {lo_b}{lo:g}, {hi:g}{hi_b}, got {text!r}")
        return value

    return parse


INF = float("inf")


class RepeatableList(argparse.Action):
    """``nargs="+"`` that may be repeated: the values of every occurrence on the command line, in
    order, replacing the default (a config file's list) rather than extending it."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = f"_{self.dest}_given"
        before = list(getattr(namespace, self.dest) or []) if getattr(namespace, given, False) else []
        setattr(namespace, self.dest, before + list(values))
        setattr(namespace, given, True)


class _HelpFormatter(argparse.HelpFormatter):
    """Shows ``(default: X)`` only where a default says something (not for switches or None)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        quiet = action.default is None or isinstance(action.default, bool) or action.default == argparse.SUPPRESS
        if "%(default)" not in text and not quiet and action.option_strings:
            text += " (default: %(default)s)"
        return text


class _DataPaths(argparse.Action):
    """``--data-path`` may be repeated and may take several values: they are collected in order. The
    first one on the command line replaces the default (a config file's list), later ones add to it."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = getattr(namespace, self.dest)
        setattr(namespace, self.dest, (list(given) if given is not self.default else []) + list(values))


def build_parser(prog: str = "osft-train", require_paths: bool = True) -> argparse.ArgumentParser:
    """The ``osft-train`` training parser, flags grouped as in ``--help``.

    ``require_paths=False`` makes model, data and output dir optional (``osft-train demo`` fills them).
    """
    p = argparse.ArgumentParser(
        prog=prog,
        description="Fine-tune a Hugging Face causal LM on chat data (messages jsonl) with Orthogonal "
        "Subspace Fine-Tuning (OSFT). Other commands: `osft-train fetch-demo`, `osft-train demo`, "
        "`osft-train plot RUN_DIR`, `osft-train make-retention-set` (a model's greedy replies as a retention "
        "set), `osft-train slurm-script`, `osft-train k8s-manifest` (multi-node jobs), `osft-train estimate-memory "
        "MODEL` (peak memory per rank before launching).",
        formatter_class=_HelpFormatter,
        allow_abbrev=False,  # a truncated or misspelt flag is an error, never silently another flag
    )
    d = TrainConfig("", "", "")
    g = p.add_argument_group("config file")
    g.add_argument("--config", metavar="FILE",
                   help="YAML file of flag values, keyed by flag name with underscores (learning_rate: 1e-5, "
                   "osft: false); flags given on the command line override it")
    g.add_argument("--print-config", action="store_true",
                   help="print the resolved config as YAML (a --config file) and exit without training")

    g = p.add_argument_group("model and data")
    g.add_argument("--model-name-or-path", required=require_paths, help="HF model directory or a .gguf file")
    g.add_argument("--data-path", required=require_paths, nargs="+", action=_DataPaths, metavar="PATH[:WEIGHT]",
                   help="training data: .jsonl/.json, .parquet, .arrow or a save_to_disk directory; several paths "
                   "(repeat the flag or list them) are one dataset, or with weights (a.jsonl:0.8 b.parquet:0.2) a "
                   "mixture drawn by weight in every batch")
    g.add_argument("--data-format", choices=DATA_FORMATS, default=d.data_format,
                   help="row shape: messages, sharegpt (conversations of from/value), alpaca (instruction/input/"
                   "output), prompt-completion; auto detects it from each source's first row")
    g.add_argument("--output-dir", required=require_paths, help="run directory (metrics, exports, checkpoints)")
    g.add_argument("--max-seq-len", type=positive_int, default=d.max_seq_len, help="longest sample, tokens")
    g.add_argument("--overlong", choices=["drop", "error", "truncate"], default=d.overlong,
                   help="what to do with samples longer than --max-seq-len (always reported)")
    g.add_argument("--train-on-all", action="store_true", help="train on every token, not only assistant turns")
    g.add_argument("--no-train-reasoning", dest="train_reasoning", action="store_false",
                   help="do not train the reasoning_content of assistant turns (nor its tags), only what follows it")
    g.add_argument("--train-last-turn-only", action="store_true",
                   help="train only the last assistant turn of each conversation (a message's \"train\": true|false "
                   "overrides, with or without this flag)")
    g.add_argument("--chat-template", metavar="FILE", default=None,
                   help="Jinja chat template that replaces the tokenizer's (for the data and in the export)")
    g.add_argument("--data-cache-dir", default=None,
                   help="cache of tokenized data (default: $OSFT_DATA_CACHE or the user cache dir)")
    g.add_argument("--no-data-cache", dest="data_cache", action="store_false", help="always re-tokenize")

    g = p.add_argument_group("batching")
    g.add_argument("--batch-size", type=positive_int, default=d.batch_size, help="global batch size, samples per optimizer step")
    g.add_argument("--max-tokens-per-gpu", type=positive_int, default=d.max_tokens_per_gpu,
                   help="token budget of one packed micro-batch; the step accumulates as many as needed")

    g = p.add_argument_group("optimisation (AdamW)")
    g.add_argument("--learning-rate", type=_float_in(0, INF, lo_open=True, hi_open=True), default=d.learning_rate,
                   help="peak learning rate")
    g.add_argument("--beta1", type=_float_in(0, 1, hi_open=True), default=d.beta1, help="AdamW beta1")
    g.add_argument("--beta2", type=_float_in(0, 1, hi_open=True), default=d.beta2, help="AdamW beta2")
    g.add_argument("--eps", type=_float_in(0, INF, lo_open=True, hi_open=True), default=d.eps, help="AdamW epsilon")
    g.add_argument("--weight-decay", type=_float_in(0, INF, hi_open=True), default=d.weight_decay,
                   help="decoupled weight decay on every trainable parameter")
    g.add_argument("--lr-scheduler", choices=SCHEDULES, default=d.lr_scheduler,
                   help="learning-rate schedule after warmup (warmup applies to each)")
    g.add_argument("--warmup-steps", type=non_negative_int, default=d.warmup_steps, help="linear warmup from 0, steps")
    g.add_argument("--max-grad-norm", type=_float_in(0, INF, lo_open=True, hi_open=True), default=d.max_grad_norm,
                   help="clip the global gradient norm to this")
    g.add_argument("--num-epochs", type=positive_int, default=d.num_epochs, help="passes over the data (unless --max-steps)")
    g.add_argument("--max-steps", type=positive_int, default=d.max_steps, help="optimizer steps to train; overrides --num-epochs")
    g.add_argument("--seed", type=int, default=d.seed, help="seed of the data order and every RNG")

    g = p.add_argument_group("OSFT")
    g.add_argument("--no-osft", dest="osft", action="store_false", help="plain full fine-tuning (the baseline)")
    g.add_argument("--osft-unfreeze-rank-ratio", type=_float_in(0, 1, lo_open=True), default=d.osft_unfreeze_rank_ratio,
                   help="URR: share of each target's rank that trains; k_high = floor(rank*(1-URR))")
    g.add_argument("--osft-target-patterns", nargs="+", metavar="REGEX", default=None,
                   help="regular expressions selecting target modules (default: built in per architecture)")
    g.add_argument("--osft-v-projection", choices=["factored", "gram"], default=d.osft_v_projection,
                   help="V-side projection: factored (dV V_high^T) V_high, or the M x M Gram form")
    cache_v = {"1": True, "0": False}.get(os.environ.get("OSFT_CACHE_V", ""))
    g.add_argument("--osft-cache-v-high", action="store_true", default=cache_v,
                   help="keep the all-gathered V bases after their first use; never checkpointed. Default: on "
                   "CPU ranks (gloo), whose gathers cost more than the copy's host memory, off under NCCL "
                   "(also OSFT_CACHE_V=1 or 0)")
    g.add_argument("--no-osft-cache-v-high", dest="osft_cache_v_high", action="store_false", default=cache_v,
                   help="gather each V basis at every use, also on CPU ranks")
    g.add_argument("--osft-forward", choices=["auto", "dense", "hybrid", "split"], default=d.osft_forward,
                   help="forward formulation per module (dense: rebuilt W and its weight gradient; hybrid: rebuilt W, "
                   "factor gradients formed directly; split: no rebuild); auto picks the one with fewer FLOPs")
    g.add_argument("--freeze-non-target", action="store_true",
                   help="train only the OSFT targets' low-rank factors and biases: embeddings, LM head (tied or not), "
                   "norms and every other parameter stay frozen (not with --no-osft)")
    g.add_argument("--freeze-router", action="store_true",
                   help="MoE models: keep every router (the gate choosing the experts of each token) as it is; the "
                   "experts still train (an error for a model without MoE blocks)")
    g.add_argument("--osft-rank-schedule", choices=["uniform", "importance"], default=d.osft_rank_schedule,
                   help="uniform: every target uses --osft-unfreeze-rank-ratio; importance: each decoder block's "
                   "frozen fraction follows its input/output cosine similarity on the first training samples "
                   "(Nayak et al. 2025), between --osft-min-frozen-ratio and --osft-max-frozen-ratio")
    g.add_argument("--osft-importance-samples", type=positive_int, default=d.osft_importance_samples,
                   help="training samples (the first N, packed) that score the blocks for --osft-rank-schedule importance")
    g.add_argument("--osft-min-frozen-ratio", type=_float_in(0, 1, hi_open=True), default=d.osft_min_frozen_ratio,
                   help="frozen fraction (1 - URR) of the block that changes its input most (importance schedule)")
    g.add_argument("--osft-max-frozen-ratio", type=_float_in(0, 1, hi_open=True), default=d.osft_max_frozen_ratio,
                   help="frozen fraction (1 - URR) of the block whose output stays closest to its input (importance schedule)")
    g.add_argument("--ortho-margin-deg", type=_float_in(0, 90, lo_open=True), default=d.ortho_margin_deg,
                   help="a deviation from 90 degrees above this is an orthogonality violation")
    g.add_argument("--ortho-check-every", type=positive_int, default=d.ortho_check_every,
                   help="steps between full orthogonality checks and forgetting indicators (also on step 1); every "
                        "other step bounds the deviation from the projection's own numbers and runs the full "
                        "check only when that bound exceeds --ortho-margin-deg")

    g = p.add_argument_group("protected subspaces (chained OSFT runs; see README 'Chaining runs')")
    g.add_argument("--no-osft-protect-subspaces", dest="osft_protect_subspaces", action="store_false",
                   help="do not protect the subspaces of earlier runs stored in the model directory "
                   "(osft_subspaces.safetensors); by default they are frozen")
    g.add_argument("--osft-protect-energy", type=_float_in(0, 1, lo_open=True), default=d.osft_protect_energy,
                   help="tau: at export, protect the fewest update directions holding this share of the "
                   "run's squared update norm ||dW||_F^2")
    g.add_argument("--osft-protect-max-rank-ratio", type=_float_in(0, 1, lo_open=True),
                   default=d.osft_protect_max_rank_ratio,
                   help="cap: at most floor(cap * k_low) new protected directions per module and side")
    g.add_argument("--osft-protect-basis", choices=["update", "inputs"], default=d.osft_protect_basis,
                   help="right-side (input) directions to protect: from the update dW, or from this run's "
                   "layer inputs (top eigenvectors of X X^T)")
    g.add_argument("--osft-protect-input-energy", type=_float_in(0, 1, lo_open=True),
                   default=d.osft_protect_input_energy,
                   help="epsilon: share of the layer inputs' energy to protect (--osft-protect-basis inputs)")
    g.add_argument("--osft-protect-input-samples", type=positive_int, default=d.osft_protect_input_samples,
                   help="training samples whose layer inputs are collected at export (--osft-protect-basis inputs)")
    g.add_argument("--osft-protect-input-memory-gb", type=_float_in(0, INF, lo_open=True, hi_open=True),
                   default=d.osft_protect_input_memory_gb,
                   help="most GB of input Gram matrices (8*M^2 bytes per distinct module input) held at once "
                   "on each rank; more than fit take one calibration pass per group (--osft-protect-basis inputs)")

    g = p.add_argument_group("precision, device and outputs")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default=d.device)
    g.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default=d.dtype,
                   help="training dtype; auto = float32 on CPU, bfloat16 on GPU")
    g.add_argument("--save-dtype", choices=["float32", "bfloat16", "float16"], default=d.save_dtype,
                   help="dtype of the HF export")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile each decoder block's forward (OSFT modules included; the gradient and "
                        "parameter projections run outside the compiled code)")
    g.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each decoder block's activations in the backward pass instead of keeping them "
                        "(less memory, about one more forward per step; gradients unchanged, bit for bit on CPU)")
    g.add_argument("--hf-export-every-steps", type=non_negative_int, default=d.hf_export_every_steps,
                   help="also export hf_format/step_N every N steps (0: only at the end)")
    g.add_argument("--logging-steps", type=positive_int, default=d.logging_steps, help="console update interval, steps")
    g.add_argument("--report-to", nargs="+", choices=REPORT_TO_CHOICES, default=d.report_to, metavar="TRACKER",
                   help="global rank 0 also sends the metrics to these trackers: none, tensorboard "
                   "(<output_dir>/tensorboard; pip install 'osft[tensorboard]'), wandb (offline run in "
                   "<output_dir>/wandb; pip install 'osft[wandb]')")

    g = p.add_argument_group("full-state checkpoints (model shards, optimizer, scheduler, data position, RNG)")
    g.add_argument("--on-demand-checkpointing", action="store_true",
                   help="save a full-state checkpoint when a signal asks for one: SIGUSR1 (see --sigusr1-action), or "
                   "SIGTERM, SIGINT, SIGUSR2, SIGXCPU, SIGHUP, SIGQUIT (checkpoint, then exit with code 75)")
    g.add_argument("--sigusr1-action", choices=["checkpoint", "checkpoint-and-exit"], default=d.sigusr1_action,
                   help="what SIGUSR1 asks for; checkpoint-and-exit suits schedulers that send it before preemption")
    g.add_argument("--checkpoint-every-steps", type=non_negative_int, default=d.checkpoint_every_steps,
                   help="also save a full-state checkpoint every N optimizer steps (0: never)")
    g.add_argument("--checkpoint-keep-last", type=non_negative_int, default=d.checkpoint_keep_last,
                   help="keep only the newest K complete checkpoints (0: keep all; the newest is never removed)")
    g.add_argument("--async-checkpoint", action="store_true",
                   help="write periodic and SIGUSR1 checkpoints in the background while training goes on (the "
                   "training thread only copies the state to CPU memory); a checkpoint counts once its manifest "
                   "is written, a stop waits for the write in flight")
    g.add_argument("--checkpoint-grace-seconds", type=positive_int, default=d.checkpoint_grace_seconds,
                   help="after a stop request, how long the launcher waits for the checkpoint before it kills the ranks, s")
    g.add_argument("--resume-from-full-state-checkpoint", metavar="STEP_DIR", default=None,
                   help="resume from this checkpoint (a full_state_checkpoints/step_N directory)")
    g.add_argument("--resume", action="store_true",
                   help="resume from the newest complete checkpoint under --output-dir, if there is one")
    g.add_argument("--resume-accept-changed-inputs", action="store_true",
                   help="resume even though the training data, tokenizer, chat template, evaluation or retention "
                   "sets differ in content from the checkpoint's (refused otherwise): training goes on from the "
                   "saved data position, and the evaluation state that depends on a changed input is reset")
    g.add_argument("--overwrite-output-dir", action="store_true",
                   help="start a new run in an --output-dir an earlier run (no longer running) left, removing its "
                        "checkpoints, exports and metrics (ignored with --resume)")

    g = p.add_argument_group("evaluation, forgetting budget, early stopping, divergence (see README 'Evaluation')")
    g.add_argument("--eval-data-path", metavar="FILE", default=None,
                   help="evaluation data (chat jsonl, validated like the training data); its loss is the exact "
                   "token mean over all ranks, without gradients")
    g.add_argument("--eval-split", type=_float_in(0, 1, lo_open=True, hi_open=True), default=None, metavar="FRACTION",
                   help="hold out this fraction of the training samples (rows spread evenly over the file) as the "
                   "evaluation set instead of --eval-data-path")
    g.add_argument("--eval-every-steps", metavar="N", type=non_negative_int, default=d.eval_every_steps,
                   help="evaluate every N optimizer steps (0: only at the start and the end; always at both)")
    g.add_argument("--eval-max-samples", metavar="N", type=positive_int, default=None,
                   help="evaluate at most N samples of each evaluation and retention set (spread evenly)")
    g.add_argument("--retention-data-path", metavar="FILE", nargs="+", action=RepeatableList, default=None,
                   help="retention set (chat jsonl, repeatable; e.g. from `osft-train make-retention-set`): its loss "
                   "minus its loss at step 0 is the forgetting, nats per token")
    g.add_argument("--max-forgetting", type=_float_in(0, INF, hi_open=True), default=None, metavar="NATS",
                   help="forgetting budget: the first evaluation where any retention set forgot more ends the run "
                   "(exit 0); the best evaluation within budget is kept exported in hf_format/best")
    g.add_argument("--save-best-eval", action="store_true",
                   help="keep hf_format/best: the model of the lowest evaluation loss (within the budget when set)")
    g.add_argument("--early-stopping-patience", metavar="N", type=non_negative_int, default=d.early_stopping_patience,
                   help="end the run (exit 0) after N evaluations without an improvement of the evaluation loss "
                   "(0: never)")
    g.add_argument("--early-stopping-threshold", metavar="NATS", type=_float_in(0, INF, hi_open=True),
                   default=d.early_stopping_threshold,
                   help="smallest decrease of the evaluation loss that counts as an improvement, nats per token")
    g.add_argument("--loss-spike-factor", metavar="F", type=_float_in(1, INF, lo_open=True, hi_open=True), default=None,
                   help="a training loss above this factor times the median of the last losses is a divergence "
                   "(default: off; a non-finite loss or gradient norm always is)")
    g.add_argument("--on-divergence", choices=["stop", "rollback"], default=d.on_divergence,
                   help="stop: checkpoint the last good step and exit 1; rollback: reload the newest complete "
                   "checkpoint, skip the offending batch and go on (stop when there is none)")
    g.add_argument("--max-rollbacks", metavar="N", type=non_negative_int, default=d.max_rollbacks,
                   help="rollbacks allowed in one run; the divergence after them stops the run")

    g = p.add_argument_group("distributed launch (torchrun worker group; FSDP2, gloo on CPU, NCCL on GPU)")
    g.add_argument("--nproc-per-node", type=positive_int, default=d.nproc_per_node,
                   help="ranks on this node; 1 (with --nnodes 1) trains in this process")
    g.add_argument("--nnodes", type=positive_int, default=d.nnodes, help="number of nodes")
    g.add_argument("--node-rank", type=non_negative_int, default=d.node_rank, help="this node's index")
    g.add_argument("--rdzv-endpoint", default=d.rdzv_endpoint, metavar="HOST:PORT",
                   help="c10d rendezvous endpoint shared by all nodes (required with --nnodes > 1)")
    return p


def config_to_argv(cfg: TrainConfig) -> list[str]:
    """Command-line flags that parse back into ``cfg`` with :func:`build_parser` (for workers)."""
    argv: list[str] = []
    negated = {"osft": "--no-osft", "data_cache": "--no-data-cache", "train_reasoning": "--no-train-reasoning",
               "osft_protect_subspaces": "--no-osft-protect-subspaces", "osft_cache_v_high": "--no-osft-cache-v-high"}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        flag = "--" + f.name.replace("_", "-")
        if f.name in negated:  # a switch with both flags; None (a default decided later) gives neither
            if value is False:
                argv.append(negated[f.name])
            elif value is True and f.default is not True:
                argv.append(flag)
        elif isinstance(value, bool):
            if value:
                argv.append(flag)
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        elif value is not None:
            argv += [flag, repr(value) if isinstance(value, float) else str(value)]
    return argv


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Build a :class:`TrainConfig` from parsed arguments."""
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in vars(args).items() if k in names})


def check_config(cfg: TrainConfig) -> None:
    """Cross-flag checks the parser cannot do alone.

    Raises:
        ValueError: a sample could not fit into one micro-batch, an input path is missing,
            ``--freeze-non-target`` with ``--no-osft``, a ``--report-to`` tracker is not installed,
            protection settings outside their ranges, ``--osft-min-frozen-ratio`` exceeds
            ``--osft-max-frozen-ratio``, ``--osft-rank-schedule importance`` goes with ``--no-osft``,
            ``--async-checkpoint`` without periodic or on-demand checkpoints, or an evaluation flag
            does not fit the others (:func:`check_eval_config`).
    """
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
    for key in ("osft_protect_energy", "osft_protect_max_rank_ratio", "osft_protect_input_energy"):
        if not 0.0 < getattr(cfg, key) <= 1.0:
            raise ValueError(f"--{key.replace('_', '-')} must be in (0, 1], got {getattr(cfg, key)}")
    if cfg.osft_protect_input_samples < 1:
        raise ValueError(f"--osft-protect-input-samples must be at least 1, got {cfg.osft_protect_input_samples}")
    if not (math.isfinite(cfg.osft_protect_input_memory_gb) and cfg.osft_protect_input_memory_gb > 0):
        raise ValueError(f"--osft-protect-input-memory-gb must be a positive number, got {cfg.osft_protect_input_memory_gb}")
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
