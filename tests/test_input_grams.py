"""The ``inputs`` variant's layer-input Gram matrices under a memory budget (docs/osft.md, "What an
export adds: the two variants"): modules that read the same input share one Gram, and a budget that
splits the collection into several passes gives the bases of one pass. A tiny random Llama under
OSFT."""

import pytest
import torch
from helpers import tiny_llama

from osft.trainer.osft.input_grams import gram_bytes, input_bases, shared_inputs
from osft.trainer.osft.protect import fold_cap, input_directions
from osft.trainer.osft.plan import OSFTSettings
from osft.trainer.osft.surgery import apply_osft


@pytest.fixture(scope="module")
def llama():
    model = tiny_llama(97, num_hidden_layers=2)
    osft = apply_osft(model, OSFTSettings(urr=0.5, max_tokens_per_micro_batch=64))
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 97, (1, n), generator=g) for n in (12, 7, 20)]
    return model, osft.modules, batches


def collect(model, modules, batches, budget, bases_q=None):
    def run(recording):
        for ids in batches[:2]:
            recording(True)
            model(ids)
        recording(False)  # an empty micro-batch's stand-in forward is not recorded
        model(batches[2])

    with torch.no_grad():
        return input_bases(modules, bases_q, lambda: model(batches[0]), run, budget, 0.95, 1.0, torch.device("cpu"))


def test_modules_reading_one_input_share_its_gram_and_get_the_per_module_bases(llama):
    model, modules, batches = llama
    classes = shared_inputs(modules, lambda: model(batches[0]))
    short = [[n.removeprefix(f"model.layers.{n.split('.')[2]}.") for n in c] for c in classes]
    assert short == [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.o_proj"],
                     ["mlp.gate_proj", "mlp.up_proj"], ["mlp.down_proj"]] * 2
    assert all(len({n.split(".")[2] for n in c}) == 1 for c in classes)  # never across blocks
    # the reference: every module's own Gram over the recorded micro-batches
    grams = {name: torch.zeros(m.in_features, m.in_features, dtype=torch.float64) for name, m in modules}
    def add(name):
        def hook(_module, args):
            x = args[0].reshape(-1, args[0].shape[-1]).double()
            grams[name] += x.t() @ x
        return hook

    handles = [m.register_forward_pre_hook(add(name)) for name, m in modules]
    with torch.no_grad():
        for ids in batches[:2]:
            model(ids)
    for h in handles:
        h.remove()
    q = {modules[0][0]: torch.linalg.qr(torch.randn(32, 3, dtype=torch.float64))[0]}  # one module protects 3 directions
    found = collect(model, modules, batches, budget=1e12, bases_q=q)
    assert found.passes == 1 and found.classes == classes
    for name, m in modules:
        ref, ref_kept = input_directions(grams[name], q.get(name, torch.zeros(m.in_features, 0)), 0.95,
                                         fold_cap(m.plan.k_low, 1.0))
        got, kept = found.directions[name]
        assert kept == ref_kept and 0 < kept.rank, name
        assert got.untyped_storage().nbytes() == got.numel() * 8, name  # its own M×r, not the M×M eigenvectors
        torch.testing.assert_close(got @ got.t(), ref @ ref.t(), rtol=0, atol=1e-10, msg=name)
    assert (found.directions[modules[0][0]][0].t() @ q[modules[0][0]]).abs().max() < 1e-10


def test_a_budget_that_forces_several_passes_gives_the_one_pass_bases(llama):
    model, modules, batches = llama
    one = collect(model, modules, batches, budget=1e12)
    # the largest Gram (down_proj, M = 64) fits with one of M = 32: 8 distinct inputs in 4 passes
    several = collect(model, modules, batches, budget=gram_bytes(64) + gram_bytes(32))
    assert one.passes == 1 and several.passes == 4
    assert several.directions.keys() == one.directions.keys() == {n for n, _ in modules}
    for name in one.directions:
        assert torch.equal(several.directions[name][0], one.directions[name][0]), name
        assert several.directions[name][1] == one.directions[name][1], name
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj \(M = 64\) alone needs .* \(32768 bytes; 2 modules"):
        collect(model, modules, batches, budget=gram_bytes(64) - 1)


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_gram_larger_than_the_budget_is_an_input_error_before_training(tiny_model_dir, tmp_path, capsys, ranks):
    """One rank: the trainer refuses it at set-up; two ranks: the launcher before any rank starts."""
    from helpers import QA, chat, write_jsonl

    from osft.trainer.launch.cli import main

    data = write_jsonl(tmp_path / "train.jsonl", [chat(q, a) for q, a in QA])
    code = main(["--model-name-or-path", str(tiny_model_dir), "--data-path", str(data), "--output-dir", str(tmp_path / "r"),
                 "--osft-protect-basis", "inputs", "--osft-protect-input-memory-gb", "1e-6", "--nproc-per-node", str(ranks)])
    err = capsys.readouterr().err.replace("\n", "")
    assert code == 2, err
    assert "--osft-protect-input-memory-gb 1e-06: the input Gram matrix of model.layers." in err and "alone needs" in err
    assert not (tmp_path / "r" / "hf_format").exists()


def test_auto_falls_back_to_update_bases_for_modules_over_the_budget_and_names_them(llama):
    from osft.trainer.osft.input_grams import describe_bases, input_basis_modules

    _, modules, _ = llama
    budget = gram_bytes(64) - 1  # down_proj (M = 64) does not fit, every M = 32 input does
    collected, fallback = input_basis_modules(modules, "auto", budget)
    assert [n for n, _ in collected] == [n for n, m in modules if m.in_features == 32]
    assert fallback == {f"model.layers.{i}.mlp.down_proj": "Gram 3.28e-05 GB > budget" for i in (0, 1)}
    assert describe_bases(len(collected), fallback) == (
        "protected subspaces at export: input bases for 12 modules; the update for 2: mlp.down_proj in "
        "model.layers.<i> for i = 0-1 (2, Gram 3.28e-05 GB > budget)")
    assert input_basis_modules(modules, "update", budget) == ([], {})
    with pytest.raises(ValueError, match="mlp.down_proj"):
        input_basis_modules(modules, "inputs", budget)
    assert input_basis_modules(modules, "inputs", 1e12) == (list(modules), {})


def test_calibrate_records_every_real_micro_batch_and_polls_before_each(llama):
    """:func:`calibrate` (the export's and ``protect-base``'s pass) gives the bases of
    :func:`input_bases` over the same micro-batches (None, a padding micro-batch, runs unrecorded),
    polls ``check(m)`` before micro-batch m of the pass, and a stop raised there abandons it."""
    from types import SimpleNamespace

    from osft.trainer.osft.input_grams import calibrate

    model, modules, batches = llama
    cfg = SimpleNamespace(osft_protect_input_memory_gb=1e3, osft_protect_input_energy=0.95,
                          osft_protect_max_rank_ratio=1.0, osft_protect_input_criterion="total")

    def forward(batch):
        return model(batches[2] if batch is None else batch)

    polled = []
    with torch.no_grad():
        found = calibrate(modules, None, forward, [batches[0], batches[1], None], cfg, torch.device("cpu"), polled.append)
    want = collect(model, modules, batches, budget=1e12)
    assert polled == [0, 1, 2] and found.passes == 1
    for name in want.directions:
        assert torch.equal(found.directions[name][0], want.directions[name][0]), name

    class Stop(Exception):
        pass

    def stop_at_1(m):
        if m == 1:
            raise Stop

    with torch.no_grad(), pytest.raises(Stop):
        calibrate(modules, None, forward, [batches[0], batches[1], None], cfg, torch.device("cpu"), stop_at_1)
