"""`osft-train --config FILE` and `--print-config` (trainer/config_file.py)."""

import re
from types import SimpleNamespace

import pytest
import yaml
from helpers import QA, chat, write_jsonl
from osft.trainer import worker
from osft.trainer.launch.cli import main
from osft.trainer.config import TrainConfig, build_parser, config_from_args
from osft.trainer.config_file import ConfigFileError, parse_with_config_file, read_config_file

PATHS = ["--model-name-or-path", "m", "--data-path", "d.jsonl", "--output-dir", "out"]


def write(tmp_path, text, name="run.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def resolve(argv) -> TrainConfig:
    return config_from_args(parse_with_config_file(build_parser(), argv))


def test_print_config_round_trips_to_the_same_config(tmp_path, capsys):
    flags = [*PATHS, "--no-osft", "--no-data-cache", "--train-on-all", "--learning-rate", "3.3e-5", "--eps", "1e-7",
             "--osft-target-patterns", "q_proj$", "v_proj$", "--max-steps", "7", "--lr-scheduler", "cosine",
             "--rdzv-endpoint", "h:1", "--seed", "0"]
    assert main([*flags, "--print-config"]) == 0
    printed = capsys.readouterr().out
    path = write(tmp_path, printed)
    expected = config_from_args(build_parser().parse_args(flags))
    assert resolve(["--config", str(path)]) == expected
    assert main(["--config", str(path), "--print-config"]) == 0
    assert capsys.readouterr().out == printed
    assert worker.main(["--config", str(path), "--print-config"]) == 0
    assert capsys.readouterr().out == printed
    data = yaml.safe_load(printed)
    assert data["osft"] is False and data["data_cache"] is False and data["max_steps"] == 7
    assert data["osft_target_patterns"] == ["q_proj$", "v_proj$"] and data["data_cache_dir"] is None


def test_command_line_overrides_the_file_and_the_file_the_defaults(tmp_path):
    path = write(tmp_path, "model_name_or_path: m\ndata_path: d.jsonl\noutput_dir: out\nlearning_rate: 1e-4\n"
                           "batch_size: 8\nosft_target_patterns: [a]\n")
    cfg = resolve(["--config", str(path), "--learning-rate", "2e-4", "--osft-target-patterns", "b", "c",
                   "--output-dir", "other"])
    assert (cfg.learning_rate, cfg.batch_size, cfg.osft_target_patterns) == (2e-4, 8, ["b", "c"])
    assert (cfg.model_name_or_path, cfg.output_dir, cfg.max_seq_len) == ("m", "other", TrainConfig("", "", "").max_seq_len)


def test_switches_lists_numbers_and_null(tmp_path):
    path = write(tmp_path, """\
model_name_or_path: m
data_path: d.jsonl
output_dir: out
learning_rate: 1e-5        # a string to PyYAML (YAML 1.1), a float to the flag
eps: 1.0e-7
weight_decay: 0
osft: false
data_cache: false
train_on_all: true
on_demand_checkpointing: yes
async_checkpoint: true
osft_target_patterns:
  - q_proj$
  - o_proj$
max_steps: null
seed: -3
data_cache_dir: 2024-01-01
""")
    cfg = resolve(["--config", str(path)])
    assert (cfg.learning_rate, cfg.eps, cfg.weight_decay, cfg.seed) == (1e-5, 1e-7, 0.0, -3)
    assert (cfg.osft, cfg.data_cache, cfg.train_on_all, cfg.on_demand_checkpointing) == (False, False, True, True)
    assert cfg.async_checkpoint is True
    assert cfg.osft_target_patterns == ["q_proj$", "o_proj$"] and cfg.max_steps is None
    assert cfg.data_cache_dir == "2024-01-01"


@pytest.mark.parametrize(
    "text, message",
    [
        ("model_name_or_path: m\n\nlearnin_rate: 1e-5\n", ":3: unknown key 'learnin_rate'; did you mean 'learning_rate'?"),
        ("no_osft: true\n", ":1: unknown key 'no_osft'; did you mean 'osft: false'?"),
        ("max-tokens-per-gpu: 512\n", ":1: unknown key 'max-tokens-per-gpu'; did you mean 'max_tokens_per_gpu'?"),
        ("zzz: 1\n", ":1: unknown key 'zzz'"),
        ("seed: 1\nseed: 2\n", ":2: 'seed' given twice (also on line 1)"),
    ],
)
def test_unknown_keys_name_the_file_line_and_closest_key(tmp_path, capsys, text, message):
    path = write(tmp_path, text)
    assert main(["--config", str(path), *PATHS]) == 2
    err = capsys.readouterr().err
    assert f"{path}{message}" in err.replace("\n", "")
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "text, message",
    [
        ("learning_rate: -1", "learning_rate: must be in (0, inf), got '-1'"),
        ("lr_scheduler: cosin", "lr_scheduler: invalid choice 'cosin' (choose from constant, linear, cosine)"),
        ("batch_size: 2.5", "batch_size: expected a positive integer, got '2.5'"),
        ("osft_unfreeze_rank_ratio: 1.5", "osft_unfreeze_rank_ratio: must be in (0, 1], got '1.5'"),
        ("seed: abc", "seed: expected int value, got 'abc'"),
        ("train_on_all: 'true'", "train_on_all: expected true or false, got 'true'"),
        ("osft: 0", "osft: expected true or false, got 0"),
        ("osft_target_patterns: q_proj$", "osft_target_patterns: expected a non-empty list, got 'q_proj$'"),
        ("osft_target_patterns: []", "osft_target_patterns: expected a non-empty list, got a list"),
        ("max_seq_len: [1, 2]", "max_seq_len: expected a single value, got a list"),
        ("batch_size: null", "batch_size: needs a value, got null"),
    ],
)
def test_bad_values_name_the_file_line_key_and_what_is_allowed(tmp_path, capsys, text, message):
    path = write(tmp_path, f"# comment\n{text}\n")
    assert main(["--config", str(path), *PATHS]) == 2
    assert f"{path}:2: {message}" in capsys.readouterr().err.replace("\n", "")


@pytest.mark.parametrize(
    "text, message",
    [
        ("seed: [1\n", ":2:1: invalid YAML: expected ',' or ']'"),
        ("- seed: 1\n", ":1: expected a mapping of flag names to values"),
    ],
)
def test_malformed_files(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigFileError, match="^" + str(path) + message.replace("[", r"\[").replace("(", r"\(")):
        read_config_file(path, build_parser())


def test_merge_keys_are_merged_and_helper_keys_ignored(tmp_path, capsys):
    inline = write(tmp_path, "<<: {batch_size: 2, max_steps: 1}\nmax_steps: 3\n", "inline.yaml")
    cfg = resolve(["--config", str(inline), *PATHS])
    assert (cfg.batch_size, cfg.max_steps) == (2, 3)  # the file's own key overrides the merged one
    anchored = write(tmp_path, """\
_common: &common
  batch_size: 4
  learning_rate: 2e-4
_small: &small {max_steps: 5, batch_size: 8}
<<: [*common, *small]
seed: 7
""", "anchored.yaml")
    cfg = resolve(["--config", str(anchored), *PATHS])
    # a later mapping of a merge list overrides an earlier one, as yaml.safe_load merges; helper keys set nothing
    assert (cfg.batch_size, cfg.learning_rate, cfg.max_steps, cfg.seed) == (8, 2e-4, 5, 7)
    assert main(["--config", str(anchored), *PATHS, "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["batch_size"] == 8 and printed["max_steps"] == 5 and not any(k.startswith("_") for k in printed)
    typo = write(tmp_path, "_common: &common {batch_sise: 4}\n<<: *common\n", "typo.yaml")
    with pytest.raises(ConfigFileError, match=f"^{typo}:1: unknown key 'batch_sise'; did you mean 'batch_size'"):
        read_config_file(typo, build_parser())
    twice = write(tmp_path, "<<: {seed: 1}\nseed: 2\nseed: 3\n", "twice.yaml")
    with pytest.raises(ConfigFileError, match=f"^{twice}:3: 'seed' given twice \\(also on line 2\\)"):
        read_config_file(twice, build_parser())


def test_missing_file_and_empty_file(tmp_path, capsys):
    assert main(["--config", str(tmp_path / "nope.yaml"), *PATHS]) == 2
    assert f"--config {tmp_path / 'nope.yaml'}: No such file or directory" in capsys.readouterr().err.replace("\n", "")
    assert resolve(["--config", str(write(tmp_path, "# nothing\n")), *PATHS]) == resolve(PATHS)
    assert worker.main(["--config", str(tmp_path / "nope.yaml"), *PATHS]) == 2


def test_demo_takes_a_config_file(tmp_path, capsys, monkeypatch):
    assets = SimpleNamespace(model_dir=tmp_path / "model", train_path=tmp_path / "train.jsonl",
                             eval_path=tmp_path / "eval.jsonl")
    monkeypatch.setattr("osft.trainer.launch.cli._fetch_demo", lambda argv, console: assets)
    path = write(tmp_path, "max_steps: 5\nlearning_rate: 1e-4\n")
    assert main(["demo", "--config", str(path), "--batch-size", "2", "--print-config"]) == 0
    data = yaml.safe_load(capsys.readouterr().out)
    assert (data["max_steps"], data["learning_rate"], data["batch_size"]) == (5, 1e-4, 2)
    assert (data["model_name_or_path"], data["lr_scheduler"], data["output_dir"]) == (str(assets.model_dir), "cosine", "runs/demo")
    assert (data["eval_data_path"], data["retention_data_path"]) == (str(assets.eval_path), ["runs/demo/retention.jsonl"])


def test_a_run_writes_its_config_and_relaunches_from_it(tiny_model_dir, tmp_path, capsys):
    data = write_jsonl(tmp_path / "train.jsonl", [chat(q, a) for q, a in QA[:4]] * 2)
    out = tmp_path / "run"
    path = write(tmp_path, f"model_name_or_path: {tiny_model_dir}\ndata_path: {data}\noutput_dir: {out}\n"
                           "batch_size: 4\nmax_tokens_per_gpu: 96\nmax_seq_len: 64\nmax_steps: 1\nosft: false\n")
    assert main(["--config", str(path), "--learning-rate", "1e-3"]) == 0
    written = (out / "config.yaml").read_text()
    expected = resolve(["--config", str(path), "--learning-rate", "1e-3"])
    assert resolve(["--config", str(out / "config.yaml")]) == expected
    assert expected.learning_rate == 1e-3 and expected.max_steps == 1
    capsys.readouterr()
    assert main(["--config", str(out / "config.yaml"), "--print-config"]) == 0
    assert capsys.readouterr().out == written
    assert not list(out.glob(".config.yaml.tmp*"))


def test_the_worker_group_reads_its_launchers_config_unchanged(tmp_path, monkeypatch):
    from osft.trainer.config_file import worker_config_yaml
    from osft.trainer.launch.launcher import torchrun_command
    from osft.trainer.rundir import RunDir

    monkeypatch.delenv("OSFT_CACHE_V", raising=False)
    step = tmp_path / "full_state_checkpoints" / "step_2"
    cfg = TrainConfig("m", ["a.jsonl:0.8", "b.parquet:0.2"], str(tmp_path), overwrite_output_dir=True,
                      resume_from_full_state_checkpoint=str(step), retention_data_path=["r1", "r2"],
                      learning_rate=3.3e-5, eps=1e-8, osft=False, report_to=["none"], chat_template="true",
                      nproc_per_node=2, node_rank=1, nnodes=2, rdzv_endpoint="h:1")
    run_dir = RunDir(cfg.output_dir, cfg.node_rank)
    cmd = torchrun_command(cfg, run_dir, "job1")
    assert cmd[-3:] == ["osft.trainer.worker", "--config", str(tmp_path / "logs" / "node1" / "config-job1.yaml")]
    run_dir.worker_config("job1").parent.mkdir(parents=True)
    run_dir.worker_config("job1").write_text(worker_config_yaml(cfg))
    args = parse_with_config_file(build_parser("osft.trainer.worker"), cmd[-2:])
    assert config_from_args(args) == cfg  # one-time fields too: the ranks' run_started record keeps them


def test_the_declarations_give_the_resume_rules_and_check_configs_made_in_code(tmp_path):
    from osft.trainer.config import ONE_TIME_FIELDS, RESUME_SETTINGS, RESUME_WARN_SETTINGS, check_config

    assert set(RESUME_SETTINGS) == {
        "batch_size", "max_tokens_per_gpu", "max_seq_len", "seed", "osft", "osft_unfreeze_rank_ratio",
        "osft_target_patterns", "osft_rank_schedule", "osft_importance_samples", "osft_min_frozen_ratio",
        "osft_max_frozen_ratio", "freeze_non_target", "freeze_router", "train_on_all", "overlong",
        "osft_protect_subspaces", "osft_frozen_rank", "data_format", "train_reasoning", "train_last_turn_only",
        "chat_template", "eval_split"}
    assert set(RESUME_WARN_SETTINGS) == {"learning_rate", "lr_scheduler", "warmup_steps", "weight_decay", "beta1",
                                         "beta2", "eps", "max_grad_norm", "max_steps", "num_epochs"}
    assert ONE_TIME_FIELDS == ("overwrite_output_dir",)
    data = write(tmp_path, '{"messages": []}\n', "d.jsonl")
    for settings, message in (({"learning_rate": 0.0}, "--learning-rate must be in (0, inf), got 0.0"),
                              ({"osft_protect_energy": 1.5}, "--osft-protect-energy must be in (0, 1], got 1.5"),
                              ({"osft_protect_input_samples": 0}, "--osft-protect-input-samples must be at least 1, got 0"),
                              ({"device": "tpu"}, "--device must be one of auto, cpu, cuda, got 'tpu'"),
                              ({"report_to": ["none", "nope"]}, "--report-to must be one of")):
        with pytest.raises(ValueError, match="^" + re.escape(message)):
            check_config(TrainConfig(str(tmp_path), str(data), str(tmp_path / "out"), **settings))
