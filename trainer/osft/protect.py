"""Protected subspaces across chained OSFT runs (sequential OSFT).

Run A's update lives in W's small singular directions; a plain OSFT run B would put exactly those
directions back into its trainable block. So every target keeps orthonormal bases P (N×p_L) and
Q (M×p_R) of what earlier runs changed; run B splits W′ = (I − PPᵀ) W (I − QQᵀ) instead of W and
freezes L = [P, U′_high] and Rb = [Q, V′_high] (see :mod:`.plan`), so every update ΔW of run B
satisfies Lᵀ ΔW = 0 and ΔW Rb = 0: PᵀW and WQ stay as run A left them.

At the end of a run (and at every HF export) each module's update
D = U_low·diag(S_low)·V_low − U_start·diag(S_start)·V_start (rank ≤ 2·k_low) is decomposed,
D = P_t Σ_D Q_tᵀ, and the smallest r with Σ_{i≤r} σ_i² ≥ τ‖D‖_F² directions (capped at
floor(cap·k_low)) are appended to P and Q (:func:`fold_module`). The ``inputs`` variant takes Q_t
from the run's layer inputs instead: the top eigenvectors of (I − QQᵀ) X Xᵀ (I − QQᵀ), as many as
bring the energy of X kept, old basis counted, to a share ε of ‖X‖_F² (gradient projection memory,
Saha et al. 2021: ‖QᵀX‖² + Σ σ²_new ≥ ε‖X‖²; or, ``residual``, ε of the energy outside Q)
(:func:`input_directions`, Grams from :mod:`.input_grams`). An expert bank
keeps one basis per expert with one rank per bank (:func:`fold_bank`, ``update`` variant only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: A new direction whose norm after removing the old basis is below this is dropped (it was
#: already protected; float32 drift only).
VANISHED = 1e-3


@dataclass(frozen=True)
class EnergyRank:
    """Directions kept by :func:`energy_rank`: ``rank`` r, ``energy`` (share of the total kept, in
    [0, 1]; 1.0 when the total is 0) and ``cap_bound`` (the cap cut r below the energy target)."""

    rank: int
    energy: float
    cap_bound: bool


def no_bases(n: int, m: int, like: torch.Tensor | None = None, experts: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The protected bases of a module nothing protects yet: P (N×0) and Q (M×0), E×N×0 and E×M×0
    for a bank of ``experts`` = E, in ``like``'s dtype and device (float32 on the CPU without it).
    Such a module stores no P/Q parameter."""
    new = like.new_zeros if like is not None else torch.zeros
    lead = (experts,) if experts else ()
    return new(*lead, n, 0), new(*lead, m, 0)


def energy_rank(sigma_sq: torch.Tensor, target: float, cap: int, kept: float = 0.0) -> EnergyRank:
    """The smallest r with ``kept`` + Σ_{i≤r} σ_i² ≥ target·(``kept`` + Σ σ_i²), capped at ``cap``.

    Args:
        sigma_sq: squared singular values (or eigenvalues), descending, ≥ 0.
        target: energy share in (0, 1]. cap: largest r allowed (≥ 0).
        kept: energy already held by an earlier basis (≥ 0; 0: the share is of ``sigma_sq``'s alone).

    Returns:
        r (0 when ``kept`` alone reaches the target), the share of the total held by ``kept`` and
        the r directions, and whether the cap cut r.
    """
    kept = max(float(kept), 0.0)
    total = kept + float(sigma_sq.sum())
    if total <= 0.0:
        return EnergyRank(0, 1.0, False)
    cumulative = torch.cat([sigma_sq.new_zeros(1, dtype=torch.float64), torch.cumsum(sigma_sq.double(), 0)])
    cumulative = (kept + cumulative) / total
    wanted = int(torch.searchsorted(cumulative, torch.tensor([target * (1 - 1e-12)], dtype=torch.float64)).item())
    wanted = min(wanted, sigma_sq.numel())
    rank = min(wanted, cap)
    return EnergyRank(rank, float(cumulative[rank]), rank < wanted)


def update_svd(U_now: torch.Tensor, S_now: torch.Tensor, V_now: torch.Tensor, U_start: torch.Tensor,
               S_start: torch.Tensor, V_start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Thin SVD of D = U_now·diag(S_now)·V_now − U_start·diag(S_start)·V_start without forming D.

    Thin QR of A = [U_now·S_now, −U_start·S_start] (N×2k) and of Bᵀ = [V_now; V_start]ᵀ (M×2k),
    then the SVD of the small core R_A R_Bᵀ: D = (Q_A U_c) Σ (Q_B V_c)ᵀ. float64.

    Args:
        U_now, U_start: N×k. S_now, S_start: k. V_now, V_start: k×M.

    Returns:
        ``(P_t, sigma, Q_t)``: N×r, r (descending), M×r with r = min(N, M, 2k).
    """
    a = torch.cat([U_now.double() * S_now.double(), -U_start.double() * S_start.double()], dim=1)
    b = torch.cat([V_now.double(), V_start.double()], dim=0).t()
    qa, ra = torch.linalg.qr(a)
    qb, rb = torch.linalg.qr(b)
    uc, sigma, vch = torch.linalg.svd(ra @ rb.t())
    return qa @ uc, sigma, qb @ vch.t()


#: The energy an input basis must reach (``--osft-protect-input-criterion``): ``total`` (GPM), the old
#: basis's ‖QᵀX‖² counted towards ε‖X‖²; ``residual``, ε of the energy outside the old basis.
INPUT_CRITERIA = ("total", "residual")


@dataclass(frozen=True)
class InputSpectrum:
    """The eigenpairs of (I − QQᵀ) G (I − QQᵀ) (:func:`input_spectrum`): ``eigvals`` (descending,
    clamped at 0) and ``vecs`` (M×M float64, columns in the same order), and ``old``, ‖QᵀX‖_F² =
    tr(QᵀGQ) for the ``total`` criterion (0.0 for ``residual``)."""

    eigvals: torch.Tensor
    vecs: torch.Tensor
    old: float

    def directions(self, target: float, cap: int) -> tuple[torch.Tensor, EnergyRank]:
        """The cut of :func:`input_directions`: the top r eigenvectors, r from :func:`energy_rank`
        of the eigenvalues with ``old`` counted, as an M×r float64 copy (not a view of ``vecs``)."""
        kept = energy_rank(self.eigvals, target, cap, kept=self.old)
        return self.vecs[:, : kept.rank].clone(), kept


def input_spectrum(gram: torch.Tensor, Q: torch.Tensor, criterion: str = "total") -> InputSpectrum:
    """The spectrum :func:`input_directions` cuts, of G = X Xᵀ (M×M) and an old basis Q (M×p_R),
    in float64; modules that share G and Q (the first run of a chain: Q empty) share it.

    Raises:
        ValueError: an unknown criterion.
    """
    if criterion not in INPUT_CRITERIA:
        raise ValueError(f"input energy criterion must be one of {INPUT_CRITERIA}, got {criterion!r}")
    q = Q.double()
    g = gram.double()
    old = float((q * (g @ q)).sum()) if criterion == "total" else 0.0
    g = g - q @ (q.t() @ g)
    g = g - (g @ q) @ q.t()
    eigvals, vecs = torch.linalg.eigh((g + g.t()) / 2)
    return InputSpectrum(eigvals.flip(0).clamp_min(0), vecs.flip(1), old)


def input_directions(gram: torch.Tensor, Q: torch.Tensor, target: float, cap: int,
                     criterion: str = "total") -> tuple[torch.Tensor, EnergyRank]:
    """Top eigenvectors of (I − QQᵀ) G (I − QQᵀ), G = X Xᵀ (M×M) of a run's layer inputs X (M×T).

    ``total``: the fewest with ‖QᵀX‖_F² + Σ λ_new ≥ ``target``·‖X‖_F² (‖QᵀX‖² = tr(QᵀGQ),
    ‖X‖² = tr G = tr(QᵀGQ) + tr of the projected Gram); ``residual``: Σ λ_new ≥ ``target``·tr of
    the projected Gram. Capped at ``cap`` either way: :meth:`InputSpectrum.directions` of
    :func:`input_spectrum` (modules that share G and Q call those two themselves, the spectrum once).

    Returns:
        ``(Q_t, kept)``: M×r float64 (its own storage, not a view of the M×M eigenvectors) with r
        from :func:`energy_rank` of the eigenvalues; ``kept.energy`` the share of the criterion's
        total held (for ``total``, by Q and Q_t together).

    Raises:
        ValueError: an unknown criterion.
    """
    return input_spectrum(gram, Q, criterion).directions(target, cap)


def extend_basis(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """[old, new′]: ``new``'s columns with ``old``'s component removed (twice, for float32 drift),
    orthonormalised by thin QR; columns that vanish (norm below :data:`VANISHED`) are dropped.

    Args:
        old: N×p orthonormal. new: N×r.

    Returns:
        N×(p + r′) float64, r′ ≤ r.
    """
    old, x = old.double(), new.double()
    for _ in range(2):
        x = x - old @ (old.t() @ x)
    q, r = torch.linalg.qr(x)
    diag = r.diagonal()
    keep = diag.abs() > VANISHED
    q = q * torch.where(diag < 0, -1.0, 1.0).to(q.dtype)
    return torch.cat([old, q[:, keep]], dim=1)


@dataclass(frozen=True)
class ModuleFold:
    """One module's protected bases after a run: ``P`` (N×p_L) and ``Q`` (M×p_R), float32 (E×N×p
    and E×M×p for a bank of E experts, see :func:`fold_bank`); ``added_left``/``added_right``
    (directions added this run); ``update`` (the energy of D kept on the P side,
    :class:`EnergyRank`; for a bank the smallest over its experts); ``inputs`` (the input energy
    kept on the Q side, for the ``inputs`` variant, else None, also for a frozen module and a bank);
    ``expert_ranks`` (a bank: each expert's own energy rank before the bank's shared r, else None);
    ``chain`` (the module's chain budget, :meth:`.chain.ModuleBudget.record`, once the export adds it)."""

    P: torch.Tensor
    Q: torch.Tensor
    added_left: int
    added_right: int
    update: EnergyRank
    inputs: EnergyRank | None
    expert_ranks: tuple[int, ...] | None = None
    chain: dict | None = None

    def summary(self) -> dict:
        """Plain data for ``osft_subspaces.json`` (``basis``: where Q's new directions came from)."""
        out = {"p_left": self.P.shape[-1], "p_right": self.Q.shape[-1], "added_left": self.added_left,
               "added_right": self.added_right, "energy_kept": self.update.energy, "cap_bound": self.update.cap_bound,
               "basis": "update" if self.inputs is None else "inputs", **(self.chain or {})}
        if self.inputs is not None:
            out.update(input_energy_kept=self.inputs.energy, input_cap_bound=self.inputs.cap_bound)
        if self.expert_ranks is not None:
            out.update(experts=len(self.expert_ranks), expert_ranks=list(self.expert_ranks))
        return out


def fold_cap(k_low: int, max_rank_ratio: float) -> int:
    """The most new directions a fold adds per side: floor(cap·k_low)."""
    return int(max_rank_ratio * k_low + 1e-9)


def fold_module(factors: dict[str, torch.Tensor], energy: float, max_rank_ratio: float,
                inputs: tuple[torch.Tensor, EnergyRank] | None = None) -> ModuleFold:
    """Add this run's update directions of one module to its protected bases.

    Args:
        factors: the module's full tensors ``P``, ``Q``, ``U_low``, ``S_low``, ``V_low``,
            ``U_start``, ``S_start``, ``V_start`` (see :class:`.decomposition.OSFTLinear`).
        energy: τ, the share of ‖D‖_F² to protect, in (0, 1].
        max_rank_ratio: cap: at most :func:`fold_cap` new directions per side.
        inputs: the ``inputs`` variant: Q_t (M×r) and the energy kept, :func:`input_directions` of
            this run's layer inputs with the same cap (see :mod:`.input_grams`); None: the
            ``update`` variant, Q_t from D.
    """
    k_low = factors["S_low"].shape[0]
    if k_low == 0:  # a frozen module changed nothing (and its inputs are not collected)
        return ModuleFold(P=factors["P"].float(), Q=factors["Q"].float(), added_left=0, added_right=0,
                          update=EnergyRank(0, 1.0, False), inputs=None)
    p_t, sigma, q_t = update_svd(*(factors[k] for k in ("U_low", "S_low", "V_low", "U_start", "S_start", "V_start")))
    kept = energy_rank(sigma.square(), energy, fold_cap(k_low, max_rank_ratio))
    q_t = q_t[:, : kept.rank] if inputs is None else inputs[0]
    P = extend_basis(factors["P"], p_t[:, : kept.rank])
    Q = extend_basis(factors["Q"], q_t)
    return ModuleFold(P=P.float(), Q=Q.float(), added_left=P.shape[1] - factors["P"].shape[1],
                      added_right=Q.shape[1] - factors["Q"].shape[1], update=kept,
                      inputs=None if inputs is None else inputs[1])


def extend_basis_exactly(old: torch.Tensor, new: torch.Tensor, fill: torch.Tensor, count: int) -> torch.Tensor:
    """[old, B] with B exactly ``count`` orthonormal columns orthogonal to ``old``: ``new``'s columns
    in order, then ``fill``'s as needed (classical Gram-Schmidt against everything before, twice,
    for float32 drift), skipping any whose norm after that is below :data:`VANISHED`.

    Args:
        old: N×p orthonormal. new: N×r. fill: N×f, with rank ≥ ``count`` outside span(old, new).

    Returns:
        N×(p + count) float64.

    Raises:
        ValueError: ``new`` and ``fill`` do not hold ``count`` independent directions outside ``old``.
    """
    basis = old.double()
    added = 0
    for x in torch.cat([new, fill], dim=1).double().unbind(1):
        if added == count:
            break
        for _ in range(2):
            x = x - basis @ (basis.t() @ x)
        norm = float(x.norm())
        if norm > VANISHED:
            basis = torch.cat([basis, (x / norm)[:, None]], dim=1)
            added += 1
    if added < count:
        raise ValueError(f"only {added} of {count} new directions lie outside the protected basis")
    return basis


#: A singular value of a bank expert's update below this share of the larger of the update's and
#: the low part's largest is rounding, not update (an expert that received no token); the bank's
#: shared rank is filled from the expert's start basis instead.
NEGLIGIBLE_SIGMA = 1e-6


def fold_bank(factors: dict[str, torch.Tensor], energy: float, max_rank_ratio: float) -> ModuleFold:
    """Add this run's update directions of every expert of a bank to its protected bases.

    Layout: one protected rank per bank, shared by its experts (P: E×N×p, Q: E×M×p), because a
    bank is one plan (:class:`.plan.ModulePlan`) whose tensors are batched over the experts: the
    same k_high and k_low for every expert, one batched projection. Each expert's update D_e is
    decomposed on its own (:func:`update_svd`) and its energy rank r_e found as in
    :func:`fold_module`; the bank adds r = max_e r_e directions per expert and side: expert e's top r
    singular directions of D_e (at least τ of ‖D_e‖_F², more where r > r_e), and where D_e has fewer
    than r non-negligible singular values (an expert that hardly received tokens), directions of its
    trainable subspace at the start of the run (U_start, V_startᵀ), which it then no longer trains.
    The ``inputs`` variant does not apply (see :mod:`.input_grams`).

    Args:
        factors: the bank's full tensors as for :func:`fold_module`, each with a leading E
            (``P``: E×N×p_L, ``Q``: E×M×p_R, ``U_low``: E×N×k_low, ...).
        energy: τ. max_rank_ratio: cap, r ≤ :func:`fold_cap` of k_low.

    Returns:
        The bank's :class:`ModuleFold` (``update``: r, the smallest energy kept over the experts,
        whether the cap bound for any; ``expert_ranks``: each r_e).
    """
    experts, k_low = factors["S_low"].shape
    if k_low == 0:
        return ModuleFold(P=factors["P"].float(), Q=factors["Q"].float(), added_left=0, added_right=0,
                          update=EnergyRank(0, 1.0, False), inputs=None, expert_ranks=(0,) * experts)
    cap = fold_cap(k_low, max_rank_ratio)
    svds = []
    for e in range(experts):
        p_t, sigma, q_t = update_svd(*(factors[k][e] for k in ("U_low", "S_low", "V_low", "U_start", "S_start", "V_start")))
        # below NEGLIGIBLE_SIGMA of the larger of D_e's and the low part's scale: rounding, not update
        scale = max(float(sigma.max()), float(factors["S_start"][e].abs().max()), float(factors["S_low"][e].abs().max()))
        svds.append((p_t, torch.where(sigma > NEGLIGIBLE_SIGMA * scale, sigma, 0.0), q_t))
    ranks = [energy_rank(sigma.square(), energy, cap) for _, sigma, _ in svds]
    r = max(k.rank for k in ranks)
    P, Q, kept = [], [], []
    for e, (p_t, sigma, q_t) in enumerate(svds):
        real = sigma[:r] > 0
        P.append(extend_basis_exactly(factors["P"][e], p_t[:, :r][:, real], factors["U_start"][e], r))
        Q.append(extend_basis_exactly(factors["Q"][e], q_t[:, :r][:, real], factors["V_start"][e].t(), r))
        total = float(sigma.square().sum())
        kept.append(float(sigma[:r].square().sum()) / total if total > 0 else 1.0)
    update = EnergyRank(r, min(kept), any(k.cap_bound for k in ranks))
    return ModuleFold(P=torch.stack(P).float(), Q=torch.stack(Q).float(), added_left=r, added_right=r,
                      update=update, inputs=None, expert_ranks=tuple(k.rank for k in ranks))
