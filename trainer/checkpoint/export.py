"""The dense Hugging Face export of a run's model with its protected subspaces.

:class:`Exporter` gathers the model's full state (every rank), folds each OSFT module's protected
bases for the next run of a chain (:func:`.osft.protect.fold_module`, spread over the ranks; the
chain budget of :func:`.osft.chain.chain_budget`), where input bases apply (``--osft-protect-basis``
``auto`` or ``inputs``) first collecting the layer inputs' Grams over training samples drawn with the
run's seed (:func:`.osft.input_grams.calibration_indices`, :func:`.osft.input_grams.input_bases`),
and rank 0 writes the export
(:func:`.hf_export.save_hf_model`) with ``osft_subspaces.safetensors``/``.json``
(:func:`.subspaces.write_subspaces`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .. import test_hooks
from ..config import DataConfig, PrecisionConfig, ProtectionConfig
from ..contract import Event
from ..data.micro_batches import MicroBatches
from ..distributed import DistEnv, barrier, map_over_ranks
from ..observe.metrics import Reporter
from ..osft.chain import chain_budget
from ..osft.input_grams import InputBases, calibrate, calibration_indices, input_basis_modules
from ..osft.protect import ModuleFold, fold_bank, fold_module, no_bases
from ..osft.surgery import OSFTModel, dense_state_dict, full_state_dict
from ..rundir import RunDir
from .hf_export import save_hf_model, source_generation_config
from .subspaces import SUBSPACES_FILE, write_subspaces


class Exporter:
    """The exports of one rank's run (collective: every rank calls :meth:`export`).

    Args:
        cfg: how the protected subspaces are folded; ``data``: the model it was trained from
            (``generation_config.json``) and the run directory (the export's ``source``);
            ``precision``: ``--save-dtype``; ``seed``: the calibration draw's (``--seed``).
        model: the trained model (sharded by FSDP2 with several ranks); ``osft``: its OSFT modules
            (None: ``--no-osft``); ``tokenizer``: saved with every export.
        loss: the summed token loss of one packed micro-batch (None: this rank's empty one), run
            for the input Grams' forward passes; ``batches(idx)``: the training samples at positions
            ``idx`` as this run packs them; ``sizes``, ``weights``: samples per training source and
            the mixture weights (None: drawn as one), for the calibration draw; ``stop_check(point,
            step)``: the poll of a long pass (:meth:`.manager.CheckpointManager.stop_check`), which
            abandons the input-Gram calibration (point ``export``) or the fold (point ``fold``) on a
            stop (:class:`.requests.StopRequested`).
        report: the run's console and metrics (``subspaces_folded`` records).
    """

    def __init__(self, cfg: ProtectionConfig, data: DataConfig, precision: PrecisionConfig, seed: int,
                 dist: DistEnv, job_id: str, run_dir: RunDir, report: Reporter,
                 model: nn.Module, osft: OSFTModel | None, tokenizer, device: torch.device,
                 loss: Callable[[dict | None], torch.Tensor], batches: Callable[[np.ndarray], MicroBatches],
                 sizes: list[int], weights: list[float] | None,
                 stop_check: Callable[[str, int], Callable[[int], None] | None]) -> None:
        self.cfg, self.seed, self.save_dtype = cfg, seed, precision.save_dtype
        self.source_model, self.output_dir = data.model_name_or_path, data.output_dir
        self.dist, self.job_id, self.run_dir, self.report = dist, job_id, run_dir, report
        self.model, self.osft, self.tokenizer, self.device = model, osft, tokenizer, device
        self.loss, self.batches, self.sizes, self.weights = loss, batches, sizes, weights
        self.stop_check = stop_check

    def export(self, step: int, out: Path | None = None) -> str:
        """Write the dense HF export of the model after ``step`` steps to ``out`` (default
        ``hf_format/step_<step>``) with its protected subspaces (``osft_subspaces.safetensors``/
        ``.json``, see :meth:`_fold_subspaces`); rank 0 writes, every rank takes part in gathering
        the shards. Returns its path."""
        out = out or self.run_dir.hf_export(step)
        state = full_state_dict(self.model)
        inputs = self._input_bases(state, step) if self.osft and self.input_basis_modules()[0] else None
        folds = self._fold_subspaces(state, inputs, step) if self.osft else None
        if self.dist.rank == 0:
            extra = None
            if self.osft:
                settings = {k.removeprefix("osft_protect_"): getattr(self.cfg, k) for k in
                            ("osft_protect_energy", "osft_protect_max_rank_ratio", "osft_protect_basis")}
                settings.update(frozen_rank=self.cfg.osft_frozen_rank)
                if inputs is not None:
                    settings.update(input_energy=self.cfg.osft_protect_input_energy,
                                    input_criterion=self.cfg.osft_protect_input_criterion,
                                    input_samples=self.cfg.osft_protect_input_samples, input_seed=self.seed,
                                    input_passes=inputs.passes)
                source = {"output_dir": str(Path(self.output_dir).resolve()), "job_id": self.job_id, "step": step}

                def extra(directory: Path) -> None:
                    write_subspaces(directory, folds, settings, source)
            else:
                self.report.say(f"export: no {SUBSPACES_FILE}: a --no-osft run (full fine-tuning) has no protected "
                          "subspaces to pass on")
            save_hf_model(
                self.model.config, dense_state_dict(state, self.osft), self.tokenizer, out,
                getattr(torch, self.save_dtype), overwrite=True, extra=extra,
                generation_config=source_generation_config(self.source_model),
            )
        barrier()
        return str(out)

    def _fold_subspaces(self, state: dict[str, torch.Tensor], inputs: InputBases | None,
                        step: int) -> dict[str, ModuleFold] | None:
        """Every module's protected bases after this run (:func:`.osft.protect.fold_module` on the
        full tensors of rank 0, with the ``inputs`` variant's directions where collected), module i
        folded by rank i mod world size (:func:`.distributed.map_over_ranks`, polling for a stop
        before each round of one module per rank, point ``fold``); on rank 0 logs a
        ``subspaces_folded`` record and the modules where the cap bound (with the energy actually
        kept) and returns the folds, on the others None. Collective.

        Raises:
            StopRequested: a stop was agreed between two rounds (nothing is logged)."""
        cfg = self.cfg
        keys = ("U_low", "S_low", "V_low", "U_start", "S_start", "V_start")

        def fold_args(name: str, plan) -> tuple[dict[str, torch.Tensor], bool, tuple | None]:
            empty = dict(zip("PQ", no_bases(plan.n, plan.m, experts=plan.experts)))  # p = 0: no parameter
            factors = {**{k: state.get(f"{name}.{k}", v) for k, v in empty.items()}, **{k: state[f"{name}.{k}"] for k in keys}}
            return factors, bool(plan.experts), None if inputs is None else inputs.directions.get(name)

        def fold(args: tuple[dict[str, torch.Tensor], bool, tuple | None]) -> ModuleFold:
            factors, bank, directions = args
            time.sleep(delay)  # test hook (.test_hooks.FOLD_DELAY_ENV)
            if bank:  # the update variant, per expert
                return fold_bank(factors, cfg.osft_protect_energy, cfg.osft_protect_max_rank_ratio)
            return fold_module(factors, cfg.osft_protect_energy, cfg.osft_protect_max_rank_ratio, directions)

        modules, delay = self.osft.modules, test_hooks.fold_delay()
        args = [fold_args(name, module.plan) for name, module in modules] if self.dist.rank == 0 else None
        results = map_over_ranks(fold, args, len(modules), self.stop_check("fold", step))
        if results is None:
            return None
        budget = chain_budget([(name, m.plan) for name, m in modules], dict(zip([n for n, _ in modules], results)),
                              cfg.osft_frozen_rank)
        folds = budget.folds
        self.report.say(budget.line())
        if warning := budget.warning():
            self.report.warn(warning)
        capped = {name: round(f.update.energy, 4) for name, f in folds.items() if f.update.cap_bound}
        passes = {} if inputs is None else {"input_passes": inputs.passes}
        self.report.log(Event.SUBSPACES_FOLDED, step=step, modules=len(folds),
                         added_left=sum(f.added_left for f in folds.values()),
                         added_right=sum(f.added_right for f in folds.values()), cap_bound_energy=capped, **passes)
        if capped:
            self.report.say(f"protected subspaces: the rank cap (--osft-protect-max-rank-ratio {cfg.osft_protect_max_rank_ratio}) "
                      f"bound on the update side in {len(capped)} modules; energy kept there {min(capped.values()):.3f}-"
                      f"{max(capped.values()):.3f} (target {cfg.osft_protect_energy})")
        return folds

    def _input_bases(self, state: dict[str, torch.Tensor], step: int) -> InputBases:
        """The input bases of the modules :meth:`input_basis_modules` names, from their layer inputs
        over ``--osft-protect-input-samples`` training samples drawn with the run's seed
        (:func:`.osft.input_grams.calibration_indices`; :func:`.osft.input_grams.input_bases`: eval mode, this run's micro-batch plan, one pass per
        group of Grams that fits ``--osft-protect-input-memory-gb``; collective). ``state``: the
        full state dict (rank 0), whose Q each module's directions avoid."""
        cfg = self.cfg
        idx = calibration_indices(self.sizes, self.weights, cfg.osft_protect_input_samples, self.seed)
        batches = self.batches(idx)
        modules = self.input_basis_modules()[0]
        q = {name: state[f"{name}.Q"] for name, _ in modules if f"{name}.Q" in state}
        self.model.eval()
        try:
            with torch.no_grad():
                found = calibrate(modules, q, self.loss, batches, cfg, self.device, self.stop_check("export", step))
        finally:
            self.model.train()
        shared = sum(len(c) for c in found.classes) - len(found.classes)
        if found.passes > 1:
            self.report.say(f"protected subspaces (inputs): {len(found.classes)} distinct layer inputs of {len(modules)} modules "
                      f"({shared} shared) collected in {found.passes} passes over {len(idx)} samples "
                      f"(--osft-protect-input-memory-gb {cfg.osft_protect_input_memory_gb:g})")
        return found

    def input_basis_modules(self) -> tuple[list[tuple[str, nn.Module]], dict[str, str]]:
        """:func:`.osft.input_grams.input_basis_modules` of this run's OSFT modules and flags: the
        modules whose input bases are collected, and those that fall back to update bases (why)."""
        return input_basis_modules(self.osft.modules, self.cfg.osft_protect_basis,
                                   self.cfg.osft_protect_input_memory_gb * 1e9)
