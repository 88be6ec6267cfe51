"""``osft-train protect-base``: a base model directory that protects its own input directions on general data.

A chain of OSFT runs protects what its own runs used; what the base model does on other inputs stays
in every run's trainable block. Before the first run, :func:`write_protected_base` writes
``--output-dir``: the ``--model-name-or-path`` directory copied byte for byte (every file, symlinks
followed) plus protected subspaces, ``osft_subspaces.safetensors`` and ``osft_subspaces.json`` in the
format an OSFT export writes (:func:`osft.trainer.checkpoint.subspaces.write_subspaces`), so a normal
chained ``osft-train --model-name-or-path OUTPUT_DIR`` run (``load_protected_bases``) trains every
target orthogonally to them (ΔW·Q = 0). Per OSFT target W (N×M, out×in):

- ``<module>.P``: N×0. No output directions are protected (no run has changed the model yet).
- ``<module>.Q``: M×p_R with orthonormal columns: the top eigenvectors of G = X Xᵀ (M×M, float64),
  X (M×T) the target's inputs at every token position of the calibration samples, the fewest whose
  eigenvalues hold ε = ``--osft-protect-input-energy`` (default 0.95) of ‖X‖_F² (the GPM criterion,
  no earlier basis), at most floor(cap·k_low) (cap = ``--osft-protect-max-rank-ratio``, default
  0.5; k_low a fresh run's at ``--osft-unfreeze-rank-ratio``: 144 of SmolLM2's 576-wide modules at
  URR 0.25, so p_R ≤ 72; 48 of its k/v_proj, p_R ≤ 24).

The computation is the export's input-basis fold (:meth:`osft.trainer.checkpoint.export.Exporter._input_bases`,
``_fold_subspaces``) on the base model, through the trainer's own functions: the OSFT modules as a
run with these settings builds them (:func:`osft.trainer.model.build.build_model`; one SVD per
target), the modules that take input bases (:func:`osft.trainer.osft.input_grams.input_basis_modules`
under ``auto``: expert banks, frozen targets and modules whose Gram exceeds
``--osft-protect-input-memory-gb`` get P and Q of width 0), the samples packed as a run packs them
(:func:`osft.trainer.run.step.rank_micro_batches`, ``--max-tokens-per-gpu``; the forward of
:class:`osft.trainer.run.micro_batch_loss.MicroBatchLoss` with packed attention, eval mode), the
Grams and directions (:func:`osft.trainer.osft.input_grams.calibrate`, one calibration pass per
Gram budget group), Q as :func:`osft.trainer.osft.protect.fold_module` extends it
(:func:`osft.trainer.osft.protect.extend_basis`), and the chain budget records
(:func:`osft.trainer.osft.chain.chain_budget`, under ``--osft-frozen-rank``). One rank, in this
process, on ``--device`` in ``--dtype`` (``auto``: CUDA in bfloat16 when available, else CPU in
float32).

``osft_subspaces.json`` holds what an export's does (format version, the protection settings with
``input_seed`` and ``input_passes``; per module ``p_left`` 0, ``p_right``, ``input_energy_kept``,
``input_cap_bound``, ``basis`` and the chain budget: this plan's and the next run's rank split),
plus ``input_data`` (the general data file); its ``source`` is the output directory itself, job
:data:`JOB_ID`, step 0 (no run wrote it).

Calibration samples: ``--osft-protect-input-samples`` rows (default 64) of the one JSON Lines chat
file ``--data-path``, drawn with ``--seed`` over its non-blank lines
(:func:`osft.trainer.osft.input_grams.calibration_indices`) and tokenized as a run tokenizes
(``--max-seq-len``, ``--overlong``, ``--chat-template``): a row the tokenizer drops (no trained token
left within ``--max-seq-len``) is not replaced, so ``samples_used`` ≤ the count drawn.

Bad input raises :class:`ProtectBaseError` (``osft-train`` exits with code 2) before the model is
built: a flag value out of range or a missing path (:func:`osft.trainer.config.check_config`), a
model path that is no directory or already carries ``osft_subspaces.safetensors``, a ``--data-path``
that is not one JSON Lines file, a file without rows, drawn rows that fail validation or leave no
sample (each problem named ``FILE:LINE`` in the data file), an output directory that exists (with
``--overwrite-output-dir`` one that this command wrote is replaced) or lies inside the model
directory. The directory is written under a hidden sibling name (``.NAME.partial-PID``) and renamed
into place at the end, so a command that fails or is stopped (SIGTERM, SIGINT, SIGHUP: exit code
128 + N, :class:`ProtectBaseStopped`) leaves ``--output-dir`` as it was; one killed with SIGKILL
may leave the hidden directory.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import shutil
import socket
import statistics
import tempfile
import time
from pathlib import Path

from ..config import TrainConfig
from .stops import ToolStopped, stopped_by_signals

#: The ``job_id`` of the ``source`` the subspaces file names (no run wrote it); also how
#: ``--overwrite-output-dir`` recognises a directory this command wrote.
JOB_ID = "protect-base"

#: The ``TrainConfig`` settings ``osft-train protect-base`` takes, as ``osft-train``'s flags (same
#: defaults); every other setting keeps its default.
SETTINGS = ("model_name_or_path", "data_path", "output_dir", "overwrite_output_dir", "osft_unfreeze_rank_ratio",
            "osft_target_patterns", "osft_protect_input_samples", "osft_protect_input_energy",
            "osft_protect_max_rank_ratio", "osft_protect_input_criterion", "osft_protect_input_memory_gb",
            "osft_frozen_rank", "max_seq_len", "overlong", "chat_template", "max_tokens_per_gpu", "seed", "device",
            "dtype")


class ProtectBaseError(ValueError):
    """Bad input to :func:`write_protected_base`, found before the model is built; the message
    names the flag or the file (and line) at fault."""


class ProtectBaseStopped(ToolStopped):
    """Signal ``signum`` (SIGTERM, SIGINT, SIGHUP) stopped :func:`main` before the directory was complete."""

    def __init__(self, signum: int, out: str) -> None:
        super().__init__(signum, f": nothing written ({out} as it was)")


def write_protected_base(cfg: TrainConfig) -> dict:
    """Write ``cfg.output_dir``: ``cfg.model_name_or_path`` copied, with protected subspaces P
    (N×0) and Q (M×p_R, the input directions of general data) per OSFT target (see the module docstring).

    Args:
        cfg: the settings of :data:`SETTINGS` as a chained run would take them (its URR, target
            patterns, protection settings, ``max_seq_len``, ``max_tokens_per_gpu``, ``device``,
            ``dtype``), with ``data_path`` the general chat file (one JSON Lines file, no weight),
            ``osft_protect_input_samples`` the calibration rows and ``seed`` their draw; the others
            are not read.

    Returns:
        :func:`protected_base_record` of the directory with ``samples_drawn``, ``samples_used``,
        ``tokens`` (input positions in the Grams), ``passes`` (calibration passes) and ``seconds``.

    Raises:
        ProtectBaseError: bad input (the module docstring), before the model is built.
        ValueError: target patterns that match nothing, or a Gram over the budget under
            ``--osft-protect-basis inputs`` (:func:`osft.trainer.model.build.build_model`,
            :func:`osft.trainer.osft.input_grams.input_basis_modules`).
    """
    from ..checkpoint.subspaces import write_subspaces
    from ..osft.input_grams import calibration_indices

    start = time.perf_counter()
    base, out, general = _checked_paths(cfg)
    rows, lines = _rows(general)
    drawn = calibration_indices([len(rows)], None, cfg.osft_protect_input_samples, cfg.seed)
    tokenizer, data = _tokenized(cfg, base, general, [rows[int(i)] for i in drawn], [lines[int(i)] for i in drawn])
    folds, passes = _folds(cfg, tokenizer, data)
    gc.collect()
    settings = {k.removeprefix("osft_protect_"): getattr(cfg, k) for k in
                ("osft_protect_energy", "osft_protect_max_rank_ratio", "osft_protect_basis")}
    settings.update(frozen_rank=cfg.osft_frozen_rank, input_energy=cfg.osft_protect_input_energy,
                    input_criterion=cfg.osft_protect_input_criterion, input_samples=cfg.osft_protect_input_samples,
                    input_seed=cfg.seed, input_passes=passes, input_data=str(general))
    source = {"output_dir": str(out.resolve()), "job_id": JOB_ID, "step": 0}

    def fill(tmp: Path) -> None:
        shutil.copytree(base, tmp)
        write_subspaces(tmp, folds, settings, source)

    _write_in_place(out, fill)
    return {**protected_base_record(out), "samples_drawn": len(drawn), "samples_used": len(data),
            "tokens": int(data.lengths.sum()), "passes": passes, "seconds": round(time.perf_counter() - start, 1)}


def _checked_paths(cfg: TrainConfig) -> tuple[Path, Path, Path]:
    """The model directory, the output directory and the general data file of ``cfg``, checked
    (the module docstring's bad input, but for the rows themselves).

    Raises:
        ProtectBaseError: naming the flag and the path.
    """
    from ..checkpoint.subspaces import SUBSPACES_FILE
    from ..config import check_config
    from ..data.sources import location_unit
    from ..data.specs import parse_data_specs

    try:
        check_config(cfg)
    except ValueError as exc:
        raise ProtectBaseError(str(exc)) from exc
    if cfg.osft_protect_basis == "update":
        raise ProtectBaseError("--osft-protect-basis update: a base model has no update to protect; "
                               "protect-base protects input directions (auto or inputs)")
    base, out = Path(cfg.model_name_or_path), Path(cfg.output_dir)
    if not base.is_dir():
        raise ProtectBaseError(f"--model-name-or-path {base}: not a model directory (protect-base copies a Hugging "
                               "Face model directory)")
    if (base / SUBSPACES_FILE).exists():
        raise ProtectBaseError(f"--model-name-or-path {base} already carries {SUBSPACES_FILE} (an OSFT export): "
                               "protect-base is for a base model, and a chained run from this directory already "
                               "protects those subspaces")
    specs = parse_data_specs(cfg.data_path)
    if len(specs) != 1 or specs[0].weight is not None:
        raise ProtectBaseError("--data-path: one general chat file expected (no weight), got " + " ".join(cfg.data_path))
    general = Path(specs[0].path)
    if not general.is_file() or location_unit(general) != "line":
        raise ProtectBaseError(f"--data-path {general}: a JSON Lines chat file expected (rows are drawn by line)")
    if out.resolve().is_relative_to(base.resolve()):
        raise ProtectBaseError(f"--output-dir {out} lies inside --model-name-or-path {base}")
    if out.exists() or out.is_symlink():
        if not cfg.overwrite_output_dir:
            raise ProtectBaseError(f"--output-dir {out} exists: give a new directory (--overwrite-output-dir "
                                   "replaces one that protect-base wrote)")
        if not _written_here(out):
            raise ProtectBaseError(f"--output-dir {out} exists and was not written by protect-base: "
                                   "--overwrite-output-dir replaces only such a directory; remove it yourself")
    return base, out, general


def _written_here(directory: Path) -> bool:
    """Whether ``directory`` holds an ``osft_subspaces.json`` this command wrote (its source job is :data:`JOB_ID`)."""
    from ..checkpoint.subspaces import SUBSPACES_JSON

    try:
        meta = json.loads((directory / SUBSPACES_JSON).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and isinstance(meta.get("source"), dict) and meta["source"].get("job_id") == JOB_ID


def _rows(general: Path) -> tuple[list[str], list[int]]:
    """The non-blank lines of the JSON Lines file ``general`` (a leading byte-order mark dropped, as
    a run's reader drops it) and their line numbers (1-based).

    Raises:
        ProtectBaseError: the file is not UTF-8 or has no row.
    """
    try:
        text = general.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ProtectBaseError(f"{general}: not UTF-8 ({exc.reason} at byte {exc.start + 1})") from exc
    numbered = [(n, line) for n, line in enumerate(text.split("\n"), 1) if line.strip()]
    if not numbered:
        raise ProtectBaseError(f"--data-path {general}: no rows")
    return [line.removesuffix("\r") for _, line in numbered], [n for n, _ in numbered]


def _tokenized(cfg: TrainConfig, base: Path, general: Path, rows: list[str], lines: list[int]):
    """The tokenizer of ``base`` and the drawn ``rows`` (from ``lines`` of ``general``) tokenized as
    a run tokenizes them.

    Raises:
        ProtectBaseError: no tokenizer with a chat template in ``base``, or the rows' problems
            (invalid rows, overlong ones under ``--overlong error``, no sample left), each named
            ``FILE:LINE`` in ``general``.
    """
    from ..data.tokenize import tokenize_chat_file
    from ..data.validate import DataValidationError
    from ..model.loading import load_tokenizer

    try:
        tokenizer = load_tokenizer(base, chat_template=cfg.chat_template)
    except (ValueError, FileNotFoundError) as exc:
        raise ProtectBaseError(str(exc)) from exc
    with tempfile.TemporaryDirectory() as tmp:
        picked = Path(tmp) / "general.jsonl"
        picked.write_text("".join(row + "\n" for row in rows), encoding="utf-8")
        try:
            data = tokenize_chat_file(picked, tokenizer, cfg.max_seq_len, cfg.overlong, num_proc=1)
        except DataValidationError as exc:  # located in the temporary file: named in the data file instead
            problems = [dataclasses.replace(p, path=str(general), line=lines[p.line - 1] if p.line else 0,
                                            message=p.message.replace(str(picked), str(general)))
                        for p in exc.problems]
            header = f"{len(problems)} problem(s) in the {len(rows)} rows drawn from {general}"
            raise ProtectBaseError(str(DataValidationError(problems, header))) from exc
    return tokenizer, data


def _folds(cfg: TrainConfig, tokenizer, data) -> tuple[dict, int]:
    """Every OSFT target's fold (``osft.trainer.osft.protect.ModuleFold`` with its chain budget
    record) by module name, from the layer inputs of the tokenized samples ``data`` through the
    base model of ``cfg`` built as a run builds it, and the calibration passes made."""
    import numpy as np
    import torch

    from ..distributed import DistEnv
    from ..model.build import build_model
    from ..model.loading import model_vocab_size
    from ..model.packed_attention import use_packed_attention
    from ..osft.chain import chain_budget
    from ..osft.input_grams import calibrate, input_basis_modules
    from ..osft.plan import OSFTSettings
    from ..osft.protect import EnergyRank, ModuleFold, extend_basis, no_bases
    from ..run.components import resolve_device_dtype
    from ..run.micro_batch_loss import MicroBatchLoss
    from ..run.step import rank_micro_batches

    device, dtype = resolve_device_dtype(cfg)
    env = DistEnv(rank=0, local_rank=0, node_rank=0, world_size=1, hostname=socket.gethostname())
    model, osft = build_model(cfg, env, device, dtype, OSFTSettings.from_config(cfg),
                              vocab_size=max(len(tokenizer), model_vocab_size(cfg.model_name_or_path)))
    loss = MicroBatchLoss(model, device, use_packed_attention(model))
    batches = rank_micro_batches(data, np.arange(len(data)), cfg.max_tokens_per_gpu, env)
    modules = input_basis_modules(osft.modules, cfg.osft_protect_basis, cfg.osft_protect_input_memory_gb * 1e9)[0]
    model.eval()
    with torch.no_grad():
        found = calibrate(modules, None, loss, batches, cfg, device)
    folds = {}
    for name, module in osft.modules:
        P, Q = no_bases(module.plan.n, module.plan.m, experts=module.plan.experts)
        inputs = found.directions.get(name)
        if inputs is not None:  # as fold_module extends Q (here from no basis)
            Q = extend_basis(Q, inputs[0]).float()
        folds[name] = ModuleFold(P=P, Q=Q, added_left=0, added_right=Q.shape[-1], update=EnergyRank(0, 1.0, False),
                                 inputs=None if inputs is None else inputs[1])
    return chain_budget([(name, m.plan) for name, m in osft.modules], folds, cfg.osft_frozen_rank).folds, found.passes


def _write_in_place(out: Path, fill) -> None:
    """Make the directory ``out`` as ``fill(tmp)`` fills a hidden sibling ``tmp``, renamed into place
    once complete; a directory ``out`` already there (``--overwrite-output-dir``, checked before) is
    removed after. When ``fill`` fails or a stop signal interrupts it (:func:`.stops.stopped_by_signals`),
    ``tmp`` is removed and ``out`` left as it was; a process killed with SIGKILL may leave ``tmp``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    try:
        fill(tmp)
        if out.exists() or out.is_symlink():
            os.replace(out, old)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if (old.exists() or old.is_symlink()) and not out.exists():
            os.replace(old, out)
        raise
    if old.is_symlink():
        old.unlink()
    elif old.exists():
        shutil.rmtree(old)


def protected_base_record(directory: Path) -> dict:
    """The fold of ``directory``'s ``osft_subspaces.json`` in brief: ``modules`` (OSFT targets),
    ``inputs_modules`` (those with input bases), ``p_right`` (protected input directions per module:
    ``median``, ``min``, ``max``), ``cap_bound_share`` (share of those modules where the cap cut p_R
    below the energy target), ``input_energy_kept`` (share of ‖X‖_F² held by Q: ``median``,
    ``min``) and ``median_next_k_low_share`` (the next run's k_low over a fresh run's, median over
    the modules); the per-module entries None when no module took input bases."""
    from ..checkpoint.subspaces import SUBSPACES_JSON

    modules = list(json.loads((Path(directory) / SUBSPACES_JSON).read_text())["modules"].values())
    inputs = [m for m in modules if m.get("basis") == "inputs"]
    p_right = [m["p_right"] for m in inputs]
    kept = [m["input_energy_kept"] for m in inputs]
    ratios = [m["next_k_low"] / m["fresh_k_low"] for m in modules if m.get("fresh_k_low")]
    return {"modules": len(modules), "inputs_modules": len(inputs),
            "p_right": {"median": statistics.median(p_right), "min": min(p_right), "max": max(p_right)} if inputs else None,
            "cap_bound_share": sum(bool(m["input_cap_bound"]) for m in inputs) / len(inputs) if inputs else None,
            "input_energy_kept": {"median": statistics.median(kept), "min": min(kept)} if inputs else None,
            "median_next_k_low_share": statistics.median(ratios) if ratios else None}


def summary_line(record: dict, general: str, out: str) -> str:
    """The one line ``osft-train protect-base`` prints at the end, from :func:`write_protected_base`'s
    ``record`` of the data file ``general`` and the directory ``out``."""
    p, kept = record["p_right"], record["input_energy_kept"]
    if record["inputs_modules"]:
        bases = (f"p_R median {p['median']:g} (min {p['min']}, max {p['max']}), the cap bound in "
                 f"{record['cap_bound_share'] * 100:.0f} %, input energy kept median {kept['median']:.3f} (lowest "
                 f"{kept['min']:.3f})")
    else:
        bases = "none (expert banks, or Grams over --osft-protect-input-memory-gb)"
    share = record["median_next_k_low_share"]
    nxt = f"; a chained run's k_low {share:.2f} of a fresh run's (median)" if share is not None else ""
    return (f"protect-base: {record['modules']} modules, {record['inputs_modules']} with input bases: {bases}{nxt}; "
            f"{record['samples_used']} of {record['samples_drawn']} drawn rows of {general}, {record['tokens']:,} "
            f"tokens, {record['passes']} pass{'es' if record['passes'] != 1 else ''}; {record['seconds']:g} s "
            f"-> {out}")


#: This command's help of the flags whose ``osft-train`` help speaks of a training run.
_HELP = {
    "model_name_or_path": "the base model: a Hugging Face model directory (not a .gguf file, nor an export that "
    "carries osft_subspaces.safetensors)",
    "data_path": "general chat data: one JSON Lines file (rows of any chat shape); the calibration rows are drawn "
    "from it",
    "output_dir": "the directory to write: a copy of --model-name-or-path with osft_subspaces.safetensors/.json; "
    "must not exist",
    "overwrite_output_dir": "replace an --output-dir that an earlier protect-base wrote",
    "osft_protect_input_samples": "rows of --data-path, drawn with --seed, whose layer inputs give the protected "
    "input directions",
}


def build_parser():
    """Flags of ``osft-train protect-base``: ``osft-train``'s own for the settings of :data:`SETTINGS`."""
    import argparse

    from ..config import FIELDS
    from ..setting import HelpFormatter, add_flag

    p = argparse.ArgumentParser(
        prog="osft-train protect-base", formatter_class=HelpFormatter, allow_abbrev=False,
        usage="%(prog)s --model-name-or-path BASE --data-path GENERAL.jsonl --output-dir DIR [options]",
        description="Copy a base model directory and add protected subspaces (osft_subspaces.safetensors): per OSFT "
        "target the input directions its layer reads on general chat data (P: N x 0, Q: M x p_R, the GPM energy "
        "criterion), so that chained `osft-train --model-name-or-path DIR` runs train orthogonally to them. One "
        "rank, in this process. See docs/osft.md, Chaining runs.")
    g = p.add_argument_group("settings (as osft-train's, same defaults; use the URR and targets of the chained runs)")
    for field in FIELDS:
        if field.name in SETTINGS:
            add_flag(g, field, require_paths=True, help=_HELP.get(field.name),
                     metavar="FILE" if field.name == "data_path" else None)
    return p


def main(argv: list[str], console) -> dict:
    """``osft-train protect-base``: parse ``argv``, write the directory, print :func:`summary_line`.

    Raises:
        ProtectBaseError: bad flags or input (the CLI exits with code 2).
        ProtectBaseStopped: a stop signal arrived before the directory was complete (the CLI exits
            with code 128 + N).
    """
    args = build_parser().parse_args(argv)
    cfg = TrainConfig(**{name: getattr(args, name) for name in SETTINGS})
    try:
        with stopped_by_signals(lambda signum: ProtectBaseStopped(signum, cfg.output_dir)):
            record = write_protected_base(cfg)
    except ProtectBaseError:
        raise
    except (ValueError, FileNotFoundError) as exc:  # target patterns, the Gram budget under `inputs`
        raise ProtectBaseError(str(exc)) from exc
    console.print(summary_line(record, cfg.data_path[0], cfg.output_dir), markup=False, highlight=False,
                  soft_wrap=True)
    return record
