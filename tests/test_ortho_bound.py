"""The per-step bound on the orthogonality deviation (Projector.deviation_bound) against the exact
deviation measured in float64, and the trainer's use of it between full checks."""

import math

import pytest
import torch
from helpers import QA, chat, write_jsonl
from test_grad_norm import prepared

from osft.trainer.osft.decomposition import OSFTLinear
from osft.trainer.osft.projection import Projector

#: (N, M, URR): keep and remove mode on both sides, thin and wide shapes, k_low = 1.
SHAPES = [(48, 48, 0.25), (96, 48, 0.25), (48, 96, 0.25), (20, 60, 0.6), (30, 12, 0.05)]


def exact_deviation_sine(mod: OSFTLinear) -> float:
    """Largest ‖frozen component‖/‖x‖ over U_low's columns and V_low's rows, in float64 with the
    exact orthogonal projector on span(basis) (B·pinv(B)), whatever the basis's orthonormality."""
    worst = 0.0
    for x, basis, keep in ((mod.U_low.double(), mod.U_basis.double(), mod.u_keep),
                           (mod.V_low.double().mT, mod.V_basis.double().mT, mod.v_keep)):
        if basis.shape[-1] == 0:
            continue
        inside = basis @ (torch.linalg.pinv(basis) @ x)
        frozen = x - inside if keep else inside
        worst = max(worst, float((frozen.detach().norm(dim=-2) / x.detach().norm(dim=-2)).max()))
    return worst


def modules(dtype: torch.dtype) -> list[OSFTLinear]:
    g = torch.Generator().manual_seed(0)
    return [OSFTLinear.from_weight(torch.randn(n, m, generator=g).to(dtype), None, urr=urr, max_tokens_per_micro_batch=16)
            for n, m, urr in SHAPES]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bound_covers_the_exact_deviation_after_every_adamw_step_and_stays_under_the_margin(dtype):
    mods = modules(dtype)
    assert {(m.u_keep, m.v_keep) for m in mods} >= {(True, True), (False, True), (True, False)}
    projector = Projector([(f"m{i}", m) for i, m in enumerate(mods)])
    assert projector.deviation_bound() is None  # nothing projected yet
    optimizer = torch.optim.AdamW([p for m in mods for p in m.parameters() if p.requires_grad], lr=5e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        for m in mods:
            for p in (m.U_low, m.S_low, m.V_low):
                p.grad = torch.randn(p.shape, generator=g).to(dtype)
        projector.project_gradients()
        optimizer.step()
        projector.project_parameters()
        bound = projector.deviation_bound()
        exact = math.degrees(math.asin(max(exact_deviation_sine(m) for m in mods)))
        assert exact <= bound < 1.0, (exact, bound)  # sound, and tight enough to rule out a 1° violation
        assert bound <= projector.check(margin_deg=1.0).max_dev_deg + (0.05 if dtype == torch.float32 else 0.5)


def test_bound_grows_with_a_basis_that_is_not_orthonormal():
    mod = modules(torch.float32)[1]  # remove mode on the U side (N = 96 > rank 48)
    assert not mod.u_keep
    with torch.no_grad():
        mod.U_basis.mul_(1.05)  # BᵀB = 1.1025·I: the projection X − B(BᵀX) overshoots by 10 %
        mod.U_low.add_(0.1 * mod.U_basis[:, :mod.U_low.shape[1]])
    projector = Projector([("m", mod)])
    projector.project_parameters()
    exact = math.degrees(math.asin(exact_deviation_sine(mod)))
    assert exact > 0.1
    assert projector.deviation_bound() >= exact


def test_one_elementwise_call_bounds_each_vector_with_its_own_side():
    from osft.trainer.osft.orthogonality import projection_bound

    coef, stored = torch.tensor([1e-3, 1e-3, 1e-3, 0.0, 1e-3]), torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0])
    n, k = torch.tensor([96.0, 96.0, 96.0, 96.0, 96.0]), torch.tensor([48.0, 48.0, 48.0, 48.0, 48.0])
    eps = torch.tensor([1e-6, 1e-6, 1.5, 1e-6, 1e-6])
    keep = torch.tensor([True, False, False, False, True])
    bounds = projection_bound(coef, stored, n, k, eps, keep, torch.zeros(5))
    for i in (0, 1):  # each element equals the call with that element's numbers alone
        alone = projection_bound(coef[i:i + 1], stored[i:i + 1], 96, 48, 1e-6, bool(keep[i]), 0.0)
        torch.testing.assert_close(bounds[i], alone[0], rtol=1e-12, atol=0)
    assert 0 < bounds[0] < bounds[1] < 1e-3  # keep mode bounds only the product's rounding
    assert bounds[2] == math.inf  # ε ≥ 1: no bound for that side
    assert bounds[3] == 0.0 and bounds[4] == math.inf  # a zero vector: 0 with nothing to bound, else none


def test_a_nan_parameter_rules_nothing_out():
    mod = modules(torch.float32)[0]
    with torch.no_grad():
        mod.V_low[0, 0] = float("nan")
    projector = Projector([("m", mod)])
    projector.project_parameters()
    assert projector.deviation_bound() == 90.0


def test_gram_v_projection_has_no_bound():
    projector = Projector([("m", modules(torch.float32)[0])], "gram")
    projector.project_parameters()
    assert projector.deviation_bound() is None


def test_steps_between_full_checks_use_the_bound(tiny_model_dir, tmp_path):
    """--ortho-check-every 3: full checks on steps 1 and 3; step 2 runs it only when the bound cannot
    rule out a deviation above the margin (1° here: it can; 1e-6°, on step 4: it cannot); the
    forgetting indicators stay on the scheduled steps."""
    data = write_jsonl(tmp_path / "train.jsonl", [chat(q, a) for q, a in QA] * 7)
    trainer = prepared(tiny_model_dir, data, tmp_path / "run", "--ortho-check-every", "3")
    records = [trainer.train_step(step, trainer.sampler.batch(0, step - 1)) for step in (1, 2, 3)]
    trainer.train_step.ortho_margin_deg = 1e-6  # the train step keeps its settings
    records.append(trainer.train_step(4, trainer.sampler.batch(0, 3)))
    assert [r["ortho_max_dev_deg"] is not None for r in records] == [True, False, True, True]
    assert [r["osft_dw_rel_max"] is not None for r in records] == [True, False, True, False]
    assert [r["ortho_violations"] for r in records[:3]] == [0, 0, 0]
