"""Build the model a run trains, on one rank or many: load the weights, resize the vocabulary,
build the OSFT modules (:mod:`.osft.surgery`) and, with more than one rank, shard it
(:mod:`osft.trainer.model.sharding`); :func:`build_run_model` adds what a run sets up around it (protected
subspaces, the importance plan, packed attention, activation checkpointing, compilation, freezing,
the projector) and says what it built.

With several ranks, rank 0 reads the weights and the other ranks build the same architecture on the
meta device (host memory does not grow with the ranks of a node); the SVDs are spread over the
ranks (:func:`.osft.surgery.apply_osft`) and rank 0's values reach the others with the FSDP2
broadcast (:func:`osft.trainer.model.sharding.shard_and_broadcast`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import get_args

import numpy as np
import torch
from rich.table import Table
from torch import nn

from .activation_checkpointing import enable_activation_checkpointing
from ..checkpoint.subspaces import SUBSPACES_FILE, read_bases, subspaces_file
from .compile import compile_blocks
from ..config import DataConfig, TrainConfig
from ..contract import Event
from ..distributed import DistEnv, agree
from ..observe.metrics import Reporter
from .loading import load_config, load_model, model_vocab_size
from ..osft.freeze import count_parameters, freeze_non_targets, freeze_routers, non_targets_frozen
from ..osft.input_grams import describe_bases, input_basis_modules
from ..osft.layer_importance import RankPlan, calibration_batches, importance_rank_plan
from ..osft.plan import ForwardForm, ModulePlan, OSFTSettings, plan_table
from ..osft.projection import Projector
from ..osft.surgery import Bases, Check, OSFTModel, apply_osft, skeleton_osft, target_weights
from ..run.router_loss import describe as describe_router_loss
from ..run.router_loss import router_aux_coef
from ..osft.targets import describe_unconstrained, find_target_modules
from .packed_attention import use_packed_attention
from .sharding import shard_and_broadcast
from ..launch.startup import Resume


def meta_model(path: str) -> nn.Module:
    """The architecture of the model at ``path`` built from its config alone on the meta device
    (no weights read, no memory for them): for checks before any rank starts."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(load_config(path))


def target_shapes(path: str, patterns: list[str] | None) -> dict[str, tuple[int, ...]]:
    """(N, M) of every OSFT target of the model at ``path`` and (E, N, M) of every expert bank, by
    module name, from its config alone (:func:`meta_model`, :func:`.osft.surgery.target_weights`)."""
    return {name: tuple(matrix.shape) for name, matrix, *_ in target_weights(meta_model(path), patterns)}


def _resize_vocab(model: nn.Module, vocab_size: int | None, materialised: bool) -> None:
    """Resize the input (and tied or separate output) embeddings to ``vocab_size`` rows when it
    differs; new rows get the mean of the old ones (``mean_resizing``) where the weights are real."""
    if vocab_size and vocab_size != model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(vocab_size, mean_resizing=materialised)


def build_model(cfg: DataConfig, env: DistEnv, device: torch.device, dtype: torch.dtype, osft: OSFTSettings | None,
                vocab_size: int | None = None, from_checkpoint: bool = False,
                plan_ranks: Callable[[nn.Module], Mapping[str, float] | None] | None = None,
                bases: Bases | None = None, plans: Mapping[str, ModulePlan] | None = None,
                check: Check | None = None) -> tuple[nn.Module, OSFTModel | None]:
    """Load the model, build its OSFT modules (with ``osft`` settings; None: ``--no-osft``) and, with
    more than one rank, shard it with FSDP2.

    Args:
        dtype: compute dtype (float32 on CPU, bfloat16 on GPU). With FSDP2 the sharded
            parameters stay float32 and ``dtype`` is the mixed-precision compute dtype.
        osft: the run's :class:`.osft.plan.OSFTSettings`, or None for plain fine-tuning.
        vocab_size: embedding rows to resize to (a larger tokenizer, or the vocab a checkpoint
            was saved with); None keeps the model's.
        from_checkpoint: build the structure only (OSFT skeletons laid out by ``plans``, no SVD, no
            weight broadcast): every parameter is about to be loaded from a full-state checkpoint.
        plan_ranks: called by every rank with the loaded dense model before the decomposition
            (real weights on rank 0, the meta device on the others; not called with
            ``from_checkpoint``); returns the URR per module name that overrides
            ``osft.urr`` (None: none), the same on every rank (collective).
        bases: protected subspaces (P, Q) per module name (:mod:`.osft.protect`).
        plans: the checkpoint's module plans (with ``from_checkpoint``).
        check: the poll for a stop before each round of the SVDs (:func:`.osft.surgery.apply_osft`;
            collective), whose :class:`.checkpoint.requests.StopRequested` abandons the build.

    Returns:
        ``(model, osft)``: the model in train mode on ``device``; ``osft`` lists its OSFT modules.

    Raises:
        ValueError: the model cannot be loaded, or target patterns match nothing.
    """
    if env.world_size == 1:
        model = load_model(cfg.model_name_or_path, dtype, device)
        _resize_vocab(model, vocab_size, materialised=not from_checkpoint)
        built = None
        if osft is not None and from_checkpoint:
            built = skeleton_osft(model, osft, device, plans)
        elif osft is not None:
            built = apply_osft(model, osft, urr_by_module=plan_ranks(model) if plan_ranks else None, bases=bases,
                               check=check)
        return model.train(), built

    from transformers import AutoModelForCausalLM

    param_dtype = torch.float32
    if env.rank == 0:
        model = load_model(cfg.model_name_or_path, param_dtype, "cpu")
    else:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(load_config(cfg.model_name_or_path), dtype=param_dtype)
    _resize_vocab(model, vocab_size, materialised=env.rank == 0 and not from_checkpoint)
    if osft is None:
        built = None
    elif from_checkpoint:
        built = skeleton_osft(model, osft, "meta", plans)
    else:
        built = apply_osft(model, osft, plan_ranks(model) if plan_ranks else None, bases, env.rank, env.world_size,
                           check)
    full_state = None if from_checkpoint else model.state_dict() if env.rank == 0 else {}
    shard_and_broadcast(model, env, device, dtype, full_state)
    if built is not None:  # the modules are the same objects, now holding DTensors
        built = OSFTModel(modules=[(n, model.get_submodule(n)) for n, _ in built.modules], svd_seconds=built.svd_seconds,
                          experts=[(n, model.get_submodule(n)) for n, _ in built.experts])
    return model.train(), built


def load_protected_bases(cfg: TrainConfig) -> tuple[Path, dict[str, tuple[torch.Tensor, torch.Tensor]]] | None:
    """The protected subspaces of ``--model-name-or-path`` (an export of an earlier OSFT run holding
    ``osft_subspaces.safetensors``), checked against this model's targets.

    Returns:
        ``(file, bases by module name)``, or None: no such file, ``--no-osft`` or
        ``--no-osft-protect-subspaces``.

    Raises:
        ValueError: the file does not match the model's targets (names the module and the file).
    """
    path = subspaces_file(cfg.model_name_or_path)
    if path is None or not (cfg.osft and cfg.osft_protect_subspaces):
        return None
    return path, read_bases(path, target_shapes(cfg.model_name_or_path, cfg.osft_target_patterns))


@dataclass(frozen=True)
class BuiltModel:
    """The model a run trains and what came with it: ``osft`` its OSFT modules (None:
    ``--no-osft``), ``projector`` the projection of their gradients and parameters (None without
    OSFT), ``rank_plan`` the importance plan (None: uniform URR or a resume), and whether the model
    runs :mod:`osft.trainer.model.packed_attention`."""

    model: nn.Module
    osft: OSFTModel | None
    projector: Projector | None
    rank_plan: RankPlan | None
    packed_attention: bool


def build_run_model(cfg: TrainConfig, env: DistEnv, device: torch.device, dtype: torch.dtype, resume: Resume | None,
                    tokenizer, dataset, lengths: np.ndarray, report: Reporter, check: Check | None = None) -> BuiltModel:
    """Build the model of a run (collective) and say what was built: from the checkpoint's
    vocabulary size and OSFT plans when resuming (no SVD), else with the protected subspaces of the
    model directory and, under ``--osft-rank-schedule importance``, the URR of each target from the
    block importance on the first training samples (``dataset``, ``lengths``); then the OSFT report,
    packed attention, activation checkpointing, compilation, freezing and the projector. ``check``:
    the poll for a stop between rounds of the start-up SVDs (:func:`build_model`; collective).

    Raises:
        StopRequested: a stop was agreed during the SVDs (:mod:`.checkpoint.requests`).
        ValueError: the model cannot be loaded, target patterns match nothing, protected subspaces
            that do not fit, or input Grams over ``--osft-protect-input-memory-gb``.
    """
    bases, plans, rank_plan = None, None, None
    if resume is not None:
        vocab = resume.state.model.vocab_size
        if resume.state.osft_plan:  # None for a --no-osft run
            plans = {name: ModulePlan.from_dict(d) for name, d in resume.state.osft_plan.items()}
    else:
        vocab = max(len(tokenizer), model_vocab_size(cfg.model_name_or_path))
        bases = _protected_bases(cfg, report)

    def plan_ranks(model: nn.Module) -> dict[str, float] | None:
        nonlocal rank_plan
        rank_plan = _importance_plan(cfg, env, model, dataset, lengths)
        return rank_plan.urr_by_module if rank_plan else None

    osft_settings = OSFTSettings.from_config(cfg) if cfg.osft else None
    model, osft = build_model(cfg, env, device, dtype, osft=osft_settings, vocab_size=vocab,
                              from_checkpoint=resume is not None, bases=bases, plans=plans, plan_ranks=plan_ranks,
                              check=check)
    if osft:
        _report_osft(cfg, env, osft, resume, rank_plan, report)
    # each packed sample attends within itself (no T x T mask); compiled blocks keep transformers'
    # SDPA, whose graph does not depend on where the samples of a row start
    packed_attention = not cfg.compile and use_packed_attention(model)
    if cfg.activation_checkpointing:
        report.say(f"activation checkpointing: {enable_activation_checkpointing(model)} decoder blocks "
                   "recompute their activations in the backward pass")
    if cfg.compile:
        report.say(f"compile: {compile_blocks(model)} decoder blocks (torch.compile, inductor)")
    frozen, why = non_targets_frozen(cfg) if osft else (False, None)
    if frozen:
        freeze_non_targets(model, osft)
        report.say(why)
    if cfg.freeze_router:
        report.say(f"MoE routers frozen: {len(freeze_routers(model, cfg.model_name_or_path))} parameters")
    if coef := router_aux_coef(model.config):
        report.say(describe_router_loss(coef))
    report.say(count_parameters(model, osft).describe())
    if osft and env.rank == 0:
        warning, note = describe_unconstrained(model, [name for name, _ in osft.modules])
        if note:
            report.say(note)
        if warning:
            report.warn(warning)
    trained = [(n, m) for n, m in osft.modules if not m.plan.frozen] if osft else []
    projector = Projector(trained, osft_settings.v_projection, osft_settings.caches_v_basis(device)) if osft else None
    return BuiltModel(model, osft, projector, rank_plan, packed_attention)


def _report_osft(cfg: TrainConfig, env: DistEnv, osft: OSFTModel, resume: Resume | None, rank_plan: RankPlan | None,
                 report: Reporter) -> None:
    """Say which modules will protect their input bases at export (an ``inputs`` Gram over its
    budget fails now, not at the first export) and how the OSFT modules were made, with the plan
    table on rank 0 and the importance plan."""
    if cfg.osft_protect_basis != "update":
        collected, fallback = input_basis_modules(osft.modules, cfg.osft_protect_basis,
                                                  cfg.osft_protect_input_memory_gb * 1e9)
        report.say(describe_bases(len(collected), fallback))
    if resume is not None:
        report.say(f"OSFT: {len(osft.modules)} modules loaded from {resume.path} (no SVD)")
    else:
        forms = [m.forward_form for m in osft.osft_modules]
        urrs = [m.plan.urr for m in osft.osft_modules]
        urr = f"{min(urrs):.3g}-{max(urrs):.3g} by block importance" if rank_plan else f"{cfg.osft_unfreeze_rank_ratio}"
        report.say(
            f"OSFT: {len(forms)} modules decomposed in {osft.svd_seconds:.1f} s "
            f"(URR {urr}; forward: {', '.join(f'{forms.count(f)} {f}' for f in get_args(ForwardForm))})"
        )
        if rank_plan:
            _report_rank_plan(env, osft, rank_plan, report)
    if env.rank == 0:
        report.show(plan_table([(n, m.plan) for n, m in osft.modules]))


def _importance_plan(cfg: TrainConfig, env: DistEnv, model: nn.Module, dataset, lengths: np.ndarray) -> RankPlan | None:
    """The importance plan under ``--osft-rank-schedule importance`` (None: uniform URR).

    Called by every rank with its freshly built dense ``model`` (real weights on rank 0, the meta
    device elsewhere): rank 0 scores the decoder blocks on the first ``--osft-importance-samples``
    training samples, packed as for training (:mod:`.osft.layer_importance`), and every rank
    receives the same plan (:func:`.distributed.agree`).
    """
    if cfg.osft_rank_schedule != "importance":
        return None

    def plan() -> RankPlan:
        targets = find_target_modules(model, model.config.model_type, cfg.osft_target_patterns)
        batches = calibration_batches(dataset, lengths, cfg.osft_importance_samples, cfg.max_tokens_per_gpu)
        return importance_rank_plan(model, batches, targets, cfg.osft_min_frozen_ratio, cfg.osft_max_frozen_ratio)

    return agree(plan, env.rank)


def _report_rank_plan(env: DistEnv, osft: OSFTModel, plan: RankPlan, report: Reporter) -> None:
    """Print the importance plan (rich table, each node's local rank 0) and log it as one
    ``osft_rank_plan`` record, with the k_high each target got."""
    k_high = {name: m.plan.k_high for name, m in osft.modules}
    report.log(Event.OSFT_RANK_PLAN, **plan.to_json(), k_high_by_module=k_high)
    table = Table(title=f"OSFT rank plan: block importance on {plan.tokens} calibration tokens")
    for column in ("block", "cos(input, output)", "frozen", "URR", "k_high"):
        table.add_column(column, justify="left" if column == "block" else "right")
    for i, block in enumerate(plan.blocks):
        ks = [k for name, k in k_high.items() if plan.block_of(name) == i]
        shown = "-" if not ks else str(ks[0]) if min(ks) == max(ks) else f"{min(ks)}-{max(ks)}"
        table.add_row(block, f"{plan.similarity[i]:.4f}", f"{plan.frozen[i]:.3f}", f"{plan.urr[i]:.3f}", shown)
    if env.is_local_main:
        report.show(table)


def _protected_bases(cfg: TrainConfig, report: Reporter) -> dict | None:
    """The protected subspaces of the model directory (None without), announced on the console."""
    found = load_protected_bases(cfg)
    if found is None:
        file = Path(cfg.model_name_or_path) / SUBSPACES_FILE
        if file.is_file() and not cfg.osft:
            report.say(f"protected subspaces: {file} dropped (--no-osft): full fine-tuning trains every direction "
                       "and this run's export carries no subspaces")
        elif file.is_file() and not cfg.osft_protect_subspaces:
            report.say(f"protected subspaces: {file} not used (--no-osft-protect-subspaces): every direction of the "
                       "model may train again")
        return None
    path, bases = found
    p_left = [P.shape[-1] for P, _ in bases.values()]
    p_right = [Q.shape[-1] for _, Q in bases.values()]
    banks = sum(P.dim() == 3 for P, _ in bases.values())
    of_banks = f" ({banks} of them expert banks, a basis per expert)" if banks else ""
    report.say(f"protected subspaces: {len(bases)} modules{of_banks} from {path} are frozen; protected rank per module "
               f"p_L {min(p_left, default=0)}-{max(p_left, default=0)} (total {sum(p_left)}), "
               f"p_R {min(p_right, default=0)}-{max(p_right, default=0)} (total {sum(p_right)}); "
               "--no-osft-protect-subspaces turns this off")
    return bases
