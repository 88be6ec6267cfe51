"""End-to-end `osft-train` runs on a tiny random Llama saved to disk (real loading, real data files)."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers import QA, chat, tiny_chat_tokenizer, tiny_llama, write_jsonl, write_tiny_gguf
from osft.trainer.launch.cli import main

STEP_FIELDS = {
    "ts", "event", "node_rank", "rank", "local_rank", "world_size", "hostname", "job_id", "step", "epoch", "lr",
    "loss", "grad_norm", "num_tokens", "num_loss_tokens", "num_samples", "step_time_s", "tokens_per_s",
    "node_tokens_per_s", "samples_per_s", "model_flops", "flops_per_s", "mfu", "node_mfu", "ortho_violations", "ortho_violations_total", "ortho_max_dev_deg",
    "rss_bytes", "gpu_mem_bytes", "gpus", "osft_dw_rel_max", "osft_dw_rel_median", "osft_dw_rel_worst_module", "osft_gap_max",
    "osft_gap_median", "osft_gap_worst_module",
}

@pytest.fixture()
def chat_file(tmp_path):
    rows = [chat(q, a) for q, a in QA[:4]] * 6  # 24 rows: full batches of 4
    return write_jsonl(tmp_path / "train.jsonl", rows)


def read_records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics" / "node0.jsonl").read_text().splitlines()]


def test_tiny_osft_run_learns_without_violations_and_exports(tiny_model_dir, chat_file, tmp_path):
    out = tmp_path / "run"
    code = main([
        "--model-name-or-path", str(tiny_model_dir), "--data-path", str(chat_file), "--output-dir", str(out),
        "--batch-size", "4", "--max-tokens-per-gpu", "96", "--max-seq-len", "64", "--learning-rate", "5e-3",
        "--max-steps", "24", "--osft-unfreeze-rank-ratio", "0.5", "--weight-decay", "0.1",
    ])
    assert code == 0
    records = read_records(out)
    steps = [r for r in records if r["event"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 25))
    assert all(STEP_FIELDS <= set(r) for r in steps)
    assert all(r["gpus"] is None and r["gpu_mem_bytes"] is None for r in steps)  # on CPU
    assert all(r["world_size"] == 1 and r["node_rank"] == 0 and r["rank"] == 0 for r in steps)
    first, last = sum(r["loss"] for r in steps[:4]) / 4, sum(r["loss"] for r in steps[-4:]) / 4
    assert last < 0.7 * first, (first, last)
    assert steps[-1]["ortho_violations_total"] == 0
    # full checks on step 1 and every 10 steps (the default); between them the bound ruled out any violation
    checked = {r["step"]: r["ortho_max_dev_deg"] for r in steps if r["ortho_max_dev_deg"] is not None}
    assert set(checked) == {1, 10, 20} and max(checked.values()) < 0.01
    assert all(r["num_samples"] == 4 and r["num_loss_tokens"] > 0 for r in steps)
    assert [r["event"] for r in records][-1] == "run_finished"

    run = json.loads((out / "run.json").read_text())
    assert run["state"] == "completed" and run["exit_code"] == 0
    export = out / "hf_format" / "step_24"
    assert run["export_dir"] == str(export)
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(export)
    assert tokenizer.chat_template
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True, return_tensors="pt", return_dict=True)
    generated = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert generated.shape[1] > prompt["input_ids"].shape[1]
    assert {k for k in model.state_dict()} == {k for k in AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()}


def test_no_osft_is_plain_full_fine_tuning(tiny_model_dir, chat_file, tmp_path):
    out = tmp_path / "run"
    code = main([
        "--model-name-or-path", str(tiny_model_dir), "--data-path", str(chat_file), "--output-dir", str(out),
        "--batch-size", "4", "--max-tokens-per-gpu", "96", "--max-seq-len", "64", "--max-steps", "3", "--no-osft",
    ])
    assert code == 0
    steps = [r for r in read_records(out) if r["event"] == "step"]
    assert len(steps) == 3
    assert all(r["ortho_violations"] == 0 and r["ortho_max_dev_deg"] is None for r in steps)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--osft-unfreeze-rank-ratio", "1.5"], "argument --osft-unfreeze-rank-ratio: must be in (0, 1], got '1.5'"),
        (["--osft-unfreeze-rank-ratio", "0"], "argument --osft-unfreeze-rank-ratio: must be in (0, 1], got '0'"),
        (["--batch-size", "-3"], "argument --batch-size: expected a positive integer, got '-3'"),
        (["--lr-scheduler", "exp"], "argument --lr-scheduler: invalid choice: 'exp'"),
        (["--osft-max-frozen-ratio", "1"], "argument --osft-max-frozen-ratio: must be in [0, 1), got '1'"),
        (["--osft-rank-schedule", "random"], "argument --osft-rank-schedule: invalid choice: 'random'"),
        (["--learning-rat", "1e-5"], "unrecognized arguments: --learning-rat"),  # no prefix matching
    ],
)
def test_bad_flag_values_give_one_clear_line(tiny_model_dir, chat_file, tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as exc:
        main(["--model-name-or-path", str(tiny_model_dir), "--data-path", str(chat_file), "--output-dir", str(tmp_path / "r"), *flags])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_help_names_every_other_command():
    from osft.trainer.launch.cli import NOT_TRAINING
    from osft.trainer.config import build_parser

    description = build_parser().description
    assert all(f"`osft-train {name}" in description for name in (*NOT_TRAINING, "demo")), description


def test_help_starts_with_a_short_usage_and_demo_help_fetches_nothing(tmp_path, monkeypatch, capsys):
    """``--help`` opens with the one-line usage (not a synopsis of every flag); ``demo --help`` lists
    the flags without downloading the demo's model and data first."""
    from osft.trainer.tools.demo_assets import DEMO_DIR_ENV

    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    usage = capsys.readouterr().out.splitlines()[:2]
    assert usage == ["usage: osft-train --model-name-or-path MODEL --data-path DATA --output-dir DIR [options]",
                     "       osft-train COMMAND --help"]
    monkeypatch.setenv(DEMO_DIR_ENV, str(tmp_path / "demo"))
    with pytest.raises(SystemExit) as done:
        main(["demo", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: osft-train demo [options]") and "--eval-max-samples" in out
    assert not (tmp_path / "demo").exists()


def test_cross_flag_and_path_errors_before_training(tiny_model_dir, chat_file, tmp_path, capsys):
    base = ["--data-path", str(chat_file), "--output-dir", str(tmp_path / "r")]
    assert main(["--model-name-or-path", str(tmp_path / "nope"), *base]) == 2
    assert "--model-name-or-path" in capsys.readouterr().err
    assert main(["--model-name-or-path", str(tiny_model_dir), *base, "--max-seq-len", "512", "--max-tokens-per-gpu", "256"]) == 2
    assert "--max-seq-len 512 exceeds --max-tokens-per-gpu 256" in capsys.readouterr().err
    assert main(["--model-name-or-path", str(tiny_model_dir), *base, "--osft-min-frozen-ratio", "0.8",
                 "--osft-max-frozen-ratio", "0.6"]) == 2
    assert "--osft-min-frozen-ratio 0.8 exceeds --osft-max-frozen-ratio 0.6" in capsys.readouterr().err
    assert main(["--model-name-or-path", str(tiny_model_dir), *base, "--osft-rank-schedule", "importance", "--no-osft"]) == 2
    assert "--osft-rank-schedule importance sets OSFT ranks: it cannot go with --no-osft" in capsys.readouterr().err


def test_invalid_data_is_reported_before_the_model_loads(tiny_model_dir, tmp_path, capsys):
    bad = write_jsonl(tmp_path / "bad.jsonl", [chat("hi", "there"), '{"messages": [', "[1, 2]"])
    out = tmp_path / "r"
    code = main(["--model-name-or-path", str(tiny_model_dir), "--data-path", str(bad), "--output-dir", str(out)])
    assert code == 2
    err = capsys.readouterr().err
    assert f"{bad}:2" in err and f"{bad}:3" in err
    assert "row must be an object with a messages list" in err
    assert json.loads((out / "run.json").read_text())["state"] == "failed"
    assert not any(r["event"] == "step" for r in read_records(out))


def test_trains_from_a_gguf_file_and_exports_a_plain_directory(chat_file, tmp_path):
    tokenizer = tiny_chat_tokenizer()
    model = tiny_llama(len(tokenizer), hidden_size=64, intermediate_size=128)
    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_path, model, tokenizer)
    out = tmp_path / "run"
    code = main([
        "--model-name-or-path", str(gguf_path), "--data-path", str(chat_file), "--output-dir", str(out),
        "--batch-size", "4", "--max-tokens-per-gpu", "96", "--max-seq-len", "64", "--max-steps", "2",
        "--save-dtype", "float32",
    ])
    assert code == 0
    export = out / "hf_format" / "step_2"
    assert not list(export.glob("*.gguf"))
    reloaded = AutoModelForCausalLM.from_pretrained(export)
    assert "quantization_config" not in json.loads((export / "config.json").read_text())
    # Two small steps moved the weights, but not far from the GGUF's.
    moved = [k for k, v in model.state_dict().items() if not torch.equal(reloaded.state_dict()[k], v)]
    assert "model.layers.0.self_attn.q_proj.weight" in moved and "model.embed_tokens.weight" in moved
    for key, value in model.state_dict().items():
        assert (reloaded.state_dict()[key] - value).abs().max() < 0.05, key


def test_optimizer_flags_and_lr_schedule_are_honoured(tiny_model_dir, chat_file, tmp_path):
    out = tmp_path / "run"
    code = main([
        "--model-name-or-path", str(tiny_model_dir), "--data-path", str(chat_file), "--output-dir", str(out),
        "--batch-size", "4", "--max-tokens-per-gpu", "96", "--max-seq-len", "64", "--max-steps", "6",
        "--learning-rate", "1e-3", "--beta1", "0.8", "--beta2", "0.9", "--eps", "1e-6", "--weight-decay", "0.05",
        "--lr-scheduler", "linear", "--warmup-steps", "2",
    ])
    assert code == 0
    config = json.loads((out / "run.json").read_text())["config"]
    assert (config["beta1"], config["beta2"], config["eps"], config["weight_decay"]) == (0.8, 0.9, 1e-6, 0.05)
    lrs = [r["lr"] for r in read_records(out) if r["event"] == "step"]
    # linear warmup over 2 steps to 1e-3, then linear decay to 0 at step 6 (lr used by each step)
    assert lrs == pytest.approx([0.0, 5e-4, 1e-3, 7.5e-4, 5e-4, 2.5e-4])


def test_trainer_builds_adamw_from_the_flags(tiny_model_dir, chat_file, tmp_path):
    from osft.trainer.config import TrainConfig
    from osft.trainer.run.loop import Trainer

    cfg = TrainConfig(str(tiny_model_dir), str(chat_file), str(tmp_path / "r"), max_seq_len=64, max_tokens_per_gpu=96,
                      learning_rate=3e-4, beta1=0.7, beta2=0.8, eps=1e-7, weight_decay=0.2, lr_scheduler="cosine", max_steps=4)
    trainer = Trainer(cfg)
    trainer.prepare()
    assert isinstance(trainer.optimizer, torch.optim.AdamW)
    group = trainer.optimizer.param_groups[0]
    assert (group["betas"], group["eps"], group["weight_decay"]) == ((0.7, 0.8), 1e-7, 0.2)
    assert group["initial_lr"] == 3e-4
    trained = {id(p) for p in group["params"]}
    frozen = [p for n, p in trainer.model.named_parameters() if n.endswith(("W_high", "U_basis", "V_basis"))]
    assert frozen and not any(id(p) in trained for p in frozen)
    assert trainer.total_steps == 4


def test_config_round_trips_through_worker_flags():
    from osft.trainer.config import TrainConfig, build_parser, config_from_args, config_to_argv

    cfg = TrainConfig("m", "d.jsonl", "out", osft=False, data_cache=False, train_on_all=True, learning_rate=3.3e-5,
                      osft_target_patterns=[r"q_proj$", r"v_proj$"], max_steps=7, nproc_per_node=2, rdzv_endpoint="h:1")
    assert config_from_args(build_parser().parse_args(config_to_argv(cfg))) == cfg
    default = TrainConfig("m", "d.jsonl", "out")
    assert config_from_args(build_parser().parse_args(config_to_argv(default))) == default
