"""Stage 0 of the ``osft_general`` arm: protect the base model's input directions on general chat data.

The default chain protects what its own runs used; what the base model does on other inputs stays
in every stage's trainable block. Before the first task, :func:`write_general_basis` writes a copy
of the base model directory (every file byte for byte) that also carries protected subspaces,
``osft_subspaces.safetensors`` and ``osft_subspaces.json`` in the format an OSFT export writes
(:func:`osft.trainer.checkpoint.subspaces.write_subspaces`), so a normal chained ``osft-train``
run from it (``load_protected_bases``) trains every target orthogonally to them. Per OSFT target
W (N×M, out×in):

- ``<module>.P``: N×0. No output directions are protected (no run has changed the model yet).
- ``<module>.Q``: M×p_R with orthonormal columns: the top eigenvectors of G = X Xᵀ (M×M, float64),
  X (M×T) the target's inputs at every token position of the calibration samples, the fewest whose
  eigenvalues hold ε = ``--osft-protect-input-energy`` (default 0.95) of ‖X‖_F² (the GPM criterion,
  no earlier basis), at most floor(cap·k_low) (cap = ``--osft-protect-max-rank-ratio``, default
  0.5; k_low a fresh run's at the config's URR: 144 of SmolLM2's 576-wide modules at URR 0.25,
  so p_R ≤ 72; 48 of its k/v_proj, p_R ≤ 24).

The computation is the export's input-basis fold (:meth:`osft.trainer.checkpoint.export.Exporter._input_bases`,
``_fold_subspaces``) on the base model, through the trainer's own functions: the OSFT modules as a
run at ``cfg`` builds them (:func:`osft.trainer.model.build.build_model`; one SVD per target), the
modules that take input bases (:func:`osft.trainer.osft.input_grams.input_basis_modules`), the
samples packed as that run packs them (:func:`osft.trainer.run.step.rank_micro_batches`, the
forward of :class:`osft.trainer.run.micro_batch_loss.MicroBatchLoss` with packed attention, eval
mode), the Grams and directions (:func:`osft.trainer.osft.input_grams.input_bases`), Q as
:func:`osft.trainer.osft.protect.fold_module` extends it (:func:`osft.trainer.osft.protect.extend_basis`),
the chain budget records (:func:`osft.trainer.osft.chain.chain_budget`). Expert banks and frozen
targets take no input bases (as at export): they get P and Q of width 0.

``osft_subspaces.json`` holds what an export's does (format version, the protection settings of
``cfg`` with ``input_seed``, ``input_passes``; per module ``p_left`` 0, ``p_right``,
``input_energy_kept``, ``input_cap_bound``, ``basis`` and the chain budget: this plan's and the next
run's rank split), plus ``input_data`` (the general data file); its ``source`` is ``out`` itself,
job ``general-basis``, step 0 (no run wrote it).

Calibration samples: ``cfg.osft_protect_input_samples`` rows of the general data file
(``cfg.data_path[0]``; in the benchmark the demo's chit-chat *training* file, never its eval file,
whose rows the R1 probe uses) drawn with ``cfg.seed`` over the file's rows
(:func:`osft.trainer.osft.input_grams.calibration_indices`), tokenized as the stages tokenize
(``cfg.max_seq_len``, ``cfg.overlong``): a row the tokenizer drops (no trained token left within
``max_seq_len``) is not replaced, so ``samples_used`` ≤ the count drawn.
"""

from __future__ import annotations

import gc
import json
import shutil
import socket
import statistics
import tempfile
import time
from pathlib import Path

#: The ``job_id`` of the ``source`` the subspaces file names (no run wrote it).
JOB_ID = "general-basis"


def write_general_basis(cfg, out: Path) -> dict:
    """Write the stage-0 directory ``out``: ``cfg.model_name_or_path`` copied, with protected
    subspaces P (N×0) and Q (M×p_R, the input directions of general data) per OSFT target (see the
    module docstring).

    Args:
        cfg: an ``osft.trainer.config.TrainConfig`` as a stage's run would get (its URR, target
            patterns, protection settings, ``max_seq_len``, ``max_tokens_per_gpu``, ``device``,
            ``dtype``, both named, not ``auto``), with ``data_path`` the general chat file (one
            source, no weight), ``osft_protect_input_samples`` the calibration rows and ``seed``
            their draw.
        out: the directory to write; must not exist.

    Returns:
        :func:`general_record` of ``out`` with ``samples_drawn``, ``samples_used``, ``tokens``
        (input positions in the Grams), ``passes`` (calibration passes) and ``seconds``.

    Raises:
        ValueError: the model is not a directory or already carries protected subspaces (a stage-0
            basis is for a base model), or ``data_path`` is not one source.
        FileExistsError: ``out`` exists (checked before any work).
        osft.trainer.data.tokenize.DataValidationError: from tokenizing the drawn rows, among
            others when none of them is left (every one without a trained token within ``max_seq_len``).
    """
    from osft.trainer.checkpoint.subspaces import SUBSPACES_FILE, write_subspaces
    from osft.trainer.data.tokenize import tokenize_chat_file
    from osft.trainer.model.loading import load_tokenizer
    from osft.trainer.osft.input_grams import calibration_indices

    start = time.perf_counter()
    base, out = Path(cfg.model_name_or_path), Path(out)
    if not base.is_dir():
        raise ValueError(f"stage-0 basis: {base} is not a model directory")
    if (base / SUBSPACES_FILE).exists():
        raise ValueError(f"stage-0 basis: {base} already carries {SUBSPACES_FILE}; a stage-0 basis is for a base model")
    if len(cfg.data_path) != 1:
        raise ValueError(f"stage-0 basis: one general data file expected, got {cfg.data_path}")
    if out.exists():
        raise FileExistsError(f"stage-0 basis: {out} exists")
    general = Path(cfg.data_path[0])
    rows = [line for line in general.read_text(encoding="utf-8").splitlines() if line.strip()]
    drawn = calibration_indices([len(rows)], None, cfg.osft_protect_input_samples, cfg.seed)
    tokenizer = load_tokenizer(base)
    with tempfile.TemporaryDirectory() as tmp:
        picked = Path(tmp) / "general.jsonl"
        picked.write_text("".join(rows[int(i)] + "\n" for i in drawn), encoding="utf-8")
        data = tokenize_chat_file(picked, tokenizer, cfg.max_seq_len, cfg.overlong, num_proc=1)
    folds, passes = _folds(cfg, tokenizer, data)
    gc.collect()
    shutil.copytree(base, out)
    settings = {k.removeprefix("osft_protect_"): getattr(cfg, k) for k in
                ("osft_protect_energy", "osft_protect_max_rank_ratio", "osft_protect_basis")}
    settings.update(frozen_rank=cfg.osft_frozen_rank, input_energy=cfg.osft_protect_input_energy,
                    input_criterion=cfg.osft_protect_input_criterion, input_samples=cfg.osft_protect_input_samples,
                    input_seed=cfg.seed, input_passes=passes, input_data=str(general))
    write_subspaces(out, folds, settings, {"output_dir": str(out.resolve()), "job_id": JOB_ID, "step": 0})
    return {**general_record(out), "samples_drawn": len(drawn), "samples_used": len(data),
            "tokens": int(data.lengths.sum()), "passes": passes, "seconds": round(time.perf_counter() - start, 1)}


def _folds(cfg, tokenizer, data) -> tuple[dict, int]:
    """Every OSFT target's stage-0 fold (``osft.trainer.osft.protect.ModuleFold`` with its chain
    budget record) by module name, from the layer inputs of the tokenized samples ``data`` through
    the base model of ``cfg`` built as a run builds it, and the calibration passes made."""
    import numpy as np
    import torch

    from osft.trainer.distributed import DistEnv
    from osft.trainer.model.build import build_model
    from osft.trainer.model.loading import model_vocab_size
    from osft.trainer.model.packed_attention import use_packed_attention
    from osft.trainer.osft.chain import chain_budget
    from osft.trainer.osft.input_grams import input_bases, input_basis_modules
    from osft.trainer.osft.plan import OSFTSettings
    from osft.trainer.osft.protect import EnergyRank, ModuleFold, extend_basis, no_bases
    from osft.trainer.run.micro_batch_loss import MicroBatchLoss
    from osft.trainer.run.step import rank_micro_batches

    device, dtype = torch.device(cfg.device), getattr(torch, cfg.dtype)
    env = DistEnv(rank=0, local_rank=0, node_rank=0, world_size=1, hostname=socket.gethostname())
    model, osft = build_model(cfg, env, device, dtype, OSFTSettings.from_config(cfg),
                              vocab_size=max(len(tokenizer), model_vocab_size(cfg.model_name_or_path)))
    loss = MicroBatchLoss(model, device, use_packed_attention(model))
    batches = rank_micro_batches(data, np.arange(len(data)), cfg.max_tokens_per_gpu, env)
    budget_bytes = cfg.osft_protect_input_memory_gb * 1e9
    modules = input_basis_modules(osft.modules, cfg.osft_protect_basis, budget_bytes)[0]

    def probe() -> None:
        loss(next(iter(batches)))

    def run(recording) -> None:
        for batch in batches:
            recording(batch is not None)
            loss(batch)

    model.eval()
    with torch.no_grad():
        found = input_bases(modules, None, probe, run, budget_bytes, cfg.osft_protect_input_energy,
                            cfg.osft_protect_max_rank_ratio, device, cfg.osft_protect_input_criterion)
    folds = {}
    for name, module in osft.modules:
        P, Q = no_bases(module.plan.n, module.plan.m, experts=module.plan.experts)
        inputs = found.directions.get(name)
        if inputs is not None:  # as fold_module extends Q (here from no basis)
            Q = extend_basis(Q, inputs[0]).float()
        folds[name] = ModuleFold(P=P, Q=Q, added_left=0, added_right=Q.shape[-1], update=EnergyRank(0, 1.0, False),
                                 inputs=None if inputs is None else inputs[1])
    return chain_budget([(name, m.plan) for name, m in osft.modules], folds, cfg.osft_frozen_rank).folds, found.passes


def general_record(directory: Path) -> dict:
    """The stage-0 fold of ``directory``'s ``osft_subspaces.json`` in brief: ``modules`` (OSFT
    targets), ``inputs_modules`` (those with input bases), ``p_right`` (protected input directions
    per module: ``median``, ``min``, ``max``), ``cap_bound_share`` (share of those modules where
    the cap cut p_R below the energy target), ``input_energy_kept`` (share of ‖X‖_F² held by Q:
    ``median``, ``min``) and ``median_next_k_low_share`` (the next run's k_low over a fresh run's,
    median over the modules)."""
    modules = list(json.loads((Path(directory) / "osft_subspaces.json").read_text())["modules"].values())
    inputs = [m for m in modules if m.get("basis") == "inputs"]
    p_right = [m["p_right"] for m in inputs]
    kept = [m["input_energy_kept"] for m in inputs]
    ratios = [m["next_k_low"] / m["fresh_k_low"] for m in modules if m.get("fresh_k_low")]
    return {"modules": len(modules), "inputs_modules": len(inputs),
            "p_right": {"median": statistics.median(p_right), "min": min(p_right), "max": max(p_right)} if inputs else None,
            "cap_bound_share": sum(bool(m["input_cap_bound"]) for m in inputs) / len(inputs) if inputs else None,
            "input_energy_kept": {"median": statistics.median(kept), "min": min(kept)} if inputs else None,
            "median_next_k_low_share": statistics.median(ratios) if ratios else None}
