"""The parts of one rank's run, built from its config: the device and dtype, the generators' seed,
the metrics and trackers, and what trains the model: its loss, AdamW, LR schedule and step records.

Each builder takes what it needs and returns typed parts; :class:`.loop.Trainer` calls them in
order and wires the results together.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import numpy as np
import torch
from rich.console import Console
from torch import nn

from ..config import DataConfig, OptimizerConfig, PrecisionConfig, TrainConfig
from ..distributed import DistEnv
from ..model.build import BuiltModel
from ..model.loading import load_config
from ..observe.flops import FlopModel, flop_model
from ..observe.metrics import MetricsLogger, Reporter, console_reporter
from ..observe.step_record import StepRecorder
from ..observe.trackers import open_trackers
from ..osft.projection import Projector
from ..osft.surgery import OSFTModel
from ..rundir import RunDir
from .micro_batch_loss import MicroBatchLoss
from .schedule import build_scheduler


def resolve_device_dtype(cfg: PrecisionConfig) -> tuple[torch.device, torch.dtype]:
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


def open_metrics(cfg: TrainConfig, dist: DistEnv, run_dir: RunDir, job_id: str,
                 console: Console) -> tuple[MetricsLogger, Reporter]:
    """This rank's metrics file (``--report-to`` trackers on global rank 0 only) and its console
    reporter.

    Raises:
        ModuleNotFoundError: a tracker asked for cannot be imported.
    """
    trackers = open_trackers(cfg.report_to, cfg.output_dir, cfg.to_json(), job_id) if dist.rank == 0 else []
    metrics = MetricsLogger(run_dir.metrics, dist, job_id, sinks=trackers)
    return metrics, console_reporter(console, metrics)


def model_flops(cfg: DataConfig) -> FlopModel:
    """The FLOPs per token of ``--model-name-or-path`` (from its config alone: no weights loaded)."""
    return flop_model(load_config(cfg.model_name_or_path))


@dataclass
class RunParts:
    """The model of a run and what trains it: its OSFT modules (None for ``--no-osft``) and their
    projector (None without OSFT), the micro-batch loss, AdamW, the LR schedule and the step
    records' builder."""

    model: nn.Module
    osft: OSFTModel | None
    projector: Projector | None
    loss: MicroBatchLoss
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    recorder: StepRecorder


def build_run_parts(cfg: OptimizerConfig, built: BuiltModel, device: torch.device, dtype: torch.dtype, dist: DistEnv,
                    total_steps: int, flops: FlopModel, report: Reporter) -> RunParts:
    """What trains the ``built`` model (:func:`osft.trainer.model.build.build_run_model`): AdamW over
    its trainable parameters (fused kernels on CUDA), the LR schedule over ``total_steps`` and the
    step records (:meth:`.observe.step_record.StepRecorder.measure`: the GEMM peak, collective)."""
    params = [p for p in built.model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                  weight_decay=cfg.weight_decay, fused=device.type == "cuda" or None)
    scheduler = build_scheduler(cfg.lr_scheduler, optimizer, cfg.warmup_steps, total_steps)
    recorder = StepRecorder.measure(flops, dist, device, dtype, report)
    return RunParts(built.model, built.osft, built.projector, MicroBatchLoss(built.model, device, built.packed_attention),
                    optimizer, scheduler, recorder)
