"""OSFT math on single modules: rank split, reconstruction, projection, orthogonality under AdamW."""

import math

import pytest
import torch
import torch.nn.functional as F

from osft.trainer.osft.decomposition import OSFTLinear
from osft.trainer.osft.plan import choose_forward_form
from osft.trainer.osft.plan import split_rank
from osft.trainer.osft.projection import Projector


def deviation_deg(mod):
    return Projector([("m", mod)]).check(margin_deg=90.0).max_dev_deg


def pretrained_like(n, m, seed=0):
    """A weight with a decaying spectrum like a trained layer's (random spectrum would be flat)."""
    g = torch.Generator().manual_seed(seed)
    r = min(n, m)
    u, _ = torch.linalg.qr(torch.randn(n, r, generator=g))
    v, _ = torch.linalg.qr(torch.randn(m, r, generator=g))
    s = torch.logspace(0, -2, r)
    return (u * s) @ v.t()


def frozen_bases(weight, urr):
    u, s, vh = torch.linalg.svd(weight.double(), full_matrices=False)
    kh, _ = split_rank(min(weight.shape), urr)
    return u[:, :kh].float(), vh[:kh].float()


@pytest.mark.parametrize(
    "n,m,urr,k_high",
    [(576, 576, 0.25, 432), (192, 576, 0.25, 144), (10, 7, 1.0, 0), (10, 7, 0.5, 3), (8, 8, 0.01, 7), (1, 5, 0.3, 0)],
)
def test_rank_split(n, m, urr, k_high):
    got_high, k_low = split_rank(min(n, m), urr)
    assert got_high == k_high
    assert k_low == min(n, m) - k_high
    assert k_low >= 1


@pytest.mark.parametrize("urr", [0.0, -0.1, 1.0001, 2, float("nan"), float("inf")])
def test_rank_split_rejects_urr_outside_range(urr):
    with pytest.raises(ValueError, match=r"must be in \(0, 1\]"):
        split_rank(8, urr)


@pytest.mark.parametrize("shape", [(48, 48), (96, 32), (32, 96)])
@pytest.mark.parametrize("urr", [0.1, 0.25, 0.5, 1.0])
def test_reconstruction_fp32(shape, urr):
    w = pretrained_like(*shape)
    mod = OSFTLinear.from_weight(w, None, urr=urr, max_tokens_per_micro_batch=64)
    torch.testing.assert_close(mod.dense_weight(), w, rtol=0, atol=2e-6)
    assert mod.k_low == split_rank(min(shape), urr)[1]


def test_keep_mode_chosen_only_when_cheaper_and_complete():
    square = OSFTLinear.from_weight(pretrained_like(40, 40), None, urr=0.25, max_tokens_per_micro_batch=8)
    assert square.u_keep and square.v_keep and square.U_basis.shape == (40, 10)
    tall = OSFTLinear.from_weight(pretrained_like(80, 40), None, urr=0.25, max_tokens_per_micro_batch=8)
    assert not tall.u_keep and tall.v_keep  # U side lacks the null-space columns: U_high is used
    half = OSFTLinear.from_weight(pretrained_like(40, 40), None, urr=0.5, max_tokens_per_micro_batch=8)
    assert not half.u_keep and not half.v_keep


@pytest.mark.parametrize("form", ["dense", "hybrid", "split"])
@pytest.mark.parametrize("transposed", [False, True])
def test_forward_and_gradients_match_dense_linear(form, transposed):
    w = pretrained_like(24, 40)
    bias = torch.randn(24)
    stored = w.t().contiguous() if transposed else w
    mod = OSFTLinear.from_weight(stored, bias, urr=0.5, max_tokens_per_micro_batch=8, forward_form=form, transposed=transposed)
    x = torch.randn(3, 5, 40)
    torch.testing.assert_close(mod(x), F.linear(x, w, bias), rtol=1e-5, atol=1e-5)
    # Gradients of the factors follow the chain rule through W = W_high + U_low diag(S_low) V_low.
    x.requires_grad_(True)
    mod(x).square().sum().backward()
    w_eff = w.clone().requires_grad_(True)
    F.linear(x.detach(), w_eff, bias).square().sum().backward()
    dw = w_eff.grad
    torch.testing.assert_close(mod.U_low.grad, dw @ mod.V_low.detach().t() * mod.S_low.detach(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(mod.V_low.grad, mod.S_low.detach()[:, None] * (mod.U_low.detach().t() @ dw), rtol=1e-4, atol=1e-4)
    assert mod.W_high.grad is None and mod.U_basis.grad is None


@pytest.mark.parametrize("form,save_rebuilt", [("split", True), ("hybrid", True), ("hybrid", False)],
                         ids=["split", "hybrid", "hybrid-rebuilt-in-backward"])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("trainable", ["all", "input_only", "factors_only"])
def test_factored_backward_gives_autograd_values_of_its_expression(form, save_rebuilt, with_bias, trainable):
    from osft.trainer.osft.factored_backward import factored_linear

    g = torch.Generator().manual_seed(3)
    x, w_high = torch.randn(2, 7, 40, generator=g), torch.randn(24, 40, generator=g)
    u, s, v = torch.randn(24, 6, generator=g), torch.rand(6, generator=g) + 0.5, torch.randn(6, 40, generator=g)
    b = torch.randn(24, generator=g) if with_bias else None
    dy = torch.randn(2, 7, 24, generator=g)
    grads = {"all": (True, True), "input_only": (True, False), "factors_only": (False, True)}[trainable]

    def run(fn):
        leaves = [t.clone().requires_grad_(grads[0] if i == 0 else grads[1]) if t is not None else None
                  for i, t in enumerate((x, u, s, v, b))]
        xl, ul, sl, vl, bl = leaves
        y = fn(xl, ul, sl, vl, bl)
        y.backward(dy)
        return y.detach(), [t.grad if t is not None else None for t in leaves]

    def reference(xl, ul, sl, vl, bl):  # autograd on the form's own expression
        if form == "hybrid":
            return F.linear(xl, torch.addmm(w_high, ul * sl, vl), bl)
        return F.linear(xl, w_high, bl) + F.linear(F.linear(xl, vl) * sl, ul)

    y, got = run(lambda xl, ul, sl, vl, bl: factored_linear(xl, w_high, ul, sl, vl, bl, form, save_rebuilt))
    y_ref, want = run(reference)
    torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-5)
    for name, a, e in zip(("x", "U_low", "S_low", "V_low", "bias"), got, want):
        assert (a is None) == (e is None), name
        if e is not None:
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5, msg=name)
    with pytest.raises(ValueError, match="form must be"):
        factored_linear(x, w_high, u, s, v, b, "dense")


def test_forward_form_choice_by_flops():
    # SmolLM2's shapes at URR 0.25 and 1,024 tokens: the rebuilt W forward with the factors'
    # gradients formed directly (no N×M weight gradient) is the cheapest everywhere.
    assert choose_forward_form(576, 576, 144, 1024) == "hybrid"
    assert choose_forward_form(1536, 576, 144, 1024) == "hybrid"
    assert choose_forward_form(192, 576, 48, 1024) == "hybrid"
    # Split beats hybrid exactly below T = N·M/(N + M) tokens (419 for 1536×576): no rebuild to amortise.
    assert choose_forward_form(1536, 576, 144, 400) == "split"
    assert choose_forward_form(1536, 576, 144, 440) == "hybrid"
    assert choose_forward_form(576, 576, 144, 128) == "split"
    # A high URR with many tokens: the 4·T·k·(N + M) of the factored backward exceeds the weight gradient's cost.
    assert choose_forward_form(576, 576, 288, 4096) == "dense"
    # Tiny weights: the hand-written function's fixed cost per call outweighs the FLOPs it saves.
    assert choose_forward_form(32, 32, 8, 512) == "dense"
    assert choose_forward_form(256, 256, 64, 512) == "hybrid"


@pytest.mark.parametrize("shape", [(40, 40), (80, 40), (40, 80)])
@pytest.mark.parametrize("urr", [0.25, 0.6])
@pytest.mark.parametrize("v_projection", ["factored", "gram"])
def test_projected_gradients_are_orthogonal_to_frozen_subspaces(shape, urr, v_projection):
    w = pretrained_like(*shape)
    mod = OSFTLinear.from_weight(w, None, urr=urr, max_tokens_per_micro_batch=8)
    u_high, v_high = frozen_bases(w, urr)
    mod.U_low.grad = torch.randn_like(mod.U_low)
    mod.V_low.grad = torch.randn_like(mod.V_low)
    before_u = (u_high.t() @ mod.U_low.grad).abs().max()
    projector = Projector([("m", mod)], v_projection)
    projector.project_gradients()
    assert before_u > 0.1
    assert (u_high.t() @ mod.U_low.grad).abs().max() < 1e-5
    assert (mod.V_low.grad @ v_high.t()).abs().max() < 1e-5
    # The projection is idempotent and leaves the trainable component untouched.
    g_u, g_v = mod.U_low.grad.clone(), mod.V_low.grad.clone()
    projector.project_gradients()
    torch.testing.assert_close(mod.U_low.grad, g_u, atol=1e-5, rtol=0)
    torch.testing.assert_close(mod.V_low.grad, g_v, atol=1e-5, rtol=0)


@pytest.mark.parametrize("shape", [(40, 40), (80, 40), (40, 80)])
def test_factored_equals_gram(shape):
    w = pretrained_like(*shape)
    a = OSFTLinear.from_weight(w, None, urr=0.3, max_tokens_per_micro_batch=8)
    b = OSFTLinear.from_weight(w, None, urr=0.3, max_tokens_per_micro_batch=8)
    g = torch.Generator().manual_seed(3)
    u, v = torch.randn(a.U_low.shape, generator=g), torch.randn(a.V_low.shape, generator=g)
    for mod in (a, b):
        mod.U_low.data, mod.V_low.data = u.clone(), v.clone()
    Projector([("a", a)], "factored").project_parameters()
    Projector([("b", b)], "gram").project_parameters()
    torch.testing.assert_close(a.V_low, b.V_low, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a.U_low, b.U_low, rtol=1e-5, atol=1e-5)


def test_deviation_measure_is_the_angle_to_the_frozen_subspace():
    w = pretrained_like(30, 30)
    mod = OSFTLinear.from_weight(w, None, urr=0.5, max_tokens_per_micro_batch=8)
    u_high, _ = frozen_bases(w, 0.5)
    assert deviation_deg(mod) < 1e-3
    # Tilt one trainable column by exactly 3 degrees towards a frozen direction.
    with torch.no_grad():
        col = mod.U_low[:, 0].clone()
        mod.U_low[:, 0] = col * math.cos(math.radians(3)) + u_high[:, 0] * col.norm() * math.sin(math.radians(3))
    assert deviation_deg(mod) == pytest.approx(3.0, abs=1e-3)
    report = Projector([("m", mod)]).check(margin_deg=1.0)
    assert report.violations == 1 and report.violating == ["m"]
    assert Projector([("m", mod)]).check(margin_deg=5.0).violations == 0
    # The V side is measured too: tilt a row of V_low by 7 degrees.
    _, v_high = frozen_bases(w, 0.5)
    with torch.no_grad():
        row = mod.V_low[1].clone()
        mod.V_low[1] = row * math.cos(math.radians(7)) + v_high[2] * row.norm() * math.sin(math.radians(7))
    assert deviation_deg(mod) == pytest.approx(7.0, abs=1e-3)


def _adamw_stress(reproject: bool, steps: int = 200):
    torch.manual_seed(0)
    shapes = [(48, 48), (96, 48), (48, 96)]
    mods = [OSFTLinear.from_weight(pretrained_like(n, m, seed=i), None, urr=0.25, max_tokens_per_micro_batch=16) for i, (n, m) in enumerate(shapes)]
    targets = [torch.randn(n, m) for n, m in shapes]
    params = [p for mod in mods for p in mod.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    projector = Projector([(f"m{i}", mod) for i, mod in enumerate(mods)])
    violations, worst = 0, 0.0
    for _ in range(steps):
        x = torch.randn(16, 96)
        loss = sum(F.mse_loss(mod(x[:, : mod.in_features]), x[:, : mod.in_features] @ t.t()) for mod, t in zip(mods, targets))
        opt.zero_grad()
        loss.backward()
        projector.project_gradients()
        opt.step()
        if reproject:
            projector.project_parameters()
        report = projector.check(margin_deg=1.0)
        violations += report.violations
        worst = max(worst, report.max_dev_deg)
    return violations, worst, loss.item()


def test_adamw_stress_has_no_violations_with_reprojection():
    violations, worst, _ = _adamw_stress(reproject=True)
    assert violations == 0
    assert worst < 1e-2  # degrees; fp32 projection leaves only rounding error


def test_violations_appear_without_post_step_reprojection():
    violations, worst, _ = _adamw_stress(reproject=False)
    assert violations > 0
    assert worst > 1.0


@pytest.mark.parametrize("shape", [(64, 32), (32, 64)])
@pytest.mark.parametrize("rank_deficient", [False, True])
def test_thin_svd_matches_lapack_and_is_orthonormal(shape, rank_deficient):
    from osft.trainer.osft.decomposition import thin_svd

    w = pretrained_like(*shape)
    if rank_deficient:  # condition number beyond the Gram route's limit: the LAPACK fallback runs
        w = w @ torch.diag(torch.cat([torch.ones(16), torch.zeros(shape[1] - 16)]))
    u, s, vh = thin_svd(w)
    r = min(shape)
    assert u.shape == (shape[0], r) and s.shape == (r,) and vh.shape == (r, shape[1])
    reference = torch.linalg.svd(w.double(), full_matrices=False).S
    torch.testing.assert_close(s, reference, rtol=0, atol=1e-9)
    torch.testing.assert_close(u.t() @ u, torch.eye(r, dtype=u.dtype), rtol=0, atol=1e-9)
    torch.testing.assert_close(vh @ vh.t(), torch.eye(r, dtype=vh.dtype), rtol=0, atol=1e-9)
    torch.testing.assert_close((u * s) @ vh, w.double(), rtol=0, atol=1e-9)
    mod = OSFTLinear.from_weight(w, None, urr=0.5, max_tokens_per_micro_batch=8)
    assert torch.isfinite(mod.U_low).all()


@pytest.mark.parametrize("shape", [(40, 40), (80, 40), (40, 80), (12, 30)])
@pytest.mark.parametrize("urr", [0.25, 0.5, 1.0])
def test_empty_skeleton_has_the_structure_of_the_decomposed_module(shape, urr):
    real = OSFTLinear.from_weight(pretrained_like(*shape), torch.zeros(shape[0]), urr=urr, max_tokens_per_micro_batch=64)
    skeleton = OSFTLinear.empty(*shape, has_bias=True, urr=urr, max_tokens_per_micro_batch=64)
    assert {n: p.shape for n, p in skeleton.named_parameters()} == {n: p.shape for n, p in real.named_parameters()}
    assert (skeleton.u_keep, skeleton.v_keep, skeleton.forward_form) == (real.u_keep, real.v_keep, real.forward_form)
    assert skeleton.W_high.is_meta
