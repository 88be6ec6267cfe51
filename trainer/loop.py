"""The training loop of one rank: data, model, OSFT, AdamW, metrics and the final HF export.

Rank and world size come from the environment (:class:`.distributed.DistEnv`), so the same loop
runs in-process and under torchrun. Loss = sum of token losses / number of loss tokens in the global
batch (all micro-batches of all ranks), so it does not depend on how samples were packed.
"""

from __future__ import annotations

import hashlib
import os
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import get_args

import numpy as np
import psutil
import torch
import torch.nn.functional as F
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from torch import nn

from .activation_checkpointing import enable_activation_checkpointing
from .checkpoint.background import BackgroundWriter
from .checkpoint.full_state import (
    Checkpointer,
    PendingSave,
    SavedCheckpoint,
    capture_rng,
    local_tensor,
    restore_rng,
)
from .checkpoint.hf_export import save_hf_model, source_generation_config
from .checkpoint.requests import Request, RequestPoller, Seen, StopRequested
from .checkpoint.signals import (
    Action,
    TriggerDir,
    install_handlers,
    job_start_time,
    restore_handlers,
)
from .checkpoint.subspaces import SUBSPACES_FILE, write_subspaces
from .checkpoint.store import check_shared
from .checkpoint.trainer_state import ModelFacts, TrainerState, run_settings
from .compile import compile_blocks
from .config import TrainConfig
from .contract import EXIT_COMPLETED, EXIT_STOPPED, JOB_ID_ENV, LAUNCHER_PID_ENV, Event, FinishReason
from .data.cache import tokenize_source
from .data.collate import collate_packed
from .data.packing import plan_micro_batches
from .data.tokenize import IGNORE_INDEX
from .divergence import Diverged
from .distributed import (
    DistEnv,
    agree,
    barrier,
    gather_float,
    gather_on_device,
    init_distributed,
    map_over_ranks,
    node_ranks,
    shutdown_distributed,
)
from .flops import Utilization, flop_model
from .matmul_peak import measure_matmul_peak
from .metrics import MetricsLogger
from .model_build import build_model, load_protected_bases
from .model_loading import load_config, load_tokenizer, model_vocab_size
from .monitor import RunEnd, RunMonitor
from .osft.freeze import count_parameters, freeze_non_targets, freeze_routers
from .osft.indicators import INDICATOR_FIELDS
from .osft.layer_importance import RankPlan, calibration_batches, importance_rank_plan
from .osft.plan import ForwardForm, ModulePlan, plan_table
from .osft.projection import Projector
from .osft.input_grams import InputBases, check_gram_budget, input_bases
from .osft.protect import ModuleFold, fold_bank, fold_module, no_bases
from .osft.settings import OSFTSettings
from .osft.surgery import dense_state_dict, full_state_dict
from .osft.targets import describe_unconstrained, find_target_modules
from .packed_attention import BOUNDS_KWARG, use_packed_attention
from .progress import TrainProgress
from .rundir import RunDir, write_json_atomic
from .router_loss import describe as describe_router_loss
from .router_loss import router_aux_coef, router_term
from .schedule import build_scheduler
from .startup import (
    DataPlan,
    Resume,
    ResumeChoice,
    check_data,
    check_start,
    choose_checkpoint,
    load_data,
    resume_requested,
)
from .trackers import open_trackers


@dataclass
class TrainResult:
    """Outcome of :meth:`Trainer.run`: the step reached, the last loss (NaN when this run trained
    no step), the total orthogonality violations, the final HF export (None when the run stopped on
    request), the last full-state checkpoint written (or None), the exit code (0 completed or ended
    by an evaluation rule, :data:`.exit_codes.EXIT_STOPPED`, :data:`.exit_codes.EXIT_FAILED` after a divergence), the
    steps trained by this run (fewer than ``steps`` after a resume) and the reason of
    ``run_finished``."""

    steps: int
    last_loss: float
    violations_total: int
    export_dir: str | None
    checkpoint: str | None = None
    exit_code: int = 0
    steps_run: int = 0
    reason: str = FinishReason.COMPLETED

    def summary(self) -> str:
        """One line for the console: steps, last loss and violations; after a resume with no
        step left, that no step was trained (tests/test_stop_rule.py)."""
        if self.steps_run == 0:
            return (f"no step left to train: the run was resumed at step {self.steps}, its last step; "
                    f"orthogonality violations {self.violations_total}")
        resumed = f" ({self.steps_run} in this run)" if self.steps_run != self.steps else ""
        return (f"{self.steps} steps{resumed}, last loss {self.last_loss:.4f}, "
                f"orthogonality violations {self.violations_total}")


class StepInterrupted(Exception):
    """A checkpoint request agreed between micro-batches: the step is abandoned and replayed."""

    def __init__(self, request: Request) -> None:
        super().__init__(request.signal)
        self.request = request


def resolve_device_dtype(cfg: TrainConfig) -> tuple[torch.device, torch.dtype]:
    """``--device auto`` = CUDA when available, else CPU; ``--dtype auto`` = bf16 on GPU, fp32 on CPU.

    Raises:
        ValueError: ``--device cuda`` without a CUDA device.
    """
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if cfg.dtype == "auto":
        dtype = torch.bfloat16 if use_cuda else torch.float32
    else:
        dtype = getattr(torch, cfg.dtype)
    return device, dtype


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's (CPU and CUDA) generators."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def shifted_loss_tokens(labels: list[list[int]]) -> np.ndarray:
    """Per sample, the tokens that carry loss after the next-token shift: trained labels at
    positions 1..L-1 (the first token has no prediction). int64 array [num_samples]."""
    return np.fromiter((sum(1 for t in lab[1:] if t != IGNORE_INDEX) for lab in labels), dtype=np.int64, count=len(labels))


#: Test-only hook (tests/test_distributed.py, local-rank-1 warnings): "STEP:LOCAL_RANK" makes that local rank log a warning after that step.
TEST_WARNING_ENV = "OSFT_TEST_WARN_AT"
#: Test-only hook: "1" adds ``state_sha256`` (every parameter and optimizer tensor of every rank)
#: to each step record, to compare runs bit for bit.
TEST_STATE_HASH_ENV = "OSFT_TEST_STATE_HASH"


def _tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of a tensor of any dtype (bfloat16 included)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


class Trainer:
    """One rank's training run. Build with a config, then call :meth:`run`."""

    def __init__(self, cfg: TrainConfig, console: Console | None = None, job_id: str | None = None) -> None:
        self.cfg = cfg
        self.dist = DistEnv.from_env()
        self.console = console or Console(stderr=True)
        self.run_dir = RunDir(cfg.output_dir)
        self.run_dir.create()
        self.job_id = job_id or os.environ.get(JOB_ID_ENV) or uuid.uuid4().hex[:12]
        trackers = open_trackers(cfg.report_to, cfg.output_dir, cfg.to_json(), self.job_id) if self.dist.rank == 0 else []
        self.metrics = MetricsLogger(self.run_dir.metrics, self.dist, self.job_id, sinks=trackers)
        self.device, self.dtype = resolve_device_dtype(cfg)
        self.trigger = TriggerDir(self.job_id)
        self.poller: RequestPoller | None = None
        self._handlers: dict = {}
        if cfg.on_demand_checkpointing:  # as early as possible: a request during start-up is kept
            self.trigger.create()
            self._handlers = install_handlers(self.trigger.record)
            self.poller = RequestPoller(self.trigger, self.run_dir.control, cfg.sigusr1_action, self.dist.rank)
        init_distributed(self.dist, self.device)
        self.start_step = 0
        self.counters = {"ortho_violations_total": 0, "samples_seen": 0, "tokens_seen": 0}
        self.checkpointer: Checkpointer | None = None
        self._saved: tuple[int, str] | None = None  # (step, path) of this run's newest complete checkpoint
        #: the checkpoint being written in the background (--async-checkpoint) and the requests it serves
        self._writing: tuple[PendingSave, Seen | None] | None = None
        self.rank_plan: RankPlan | None = None
        self.monitor = RunMonitor(self)

    def _say(self, message: str) -> None:
        if self.dist.is_local_main:
            self.console.print(message, markup=False, highlight=False, soft_wrap=True)

    def _warn(self, message: str) -> None:
        self.metrics.log(Event.WARNING, message=message)
        self.console.print("[yellow]warning:[/yellow]", escape(message), soft_wrap=True)

    def prepare(self) -> None:
        """Prepare the run with the start-up plan the launcher also checks (:mod:`.startup`): the
        data (all validation problems raised before the model loads), the checkpoint to resume from,
        the model with its OSFT decomposition and AdamW, then the LR schedule and the restore."""
        cfg = self.cfg
        seed_everything(cfg.seed)
        self.flop_model = flop_model(load_config(cfg.model_name_or_path))
        self.metrics.log(Event.RUN_STARTED, pid=os.getpid(), config=cfg.to_json(), model_flops=self.flop_model.to_json())
        plan = self._prepare_data()
        if self.poller and self.dist.is_local_main:
            for stale in self.poller.remove_stale(job_start_time()):
                self._warn(f"stale checkpoint request removed ({stale}): it is older than this job")
        # rank 0 reads the disk, every rank gets its answer
        choice = agree(lambda: choose_checkpoint(cfg), self.dist.rank) if resume_requested(cfg) else ResumeChoice(None)
        if self.dist.rank == 0:
            for message in choice.skipped:
                self._warn(message)
        if choice.note:
            self._say(choice.note)
        start = check_start(cfg, choice.path, self.dist.world_size, plan)
        if self.dist.rank == 0:
            for message in (start.resume.warnings if start.resume else []) + [start.warmup_warning]:
                if message:
                    self._warn(message)
        self.sampler, self.total_steps = plan.sampler, plan.total_steps
        self._build_model_and_optimizer(start.resume)
        self._restore(start.resume)

    def _prepare_data(self) -> DataPlan:
        """Tokenize the training data and the evaluation and retention sets (each node's local
        rank 0 first, its peers then hit the cache), check them (:func:`.startup.check_data`),
        write ``data_report.json`` and say what was read."""
        cfg = self.cfg
        self.tokenizer = load_tokenizer(cfg.model_name_or_path, chat_template=cfg.chat_template)
        if not self.dist.is_local_main:
            barrier()
        data = load_data(cfg, self.tokenizer, self._warn, self._tokenize)
        if self.dist.is_local_main:
            barrier()
        if data.cache_hit:
            self._say("data: tokenized data loaded from the cache")
        self.monitor.use_sets(data.sets)
        self.data = data.train
        plan = check_data(cfg, self.data, self.dist.world_size)
        if self.dist.rank == 0:
            write_json_atomic(self.run_dir.data_report, self.data.report_dict())
        for line in self.data.summary_lines():
            self._say(line)
        if self.data.dropped and self.dist.rank == 0:  # every rank sees the same data: one warning is enough
            self._warn(f"{self.data.dropped} sample(s) of {', '.join(self.data.names)} dropped; "
                       f"see {self.run_dir.data_report}")
        if plan.positions_warning and self.dist.rank == 0:
            self._warn(plan.positions_warning)
        self.lengths = self.data.lengths
        self.loss_tokens = shifted_loss_tokens(self.data.dataset["labels"])
        return plan

    def _build_model_and_optimizer(self, resume: Resume | None) -> None:
        """Build the model (from the checkpoint's vocabulary size and OSFT plans when resuming: no
        SVD), report the OSFT decomposition, and make the projector and AdamW."""
        cfg = self.cfg
        bases, plans = None, None
        if resume is not None:
            vocab = resume.state.model.vocab_size
            if resume.state.osft_plan:  # None for a --no-osft run
                plans = {name: ModulePlan.from_dict(d) for name, d in resume.state.osft_plan.items()}
        else:
            vocab = max(len(self.tokenizer), model_vocab_size(cfg.model_name_or_path))
            bases = self._protected_bases()
        osft_settings = OSFTSettings.from_config(cfg) if cfg.osft else None
        self.model, self.osft = build_model(cfg, self.dist, self.device, self.dtype, osft=osft_settings, vocab_size=vocab,
                                            from_checkpoint=resume is not None, bases=bases, plans=plans,
                                            plan_ranks=self._plan_ranks)
        if self.osft and cfg.osft_protect_basis == "inputs":  # fails now, not at the first export
            check_gram_budget({n: m.in_features for n, m in self.osft.modules if not (m.plan.experts or m.plan.frozen)},
                              cfg.osft_protect_input_memory_gb * 1e9)
            if banks := [n for n, m in self.osft.modules if m.plan.experts]:
                self._say(f"protected subspaces: --osft-protect-basis inputs does not apply to the {len(banks)} expert "
                          "banks (each expert sees only the tokens routed to it): their exports protect the update "
                          "directions of each expert")
        if self.osft and resume is not None:
            self._say(f"OSFT: {len(self.osft.modules)} modules loaded from {resume.path} (no SVD)")
        elif self.osft:
            forms = [m.forward_form for m in self.osft.osft_modules]
            urrs = [m.plan.urr for m in self.osft.osft_modules]
            urr = f"{min(urrs):.3g}-{max(urrs):.3g} by block importance" if self.rank_plan else f"{cfg.osft_unfreeze_rank_ratio}"
            self._say(
                f"OSFT: {len(forms)} modules decomposed in {self.osft.svd_seconds:.1f} s "
                f"(URR {urr}; forward: {', '.join(f'{forms.count(f)} {f}' for f in get_args(ForwardForm))})"
            )
            if self.rank_plan:
                self._report_rank_plan()
        if self.osft and self.dist.rank == 0:
            self.console.print(plan_table([(n, m.plan) for n, m in self.osft.modules]))
        # each packed sample attends within itself (no T x T mask); compiled blocks keep transformers'
        # SDPA, whose graph does not depend on where the samples of a row start
        self.packed_attention = not cfg.compile and use_packed_attention(self.model)
        if cfg.activation_checkpointing:
            self._say(f"activation checkpointing: {enable_activation_checkpointing(self.model)} decoder blocks "
                      "recompute their activations in the backward pass")
        if cfg.compile:
            self._say(f"compile: {compile_blocks(self.model)} decoder blocks (torch.compile, inductor)")
        if cfg.freeze_non_target:
            freeze_non_targets(self.model, self.osft)
        if cfg.freeze_router:
            self._say(f"MoE routers frozen: {len(freeze_routers(self.model, cfg.model_name_or_path))} parameters")
        self.router_coef = router_aux_coef(self.model.config)
        if self.router_coef:
            self._say(describe_router_loss(self.router_coef))
        self._say(count_parameters(self.model, self.osft).describe())
        if self.osft and self.dist.rank == 0:
            warning, note = describe_unconstrained(self.model, [name for name, _ in self.osft.modules])
            if note:
                self._say(note)
            if warning:
                self._warn(warning)
        trained = [(n, m) for n, m in self.osft.modules if not m.plan.frozen] if self.osft else []
        self.projector = Projector(trained, osft_settings.v_projection, osft_settings.caches_v_basis(self.device)) if self.osft else None
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(  # fused kernels on CUDA (PyTorch's fused AdamW)
            params, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay,
            fused=self.device.type == "cuda" or None,
        )
        self.node_of_rank = node_ranks(self.dist)
        peaks = gather_float(measure_matmul_peak(self.device, self.dtype))
        self.utilization = Utilization(self.flop_model, tuple(peaks), tuple(self.node_of_rank), self.dist.node_rank)
        self._say(f"matmul peak measured: {sum(peaks) / 1e9:,.1f} GFLOP/s ({self.dtype}, {len(peaks)} rank(s)); "
                  f"model FLOPs per token {self.flop_model.dense_flops_per_token / 1e9:.3f} G + attention")

    def _restore(self, resume: Resume | None) -> None:
        """Build the LR schedule and the checkpointer (checking the checkpoint root is shared), and
        load the checkpoint to resume from."""
        cfg = self.cfg
        self.scheduler = build_scheduler(cfg.lr_scheduler, self.optimizer, cfg.warmup_steps, self.total_steps)
        root = RunDir(cfg.output_dir).checkpoints
        # Always: a divergence or an evaluation rule that ends the run checkpoints it.
        self.checkpointer = Checkpointer(root, self.dist, self.job_id, self.model, self.optimizer, self.scheduler, self.osft,
                                         keep_last=cfg.checkpoint_keep_last,
                                         writer=BackgroundWriter(self.device) if cfg.async_checkpoint else None)
        if cfg.checkpointing:
            check_shared(root, self.dist.rank, self.dist.hostname)
        if resume is not None:
            self.start_step = self.load_checkpoint(resume.path)
            self._saved = (self.start_step, str(resume.path))  # a request before the first step is served by it
            self.metrics.log(Event.RESUMED, from_step=self.start_step, path=str(resume.path),
                             changed={k: list(v) for k, v in resume.state.changed_settings(cfg).items()})
            self._say(f"resumed from {resume.path} at step {self.start_step}")

    def _tokenize(self, path: str):
        """Validate and tokenize one chat file (an evaluation or retention set) as the training
        sources are (through the data cache unless ``--no-data-cache``).

        Raises:
            DataValidationError: every problem of the file. ValueError: an unusable file.
        """
        data, hit = tokenize_source(self.cfg, path, self.tokenizer, self._warn)
        if hit:
            self._say(f"data: tokenized {path} loaded from the cache")
        return data

    def load_checkpoint(self, step_dir: str | Path, rollback: bool = False) -> int:
        """Load a verified full-state checkpoint into this run (collective): model, optimizer,
        scheduler, counters, the evaluation and divergence state (a ``rollback`` keeps this run's
        skipped batches), and last the generators. Returns the checkpoint's step."""
        state, rng = self.checkpointer.load(Path(step_dir))
        self.counters = dict(state.counters)
        self.monitor.load_state_dict(state.monitor, keep_divergence=rollback)
        saved = state.sampler  # the data position it was saved at (skipped batches counted)
        self.sampler.restore(saved, saved["next_epoch"] * self.sampler.steps_per_epoch + saved["next_index"])
        restore_rng(rng)  # last: nothing after this draws random numbers before training
        return state.step

    def _plan_ranks(self, model: nn.Module) -> dict[str, float] | None:
        """The URR of each OSFT target under ``--osft-rank-schedule importance`` (None: uniform).

        Called by every rank with its freshly built dense ``model`` (real weights on rank 0, the meta
        device elsewhere): rank 0 scores the decoder blocks on the first ``--osft-importance-samples``
        training samples, packed as for training (:mod:`.osft.layer_importance`), and every rank
        receives the same plan (:func:`.distributed.agree`), kept in ``self.rank_plan``.
        """
        cfg = self.cfg
        if cfg.osft_rank_schedule != "importance":
            return None

        def plan() -> RankPlan:
            targets = find_target_modules(model, model.config.model_type, cfg.osft_target_patterns)
            batches = calibration_batches(self.data, self.lengths, cfg.osft_importance_samples, cfg.max_tokens_per_gpu)
            return importance_rank_plan(model, batches, targets, cfg.osft_min_frozen_ratio, cfg.osft_max_frozen_ratio)

        self.rank_plan = agree(plan, self.dist.rank)
        return self.rank_plan.urr_by_module

    def _report_rank_plan(self) -> None:
        """Print the importance plan (rich table) and log it as one ``osft_rank_plan`` record, with the
        k_high each target got."""
        plan = self.rank_plan
        k_high = {name: m.plan.k_high for name, m in self.osft.modules}
        self.metrics.log(Event.OSFT_RANK_PLAN, **plan.to_json(), k_high_by_module=k_high)
        table = Table(title=f"OSFT rank plan: block importance on {plan.tokens} calibration tokens")
        for column in ("block", "cos(input, output)", "frozen", "URR", "k_high"):
            table.add_column(column, justify="left" if column == "block" else "right")
        for i, block in enumerate(plan.blocks):
            ks = [k for name, k in k_high.items() if plan.block_of(name) == i]
            shown = "-" if not ks else str(ks[0]) if min(ks) == max(ks) else f"{min(ks)}-{max(ks)}"
            table.add_row(block, f"{plan.similarity[i]:.4f}", f"{plan.frozen[i]:.3f}", f"{plan.urr[i]:.3f}", shown)
        if self.dist.is_local_main:
            self.console.print(table)

    def _protected_bases(self) -> dict | None:
        """The protected subspaces of the model directory (None without), announced on the console."""
        cfg = self.cfg
        found = load_protected_bases(self.cfg)
        if found is None:
            if cfg.osft and not cfg.osft_protect_subspaces and (Path(cfg.model_name_or_path) / SUBSPACES_FILE).is_file():
                self._say(f"protected subspaces: {Path(cfg.model_name_or_path) / SUBSPACES_FILE} not used "
                          "(--no-osft-protect-subspaces): every direction of the model may train again")
            return None
        path, bases = found
        p_left = [P.shape[-1] for P, _ in bases.values()]
        p_right = [Q.shape[-1] for _, Q in bases.values()]
        banks = sum(P.dim() == 3 for P, _ in bases.values())
        of_banks = f" ({banks} of them expert banks, a basis per expert)" if banks else ""
        self._say(f"protected subspaces: {len(bases)} modules{of_banks} from {path} are frozen; protected rank per module "
                  f"p_L {min(p_left, default=0)}-{max(p_left, default=0)} (total {sum(p_left)}), "
                  f"p_R {min(p_right, default=0)}-{max(p_right, default=0)} (total {sum(p_right)}); "
                  "--no-osft-protect-subspaces turns this off")
        return bases

    def _trainer_state(self, step: int) -> TrainerState:
        """The trainer state (``trainer_state.json``) after ``step`` optimizer steps."""
        position = self.monitor.position(step + 1)  # the data position of the next step (after skipped batches)
        return TrainerState(
            step=step,
            epoch=position // self.sampler.steps_per_epoch,
            sampler=self.sampler.state(position),
            counters=dict(self.counters),
            scheduler=self.scheduler.state_dict(),
            world_size=self.dist.world_size,
            total_steps=self.total_steps,
            settings=run_settings(self.cfg),
            model=ModelFacts(vocab_size=self.model.get_input_embeddings().weight.shape[0],
                             model_type=self.model.config.model_type),
            osft_plan={name: m.plan.to_dict() for name, m in self.osft.modules} if self.osft else None,
            monitor=self.monitor.state_dict(),
        )

    def checkpoint(self, step: int, request: Request | None) -> str:
        """Save a full-state checkpoint of the state after ``step`` optimizer steps (collective;
        the checkpointer applies retention) and return its path. A request for the step this run last saved
        (it arrived while that checkpoint was written) or resumed from is served by that
        checkpoint: no step is saved twice (the rule: :mod:`.checkpoint.requests`).

        With ``--async-checkpoint`` the write in flight is waited for first (at most one), and a
        periodic or plain checkpoint request is staged here and written in the background
        (:meth:`.checkpoint.full_state.Checkpointer.save_async`): it is logged, and serves its
        requests, once complete (:meth:`check_checkpoint`). A stop request's checkpoint is written
        before this returns."""
        if request is not None:
            self.metrics.log(Event.CHECKPOINT_REQUESTED, signal=request.signal, step=step, point=request.point)
        self.check_checkpoint(wait=True)
        if request is not None:
            if self._saved and self._saved[0] == step and Path(self._saved[1]).is_dir():
                self.poller.served()
                self._say(f"{request.signal}: served by the complete checkpoint of step {step}: {self._saved[1]}")
                return self._saved[1]
            self._say(f"{request.signal}: saving a full-state checkpoint of step {step} (requested {request.point.replace('_', ' ')})")
        if self.cfg.async_checkpoint and (request is None or request.action is Action.CHECKPOINT):
            pending = self.checkpointer.save_async(step, self._trainer_state(step), capture_rng())
            self._writing = (pending, self.poller.claim() if request is not None else None)
            if request is not None:
                barrier()  # see below
            self._say(f"checkpoint: writing {pending.path} in the background (training blocked {pending.blocking_s:.2f} s)")
            return str(pending.path)
        saved = self.checkpointer.save(step, self._trainer_state(step), capture_rng())
        self._checkpoint_complete(saved, self.poller.served if request is not None else None)
        if request is not None:
            # Every rank has removed (or claimed) the trigger files it saw before any rank polls
            # again: a rank that read the node's trigger directory before a peer's removal would
            # otherwise agree the same request once more.
            barrier()
        return str(saved.path)

    def check_checkpoint(self, wait: bool = False) -> None:
        """Finish the checkpoint written in the background, if any, once it is complete (with
        ``wait``: wait for it): log it and serve the requests it was written for. Not collective
        without ``wait``; every rank waits before anything that depends on the newest checkpoint.

        Raises:
            CheckpointWriteError: its write failed on some rank (it has no manifest).
        """
        if self._writing is None or not (wait or self._writing[0].done()):
            return
        pending, claimed = self._writing
        self._writing = None
        saved = pending.result()
        self._checkpoint_complete(saved, None if claimed is None else lambda: self.poller.served(claimed))

    def _checkpoint_complete(self, saved: SavedCheckpoint, serve: Callable[[], None] | None) -> None:
        """A checkpoint is complete: remember it, serve its requests (``serve``, or None), log it."""
        self._saved = (saved.step, str(saved.path))
        if serve is not None:
            serve()
        self.metrics.log(Event.CHECKPOINT_SAVED, step=saved.step, path=str(saved.path), bytes=saved.bytes,
                         seconds=saved.seconds, blocking_s=saved.blocking_s, frozen_bytes=saved.frozen_bytes)
        for path in saved.removed:  # rank 0's list; empty on the other ranks
            self._say(f"checkpoint retention: removed {path}")
        blocked = f"; training blocked {saved.blocking_s:.2f} s" if saved.blocking_s < saved.seconds else ""
        self._say(f"checkpoint: {saved.path} ({saved.bytes / 1e6:.1f} MB in {saved.seconds:.1f} s{blocked})")

    def _micro_batch_loss(self, batch: dict | None, float64_sum: bool = False) -> torch.Tensor:
        """Summed token loss of one packed micro-batch (float32 scalar, on the device; with
        ``float64_sum`` the float32 token losses are summed in float64, as evaluation does, so the
        sum hardly depends on how the samples were packed).

        ``None`` is this rank's empty micro-batch (fewer samples than micro-batches): a one-token
        forward whose loss is multiplied by 0, so the rank still joins FSDP's collectives.
        """
        if batch is None:
            pad = torch.zeros((1, 1), dtype=torch.long, device=self.device)
            return self.model(input_ids=pad, use_cache=False).logits.float().sum() * 0.0
        # The LM head runs only where a label is trained (transformers' ``logits_to_keep`` with the
        # positions as a 1-D tensor): prompts, system turns and padding get no V-wide logits, and no
        # float32 copy of them is made for the cross-entropy (the packed row is one sample row).
        # The positions are found on the host, where collate_packed made the labels: a nonzero()
        # on the device would wait for it once per micro-batch.
        keep = (batch["labels"][0] != IGNORE_INDEX).nonzero().squeeze(1)
        bounds = {BOUNDS_KWARG: batch["sample_bounds"]} if self.packed_attention else {}
        out = self.model(
            input_ids=batch["input_ids"].to(self.device),
            position_ids=batch["position_ids"].to(self.device),
            use_cache=False,
            logits_to_keep=keep.to(self.device),
            **bounds,
        )
        self.last_aux_loss = getattr(out, "aux_loss", None)  # the routers' auxiliary loss (.router_loss)
        logits = out.logits
        losses = F.cross_entropy(
            logits.view(-1, logits.shape[-1]).float(),
            batch["labels"][0, keep].to(self.device),
            reduction="none" if float64_sum else "sum",
        )
        return losses.double().sum() if float64_sum else losses

    def _poll(self, point: str, step: int, micro: int) -> None:
        if self.poller and (request := self.poller.poll(point, step, micro)):
            raise StepInterrupted(request)

    def train_step(self, step: int, indices: list[int]) -> dict:
        """Forward/backward every micro-batch of this rank, project, clip, step, re-project.

        With on-demand checkpointing every rank polls for requests before the forward and before
        and after the backward of each micro-batch.

        Returns the numbers of the ``step`` metrics record.

        Raises:
            RuntimeError: the batch has no loss token.
            Diverged: a non-finite loss or gradient norm, or a loss spike (nothing was applied).
            StepInterrupted: a checkpoint request was agreed before the optimizer step.
        """
        cfg = self.cfg
        start = time.perf_counter()
        waited = self.checkpointer.waited_s  # a wait for a background write below is the next save's, not this step's
        idx = np.asarray(indices, dtype=np.int64)
        total_loss_tokens = int(self.loss_tokens[idx].sum())
        if total_loss_tokens == 0:
            raise RuntimeError(f"step {step}: the global batch has zero trainable tokens (lines {self._lines(idx)})")
        plans = plan_micro_batches(self.lengths[idx], cfg.max_tokens_per_gpu, self.dist.world_size)
        plan = plans[self.dist.rank]
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)  # on the device: no sync per micro-batch
        aux_sum = torch.zeros((), dtype=torch.float64, device=self.device)  # coef x router aux loss x loss tokens
        num_tokens = 0
        # FSDP2 averages gradients over ranks; scaling by world size turns that into the sum, so the
        # gradient is that of (sum of token losses of all ranks) / (loss tokens of the global batch).
        scale = self.dist.world_size / total_loss_tokens
        inject = self.monitor.injected(step)
        for m, micro in enumerate(plan):
            self._poll("before_forward", step, m)
            batch = collate_packed([self.data[int(idx[i])] for i in micro]) if micro else None
            mb_loss = self._micro_batch_loss(batch)
            if m == 0 and inject in ("loss", "spike"):  # test hook (.divergence.TEST_DIVERGE_ENV)
                mb_loss = mb_loss * (float("nan") if inject == "loss" else 1000.0)
            aux = router_term(self.last_aux_loss, self.router_coef, batch)
            self._poll("before_backward", step, m)
            ((mb_loss if aux is None else mb_loss + aux) * scale).backward()
            self._poll("after_backward", step, m)
            loss_sum += mb_loss.detach().double()
            if aux is not None:
                aux_sum += aux.detach().double()
            if batch is not None:
                num_tokens += int(batch["num_tokens"])  # collate_packed's host tensor
        loss_by_rank = gather_on_device(torch.stack([loss_sum, aux_sum]) if self.router_coef else loss_sum).reshape(-1)
        tokens_by_rank = [int(t) for t in gather_float(num_tokens)]
        if inject == "grad":
            local_tensor(next(p.grad for p in self.model.parameters() if p.grad is not None)).view(-1)[0] = float("nan")
        if self.projector:
            self.projector.project_gradients()
        grad_norm = torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.grad is not None], cfg.max_grad_norm)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        # The step's one host sync before the update: the divergence check needs the loss and the grad norm
        # (after it, a step between full orthogonality checks reads the bound: _bound_exceeds_margin).
        *losses, grad_norm = torch.cat([loss_by_rank, grad_norm.detach().double().reshape(1)]).tolist()
        router = {}
        if self.router_coef:  # (CE sum, aux term) per rank
            ce, aux_total = sum(losses[0::2]) / total_loss_tokens, sum(losses[1::2]) / total_loss_tokens
            router = {"ce_loss": ce, "router_aux_loss": aux_total / self.router_coef}
            losses = [ce * total_loss_tokens, aux_total * total_loss_tokens]
        loss = sum(losses) / total_loss_tokens  # the ranks' sums added in rank order, as global_sums does
        self.monitor.check_step(step, loss, grad_norm, lambda: self._lines(idx))
        lr = self.optimizer.param_groups[0]["lr"]  # what this update uses (also after a resume that changed it)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.projector:
            self.projector.project_parameters()
        violations, max_dev, forgetting = 0, None, dict.fromkeys(INDICATOR_FIELDS)
        scheduled = step == 1 or step % cfg.ortho_check_every == 0
        if self.projector and (scheduled or self._bound_exceeds_margin()):
            # The check gathers whole factors (DTensor.full_tensor, functional collectives); one ran
            # beside a background checkpoint's collectives and crashed rank 0 (SIGSEGV) once in a
            # fresh-clone suite: the write in flight finishes first (every --ortho-check-every steps).
            self.check_checkpoint(wait=True)
            report = self.projector.check(cfg.ortho_margin_deg)
            violations, max_dev = report.violations, report.max_dev_deg
            if report.violating:
                self._warn(f"step {step}: orthogonality violations in {report.violating}")
            if scheduled:
                forgetting = self.projector.indicators().fields()
        elapsed = time.perf_counter() - start - (self.checkpointer.waited_s - waited)
        exceeded_before = self.utilization.peak_exceeded
        utilization = self.utilization.fields([self.lengths[idx[[i for micro in p for i in micro]]] for p in plans], elapsed)
        if self.utilization.peak_exceeded and not exceeded_before:
            self._warn(f"step {step} ran faster than the matmul peak measured at start-up allows "
                       f"({self.utilization.measured[0] / 1e9:,.1f} GFLOP/s): that measurement was disturbed; "
                       "MFU is taken against the fastest step from here on")
        global_tokens = sum(tokens_by_rank)
        node_tokens = sum(t for t, node in zip(tokens_by_rank, self.node_of_rank) if node == self.dist.node_rank)
        return dict(
            loss=loss,
            grad_norm=grad_norm,
            lr=lr,
            num_tokens=global_tokens,
            num_loss_tokens=total_loss_tokens,
            num_samples=len(indices),
            step_time_s=elapsed,
            tokens_per_s=global_tokens / elapsed,
            node_tokens_per_s=node_tokens / elapsed,
            samples_per_s=len(indices) / elapsed,
            **utilization,
            **router,
            ortho_violations=violations,
            ortho_max_dev_deg=max_dev,
            **forgetting,
        )

    def _bound_exceeds_margin(self) -> bool:
        """Between the full checks: whether :meth:`.osft.projection.Projector.deviation_bound` fails
        to rule out a deviation above ``--ortho-margin-deg`` (then the step runs the full check);
        False where no bound is available (``--osft-v-projection gram``). Collective."""
        bound = self.projector.deviation_bound()
        return bound is not None and bound > self.cfg.ortho_margin_deg

    def state_sha256(self) -> str:
        """SHA-256 over every rank's local parameter shards and optimizer state, in a fixed order
        (collective). Equal digests mean bit-identical training states."""
        h = hashlib.sha256()
        for name, p in self.model.named_parameters():
            h.update(name.encode())
            h.update(_tensor_bytes(local_tensor(p.detach())))
        for i, state in sorted(self.optimizer.state_dict()["state"].items()):
            for key, value in sorted(state.items()):
                h.update(f"{i}.{key}".encode())
                h.update(_tensor_bytes(local_tensor(value)))
        digests = [h.hexdigest()]
        if self.dist.world_size > 1:
            digests = [None] * self.dist.world_size
            torch.distributed.all_gather_object(digests, h.hexdigest())
        return hashlib.sha256("".join(digests).encode()).hexdigest()

    def _lines(self, idx: np.ndarray) -> list[int]:
        return [int(self.data[int(i)]["line"]) for i in idx[:20]]

    def export(self, step: int, out: Path | None = None) -> str:
        """Write the dense HF export of the model after ``step`` steps to ``out`` (default
        ``hf_format/step_<step>``) with its protected subspaces (``osft_subspaces.safetensors``/
        ``.json``, see :meth:`_fold_subspaces`); rank 0 writes, every rank takes part in gathering
        the shards. Returns its path."""
        out = out or self.run_dir.hf_export(step)
        state = full_state_dict(self.model)
        inputs = self._input_bases(state, step) if self.osft and self.cfg.osft_protect_basis == "inputs" else None
        folds = self._fold_subspaces(state, inputs, step) if self.osft else None
        if self.dist.rank == 0:
            extra = None
            if self.osft:
                settings = {k.removeprefix("osft_protect_"): getattr(self.cfg, k) for k in
                            ("osft_protect_energy", "osft_protect_max_rank_ratio", "osft_protect_basis")}
                if inputs is not None:
                    settings.update(input_energy=self.cfg.osft_protect_input_energy,
                                    input_samples=self.cfg.osft_protect_input_samples, input_passes=inputs.passes)
                source = {"output_dir": str(Path(self.cfg.output_dir).resolve()), "job_id": self.job_id, "step": step}

                def extra(directory: Path) -> None:
                    write_subspaces(directory, folds, settings, source)
            else:
                self._say(f"export: no {SUBSPACES_FILE}: a --no-osft run (full fine-tuning) has no protected "
                          "subspaces to pass on")
            save_hf_model(
                self.model.config, dense_state_dict(state, self.osft), self.tokenizer, out,
                getattr(torch, self.cfg.save_dtype), overwrite=True, extra=extra,
                generation_config=source_generation_config(self.cfg.model_name_or_path),
            )
        barrier()
        return str(out)

    def _fold_subspaces(self, state: dict[str, torch.Tensor], inputs: InputBases | None,
                        step: int) -> dict[str, ModuleFold] | None:
        """Every module's protected bases after this run (:func:`.osft.protect.fold_module` on the
        full tensors of rank 0, with the ``inputs`` variant's directions where collected), module i
        folded by rank i mod world size (:func:`.distributed.map_over_ranks`); on rank 0 logs a
        ``subspaces_folded`` record and the modules where the cap bound (with the energy actually
        kept) and returns the folds, on the others None. Collective."""
        cfg = self.cfg
        keys = ("U_low", "S_low", "V_low", "U_start", "S_start", "V_start")

        def fold_args(name: str, plan) -> tuple[dict[str, torch.Tensor], bool, tuple | None]:
            empty = dict(zip("PQ", no_bases(plan.n, plan.m, experts=plan.experts)))  # p = 0: no parameter
            factors = {**{k: state.get(f"{name}.{k}", v) for k, v in empty.items()}, **{k: state[f"{name}.{k}"] for k in keys}}
            return factors, bool(plan.experts), None if inputs is None else inputs.directions.get(name)

        def fold(args: tuple[dict[str, torch.Tensor], bool, tuple | None]) -> ModuleFold:
            factors, bank, directions = args
            if bank:  # the update variant, per expert
                return fold_bank(factors, cfg.osft_protect_energy, cfg.osft_protect_max_rank_ratio)
            return fold_module(factors, cfg.osft_protect_energy, cfg.osft_protect_max_rank_ratio, directions)

        modules = self.osft.modules
        args = [fold_args(name, module.plan) for name, module in modules] if self.dist.rank == 0 else None
        results = map_over_ranks(fold, args, len(modules))
        if results is None:
            return None
        folds = {name: f for (name, _), f in zip(modules, results)}
        capped = {name: round(f.update.energy, 4) for name, f in folds.items() if f.update.cap_bound}
        passes = {} if inputs is None else {"input_passes": inputs.passes}
        self.metrics.log(Event.SUBSPACES_FOLDED, step=step, modules=len(folds),
                         added_left=sum(f.added_left for f in folds.values()),
                         added_right=sum(f.added_right for f in folds.values()), cap_bound_energy=capped, **passes)
        if capped:
            self._say(f"protected subspaces: the rank cap (--osft-protect-max-rank-ratio {cfg.osft_protect_max_rank_ratio}) "
                      f"bound in {len(capped)} modules; energy kept there {min(capped.values()):.3f}-"
                      f"{max(capped.values()):.3f} (target {cfg.osft_protect_energy})")
        return folds

    def _input_bases(self, state: dict[str, torch.Tensor], step: int) -> InputBases:
        """The ``inputs`` variant's directions of every trainable OSFT module (not banks) from its
        layer inputs over the first ``--osft-protect-input-samples`` training samples
        (:func:`.osft.input_grams.input_bases`: eval mode, this run's micro-batch plan, one pass per
        group of Grams that fits ``--osft-protect-input-memory-gb``; collective). ``state``: the
        full state dict (rank 0), whose Q each module's directions avoid."""
        cfg = self.cfg
        idx = np.arange(min(cfg.osft_protect_input_samples, len(self.data)))
        plan = plan_micro_batches(self.lengths[idx], cfg.max_tokens_per_gpu, self.dist.world_size)[self.dist.rank]

        def batch(micro: list[int]) -> dict | None:
            return collate_packed([self.data[int(idx[i])] for i in micro]) if micro else None

        def probe() -> None:
            self._micro_batch_loss(batch(plan[0]))

        check = self.poller.stop_check("export", step) if self.poller else None

        def run(recording) -> None:
            for m, micro in enumerate(plan):
                if check:
                    check(m)
                recording(bool(micro))
                self._micro_batch_loss(batch(micro))

        modules = [(name, m) for name, m in self.osft.modules if not m.plan.experts and not m.plan.frozen]
        q = {name: state[f"{name}.Q"] for name, _ in modules if f"{name}.Q" in state}
        self.model.eval()
        try:
            with torch.no_grad():
                found = input_bases(modules, q, probe, run, cfg.osft_protect_input_memory_gb * 1e9,
                                    cfg.osft_protect_input_energy, cfg.osft_protect_max_rank_ratio, self.device)
        finally:
            self.model.train()
        shared = sum(len(c) for c in found.classes) - len(found.classes)
        if found.passes > 1:
            self._say(f"protected subspaces (inputs): {len(found.classes)} distinct layer inputs of {len(modules)} modules "
                      f"({shared} shared) collected in {found.passes} passes over {len(idx)} samples "
                      f"(--osft-protect-input-memory-gb {cfg.osft_protect_input_memory_gb:g})")
        return found

    def _finish(self, reason: str, exit_code: int, step: int, **fields) -> None:
        """End the run: wait for the checkpoint written in the background (a stop never leaves one
        half-written), log ``run_finished``, close the metrics and leave the process group."""
        self.check_checkpoint(wait=True)
        self.checkpointer.close()
        self.metrics.log(Event.RUN_FINISHED, reason=reason, exit_code=exit_code, step=step, **fields)
        self.metrics.close()
        restore_handlers(self._handlers)
        if self.dist.is_local_main and not os.environ.get(LAUNCHER_PID_ENV):
            self.trigger.remove()  # under the launcher, the launcher removes it
        shutdown_distributed()

    def release(self) -> None:
        """After a failure in process: wait for a background write, give back the signal handlers,
        the trigger directory and the process group (what :meth:`_finish` does at a normal end)."""
        if self.checkpointer is not None:
            self.checkpointer.close()
        restore_handlers(self._handlers)
        if self.dist.is_local_main and not os.environ.get(LAUNCHER_PID_ENV):
            self.trigger.remove()
        shutdown_distributed()

    def run(self) -> TrainResult:
        """Train to ``total_steps`` optimizer steps (from the resumed step), log every step, serve
        checkpoint requests and periodic checkpoints, export at the end.

        A request agreed in the middle of a step saves the state at the start of that step
        (partial gradients dropped, generators rewound), so a resume replays the step exactly.
        Evaluations, the rules that may end the run and divergences: :class:`.monitor.RunMonitor`.
        """
        cfg = self.cfg
        step, last_loss, last_checkpoint = self.start_step, float("nan"), None
        process = psutil.Process()
        try:
            self.monitor.start(step)
        except StopRequested as stop:  # agreed in the step-0 evaluation: served by a checkpoint of the start step
            return self._stopped(step, last_loss, self.checkpoint(step, stop.request), stop.request)
        with TrainProgress(self.total_steps, self.console, enabled=self.dist.is_local_main) as progress:
            while step < self.total_steps:
                self.check_checkpoint()  # a failed background write ends the run here
                position = self.monitor.position(step + 1)
                epoch = position // self.sampler.steps_per_epoch
                rng_at_start = capture_rng()
                indices = self.sampler.indices(position)
                try:
                    record = self.train_step(step + 1, indices)
                except (StepInterrupted, Diverged) as cut:
                    self.optimizer.zero_grad(set_to_none=True)
                    restore_rng(rng_at_start)
                    if isinstance(cut, Diverged):
                        self.check_checkpoint(wait=True)  # a rollback picks the newest complete checkpoint
                        outcome = self.monitor.on_divergence(cut, step)
                        if isinstance(outcome, RunEnd):
                            return self._end_early(step, last_loss, outcome)
                        step = outcome  # rolled back: go on after the reloaded step
                        continue
                    last_checkpoint = self.checkpoint(step, cut.request)
                    if cut.request.action is Action.CHECKPOINT_AND_EXIT:
                        return self._stopped(step, last_loss, last_checkpoint, cut.request)
                    continue  # replay the step from its start
                step += 1
                if len(self.data.parts) > 1:
                    record["dataset_samples"] = self.data.counts(indices)
                self.counters["ortho_violations_total"] += record["ortho_violations"]
                self.counters["samples_seen"] += record["num_samples"]
                self.counters["tokens_seen"] += record["num_tokens"]
                if os.environ.get(TEST_WARNING_ENV) == f"{step}:{self.dist.local_rank}":
                    self._warn(f"test warning from local rank {self.dist.local_rank} at step {step}")
                last_loss = record["loss"]
                if os.environ.get(TEST_STATE_HASH_ENV) == "1":
                    record["state_sha256"] = self.state_sha256()
                self.metrics.log(
                    Event.STEP, step=step, epoch=epoch, ortho_violations_total=self.counters["ortho_violations_total"],
                    rss_bytes=process.memory_info().rss,
                    gpu_mem_bytes=torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None,
                    **record,
                )
                if step % cfg.logging_steps == 0 or step == self.total_steps:
                    progress.update(step, record["loss"], record["lr"], record["tokens_per_s"],
                                    self.counters["ortho_violations_total"], record["mfu"],
                                    self.monitor.console_stats())
                try:
                    end = self.monitor.after_step(step, final=step == self.total_steps)
                    request = self.poller.poll("after_step", step) if self.poller else None
                except StopRequested as stop:  # the evaluation (or best export) abandoned, not recorded
                    end, request = None, stop.request
                if request or (cfg.checkpoint_every_steps and step % cfg.checkpoint_every_steps == 0):
                    last_checkpoint = self.checkpoint(step, request)
                if request and request.action is Action.CHECKPOINT_AND_EXIT:
                    return self._stopped(step, last_loss, last_checkpoint, request)
                if end is not None:
                    return self._end_early(step, last_loss, end)
                try:
                    if cfg.hf_export_every_steps and step % cfg.hf_export_every_steps == 0 and step != self.total_steps:
                        progress.print(f"exported {self.export(step)}")
                except StopRequested as stop:
                    return self._stopped(step, last_loss, self.checkpoint(step, stop.request), stop.request)
        try:
            export_dir = self.export(step)
        except StopRequested as stop:  # agreed in its input-Gram pass: the export is written by the resume
            return self._stopped(step, last_loss, self.checkpoint(step, stop.request), stop.request)
        self._say(f"export: {export_dir}")
        late = self.poller.poll("after_export", step) if self.poller else None
        if late:  # after the last step's safe point: the completed run answers it (.checkpoint.requests)
            self.poller.served()
            self.metrics.log(Event.REQUEST_AFTER_COMPLETION, signal=late.signal, step=step)
            self._say(f"{late.signal} arrived after the last step: the run completed (exit code 0), nothing to resume")
        self._finish(FinishReason.COMPLETED, EXIT_COMPLETED, step, export_dir=export_dir)
        return TrainResult(steps=step, last_loss=last_loss, violations_total=self.counters["ortho_violations_total"],
                           export_dir=export_dir, checkpoint=last_checkpoint, steps_run=step - self.start_step)

    def _end_early(self, step: int, last_loss: float, end: RunEnd) -> TrainResult:
        """End the run after ``step`` steps by an evaluation rule or a divergence: a full-state
        checkpoint of that step (unless one was just written), the final export when ``end`` asks
        for it, its message and ``run_finished`` with its reason and exit code."""
        self.check_checkpoint(wait=True)
        if self._saved and self._saved[0] == step:
            checkpoint = self._saved[1]  # written (or resumed from) at this very state
        else:
            checkpoint = self.checkpoint(step, None)
        export_dir = self.export(step) if end.export_final else end.export_dir
        self._say(end.message)
        self._finish(end.reason, end.exit_code, step, checkpoint=checkpoint, export_dir=export_dir, **end.fields)
        return TrainResult(steps=step, last_loss=last_loss, violations_total=self.counters["ortho_violations_total"],
                           export_dir=export_dir, checkpoint=checkpoint, exit_code=end.exit_code, reason=end.reason,
                           steps_run=step - self.start_step)

    def _stopped(self, step: int, last_loss: float, checkpoint: str, request: Request) -> TrainResult:
        self._say(f"stopped after step {step} on {request.signal}; resume with --resume or "
                  f"--resume-from-full-state-checkpoint {checkpoint}")
        self._finish(FinishReason.STOPPED, EXIT_STOPPED, step, signal=request.signal, checkpoint=checkpoint)
        return TrainResult(steps=step, last_loss=last_loss, violations_total=self.counters["ortho_violations_total"],
                           export_dir=None, checkpoint=checkpoint, exit_code=EXIT_STOPPED,
                           steps_run=step - self.start_step)
