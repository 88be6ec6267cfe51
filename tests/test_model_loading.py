"""save_hf_model round trips, and load_model/load_tokenizer on HF directories and GGUF files."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import CHATML_TEMPLATE, tiny_chat_tokenizer, tiny_llama, write_tiny_gguf
from transformers import AutoModelForCausalLM, AutoTokenizer

from osft.trainer.checkpoint.hf_export import save_hf_model
from osft.trainer.model.loading import load_model, load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_chat_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    """Tiny random Llama: hidden 64, 2 layers, 4 heads (2 KV), tied embeddings."""
    return tiny_llama(len(tokenizer), seed=3, hidden_size=64, intermediate_size=128, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def exported(tmp_path_factory, model, tokenizer):
    return save_hf_model(model.config, model.state_dict(), tokenizer, tmp_path_factory.mktemp("x") / "hf", torch.float32)


def _assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert set(sa) == set(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype, k
        assert torch.equal(sa[k], sb[k]), k


def test_round_trip_is_exact_and_keeps_tying_and_tokenizer(exported, model, tokenizer):
    reloaded = AutoModelForCausalLM.from_pretrained(exported)
    _assert_same_weights(model, reloaded)
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()
    assert (exported / "model.safetensors").is_file()
    assert (exported / "generation_config.json").is_file()
    assert not list(exported.parent.glob(".*"))  # no temporary sibling left behind
    tok = AutoTokenizer.from_pretrained(exported)
    assert tok.chat_template == CHATML_TEMPLATE
    msgs = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]
    assert tok.apply_chat_template(msgs, tokenize=False) == tokenizer.apply_chat_template(msgs, tokenize=False)


def test_tied_weight_given_once_and_dtype_cast(tmp_path, model, tokenizer):
    sd = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    out = save_hf_model(model.config, sd, None, tmp_path / "bf16", torch.bfloat16)
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert reloaded.dtype == torch.bfloat16
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    for k, v in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[k], v.to(torch.bfloat16)), k


def test_quantization_config_is_dropped(tmp_path, model):
    config = model.config.__class__.from_dict(model.config.to_dict())
    config.quantization_config = {"quant_method": "gguf", "gguf_file": "x.gguf"}
    out = save_hf_model(config, model.state_dict(), None, tmp_path / "m", torch.float32)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert config.quantization_config  # the caller's config is untouched


def test_missing_and_unexpected_keys_are_listed(tmp_path, model):
    sd = dict(model.state_dict())
    del sd["model.layers.1.mlp.down_proj.weight"]
    sd["model.layers.9.extra.weight"] = torch.zeros(2)
    with pytest.raises(ValueError, match=r"1 missing keys: model\.layers\.1\.mlp\.down_proj\.weight") as e:
        save_hf_model(model.config, sd, None, tmp_path / "bad", torch.float32)
    assert "1 unexpected keys: model.layers.9.extra.weight" in str(e.value)
    assert not (tmp_path / "bad").exists()
    assert not list(tmp_path.iterdir())


def test_shape_mismatch_and_differing_tied_weights(tmp_path, model):
    sd = dict(model.state_dict())
    sd["model.norm.weight"] = torch.ones(3)
    with pytest.raises(ValueError, match=r"model\.norm\.weight: expected \(64,\), got \(3,\)"):
        save_hf_model(model.config, sd, None, tmp_path / "bad", torch.float32)
    sd = dict(model.state_dict())
    sd["lm_head.weight"] = sd["lm_head.weight"] + 1
    with pytest.raises(ValueError, match="different values for the tied weights"):
        save_hf_model(model.config, sd, None, tmp_path / "bad", torch.float32)


def test_existing_dir_needs_overwrite(tmp_path, model):
    out = tmp_path / "m"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    with pytest.raises(FileExistsError, match=str(out)):
        save_hf_model(model.config, model.state_dict(), None, out, torch.float32)
    save_hf_model(model.config, model.state_dict(), None, out, torch.float32, overwrite=True)
    assert not (out / "stale.txt").exists() and (out / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_load_model_and_tokenizer_from_dir(exported, model, tokenizer):
    loaded = load_model(exported, "float32")
    _assert_same_weights(model, loaded)
    assert not loaded.training
    tok = load_tokenizer(exported)
    assert tok.pad_token == "<|endoftext|>" and tok.chat_template == CHATML_TEMPLATE
    assert load_model(exported, torch.bfloat16).dtype == torch.bfloat16


def test_tokenizer_without_pad_uses_eos(tmp_path):
    tok = tiny_chat_tokenizer()
    tok.pad_token = None
    tok.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert load_tokenizer(tmp_path).pad_token == "<|im_end|>"


def test_load_errors_name_the_path(tmp_path, exported):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        load_model(missing)
    with pytest.raises(FileNotFoundError, match=str(missing)):
        load_tokenizer(missing)
    with pytest.raises(ValueError, match=rf"no config\.json\): {tmp_path}"):
        load_model(tmp_path)
    txt = tmp_path / "weights.bin"
    txt.write_bytes(b"\0")
    with pytest.raises(ValueError, match=r"\.gguf file: .*weights\.bin"):
        load_model(txt)
    with pytest.raises(ValueError, match="unknown dtype"):
        load_model(exported, "float33")
    tok = tiny_chat_tokenizer()
    tok.chat_template = None
    tok.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match=rf"from {tmp_path} has no chat template"):
        load_tokenizer(tmp_path)
    assert load_tokenizer(tmp_path, require_chat_template=False).chat_template is None


# ----------------------------------------------------------------------------- GGUF


@pytest.mark.parametrize("tied", [True, False])
def test_load_from_gguf_file(tmp_path, tokenizer, tied):
    model = tiny_llama(len(tokenizer), seed=5, hidden_size=64, intermediate_size=128, tie_word_embeddings=tied)
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, model, tokenizer)

    loaded = load_model(path, torch.float32)
    assert loaded.config.tie_word_embeddings is tied
    _assert_same_weights(model, loaded)
    ids = torch.tensor([[5, 17, 42, 99, 7]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)

    tok = load_tokenizer(path)
    assert tok.chat_template == CHATML_TEMPLATE
    assert tok.pad_token == "<|endoftext|>"
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert tok(text)["input_ids"] == tokenizer(text)["input_ids"]

    # A GGUF-loaded model exports to a plain directory that loads without the GGUF.
    out = save_hf_model(loaded.config, loaded.state_dict(), tok, tmp_path / "hf", torch.float32)
    _assert_same_weights(model, load_model(out))


def test_export_files_follow_the_umask(exported):
    import os

    umask = os.umask(0)
    os.umask(umask)
    assert {p.name: p.stat().st_mode & 0o777 for p in exported.iterdir()} == {
        p.name: 0o666 & ~umask for p in exported.iterdir()
    }
