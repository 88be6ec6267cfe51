"""Forgetting indicators (trainer/osft/indicators.py) against the dense N×M computation."""

import pytest
import torch

from osft.trainer.osft import indicators
from osft.trainer.osft.decomposition import OSFTLinear
from osft.trainer.osft.projection import Projector


def factors(n, m, k, seed, drift=0.3, step=0.1):
    """Start factors with orthonormal U₀, V₀ (as the SVD leaves them) and factors moved from
    them by ``step`` that are no longer orthonormal (``drift``), float32."""
    g = torch.Generator().manual_seed(seed)
    u0 = torch.linalg.qr(torch.randn(n, k, generator=g))[0]
    v0 = torch.linalg.qr(torch.randn(m, k, generator=g))[0].t().contiguous()
    s0 = torch.rand(k, generator=g) + 0.5
    u = u0 + step * torch.randn(n, k, generator=g) + drift * u0 @ torch.randn(k, k, generator=g)
    v = v0 + step * torch.randn(k, m, generator=g)
    s = s0 + step * torch.randn(k, generator=g)
    return [t.float() for t in (u, s, v, u0, s0, v0)]


def grams(u, s, v, u0, s0, v0):
    return indicators.left_gram(u, s, u0, s0), indicators.right_gram(v, v0), s0


def dense_low(u, s, v):
    return (u.double() * s.double()) @ v.double()


@pytest.mark.parametrize(("n", "m", "k", "step"), [(48, 32, 8, 0.1), (20, 60, 5, 0.1), (64, 64, 16, 1e-4)])
def test_update_norm_and_top_singular_value_match_the_dense_matrices(n, m, k, step):
    u, s, v, u0, s0, v0 = factors(n, m, k, seed=n + m, step=step, drift=0.3 if step > 1e-3 else 0.0)
    g = grams(u, s, v, u0, s0, v0)
    dense_dw = torch.linalg.matrix_norm(dense_low(u, s, v) - dense_low(u0, s0, v0)).item()
    update_sq, sigma_max = indicators.low_part_norms(*g)
    assert update_sq ** 0.5 == pytest.approx(dense_dw, rel=1e-4)
    want = torch.linalg.svdvals(dense_low(u, s, v))[0].item()
    assert want > s.abs().max().item() * 1.01 or step < 1e-3  # drift: S_low alone is not the answer
    assert sigma_max == pytest.approx(want, rel=1e-5)


def test_row_shards_sum_to_the_whole_gram():
    u, s, v, u0, s0, v0 = factors(30, 20, 6, seed=1)
    g_u = sum(indicators.left_gram(u[r], s, u0[r], s0) for r in (slice(0, 17), slice(17, 30)))
    torch.testing.assert_close(g_u, grams(u, s, v, u0, s0, v0)[0], rtol=1e-5, atol=1e-5)


def test_no_update_is_zero_and_singular_v_falls_back_to_eigh():
    u, s, v, u0, s0, v0 = factors(24, 24, 6, seed=2)
    assert indicators.low_part_norms(*grams(u0, s0, v0, u0, s0, v0))[0] < 1e-10
    v0 = torch.eye(6, 24)
    v = v0 + 0.1 * torch.randn(6, 24)
    v[3] = 0  # V Vᵀ is exactly singular: Cholesky fails, the eigh root takes over
    want = torch.linalg.svdvals(dense_low(u, s, v))[0].item()
    assert indicators.low_part_norms(*grams(u, s, v, u0, s0, v0))[1] == pytest.approx(want, rel=1e-5)


def test_projector_indicators_of_an_osft_module_match_the_dense_weights():
    torch.manual_seed(0)
    weight = torch.randn(40, 24)
    module = OSFTLinear.from_weight(weight, None, urr=0.25, max_tokens_per_micro_batch=64)
    k_high = module.plan.k_high
    sigma = torch.linalg.svdvals(weight.double())
    assert module.sigma_frozen_min.item() == pytest.approx(sigma[k_high - 1].item(), rel=1e-6)
    with torch.no_grad():
        module.U_low.add_(0.05 * torch.randn_like(module.U_low))
        module.V_low.add_(0.05 * torch.randn_like(module.V_low))
        module.S_low.mul_(3.0)  # the low part now outgrows the weakest frozen direction
    report = Projector([("layer", module)]).indicators()
    after = module.dense_weight().double()
    dw = torch.linalg.matrix_norm(after - weight.double()) / torch.linalg.matrix_norm(weight.double())
    assert report.dw_rel[0] == pytest.approx(dw.item(), rel=1e-4)
    low = dense_low(module.U_low.detach(), module.S_low.detach(), module.V_low.detach())
    gap = torch.linalg.svdvals(low)[0] / sigma[k_high - 1]
    assert report.gap[0] == pytest.approx(gap.item(), rel=1e-5) and report.gap[0] > 1


def test_report_fields_name_the_worst_module_and_skip_modules_without_frozen_directions():
    report = indicators.IndicatorReport(names=["a", "b", "c"], dw_rel=[0.1, 0.3, 0.2], gap=[0.5, None, 0.9])
    assert report.fields() == {
        "osft_dw_rel_max": 0.3, "osft_dw_rel_median": 0.2, "osft_dw_rel_worst_module": "b",
        "osft_gap_max": 0.9, "osft_gap_median": pytest.approx(0.7), "osft_gap_worst_module": "c",
    }
    assert set(report.fields()) == set(indicators.INDICATOR_FIELDS)
    empty = indicators.IndicatorReport(names=[], dw_rel=[], gap=[]).fields()
    assert empty == dict.fromkeys(indicators.INDICATOR_FIELDS)


def test_step_records_carry_the_indicators_of_the_export(tiny_model_dir, tmp_path):
    import json
    import math
    import statistics

    from helpers import QA, chat, dense_forgetting, write_jsonl

    from osft.trainer.launch.cli import main

    data = write_jsonl(tmp_path / "train.jsonl", [chat(q, a) for q, a in QA] * 4)
    out = tmp_path / "run"
    assert main(["--model-name-or-path", str(tiny_model_dir), "--data-path", str(data), "--output-dir", str(out),
                 "--batch-size", "5", "--max-tokens-per-gpu", "96", "--max-seq-len", "64", "--learning-rate", "5e-3",
                 "--max-steps", "3", "--ortho-check-every", "1", "--osft-unfreeze-rank-ratio", "0.25",
                 "--save-dtype", "float32"]) == 0
    records = [json.loads(line) for line in (out / "metrics" / "node0.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["event"] == "step"]
    assert len(steps) == 3
    for r in steps:
        assert all(math.isfinite(r[k]) for k in indicators.INDICATOR_FIELDS if not k.endswith("_module"))
    assert 0 < steps[0]["osft_dw_rel_max"] < steps[-1]["osft_dw_rel_max"]
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    dense = dense_forgetting(tiny_model_dir, out / "hf_format" / "step_3", 0.25, targets)
    last = steps[-1]
    for key, column in (("osft_dw_rel", 0), ("osft_gap", 1)):
        values = {name: v[column] for name, v in dense.items()}
        worst = max(values, key=values.get)
        assert last[f"{key}_worst_module"] == worst
        assert last[f"{key}_max"] == pytest.approx(values[worst], rel=1e-4)
        assert last[f"{key}_median"] == pytest.approx(statistics.median(values.values()), rel=1e-4)
