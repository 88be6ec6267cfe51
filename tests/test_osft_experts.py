"""MoE experts under OSFT (docs/osft.md, "MoE expert banks"): the fused 3-D expert tensors of Mixtral, Qwen3-MoE and
gpt-oss (transformers 5) split into per-expert banks, decomposed by batched SVDs, projected batched
over the experts, trained, exported under their original names and resumed bit-exactly. Tiny
random models built from their configs."""

import json

import pytest
import torch
from model_matrix import TINY, random_model
from transformers import AutoConfig, AutoModelForCausalLM

from osft.trainer.checkpoint.subspaces import load_bases
from osft.trainer.osft.decomposition import OSFTLinear
from osft.trainer.osft.experts import ExpertLayout, OSFTExperts
from osft.trainer.osft.projection import Projector
from osft.trainer.osft.plan import OSFTSettings
from osft.trainer.osft.surgery import apply_osft, dense_state_dict
from osft.trainer.osft.targets import describe_unconstrained

MOE = ("mixtral", "qwen3_moe", "gpt_oss")


def moe_model(model_type: str, vocab_size: int = 97, **extra):
    """A tiny random MoE model (:func:`model_matrix.random_model`)."""
    return random_model(AutoConfig.for_model(model_type, vocab_size=vocab_size, **{**TINY, **extra}))


@pytest.mark.parametrize("model_type", MOE)
def test_banks_reconstruct_every_expert_and_export_the_original_tensors(model_type):
    model = moe_model(model_type)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, 97, (2, 12))
    with torch.no_grad():
        before = model(ids).logits
    osft = apply_osft(model, OSFTSettings(urr=0.25, max_tokens_per_micro_batch=64))
    # per layer: q/k/v/o and the three banks of the experts module
    assert len(osft.modules) == 2 * 7 and len(osft.experts) == 2
    for name, experts in osft.experts:
        assert isinstance(experts, OSFTExperts) and model.get_submodule(name) is experts
        assert set(experts.banks()) == {"gate_proj", "up_proj", "down_proj"}
        for bank in experts.banks().values():
            assert bank.plan.experts == 4 and bank.W_high.shape[0] == 4
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before, rtol=1e-5, atol=1e-5)
    exported = dense_state_dict(model.state_dict(), osft)
    assert set(exported) == set(original)
    for key, value in original.items():
        assert exported[key].shape == value.shape, key
        torch.testing.assert_close(exported[key], value, rtol=0, atol=1e-6, msg=key)
    # nothing inside the blocks trains outside OSFT: the router is a normal parameter by design
    warning, note = describe_unconstrained(model, [n for n, _ in osft.modules])
    assert warning is None and "MoE routers" in note
    router = "router" if model_type == "gpt_oss" else "gate"
    assert model.get_submodule(f"model.layers.0.mlp.{router}").weight.requires_grad


def test_batched_svd_gives_each_expert_its_own_decomposition():
    """A bank's expert e holds the factors of a plain OSFTLinear of that expert's weight alone."""
    model = moe_model("gpt_oss")  # transposed, interleaved gate/up, biases
    fused = model.get_submodule("model.layers.0.mlp.experts")
    split = ExpertLayout.of(fused).split(dict(fused.named_parameters(recurse=False)))
    gate, gate_bias = (t.detach().clone() for t in split["gate_proj"])
    assert torch.equal(gate[1], fused.gate_up_proj[1].detach().t()[::2]) and torch.equal(gate_bias[1], fused.gate_up_proj_bias[1, ::2])
    osft = apply_osft(model, OSFTSettings(urr=0.5, max_tokens_per_micro_batch=64))
    bank = dict(osft.modules)["model.layers.0.mlp.experts.gate_proj"]
    for e in range(4):
        alone = OSFTLinear.from_weight(gate[e], gate_bias[e], plan=OSFTSettings(urr=0.5, max_tokens_per_micro_batch=64).plan(*gate.shape[1:]))
        torch.testing.assert_close(bank.dense_weight()[e], gate[e], rtol=0, atol=1e-6)
        torch.testing.assert_close(bank.S_low[e], alone.S_low, rtol=1e-6, atol=1e-7)
        # singular vectors up to sign
        torch.testing.assert_close((bank.U_low[e] * alone.U_low).sum(0).abs(), torch.ones(alone.k_low), rtol=0, atol=1e-5)
        torch.testing.assert_close(bank.bias[e], gate_bias[e])


def test_projection_keeps_every_experts_update_orthogonal_to_its_frozen_subspaces():
    """Random gradients and AdamW steps with weight decay: after the projection every expert's
    gradient and factors are orthogonal to that expert's own frozen bases (checked per expert
    against the frozen SVD factors), and the batched projection equals the per-expert one."""
    model = moe_model("qwen3_moe")
    osft = apply_osft(model, OSFTSettings(urr=0.25, max_tokens_per_micro_batch=64))
    banks = [(n, m) for n, m in osft.modules if m.plan.experts]
    g = torch.Generator().manual_seed(1)
    for _, m in banks:
        m.U_low.grad, m.V_low.grad = torch.randn(m.U_low.shape, generator=g), torch.randn(m.V_low.shape, generator=g)
    # the same gradients projected expert by expert, as 2-D modules with bases from their own SVD
    singles = []
    for _, m in banks:
        for e in range(m.plan.experts):
            one = OSFTLinear.from_weight(m.dense_weight()[e].detach(), None, plan=OSFTSettings(urr=0.25, max_tokens_per_micro_batch=64).plan(m.plan.n, m.plan.m))
            one.U_low.grad, one.V_low.grad = m.U_low.grad[e].clone(), m.V_low.grad[e].clone()
            singles.append(one)
    projector = Projector(banks)
    projector.project_gradients()
    Projector([(str(i), s) for i, s in enumerate(singles)]).project_gradients()
    flat = [(m, e) for _, m in banks for e in range(m.plan.experts)]
    for (m, e), one in zip(flat, singles):
        torch.testing.assert_close(m.U_low.grad[e], one.U_low.grad, rtol=0, atol=1e-6)
        torch.testing.assert_close(m.V_low.grad[e], one.V_low.grad, rtol=0, atol=1e-6)

    def frozen_parts(m):
        """Largest component of U_low (and its gradient) in span(U_high), V side alike, over experts."""
        u_high = m.U_basis if not m.u_keep else None
        v_high = m.V_basis if not m.v_keep else None
        out = []
        for x, basis, side in ((m.U_low, u_high, "u"), (m.V_low, v_high, "v")):
            if basis is None:  # keep mode: the basis is the complement; the residual is the frozen part
                keep = m.U_basis if side == "u" else m.V_basis
                comp = x - (keep @ (keep.mT @ x) if side == "u" else (x @ keep.mT) @ keep)
            else:
                comp = basis.mT @ x if side == "u" else x @ basis.mT
            out.append(float(comp.abs().max()))
        return max(out)

    optimizer = torch.optim.AdamW([p for _, m in banks for p in (m.U_low, m.S_low, m.V_low)], lr=5e-2, weight_decay=0.1)
    for _ in range(5):
        for _, m in banks:
            m.U_low.grad, m.V_low.grad = torch.randn(m.U_low.shape, generator=g), torch.randn(m.V_low.shape, generator=g)
            m.S_low.grad = torch.randn(m.S_low.shape, generator=g)
        projector.project_gradients()
        optimizer.step()
        projector.project_parameters()
        with torch.no_grad():
            assert max(frozen_parts(m) for _, m in banks) < 1e-5
    report = projector.check(margin_deg=1.0)
    assert report.violations == 0 and report.max_dev_deg < 1e-3
    assert report.max_dev_deg <= projector.deviation_bound() < 1.0  # the bound over every bank's experts
    fields = projector.indicators().fields()
    assert fields["osft_dw_rel_max"] > 0 and fields["osft_gap_max"] > 0


def test_partial_patterns_over_an_experts_module_are_refused():
    from osft.trainer.osft.targets import find_expert_banks

    model = moe_model("mixtral")
    assert find_expert_banks(model, "mixtral", [r"q_proj$"]) == []
    with pytest.raises(ValueError, match="decomposed whole or not at all"):
        find_expert_banks(model, "mixtral", [r"experts\.down_proj$"])


def train(model_dir, data, out, *flags):
    from osft.trainer.launch.cli import main

    return main(["--model-name-or-path", str(model_dir), "--data-path", str(data), "--output-dir", str(out),
                 "--batch-size", "4", "--max-tokens-per-gpu", "128", "--max-seq-len", "64", "--learning-rate", "5e-3",
                 "--save-dtype", "float32", *flags])


def test_a_moe_run_trains_exports_the_original_names_generates_and_resumes_bit_exactly(tmp_path, monkeypatch, capsys):
    """One rank in-process, tiny Qwen3-MoE with ``--freeze-router``: 2 steps with a checkpoint at
    step 1 and a resume from it (same losses and state hash at step 2, same export and protected
    subspaces, one basis per expert); the export reloads with the original parameter names and
    shapes, its experts changed and its routers did not, and generates; no unconstrained-weights
    warning. A chained run from the export keeps every expert's update orthogonal to its bases, and
    resumes bit-exactly with them."""
    from helpers import QA, chat, tiny_chat_tokenizer, weight_updates, write_jsonl
    from safetensors.torch import load_file

    monkeypatch.setenv("OSFT_TEST_STATE_HASH", "1")
    tokenizer = tiny_chat_tokenizer()
    model = moe_model("qwen3_moe", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                      pad_token_id=tokenizer.pad_token_id)
    source = tmp_path / "moe"
    model.save_pretrained(source)
    tokenizer.save_pretrained(source)
    data = write_jsonl(tmp_path / "train.jsonl", [chat(q, a) for q, a in QA] * 2)
    ref = tmp_path / "ref"
    assert train(source, data, ref, "--max-steps", "2", "--checkpoint-every-steps", "1", "--freeze-router") == 0
    err = capsys.readouterr().err.replace("\n", "")
    assert "OSFT's constraint" not in err and "MoE routers frozen: 2 parameters" in err
    resumed = tmp_path / "resumed"
    assert train(source, data, resumed, "--max-steps", "2", "--freeze-router", "--resume-from-full-state-checkpoint",
                 str(ref / "full_state_checkpoints" / "step_1")) == 0

    def steps(out):
        lines = (out / "metrics" / "node0.jsonl").read_text().splitlines()
        return {r["step"]: r for r in map(json.loads, lines) if r["event"] == "step"}

    want, got = steps(ref), steps(resumed)
    assert sorted(got) == [2]
    assert (got[2]["loss"], got[2]["state_sha256"]) == (want[2]["loss"], want[2]["state_sha256"])
    a, b = (load_file(out / "hf_format" / "step_2" / "model.safetensors") for out in (ref, resumed))
    assert all(torch.equal(a[k], b[k]) for k in a)
    # protected subspaces per expert (one rank per bank), the same after the resume
    sub_a, sub_b = (load_bases(out / "hf_format" / "step_2" / "osft_subspaces.safetensors") for out in (ref, resumed))
    assert sub_a.keys() == sub_b.keys() and all(torch.equal(sub_a[k], sub_b[k]) for k in sub_a)
    meta = json.loads((ref / "hf_format" / "step_2" / "osft_subspaces.json").read_text())
    bank = "model.layers.0.mlp.experts.gate_proj"
    r = meta["modules"][bank]["p_left"]
    assert sub_a[f"{bank}.P"].shape == (4, 24, r) and sub_a[f"{bank}.Q"].shape == (4, 32, r) and r > 0
    assert meta["modules"][bank]["experts"] == 4 and max(meta["modules"][bank]["expert_ranks"]) == r
    # a chained run protects every expert's subspaces, also across a resume
    chained, chained_resumed = tmp_path / "chained", tmp_path / "chained_resumed"
    chain = ("--max-steps", "2", "--freeze-router", "--learning-rate", "2e-2")
    assert train(ref / "hf_format" / "step_2", data, chained, *chain, "--checkpoint-every-steps", "1") == 0
    console = capsys.readouterr().err.replace("\n", "")
    assert "protected subspaces: 14 modules (6 of them expert banks, a basis per expert) from" in console
    assert f"p_L {min(m['p_left'] for m in meta['modules'].values())}-{max(m['p_left'] for m in meta['modules'].values())}" in console
    assert train(ref / "hf_format" / "step_2", data, chained_resumed, *chain, "--resume-from-full-state-checkpoint",
                 str(chained / "full_state_checkpoints" / "step_1")) == 0
    assert steps(chained_resumed)[2]["state_sha256"] == steps(chained)[2]["state_sha256"]
    sub_c, sub_r = (load_bases(out / "hf_format" / "step_2" / "osft_subspaces.safetensors") for out in (chained, chained_resumed))
    assert sub_c.keys() == sub_r.keys() and all(torch.equal(sub_c[k], sub_r[k]) for k in sub_c)
    read_a = load_bases(ref / "hf_format" / "step_2" / "osft_subspaces.safetensors")  # as the chained run read them
    # the chained run kept A's bases first (as read, re-orthonormalised, then stored as float16 again)
    torch.testing.assert_close(sub_c[f"{bank}.P"][..., :r].float(), read_a[f"{bank}.P"], rtol=0, atol=1e-3)
    moved = 0
    for key, P, Q, d in weight_updates(read_a, a, load_file(chained / "hf_format" / "step_2" / "model.safetensors")):
        if d.norm() > 1e-5:
            moved += ".experts." in key
            assert (P.t() @ d).norm() <= 1e-4 * d.norm() and (d @ Q).norm() <= 1e-4 * d.norm(), key
    assert moved >= 12
    # on disk both carry the per-expert names transformers saves Qwen3-MoE under (experts.<e>.gate_proj.weight)
    before = load_file(source / "model.safetensors")
    assert {k: tuple(v.shape) for k, v in a.items()} == {k: tuple(v.shape) for k, v in before.items()}
    for e in range(4):
        assert not torch.equal(a[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"],
                               before[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"])
    for layer in (0, 1):
        assert torch.equal(a[f"model.layers.{layer}.mlp.gate.weight"], before[f"model.layers.{layer}.mlp.gate.weight"])
    reloaded = AutoModelForCausalLM.from_pretrained(ref / "hf_format" / "step_2").eval()
    shapes = {k: tuple(v.shape) for k, v in reloaded.state_dict().items()}
    assert shapes == {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes["model.layers.0.mlp.experts.gate_up_proj"] == (4, 48, 32)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    generated = reloaded.generate(ids, max_new_tokens=5, do_sample=False)
    assert generated.shape[1] > ids.shape[1]


@pytest.mark.parametrize("model_type", MOE)
def test_freeze_router_freezes_exactly_the_routers(model_type):
    """On the fused experts (as the launcher checks a model before any rank starts) and after the
    surgery (as the trainer freezes it): the routers' weights (and gpt-oss's router bias) only."""
    from osft.trainer.osft.freeze import freeze_routers

    router = "router" if model_type == "gpt_oss" else "gate"
    want = sorted(f"model.layers.{i}.mlp.{router}.{p}" for i in (0, 1)
                  for p in (("weight", "bias") if model_type == "gpt_oss" else ("weight",)))
    for surgery in (False, True):
        model = moe_model(model_type)
        if surgery:
            apply_osft(model, OSFTSettings(urr=0.25, max_tokens_per_micro_batch=64))
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        assert freeze_routers(model, "m") == want
        assert sorted(trainable - {n for n, p in model.named_parameters() if p.requires_grad}) == want
        assert any(".experts." in n for n in trainable - set(want))


@pytest.mark.parametrize("ranks", [1, 2])
def test_freeze_router_on_a_dense_model_is_an_input_error(tiny_model_dir, tmp_path, capsys, ranks):
    """One rank: the trainer refuses it while it prepares; two ranks: the launcher before any rank starts."""
    from helpers import QA, chat, write_jsonl

    data = write_jsonl(tmp_path / "train.jsonl", [chat(q, a) for q, a in QA])
    assert train(tiny_model_dir, data, tmp_path / "r", "--freeze-router", "--nproc-per-node", str(ranks)) == 2
    err = capsys.readouterr().err.replace("\n", "")
    assert f"--freeze-router: {tiny_model_dir} (LlamaForCausalLM) has no MoE router to freeze" in err


def bank_update(m):
    """Every expert's ΔW_e = U_low S_low V_low − U_start S_start V_start of this run (E×N×M, float64)."""
    now = (m.U_low.double() * m.S_low.double().unsqueeze(-2)) @ m.V_low.double()
    return (now - (m.U_start.double() * m.S_start.double().unsqueeze(-2)) @ m.V_start.double()).detach()


def train_moe(model, osft, steps, seed):
    """AdamW with weight decay on the language-model loss of random tokens, projected as the trainer does."""
    g = torch.Generator().manual_seed(seed)
    projector = Projector(osft.modules)
    opt = torch.optim.AdamW([p for _, m in osft.modules for p in (m.U_low, m.S_low, m.V_low)], lr=2e-2, weight_decay=0.1)
    for _ in range(steps):
        ids = torch.randint(0, 97, (2, 16), generator=g)
        model(ids, labels=ids).loss.backward()
        projector.project_gradients()
        opt.step()
        opt.zero_grad(set_to_none=True)
        projector.project_parameters()


def test_protected_banks_keep_every_experts_earlier_update():
    """Run A on a tiny Mixtral, its banks folded expert by expert (one protected rank per bank; an
    expert whose update is undone is filled from its start basis), then run B on A's weights with
    those bases: every expert's update of B is orthogonal to its own P_e and Q_e."""
    from osft.trainer.osft.protect import fold_bank

    settings = OSFTSettings(urr=0.5, max_tokens_per_micro_batch=64)
    model = moe_model("mixtral")
    osft = apply_osft(model, settings)
    train_moe(model, osft, steps=3, seed=0)
    banks = {n: m for n, m in osft.modules if m.plan.experts}
    bank0 = banks["model.layers.0.mlp.experts.gate_proj"]
    with torch.no_grad():  # expert 0 of one bank ends where it started: D_0 = 0
        for k in ("U", "S", "V"):
            getattr(bank0, f"{k}_low")[0] = getattr(bank0, f"{k}_start")[0]
    folds = {}
    for name, m in banks.items():
        e, n, k_low = m.plan.experts, m.plan.n, m.plan.k_low
        factors = {k: getattr(m, k).detach() for k in ("U_low", "S_low", "V_low", "U_start", "S_start", "V_start")}
        fold = folds[name] = fold_bank({"P": torch.zeros(e, n, 0), "Q": torch.zeros(e, m.plan.m, 0), **factors}, 0.9, 0.5)
        r = fold.added_left
        assert fold.P.shape == (e, n, r) and fold.Q.shape == (e, m.plan.m, r) and 0 < r <= k_low // 2, name
        assert max(fold.expert_ranks) == r and fold.summary()["expert_ranks"] == list(fold.expert_ranks)
        eye = torch.eye(r).expand(e, r, r)
        torch.testing.assert_close(fold.P.mT @ fold.P, eye, rtol=0, atol=1e-5)
        torch.testing.assert_close(fold.Q.mT @ fold.Q, eye, rtol=0, atol=1e-5)
        d = bank_update(m)
        for x in range(e):
            if d[x].norm() == 0:
                continue
            sigma_sq = torch.linalg.svdvals(d[x]).square()
            kept = float((fold.P[x].double().mT @ d[x]).square().sum() / sigma_sq.sum())
            assert kept >= min(0.9, float(sigma_sq[:r].sum() / sigma_sq.sum())) - 1e-5, (name, x)
    p0 = folds["model.layers.0.mlp.experts.gate_proj"].P[0].double()  # from U_start alone
    u0 = bank0.U_start[0].double()
    assert torch.linalg.matrix_norm(p0 - u0 @ (u0.mT @ p0)) < 1e-5
    # run B on A's weights
    dense = dense_state_dict(model.state_dict(), osft)
    model_b = moe_model("mixtral")
    model_b.load_state_dict(dense)
    bases = {name: (f.P, f.Q) for name, f in folds.items()}
    osft_b = apply_osft(model_b, settings, bases=bases)
    b_banks = {n: m for n, m in osft_b.modules if m.plan.experts}
    for name, m in b_banks.items():
        r = folds[name].added_left
        assert (m.plan.p_left, m.plan.p_right) == (r, r) and m.P.shape == folds[name].P.shape
        torch.testing.assert_close(m.dense_weight().detach(), banks[name].dense_weight().detach(), rtol=0, atol=1e-5)
    train_moe(model_b, osft_b, steps=3, seed=1)
    for name, m in b_banks.items():
        d = bank_update(m)
        P, Q = folds[name].P.double(), folds[name].Q.double()
        for x in range(m.plan.experts):
            size = float(d[x].norm())
            assert size > 1e-4, (name, x)
            assert float((P[x].mT @ d[x]).norm()) <= 1e-5 * size and float((d[x] @ Q[x]).norm()) <= 1e-5 * size, (name, x)


def test_bank_bases_that_do_not_fit_the_bank_name_it(tmp_path):
    from safetensors.torch import save_file

    from osft.trainer.checkpoint.subspaces import read_bases

    name, path = "model.layers.0.mlp.experts.down_proj", tmp_path / "osft_subspaces.safetensors"
    shapes = {name: (4, 32, 24)}

    def basis(*shape: int) -> torch.Tensor:  # orthonormal columns (a file must hold orthonormal bases)
        return torch.eye(shape[-2])[:, :shape[-1]].expand(*shape).contiguous()

    for P, Q, why in ((basis(4, 32, 2), basis(4, 24, 2), None),
                      (basis(3, 32, 2), basis(3, 24, 2), r"is 4×32×24, but its P is \(3, 32, 2\)"),
                      (basis(4, 32, 2), basis(4, 24, 3), "p_L = p_R for an expert bank"),
                      (basis(32, 2), basis(24, 2), r"expected 4×32×p_L and 4×24×p_R")):
        save_file({f"{name}.P": P, f"{name}.Q": Q}, str(path))
        if why is None:
            assert read_bases(path, shapes)[name][0].shape == (4, 32, 2)
        else:
            with pytest.raises(ValueError, match=f"{name} {why}" if why.startswith("is") else why):
                read_bases(path, shapes)


def test_the_router_auxiliary_loss_applies_only_where_the_config_asks_for_it():
    from osft.trainer.run.router_loss import router_aux_coef

    assert router_aux_coef(AutoConfig.for_model("mixtral", output_router_logits=True, router_aux_loss_coef=0.5)) == 0.5
    assert router_aux_coef(AutoConfig.for_model("mixtral", output_router_logits=False, router_aux_loss_coef=0.5)) == 0
    assert router_aux_coef(AutoConfig.for_model("mixtral", output_router_logits=True, router_aux_loss_coef=0.0)) == 0
    assert router_aux_coef(AutoConfig.for_model("llama")) == 0  # no router at all


@pytest.mark.parametrize("coef", [0.5])
def test_the_router_auxiliary_loss_is_trained_as_transformers_computes_it(tmp_path, coef, capsys):
    """A random Mixtral whose config asks for router logits: with ``router_aux_loss_coef`` 0.5 the
    step-1 loss of one sample is cross-entropy + 0.5 x auxiliary loss and equals transformers' own
    ``loss`` on the same ids and labels (float rounding; the OSFT reconstruction), with the two
    parts logged apart and a start-up line (with coefficient 0, as with
    ``output_router_logits: false``, it is the plain cross-entropy: the test above)."""
    from helpers import QA, chat, tiny_chat_tokenizer, write_jsonl

    from osft.trainer.launch.cli import main
    from osft.trainer.data.tokenize import tokenize_chat_file
    from osft.trainer.model.loading import load_tokenizer

    tokenizer = tiny_chat_tokenizer()
    model = moe_model("mixtral", vocab_size=len(tokenizer), output_router_logits=True, router_aux_loss_coef=coef)
    model.config.eos_token_id = model.config.pad_token_id = tokenizer.eos_token_id
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    data = write_jsonl(tmp_path / "one.jsonl", [chat(*QA[0])])
    out = tmp_path / "run"
    assert main(["--model-name-or-path", str(tmp_path / "model"), "--data-path", str(data), "--output-dir", str(out),
                 "--max-steps", "1", "--batch-size", "1", "--max-seq-len", "64", "--learning-rate", "1e-9"]) == 0
    (step,) = [r for r in map(json.loads, (out / "metrics" / "node0.jsonl").read_text().splitlines())
               if r["event"] == "step"]
    sample = tokenize_chat_file(data, load_tokenizer(tmp_path / "model"), 64)[0]  # unshifted labels, -100 untrained
    with torch.no_grad():
        hf = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32).eval()(
            input_ids=torch.tensor([sample["input_ids"]]), labels=torch.tensor([sample["labels"]]))
    assert step["loss"] == pytest.approx(float(hf.loss), rel=1e-5)
    assert float(hf.aux_loss) > 0 and step["router_aux_loss"] == pytest.approx(float(hf.aux_loss), rel=1e-5)
    assert step["loss"] == pytest.approx(step["ce_loss"] + coef * step["router_aux_loss"], rel=1e-12)
    assert "MoE router auxiliary loss: the training loss is cross-entropy + 0.5 x load-balancing loss" in \
        capsys.readouterr().err
