"""The layer-input Gram matrices of the ``inputs`` variant of protected subspaces, under a memory budget.

The ``inputs`` variant (:func:`.protect.input_directions`) needs, per OSFT module of input size M,
G = X Xᵀ (M×M, float64) of its inputs X over the calibration samples: 8·M² bytes per module, 1.6 GB
for one 14336-wide ``down_proj``. Two things keep that bounded:

- Modules that read the same input tensor share one Gram (a Llama block's q/k/v_proj read the same
  normed hidden state, gate/up_proj another). Sharing is found by one forward with a pre-hook on
  every module that records which storage (data pointer, offset, shape, strides) each call's input
  lives in; the inputs are held until the forward ends, so no storage is reused within it.
- The distinct inputs are split into groups whose Grams fit ``--osft-protect-input-memory-gb``;
  each group gets one calibration pass over the same samples (the same micro-batches), its Grams
  are summed over the ranks onto rank 0, turned into each module's directions there, and freed
  before the next group: peak memory is one group's Grams. Every Gram adds up the same products in
  the same order whatever the grouping, so the result does not depend on the budget.

Expert banks (:mod:`.experts`) run no forward of their own and are not collected: each expert sees
only the tokens routed to it inside the fused kernel, so the run's update (``update`` variant)
protects them instead (:mod:`.protect`). Under ``--osft-protect-basis auto`` (the default) so is
every module whose Gram alone exceeds the budget (:func:`input_basis_modules`).

The calibration samples (:func:`calibration_indices`) are drawn with the run's seed across the whole
training data, every source of a mixture in proportion to its weight, not the first N of the file.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from .protect import EnergyRank, InputSpectrum, fold_cap, input_spectrum

#: Bytes of one Gram entry (float64).
GRAM_ENTRY_BYTES = 8

#: Runs this rank's calibration micro-batches through the model (eval mode, no gradient), calling
#: ``recording(real)`` before each forward: False for an empty micro-batch's stand-in forward.
CalibrationPass = Callable[[Callable[[bool], None]], None]


def gram_bytes(m: int) -> int:
    """Bytes of the M×M float64 Gram of an input of size M."""
    return GRAM_ENTRY_BYTES * m * m


def check_gram_budget(in_features: Mapping[str, int], budget_bytes: float) -> None:
    """Check that every module's Gram fits the budget alone.

    Args:
        in_features: M of every module whose inputs are collected, by name.
        budget_bytes: ``--osft-protect-input-memory-gb`` in bytes.

    Raises:
        ValueError: naming the largest module that does not fit and the bytes its Gram needs.
    """
    over = {name: gram_bytes(m) for name, m in in_features.items() if gram_bytes(m) > budget_bytes}
    if over:
        name = max(over, key=over.get)
        raise ValueError(f"--osft-protect-input-memory-gb {budget_bytes / 1e9:g}: the input Gram matrix of {name} "
                         f"(M = {in_features[name]}) alone needs {over[name] / 1e9:.3g} GB ({over[name]} bytes; "
                         f"{len(over)} modules do not fit); raise the budget or use --osft-protect-basis update")


def input_basis_modules(modules: Sequence[tuple[str, nn.Module]], basis: str,
                        budget_bytes: float) -> tuple[list[tuple[str, nn.Module]], dict[str, str]]:
    """Which OSFT modules take their right-side directions from their inputs under ``--osft-protect-basis``.

    Args:
        modules: the OSFT modules (``plan``, ``in_features``), frozen ones included.
        basis: ``auto``, ``inputs`` or ``update``.
        budget_bytes: ``--osft-protect-input-memory-gb`` in bytes.

    Returns:
        ``(collected, fallback)``: the modules whose inputs are collected (not frozen, not banks; under
        ``auto`` also not those whose Gram alone exceeds the budget), and the trainable modules that use
        the update instead with the reason, by name (under ``update``: none named).

    Raises:
        ValueError: ``inputs`` and a Gram larger than the budget (:func:`check_gram_budget`).
    """
    if basis == "update":
        return [], {}
    trained = [(name, m) for name, m in modules if not m.plan.frozen]
    fallback = {name: "expert bank" for name, m in trained if m.plan.experts}
    linear = [(name, m) for name, m in trained if not m.plan.experts]
    if basis == "inputs":
        check_gram_budget({name: m.in_features for name, m in linear}, budget_bytes)
    for name, m in linear:
        if gram_bytes(m.in_features) > budget_bytes:
            fallback[name] = f"Gram {gram_bytes(m.in_features) / 1e9:.3g} GB > budget"
    return [(name, m) for name, m in linear if name not in fallback], fallback


def describe_bases(collected: int, fallback: Mapping[str, str]) -> str:
    """The console line of :func:`input_basis_modules`' choice, naming every module that falls back
    (``model.layers.<i>.mlp.experts.gate_proj`` and its peers as ``mlp.experts.gate_proj in blocks 0-3``)."""
    from .plan import BLOCK_INDEX

    groups: dict[tuple[str, str, str], list[int]] = {}
    for name, reason in fallback.items():
        hit = BLOCK_INDEX.match(name)
        key = (hit.group(1), hit.group(2), reason) if hit else ("", name, reason)
        groups.setdefault(key, []).append(int(name[len(hit.group(1)):].split(".", 1)[0]) if hit else -1)
    named = []
    for (prefix, rest, reason), blocks in groups.items():
        where = "" if blocks == [-1] else (f" in {prefix}<i> for i = {min(blocks)}-{max(blocks)}" if len(blocks) > 1
                                           else f" in {prefix}{blocks[0]}")
        named.append(f"{rest}{where} ({len(blocks)}, {reason})")
    tail = f"; the update for {len(fallback)}: " + ", ".join(named) if fallback else ""
    return f"protected subspaces at export: input bases for {collected} modules{tail}"


def calibration_indices(sizes: Sequence[int], weights: Sequence[float] | None, count: int, seed: int) -> np.ndarray:
    """``count`` sample indices of the concatenated training data, drawn without replacement with ``seed``.

    One source or several drawn as one (``weights`` None): uniform over every sample. A mixture:
    source i gets a share w_i of ``count`` (largest remainders; at least one sample each while
    ``count`` allows), each at most its size, the rest moved to sources with samples left; within a
    source uniform. The same on every rank (the seed is the run's).

    Args:
        sizes: samples per source, in ``--data-path`` order. weights: normalized mixture weights or None.

    Returns:
        int64 indices into the concatenation, ascending, min(``count``, Σ sizes) of them.
    """
    rng = np.random.default_rng([seed, 0x6F736674])  # a stream of its own, not the sampler's
    total = int(sum(sizes))
    count = min(int(count), total)
    if weights is None:
        return np.sort(rng.choice(total, size=count, replace=False)).astype(np.int64)
    share = np.asarray(weights, dtype=np.float64) * count
    take = np.floor(share).astype(np.int64)
    for i in np.argsort(-(share - take), kind="stable")[: count - int(take.sum())]:
        take[i] += 1
    if count >= len(sizes):  # every source is represented
        for i in np.flatnonzero(take == 0):
            j = int(np.argmax(take))
            take[j] -= 1
            take[i] = 1
    take = np.minimum(take, sizes)
    while int(take.sum()) < count:  # a source smaller than its share: the rest goes where samples are left
        room = np.asarray(sizes) - take
        take[int(np.argmax(room))] += 1
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    picked = [offsets[i] + rng.choice(int(sizes[i]), size=int(n), replace=False) for i, n in enumerate(take)]
    return np.sort(np.concatenate(picked)).astype(np.int64)


def shared_inputs(modules: Sequence[tuple[str, nn.Module]], probe: Callable[[], None]) -> list[list[str]]:
    """The modules grouped by the input they read, from one forward (``probe()``).

    Two modules share when every call of the forward handed them the same tensor storage (data
    pointer, storage offset, shape and strides of the first argument, call by call). A module the
    forward never called is alone.

    Returns:
        Classes of module names, each in ``modules`` order, ordered by their first member.
    """
    calls: dict[str, list[tuple]] = {name: [] for name, _ in modules}
    alive: list[torch.Tensor] = []  # keeps every input's storage from being reused during the forward

    def hook(name: str):
        def record(_module, args) -> None:
            x = args[0]
            alive.append(x)
            calls[name].append((x.device, x.untyped_storage().data_ptr(), x.storage_offset(), tuple(x.shape), x.stride()))
        return record

    handles = [m.register_forward_pre_hook(hook(name)) for name, m in modules]
    try:
        with torch.no_grad():
            probe()
    finally:
        for h in handles:
            h.remove()
        alive.clear()
    classes: dict[tuple, list[str]] = {}
    for name, _ in modules:
        classes.setdefault(tuple(calls[name]) or ("never called", name), []).append(name)
    return list(classes.values())


def budget_groups(classes: Sequence[Sequence[str]], in_features: Mapping[str, int],
                  budget_bytes: float) -> list[list[Sequence[str]]]:
    """The classes split, in order, into groups whose Grams (one per class, 8·M² bytes) fit the budget.

    Raises:
        ValueError: from :func:`check_gram_budget`.
    """
    check_gram_budget({c[0]: in_features[c[0]] for c in classes}, budget_bytes)
    groups: list[list[Sequence[str]]] = []
    used = 0
    for members in classes:
        size = gram_bytes(in_features[members[0]])
        if not groups or used + size > budget_bytes:
            groups.append([])
            used = 0
        groups[-1].append(members)
        used += size
    return groups


@torch.no_grad()
def accumulate_grams(readers: Sequence[nn.Module], run: CalibrationPass) -> list[torch.Tensor]:
    """X Xᵀ (M×M, float64, CPU) of each module's inputs over one calibration pass ``run``, this rank's
    share; the rows of every call's input (…, M) are the columns of X."""
    grams = [torch.zeros(m.in_features, m.in_features, dtype=torch.float64) for m in readers]
    recording = [False]

    def hook(i: int):
        def record(_module, args) -> None:
            if recording[0]:
                x = args[0].detach().reshape(-1, args[0].shape[-1]).double().cpu()
                grams[i] += x.t() @ x
        return record

    def set_recording(real: bool) -> None:
        recording[0] = real

    handles = [m.register_forward_pre_hook(hook(i)) for i, m in enumerate(readers)]
    try:
        run(set_recording)
    finally:
        for h in handles:
            h.remove()
    return grams


@dataclass(frozen=True)
class InputBases:
    """The result of :func:`input_bases`: per module ``directions`` (Q_t: M×r float64 and the
    :class:`.protect.EnergyRank` kept; rank 0 only, empty on the others), the ``classes`` of modules
    that share one input, and the calibration ``passes`` made (one per budget group)."""

    directions: dict[str, tuple[torch.Tensor, EnergyRank]]
    classes: list[list[str]]
    passes: int


def input_bases(modules: Sequence[tuple[str, nn.Module]], bases_q: Mapping[str, torch.Tensor] | None,
                probe: Callable[[], None], run: CalibrationPass, budget_bytes: float, energy: float,
                max_rank_ratio: float, device: torch.device, criterion: str = "total") -> InputBases:
    """The right-side directions of the ``inputs`` variant of every module (see the module docstring).

    Collective when a process group of several ranks exists: every rank calls it with the same
    modules; rank 0 gets the directions.

    Args:
        modules: the OSFT modules (``in_features`` M, ``plan.k_low``) to collect, not frozen ones
            nor expert banks.
        bases_q: rank 0: each module's protected Q (M×p_R) before this run (missing: p_R = 0).
        probe: one forward of the model (sharing detection, :func:`shared_inputs`).
        run: one calibration pass (:data:`CalibrationPass`).
        budget_bytes: the most bytes of Grams held at once (``--osft-protect-input-memory-gb``).
        energy: ε of :func:`.protect.input_directions`; ``max_rank_ratio``: its cap as a share of k_low;
            ``criterion``: its energy criterion (``total`` or ``residual``).
        device: where the Grams are summed over the ranks (the ranks' device: NCCL needs CUDA).

    Raises:
        ValueError: one Gram exceeds the budget (:func:`check_gram_budget`, after the probe).
    """
    by_name = dict(modules)
    in_features = {name: m.in_features for name, m in modules}
    classes = shared_inputs(modules, probe)
    several = dist.is_initialized() and dist.get_world_size() > 1
    if several:  # every rank sees the same structure; rank 0's word makes it certain
        box = [classes]
        dist.broadcast_object_list(box, src=0)
        classes = box[0]
    main = not several or dist.get_rank() == 0
    groups = budget_groups(classes, in_features, budget_bytes)
    directions: dict[str, tuple[torch.Tensor, EnergyRank]] = {}

    def fold_group(group: Sequence[Sequence[str]]) -> None:  # its Grams are freed when it returns
        grams = accumulate_grams([by_name[c[0]] for c in group], run)
        for i, members in enumerate(group):
            if several:
                summed = grams[i].to(device)
                dist.reduce(summed, dst=0)
                grams[i] = summed.cpu()
                del summed
            if main:
                spectra: list[tuple[torch.Tensor, InputSpectrum]] = []  # one eigendecomposition per distinct Q
                for name in members:
                    m = by_name[name]
                    q = (bases_q or {}).get(name, grams[i].new_zeros(m.in_features, 0))
                    spectrum = next((s for q0, s in spectra if torch.equal(q0, q)), None)
                    if spectrum is None:
                        spectrum = input_spectrum(grams[i], q, criterion)
                        spectra.append((q, spectrum))
                    directions[name] = spectrum.directions(energy, fold_cap(m.plan.k_low, max_rank_ratio))
            grams[i] = None

    for group in groups:
        fold_group(group)
    return InputBases(directions=directions, classes=classes, passes=len(groups))


def calibrate(modules: Sequence[tuple[str, nn.Module]], bases_q: Mapping[str, torch.Tensor] | None,
              forward: Callable[[object], object], batches: Sequence, cfg, device: torch.device,
              check: Callable[[int], None] | None = None) -> InputBases:
    """:func:`input_bases` over this rank's micro-``batches`` (None: a padding micro-batch, run but
    not recorded), each through ``forward`` (a run's micro-batch loss), with the
    ``--osft-protect-input-*`` and ``--osft-protect-max-rank-ratio`` settings of ``cfg``; the
    probe is the first micro-batch. ``check(m)``, when given, runs before micro-batch ``m`` of each
    pass (a stop poll). The caller puts the model in eval mode and turns off gradients.

    Raises:
        ValueError: from :func:`input_bases`.
    """
    def probe() -> None:
        forward(next(iter(batches)))

    def run(recording: Callable[[bool], None]) -> None:
        for m, batch in enumerate(batches):
            if check:
                check(m)
            recording(batch is not None)
            forward(batch)

    return input_bases(modules, bases_q, probe, run, cfg.osft_protect_input_memory_gb * 1e9,
                       cfg.osft_protect_input_energy, cfg.osft_protect_max_rank_ratio, device,
                       cfg.osft_protect_input_criterion)
