"""The tested model matrix (the README's list of architectures): every architecture the README lists, as a tiny random
model built from its config (:mod:`model_matrix`): its targets found, the decomposition
reconstructing every weight, one training step, and an export that reloads under the original
names and generates; on one rank in-process, and on two gloo ranks for a subset in one torchrun
group."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import QA, chat, tiny_chat_tokenizer, weight_updates, write_jsonl
from model_matrix import MATRIX, TWO_RANK_SUBSET, block_targets, save_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from osft.trainer.checkpoint.subspaces import load_bases
from osft.trainer.osft.plan import OSFTSettings
from osft.trainer.osft.surgery import apply_osft, dense_state_dict

ROOT = Path(__file__).resolve().parents[1]
TRAIN_FLAGS = ["--batch-size", "4", "--max-tokens-per-gpu", "128", "--max-seq-len", "64", "--learning-rate", "5e-3",
               "--save-dtype", "float32", "--max-steps", "1"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("matrix") / "train.jsonl", [chat(q, a) for q, a in QA] * 2)


def check_export(source: Path, export: Path) -> None:
    """The export holds the source's tensor names and shapes on disk, its weights changed by the
    step; it reloads with the source model's parameter names and generates new tokens."""
    before, after = load_file(source / "model.safetensors"), load_file(export / "model.safetensors")
    assert {k: tuple(v.shape) for k, v in after.items()} == {k: tuple(v.shape) for k, v in before.items()}
    assert any(not torch.equal(after[k], before[k]) for k in before)
    original = AutoModelForCausalLM.from_pretrained(source)
    reloaded = AutoModelForCausalLM.from_pretrained(export).eval()
    assert list(reloaded.state_dict()) == list(original.state_dict())
    tokenizer = tiny_chat_tokenizer()
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    generated = reloaded.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert generated.shape[1] == ids.shape[1] + 4


@pytest.mark.parametrize("model_type", sorted(MATRIX))
def test_targets_decomposition_one_step_and_export(model_type, data, tmp_path):
    from osft.trainer.launch.cli import main

    source, model = save_model(model_type, tmp_path / "model")
    original = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    with torch.no_grad():
        before = model(ids).logits
    osft = apply_osft(model, OSFTSettings(urr=0.25, max_tokens_per_micro_batch=64))
    expected = sorted(MATRIX[model_type][1])
    assert len(osft.modules) == 2 * len(expected)  # every target inside the two blocks
    assert block_targets(model_type, [n for n, _ in osft.modules]) == [expected, expected]
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert not any(n.endswith(("W_high", "U_basis", "V_basis")) for n in trainable)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before, rtol=1e-5, atol=1e-5)
    exported = dense_state_dict(model.state_dict(), osft)
    assert set(exported) == set(original)
    for key, value in original.items():
        torch.testing.assert_close(exported[key], value, rtol=0, atol=2e-6, msg=key)

    out = tmp_path / "run"
    assert main(["--model-name-or-path", str(source), "--data-path", str(data), "--output-dir", str(out), *TRAIN_FLAGS]) == 0
    (step,) = [r for r in map(json.loads, (out / "metrics" / "node0.jsonl").read_text().splitlines()) if r["event"] == "step"]
    assert step["step"] == 1 and step["loss"] > 0 and step["ortho_violations"] == 0
    check_export(source, out / "hf_format" / "step_1")


@pytest.mark.torchrun
def test_two_ranks_train_and_export_the_subset_in_one_worker_group(data, tmp_path):
    """The subset of :data:`model_matrix.TWO_RANK_SUBSET` (one model per target layout and every
    MoE model) trained one step each on 2 gloo ranks by one torchrun launch: every run is a step on
    world size 2 without orthogonality violations, and its export reloads and generates. Then a run
    chained on Qwen3-MoE's export (``step_1``) protects the bases it carries, every expert's own."""
    sources = [save_model(t, tmp_path / t)[0] for t in TWO_RANK_SUBSET]
    out = tmp_path / "runs"
    chained = out / "qwen3_moe" / "hf_format" / "step_1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "tests" / "dist" / "model_matrix_run.py"), str(data), str(out), *map(str, sources), str(chained),
           "--", *TRAIN_FLAGS]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for source in [*sources, chained]:
        records = [json.loads(line) for line in (out / source.name / "metrics" / "node0.jsonl").read_text().splitlines()]
        (step,) = [r for r in records if r["event"] == "step"]
        assert (step["step"], step["world_size"], step["ortho_violations"]) == (1, 2, 0), source.name
        check_export(source, out / source.name / "hf_format" / "step_1")
    bases = load_bases(chained / "osft_subspaces.safetensors")  # as the chained run read them
    assert bases["model.layers.1.mlp.experts.down_proj.P"].shape[:2] == (4, 32)
    moved = 0
    for key, P, Q, d in weight_updates(bases, load_file(chained / "model.safetensors"),
                                       load_file(out / "step_1" / "hf_format" / "step_1" / "model.safetensors")):
        if d.norm() > 1e-6:
            moved += ".experts." in key
            assert (P.t() @ d).norm() <= 1e-4 * d.norm() and (d @ Q).norm() <= 1e-4 * d.norm(), key
    assert moved >= 12
