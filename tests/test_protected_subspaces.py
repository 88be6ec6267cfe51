"""Protected subspaces across chained OSFT runs (sequential OSFT, docs/osft.md, "Chaining runs:
protected subspaces"): the split of W′ = (I − PPᵀ)W(I − QQᵀ), the fold of a run's update into P/Q,
and chained `osft-train` runs on 1 and 2 gloo ranks, with a resume and a reload of the exported
bases."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
import numpy as np
from helpers import QA, chat, save_tiny_model, weight_updates, write_jsonl
from safetensors.torch import load_file, save_file

from osft.trainer.checkpoint.subspaces import load_bases
from osft.trainer.exit_codes import EXIT_STOPPED
from osft.trainer.osft.decomposition import OSFTLinear, protected_svd
from osft.trainer.osft.plan import plan_module, plan_table
from osft.trainer.osft.projection import Projector
from osft.trainer.osft.plan import OSFTSettings
from osft.trainer.osft.chain import chain_budget
from osft.trainer.osft.input_grams import calibration_indices
from osft.trainer.osft.protect import EnergyRank, ModuleFold, energy_rank, fold_cap, fold_module, input_directions, input_spectrum, update_svd

FOLD_KEYS = ("P", "Q", "U_low", "S_low", "V_low", "U_start", "S_start", "V_start")


def pretrained_like(n, m, seed=0):
    """A random N×M matrix with a decaying spectrum (as trained weights have)."""
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(n, min(n, m), generator=g))
    v, _ = torch.linalg.qr(torch.randn(m, min(n, m), generator=g))
    s = torch.logspace(0.5, -1.5, min(n, m))
    return (u * s) @ v.t()


def train(mod, x, y, steps=30, lr=1e-2, weight_decay=0.1):
    """AdamW on the mean squared error of y ≈ mod(x), projected as the trainer does."""
    projector = Projector([("w", mod)])
    opt = torch.optim.AdamW([mod.U_low, mod.S_low, mod.V_low], lr=lr, weight_decay=weight_decay)
    for _ in range(steps):
        loss = (mod(x) - y).square().mean()
        loss.backward()
        projector.project_gradients()
        opt.step()
        opt.zero_grad(set_to_none=True)
        projector.project_parameters()
    return mod


def update(mod):
    """This run's ΔW = U_low S_low V_low − U_start S_start V_start, float64 (W_high never changes)."""
    now = (mod.U_low.double() * mod.S_low.double()) @ mod.V_low.double()
    return (now - (mod.U_start.double() * mod.S_start.double()) @ mod.V_start.double()).detach()


def factors(mod):
    empty = {"P": torch.zeros(mod.plan.n, 0), "Q": torch.zeros(mod.plan.m, 0)}
    return {k: empty[k] if getattr(mod, k) is None else getattr(mod, k).detach() for k in FOLD_KEYS}


def test_protected_svd_matches_lapack_on_the_projected_matrix():
    w = pretrained_like(48, 32)
    P = torch.linalg.qr(torch.randn(48, 5, dtype=torch.float64))[0]
    Q = torch.linalg.qr(torch.randn(32, 3, dtype=torch.float64))[0]
    for a, p, q in ((w, P, Q), (w.t(), Q, P)):  # tall and wide
        u, s, vh = protected_svd(a, p, q)
        ref = a.double() - p @ (p.t() @ a.double())
        ref = ref - (ref @ q) @ q.t()
        r = min(a.shape[0] - p.shape[1], a.shape[1] - q.shape[1])
        assert u.shape == (a.shape[0], r) and s.shape == (r,) and vh.shape == (r, a.shape[1])
        torch.testing.assert_close(s, torch.linalg.svd(ref).S[:r], rtol=0, atol=1e-12)
        torch.testing.assert_close(u.t() @ u, torch.eye(r, dtype=torch.float64), rtol=0, atol=1e-12)
        torch.testing.assert_close(vh @ vh.t(), torch.eye(r, dtype=torch.float64), rtol=0, atol=1e-12)
        torch.testing.assert_close((u * s) @ vh, ref, rtol=0, atol=1e-12)
        assert (p.t() @ u).abs().max() < 1e-12 and (vh @ q).abs().max() < 1e-12


def test_plan_keep_modes_and_frozen_modules():
    plan = plan_module(48, 32, 0.5, 8, p_left=5, p_right=3)
    assert (plan.rank, plan.k_high, plan.k_low) == (29, 14, 15)  # reduced: floor(29·0.5)
    assert plan_module(48, 32, 0.5, 8, 5, 3, frozen_rank="keep").k_high == 16  # a fresh 48×32 split's
    assert not plan.u_keep  # 5 + 29 < 48: [L, U_low] does not span the left side
    assert plan.v_keep  # 3 + 29 = 32 spans the right side and k_low 15 < p_R + k_high = 17
    assert not plan_module(48, 32, 0.75, 8, 5, 3).v_keep  # k_low 22 > 3 + 7: removing Rb is cheaper
    frozen = plan_module(16, 12, 0.5, 8, p_left=4, p_right=12)
    assert frozen.rank == 0 and frozen.frozen and frozen.trainable_params == 0
    mod = OSFTLinear.from_weight(pretrained_like(16, 12), None, urr=0.5, max_tokens_per_micro_batch=8,
                                 protected=(torch.linalg.qr(torch.randn(16, 4))[0], torch.eye(12)))
    assert mod.plan.frozen and not mod.U_low.requires_grad and mod.U_basis.shape == (16, 4)


def test_plan_table_shows_every_module_name_whole_on_an_80_column_console():
    from rich.console import Console

    shapes = {"self_attn.q_proj": (576, 576), "self_attn.k_proj": (192, 576), "self_attn.v_proj": (192, 576),
              "mlp.down_proj": (576, 1536)}
    plans = [(f"model.layers.{i}.{proj}", plan_module(n, m, 0.25, 1024)) for i in range(3) for proj, (n, m) in shapes.items()]
    plans.append(("lm_head", plan_module(576, 49152, 0.25, 1024, p_left=576)))
    console = Console(width=80, record=True, file=open(os.devnull, "w"))
    console.print(plan_table(plans))
    lines = console.export_text().splitlines()
    assert max(map(len, lines)) <= 80
    rows = {line.split()[1]: line.split() for line in lines if line.strip()[:1].isdigit()}
    assert set(rows) == {"self_attn.q_proj", "self_attn.k_proj", "mlp.down_proj", "lm_head"}
    assert rows["self_attn.k_proj"][0] == "6" and "self_attn.v_proj" in {line.strip() for line in lines}
    assert rows["lm_head"][6:] == ["frozen", "0"]  # every left direction protected
    assert "names: after model.layers.<i>." in " ".join(lines)


def test_chained_runs_keep_earlier_updates_untouched():
    torch.manual_seed(0)
    w0 = pretrained_like(48, 32)
    x, y = torch.randn(64, 32), torch.randn(64, 48)
    a = train(OSFTLinear.from_weight(w0, None, urr=0.5, max_tokens_per_micro_batch=8), x, y)
    d = update(a)
    fold = fold_module(factors(a), energy=0.9, max_rank_ratio=1.0)
    # τ bound (the cap does not bind): the smallest r with at least 90% of ‖D‖_F² kept
    sigma_sq = torch.linalg.svdvals(d).square()
    r = fold.added_left
    assert not fold.update.cap_bound and r == fold.added_right and r > 0
    assert sigma_sq[:r].sum() >= 0.9 * sigma_sq.sum() > sigma_sq[: r - 1].sum()
    assert fold.update.energy == pytest.approx(float(sigma_sq[:r].sum() / sigma_sq.sum()), rel=1e-9)
    p_t, sigma, _ = update_svd(*(factors(a)[k] for k in FOLD_KEYS[2:]))
    torch.testing.assert_close(sigma[: len(sigma_sq)].square(), sigma_sq, rtol=1e-9, atol=1e-12)
    P, Q = fold.P, fold.Q
    torch.testing.assert_close(P.t() @ P, torch.eye(r), rtol=0, atol=1e-6)
    # the protected directions hold the update: ‖PᵀD‖² = kept energy
    assert float((P.double().t() @ d).square().sum()) == pytest.approx(float(sigma_sq[:r].sum()), rel=1e-5)

    w_a = a.dense_weight().detach()
    b = OSFTLinear.from_weight(w_a, None, urr=0.5, max_tokens_per_micro_batch=8, protected=(P, Q))
    rank = min(48 - r, 32 - r)
    assert (b.plan.rank, b.plan.k_high, b.plan.k_low) == (rank, rank // 2, rank - rank // 2)
    assert b.plan.p_left == b.plan.p_right == r
    torch.testing.assert_close(b.dense_weight().detach(), w_a, rtol=0, atol=1e-5)
    assert float(b.sigma_frozen_min) == pytest.approx(float(protected_svd(w_a, P, Q)[1][rank // 2 - 1]), rel=1e-6)
    train(b, torch.randn(64, 32), torch.randn(64, 48))
    d_b = update(b)
    assert d_b.norm() > 1e-2
    assert (P.double().t() @ d_b).norm() <= 1e-5 * d_b.norm()
    assert (d_b @ Q.double()).norm() <= 1e-5 * d_b.norm()
    w_b = b.dense_weight().detach()
    torch.testing.assert_close(P.t() @ w_b, P.t() @ w_a, rtol=0, atol=1e-5)
    torch.testing.assert_close(w_b @ Q, w_a @ Q, rtol=0, atol=1e-5)
    # the second fold extends the first bases (orthonormal, old columns first)
    fold_b = fold_module(factors(b), energy=0.9, max_rank_ratio=0.5)
    assert fold_b.added_left <= b.plan.k_low // 2 and torch.equal(fold_b.P[:, :r], P)
    torch.testing.assert_close(fold_b.P.t() @ fold_b.P, torch.eye(fold_b.P.shape[1]), rtol=0, atol=1e-5)


def test_toy_regression_inputs_variant_keeps_task_a_exactly(seed=1):
    """Two regression tasks on a 32×24 linear layer (URR 0.5, no weight decay) whose inputs share 4
    of 8 directions, with conflicting targets. Same-URR OSFT forgets task A. Protecting A's input
    span (8 directions, within the cap k_low = 12 at cap ratio 1.0) keeps A exactly: every ΔW_B
    satisfies ΔW_B Q = 0, so ΔW_B x_A = 0.

    The ``update`` variant protects only D's top directions (4 here at τ = 0.9). B's split of W′ has
    R = 20 < 24: under ``--osft-frozen-rank reduced`` k_high = 10 < 12, so two directions A kept
    frozen become trainable, and it forgets *more* than plain OSFT (seed 1: 0.57 vs 0.49); ``keep``
    freezes a fresh run's 12 (0.40 here). Neither rule is reliable with update bases: over seeds 1-8
    keep forgot less than reduced in 5 and up to 8 times more in the other 3; the inputs variant kept
    A in all 8. The test records what holds for every seed: inputs keep A, the others do not.
    """
    g = torch.Generator().manual_seed(seed)
    basis = torch.linalg.qr(torch.randn(24, 24, generator=g))[0]
    s_a, s_b = basis[:, :8], basis[:, 4:12]
    x_a = torch.randn(256, 8, generator=g) @ s_a.t()
    x_b = torch.randn(256, 8, generator=g) @ s_b.t()
    w0 = pretrained_like(32, 24, seed=2)
    target_a = w0 + 0.3 * torch.randn(32, 24, generator=g)
    target_b = w0 + 0.3 * torch.randn(32, 24, generator=g)
    y_a, y_b = x_a @ target_a.t(), x_b @ target_b.t()

    def loss_a(w):
        return float((x_a @ w.t() - y_a).square().mean())

    a = train(OSFTLinear.from_weight(w0, None, urr=0.5, max_tokens_per_micro_batch=8), x_a, y_a, steps=150, lr=2e-2,
              weight_decay=0.0)
    w_a = a.dense_weight().detach()
    assert loss_a(w_a) < 0.5 * loss_a(w0)
    update_fold = fold_module(factors(a), 0.9, 1.0)
    folds = {
        "plain": (None, "keep"),
        "update reduced": (update_fold, "reduced"),
        "update keep": (update_fold, "keep"),
        "inputs": (fold_module(factors(a), 0.9, 1.0, input_directions(x_a.double().t() @ x_a.double(),
                                                                      torch.zeros(24, 0), 0.95,
                                                                      fold_cap(a.plan.k_low, 1.0))), "keep"),
    }
    assert folds["inputs"][0].added_right == 8 and not folds["inputs"][0].inputs.cap_bound
    forgetting = {}
    for name, (fold, rule) in folds.items():
        prot = None if fold is None else (fold.P, fold.Q)
        plan = plan_module(32, 24, 0.5, 8, *((fold.P.shape[1], fold.Q.shape[1]) if fold else (0, 0)), frozen_rank=rule)
        b = OSFTLinear.from_weight(w_a, None, plan=plan, protected=prot)
        w_b = train(b, x_b, y_b, steps=150, lr=2e-2, weight_decay=0.0).dense_weight().detach()
        forgetting[name] = loss_a(w_b) - loss_a(w_a)
    assert forgetting["plain"] > 0.5 * loss_a(w_a), forgetting
    # float32 rounding of W (entries ~1, 24 inputs): the loss moves by a few 1e-7 at most
    assert abs(forgetting["inputs"]) < 1e-5, forgetting
    assert forgetting["inputs"] < 0.1 * min(forgetting["update keep"], forgetting["update reduced"]), forgetting
    assert forgetting["plain"] < forgetting["update reduced"], forgetting  # seed 1, the caveat in the README


def test_input_energy_criterion_counts_the_old_basis_as_gpm_does():
    """Hand-made inputs along the standard basis with energies 10, 5, 3, 1, 0.5, 0.5 (‖X‖² = 20) and
    Q = e_0 (‖QᵀX‖² = 10): at ε = 0.9 the total (GPM) criterion needs 18, so e_1 and e_2; the residual
    one needs 0.9 of the other 10, so e_1, e_2, e_3; a basis that already holds 90 % adds nothing."""
    energies = torch.tensor([10.0, 5, 3, 1, 0.5, 0.5], dtype=torch.float64)
    rotation = torch.linalg.qr(torch.randn(6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0)))[0]
    x = rotation @ torch.diag(energies.sqrt())  # X Xᵀ has these eigenvalues along rotation's columns
    gram = x @ x.t()
    q = rotation[:, :1]
    got, kept = input_directions(gram, q, 0.9, cap=6)
    assert (kept.rank, kept.cap_bound) == (2, False) and kept.energy == pytest.approx(18 / 20)
    torch.testing.assert_close(got @ got.t(), rotation[:, 1:3] @ rotation[:, 1:3].t(), rtol=0, atol=1e-10)
    got, kept = input_directions(gram, q, 0.9, cap=6, criterion="residual")
    assert kept.rank == 3 and kept.energy == pytest.approx(9 / 10)
    torch.testing.assert_close(got @ got.t(), rotation[:, 1:4] @ rotation[:, 1:4].t(), rtol=0, atol=1e-10)
    got, kept = input_directions(gram, rotation[:, :3], 0.9, cap=6)
    assert got.shape == (6, 0) and (kept.rank, kept.cap_bound) == (0, False) and kept.energy == pytest.approx(0.9)
    got, kept = input_directions(gram, q, 0.9, cap=1)  # the cap binds: e_1 only, 15 of 20 kept
    assert (kept.rank, kept.cap_bound) == (1, True) and kept.energy == pytest.approx(15 / 20)
    shared = input_spectrum(gram, q)  # one eigendecomposition serves modules of other caps
    for cap in (1, 6):
        again, kept_again = shared.directions(0.9, cap)
        assert torch.equal(again, input_directions(gram, q, 0.9, cap)[0]) and kept_again.rank == min(cap, 2)
    assert energy_rank(torch.tensor([3.0, 1.0]), 0.5, 2, kept=6.0) == EnergyRank(0, 0.6, False)
    with pytest.raises(ValueError, match="criterion"):
        input_directions(gram, q, 0.9, 6, criterion="sum")


def expected_split(n, m, urr, p_left, p_right, rule):
    """R, k_high, k_low as docs/architecture.md section 8 states them."""
    rank = min(n - p_left, m - p_right)
    fresh_high = math.floor(min(n, m) * (1 - urr) + 1e-9)
    k_high = min(rank - 1, fresh_high if rule == "keep" else math.floor(rank * (1 - urr) + 1e-9))
    return rank, k_high, rank - k_high


@pytest.mark.parametrize("rule, cap", [("keep", 0.5), ("reduced", 0.5), ("keep", 0.125)])
def test_four_chained_runs_grow_the_bases_and_split_the_rest_as_documented(rule, cap):
    """Four runs on one 64×48 module at URR 0.5, each folded at τ = 0.9: P and Q grow by each run's
    energy rank, capped at floor(cap·k_low) (the cap binds at 0.125); every later run's update leaves
    all earlier runs' PᵀW and WQ as they were; each run's R, k_high, k_low follow the rule; and the
    chain budget each export records is the next run's actual split."""
    g = torch.Generator().manual_seed(3)
    w = pretrained_like(64, 48, seed=4)
    protected, earlier, capped = None, [], 0
    for run in range(4):
        p_left, p_right = (0, 0) if protected is None else (protected[0].shape[1], protected[1].shape[1])
        settings = OSFTSettings(urr=0.5, max_tokens_per_micro_batch=8, frozen_rank=rule)
        mod = OSFTLinear.from_weight(w, None, plan=settings.plan(64, 48, p_left, p_right), protected=protected)
        assert (mod.plan.p_left, mod.plan.p_right) == (p_left, p_right)
        assert (mod.plan.rank, mod.plan.k_high, mod.plan.k_low) == expected_split(64, 48, 0.5, p_left, p_right, rule)
        if rule == "reduced":  # also the layout of a module built without settings
            assert OSFTLinear.from_weight(w, None, 0.5, 8, protected=protected).plan == mod.plan
        train(mod, torch.randn(64, 48, generator=g), torch.randn(64, 64, generator=g), steps=20)
        d = update(mod)
        for P, Q in earlier:  # every earlier run's protected directions stay untouched
            assert (P.double().t() @ d).norm() <= 1e-5 * d.norm() and (d @ Q.double()).norm() <= 1e-5 * d.norm()
        fold = fold_module(factors(mod), energy=0.9, max_rank_ratio=cap)
        sigma_sq = torch.linalg.svdvals(d).square()
        wanted = int((torch.cumsum(sigma_sq, 0) < 0.9 * sigma_sq.sum() * (1 - 1e-12)).sum()) + 1
        assert fold.added_left == min(wanted, fold_cap(mod.plan.k_low, cap)), run
        assert fold.update.cap_bound == (wanted > fold_cap(mod.plan.k_low, cap))
        capped += fold.update.cap_bound
        assert fold.P.shape[1] == p_left + fold.added_left and fold.Q.shape[1] == p_right + fold.added_right
        if protected is not None:
            assert torch.equal(fold.P[:, :p_left], protected[0]) and torch.equal(fold.Q[:, :p_right], protected[1])
        budget = chain_budget([("w", mod.plan)], {"w": fold}, rule).budgets["w"]
        assert (budget.rank, budget.k_high, budget.k_low) == (mod.plan.rank, mod.plan.k_high, mod.plan.k_low)
        assert (budget.next_rank, budget.next_k_high, budget.next_k_low) == expected_split(
            64, 48, 0.5, fold.P.shape[1], fold.Q.shape[1], rule)
        assert budget.fresh_k_low == 24
        w = mod.dense_weight().detach()
        protected = (fold.P, fold.Q)
        earlier.append(protected)
    if cap == 0.125:  # the cap binds in every run
        assert capped == 4
    if rule == "keep":  # the pretrained block stays at a fresh run's 24 frozen directions
        assert mod.plan.k_high == 24 and mod.plan.k_low == 24 - max(p_left, p_right)
        assert mod.plan.k_low == budget.k_low


def test_chain_budget_reports_and_warns_below_the_stated_share():
    plan = plan_module(64, 48, 0.5, 8)
    folds = {"a": ModuleFold(torch.zeros(64, 4), torch.zeros(48, 4), 4, 4, EnergyRank(4, 0.9, False), None),
             "b": ModuleFold(torch.zeros(64, 12), torch.zeros(48, 12), 12, 12, EnergyRank(12, 0.7, True),
                             EnergyRank(12, 0.8, True))}
    budget = chain_budget([("a", plan), ("b", plan)], folds, "keep")
    assert budget.budgets["a"].next_k_low == 20 and budget.budgets["b"].next_k_low == 12  # 24 - p
    assert budget.folds["b"].summary()["next_k_low"] == 12 and budget.folds["b"].summary()["basis"] == "inputs"
    line = budget.line()
    assert "p_L 4-12" in line and "k_low 12-20, median 67 % of a fresh run's (lowest 50 %)" in line
    assert "cap bound in 1 of 2 modules (update side 1, input side 1)" in line
    assert "update 0.700 (lowest), inputs 0.800" in line
    warning = budget.warning()
    assert warning.startswith("chain budget: in 1 of 2 modules") and "below 60%" in warning and "b: 12 of 24" in warning
    assert chain_budget([("a", plan)], {"a": folds["a"]}, "keep").warning() is None


def test_calibration_samples_are_drawn_with_the_seed_across_every_source():
    one = calibration_indices([1000], None, 64, seed=0)
    assert len(one) == 64 == len(set(one.tolist())) and one.max() > 500  # not the first 64
    assert np.array_equal(one, calibration_indices([1000], None, 64, seed=0))
    assert not np.array_equal(one, calibration_indices([1000], None, 64, seed=1))
    mixed = calibration_indices([900, 50, 50], [0.5, 0.3, 0.2], 20, seed=0)
    counts = np.bincount(np.searchsorted(np.cumsum([900, 50, 50]), mixed, side="right"), minlength=3)
    assert counts.tolist() == [10, 6, 4]
    tiny = calibration_indices([900, 3, 50], [0.01, 0.9, 0.09], 20, seed=0)  # source 1 has 3 samples only
    counts = np.bincount(np.searchsorted(np.cumsum([900, 3, 50]), tiny, side="right"), minlength=3)
    assert counts[1] == 3 and counts.sum() == 20 and counts.min() >= 1
    assert len(calibration_indices([5, 5], [0.5, 0.5], 64, seed=0)) == 10  # fewer samples than asked: all


def test_four_chained_runs_of_a_tiny_model_and_the_logits_on_a_calibration_inputs(job, tmp_path):
    """Function level, in process: a tiny Llama learns task A (4 steps), then B (the reversed pairs,
    4 steps at twice the rate), C and D (A and B again), each chained on the export before, with the
    default recipe (input bases, GPM criterion, frozen non-targets; the cap binds in most modules);
    and B once without protection. Every export's records follow the docs: p grows by the
    directions added, R = min(N − p_L, M − p_R), k_high = floor(R·(1 − URR)), and the next run's split
    is the one recorded; each run leaves every earlier run's PᵀW and WQ as they were. On A's
    calibration samples (here every sample of A) B with the default recipe moves A's logits by at
    most 10 % of their norm and by at most a tenth of what the unprotected B moves them (measured:
    4.0 % and 316 %; A itself moved the base model's logits by 99 %)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from osft.trainer.launch.api import train as api_train

    model, data = job
    rows = [chat(q, a) for q, a in QA] * 2
    b_data = write_jsonl(tmp_path / "b.jsonl", [chat(a, q) for q, a in QA] * 2)
    common = dict(batch_size=4, max_tokens_per_gpu=64, max_seq_len=64, save_dtype="float32",
                  osft_unfreeze_rank_ratio=0.5, max_steps=4)

    def run(name, source, path, lr, **flags):
        outcome = api_train(model_name_or_path=str(source), data_path=[str(path)], output_dir=str(tmp_path / name),
                            learning_rate=lr, **common, **flags)
        assert outcome.exit_code == 0, name
        return Path(outcome.export_dir)

    exports = [run("A", model, data, 5e-3)]
    unprotected = run("B-unprotected", exports[0], b_data, 1e-2, osft_protect_subspaces=False)
    for name, path in (("B", b_data), ("C", data), ("D", b_data)):
        exports.append(run(name, exports[-1], path, 1e-2))
    metas = [json.loads((e / "osft_subspaces.json").read_text()) for e in exports]
    for i, meta in enumerate(metas):
        for module, rec in meta["modules"].items():
            before = metas[i - 1]["modules"][module] if i else {"p_left": 0, "p_right": 0}
            bases = load_bases(exports[i] / "osft_subspaces.safetensors")
            n, m = bases[f"{module}.P"].shape[0], bases[f"{module}.Q"].shape[0]
            assert rec["p_left"] == before["p_left"] + rec["added_left"], (i, module)
            assert rec["p_right"] == before["p_right"] + rec["added_right"], (i, module)
            rank = min(n - before["p_left"], m - before["p_right"])
            k_high = min(rank - 1, math.floor(rank * 0.5 + 1e-9))
            assert (rec["rank"], rec["k_high"], rec["k_low"]) == (rank, k_high, rank - k_high), (i, module)
            if i:
                assert (before["next_rank"], before["next_k_high"], before["next_k_low"]) == (
                    rec["rank"], rec["k_high"], rec["k_low"]), (i, module)
            assert rec["basis"] == "inputs" and rec["fresh_k_low"] == min(n, m) - min(n, m) // 2
    assert all(metas[3]["modules"][k]["next_k_low"] < metas[0]["modules"][k]["next_k_low"] for k in metas[0]["modules"])
    for i in range(1, 4):  # run i's update leaves the bases it was given (every earlier run's) untouched
        given = load_bases(exports[i - 1] / "osft_subspaces.safetensors")
        for key, P, Q, d in weight_updates(given, load_file(str(exports[i - 1] / "model.safetensors")),
                                           load_file(str(exports[i] / "model.safetensors"))):
            assert (P.t() @ d).norm() <= 1e-4 * d.norm() and (d @ Q).norm() <= 1e-4 * d.norm(), (i, key)

    assert len(calibration_indices([len(rows)], None, 64, seed=42)) == len(rows)  # A's calibration: all of A
    tokenizer = AutoTokenizer.from_pretrained(exports[0])
    ids = [tokenizer.apply_chat_template(r["messages"], return_tensors="pt", return_dict=True)["input_ids"]
           for r in rows[: len(QA)]]

    def logits(directory):
        net = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        with torch.no_grad():
            return torch.cat([net(x).logits[0] for x in ids])

    after_a = logits(exports[0])
    moved = {name: float((logits(d) - after_a).norm() / after_a.norm()) for name, d in
             (("default", exports[1]), ("unprotected", unprotected))}
    assert moved["default"] <= 0.1 and moved["default"] <= 0.1 * moved["unprotected"], moved


# -- real `osft-train` runs ---------------------------------------------------------------------
STEPS = 4


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("protect")
    model = save_tiny_model(root / "model", hidden_size=64, intermediate_size=128)
    data = write_jsonl(root / "train.jsonl", [chat(q, a) for q, a in QA] * 2)
    return model, data


def osft_train(model, data, out, *flags, env=None):
    cmd = [sys.executable, "-m", "osft.trainer.launch.cli", "--model-name-or-path", str(model), "--data-path", str(data),
           "--output-dir", str(out), "--batch-size", "4", "--max-tokens-per-gpu", "64", "--max-seq-len", "64",
           "--learning-rate", "5e-3", "--save-dtype", "float32", "--max-steps", str(STEPS),
           "--osft-unfreeze-rank-ratio", "0.5", *flags]
    proc = subprocess.run(cmd, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


def exported(out, step=STEPS):
    return out / "hf_format" / f"step_{step}"


def projectors(export):
    """PPᵀ and QQᵀ of every module (float64), which do not depend on the basis chosen."""
    bases = load_bases(export / "osft_subspaces.safetensors")
    return {k: bases[k].double() @ bases[k].double().t() for k in bases}


#: Task A's bases from its layer inputs, with a budget that holds the Grams of 1 of the 2 blocks
#: (8·(3·64² + 128²) bytes a block: q/k/v, o, gate/up and down read 4 distinct inputs): 2 passes.
INPUTS = ("--osft-protect-basis", "inputs", "--osft-protect-input-memory-gb", "0.0003")


@pytest.fixture(scope="module")
def runs(job, tmp_path_factory):
    """Task A (variant ``inputs``) on 1 rank and on 2 ranks (the latter uninterrupted and stopped +
    resumed)."""
    model, data = job
    root = tmp_path_factory.mktemp("runs")
    one, two, resumed = root / "one", root / "two", root / "resumed"
    code, output = osft_train(model, data, one, *INPUTS)
    assert code == 0, output
    assert "8 distinct layer inputs of 14 modules (6 shared) collected in 2 passes" in output, output
    code, output = osft_train(model, data, two, "--nproc-per-node", "2", "--on-demand-checkpointing", *INPUTS)
    assert code == 0, output
    env = {"OSFT_JOB_ID": uuid.uuid4().hex[:12], "OSFT_TEST_SIGNAL_AT": "2:after_step:0:SIGTERM"}
    code, output = osft_train(model, data, resumed, "--nproc-per-node", "2", "--on-demand-checkpointing", *INPUTS,
                              env=env)
    assert code == EXIT_STOPPED, output
    code, output = osft_train(model, data, resumed, "--nproc-per-node", "2", "--on-demand-checkpointing", "--resume",
                              *INPUTS, env={"OSFT_JOB_ID": env["OSFT_JOB_ID"]})
    assert code == 0 and "resumed from" in output, output
    return one, two, resumed


@pytest.mark.torchrun
def test_exports_carry_the_same_subspaces_on_one_and_two_ranks_and_after_a_resume(runs):
    one, two, resumed = runs
    meta = json.loads((exported(one) / "osft_subspaces.json").read_text())
    assert meta["format_version"] == 2 and meta["energy"] == 0.9 and meta["max_rank_ratio"] == 0.5
    assert meta["basis"] == "inputs" and meta["input_passes"] == 2
    assert meta["source"]["step"] == STEPS and len(meta["modules"]) == 14
    assert all(m["p_left"] == m["added_left"] > 0 and 0 < m["input_energy_kept"] <= 1 for m in meta["modules"].values())
    p1, p2 = projectors(exported(one)), projectors(exported(two))
    assert p1.keys() == p2.keys()
    for key in p1:
        torch.testing.assert_close(p2[key], p1[key], rtol=0, atol=1e-3, msg=key)
    # bit-exact after a stop at step 2 and a resume (the start factors come from the frozen store)
    assert load_bases(exported(resumed) / "osft_subspaces.safetensors").keys() == p2.keys()
    for key, value in load_bases(exported(resumed) / "osft_subspaces.safetensors").items():
        assert torch.equal(value, load_bases(exported(two) / "osft_subspaces.safetensors")[key]), key


@pytest.mark.torchrun
def test_a_chained_run_reads_the_subspaces_and_leaves_them_untouched(job, runs, tmp_path):
    _, data = job
    one = runs[0]
    code, output = osft_train(exported(one), data, tmp_path / "b", "--learning-rate", "1e-2")
    assert code == 0, output
    assert "protected subspaces: 14 modules from" in output and "OSFT plan" in output
    bases = load_bases(exported(one) / "osft_subspaces.safetensors")  # as the chained run read them
    before = load_file(str(exported(one) / "model.safetensors"))
    after = load_file(str(exported(tmp_path / "b") / "model.safetensors"))
    meta = json.loads((exported(tmp_path / "b") / "osft_subspaces.json").read_text())
    for name in {k.rpartition(".")[0] for k in bases}:
        P, Q = bases[f"{name}.P"].double(), bases[f"{name}.Q"].double()
        d = after[f"{name}.weight"].double() - before[f"{name}.weight"].double()
        assert d.norm() > 0, name
        assert (P.t() @ d).norm() <= 1e-4 * d.norm() and (d @ Q).norm() <= 1e-4 * d.norm(), name
        assert meta["modules"][name]["p_left"] > P.shape[1] - 1  # the old bases are kept, new ones added
    # the default recipe: input bases (every module of this dense model), the GPM criterion, frozen non-targets
    assert meta["basis"] == "auto" and meta["input_criterion"] == "total" and meta["frozen_rank"] == "reduced"
    assert all(m["basis"] == "inputs" and m["next_k_low"] == m["next_rank"] - m["next_k_high"]
               for m in meta["modules"].values())
    assert "protected subspaces at export: input bases for 14 modules" in output and "chain budget: p_L" in output
    assert "non-target parameters frozen: a chained run" in output
    for key in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        assert torch.equal(after[key], before[key]), key
    no_protect = tmp_path / "c"
    code, output = osft_train(exported(one), data, no_protect, "--no-osft-protect-subspaces", "--max-steps", "1")
    assert code == 0 and "not used (--no-osft-protect-subspaces)" in output, output
    assert "non-target parameters frozen" not in output


def test_a_full_fine_tuning_run_on_an_export_with_subspaces_says_they_are_dropped(job, runs, tmp_path, capsys):
    from osft.trainer.launch.cli import main

    code = main(["--model-name-or-path", str(exported(runs[0])), "--data-path", str(job[1]), "--output-dir",
                 str(tmp_path / "full"), "--no-osft", "--max-steps", "1", "--batch-size", "2", "--max-seq-len", "64",
                 "--max-tokens-per-gpu", "64"])
    err = capsys.readouterr().err.replace("\n", "")
    assert code == 0, err
    assert f"{exported(runs[0]) / 'osft_subspaces.safetensors'} dropped (--no-osft)" in err, err
    assert not (exported(tmp_path / "full", 1) / "osft_subspaces.safetensors").exists()


@pytest.mark.torchrun
def test_subspaces_that_do_not_fit_the_model_fail_before_any_rank_starts(job, runs, tmp_path):
    _, data = job
    broken = tmp_path / "model"
    subprocess.run(["cp", "-r", str(exported(runs[0])), str(broken)], check=True)
    bases = load_bases(broken / "osft_subspaces.safetensors")
    bases["model.layers.0.self_attn.q_proj.P"] = torch.zeros(7, 1)
    save_file(bases, str(broken / "osft_subspaces.safetensors"))
    code, output = osft_train(broken, data, tmp_path / "out", "--nproc-per-node", "2")
    assert code != 0
    assert "model.layers.0.self_attn.q_proj" in output and "osft_subspaces.safetensors" in output, output
    assert not (tmp_path / "out" / "logs").exists() or not any((tmp_path / "out" / "logs").rglob("*.log"))
