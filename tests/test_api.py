"""The Python API (`osft.trainer.launch.api.train`): outcomes of one-rank and launched runs, the CLI's
errors, the caller's signal handlers kept, and the example of docs/python-api.md run as written."""

import json
import re
import signal
import threading
from pathlib import Path

import pytest

from helpers import QA, chat, write_jsonl
from osft.trainer.launch.api import InputError, TrainConfig, train
from osft.trainer.test_hooks import SIGNAL_AT_ENV as TEST_SIGNAL_ENV
from osft.trainer.checkpoint.signals import CHECKPOINT_SIGNALS
from osft.trainer.launch.cli import main

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "python-api.md"
TINY = {"batch_size": 4, "max_tokens_per_gpu": 96, "max_seq_len": 64, "max_steps": 3}


@pytest.fixture()
def chat_file(tmp_path):
    return write_jsonl(tmp_path / "train.jsonl", [chat(q, a) for q, a in QA[:4]] * 3)


@pytest.fixture()
def handlers():
    """The checkpoint signals' handlers before the test, which must be in place again after it
    (SIGINT gets one of its own, as a notebook's kernel has)."""
    def mine(signum, frame):
        raise AssertionError(f"signal {signum} reached the caller's handler")

    before = signal.signal(signal.SIGINT, mine)
    expected = {s: signal.getsignal(s) for s in CHECKPOINT_SIGNALS}
    yield expected
    signal.signal(signal.SIGINT, before)


def kept(expected):
    return {s: signal.getsignal(s) for s in CHECKPOINT_SIGNALS} == expected


def test_one_rank_in_process_stopped_by_ctrl_c_then_resumed_to_completion(tiny_model_dir, chat_file, tmp_path,
                                                                          monkeypatch, handlers):
    out = tmp_path / "run"
    settings = {"model_name_or_path": tiny_model_dir, "data_path": chat_file, "output_dir": out, **TINY}
    monkeypatch.setenv(TEST_SIGNAL_ENV, "2:after_step:0:SIGINT")  # Ctrl-C after step 2
    stopped = train(settings, on_demand_checkpointing=True)
    assert kept(handlers)
    assert (stopped.exit_code, stopped.reason, stopped.step, stopped.export_dir) == (75, "stopped", 2, None)
    assert stopped.checkpoint == str(out / "full_state_checkpoints" / "step_2")
    assert stopped.last_step["step"] == 2 and stopped.last_step["loss"] > 0
    assert stopped.run_dir == out
    run = json.loads((out / "run.json").read_text())
    assert run["state"] == "stopped" and run["job_id"] == stopped.job_id
    assert run["argv"][0] == "osft-train" and "--on-demand-checkpointing" in run["argv"]  # what the dashboard relaunches

    monkeypatch.delenv(TEST_SIGNAL_ENV)
    done = train(TrainConfig(**settings), resume=True)  # a TrainConfig, settings replaced by keywords
    assert kept(handlers)
    assert (done.exit_code, done.reason, done.step, done.checkpoint) == (0, "completed", 3, None)
    assert done.export_dir == str(out / "hf_format" / "step_3") and Path(done.export_dir, "config.json").is_file()
    assert done.last_step["step"] == 3 and done.job_id != stopped.job_id


@pytest.mark.torchrun
def test_two_ranks_launched_stop_on_ctrl_c_to_the_caller_and_return_its_outcome(tiny_model_dir, chat_file, tmp_path,
                                                                                monkeypatch, handlers):
    out = tmp_path / "two"
    config = tmp_path / "run.yaml"
    config.write_text(f"model_name_or_path: {tiny_model_dir}\ndata_path: {chat_file}\noutput_dir: {out}\n"
                      + "".join(f"{key}: {value}\n" for key, value in TINY.items()))
    monkeypatch.setenv(TEST_SIGNAL_ENV, "2:after_step:0:SIGINT")  # rank 0 sends it to this process
    outcome = train(str(config), nproc_per_node=2, on_demand_checkpointing=True)
    assert kept(handlers)
    assert (outcome.exit_code, outcome.reason, outcome.step, outcome.export_dir) == (75, "stopped", 2, None)
    assert outcome.checkpoint == str(out / "full_state_checkpoints" / "step_2")
    assert outcome.last_step["world_size"] == 2 and outcome.last_step["step"] == 2
    assert json.loads((out / "run.json").read_text())["state"] == "stopped"


def _cli_error(argv, capsys):
    assert main(argv) == 2
    return capsys.readouterr().err.split("osft-train: error: ", 1)[1].strip()


def test_bad_input_raises_input_error_with_the_cli_message(tiny_model_dir, chat_file, tmp_path, capsys, handlers):
    paths = {"model_name_or_path": str(tiny_model_dir), "data_path": str(chat_file), "output_dir": str(tmp_path / "r")}
    flags = [w for key, value in paths.items() for w in ("--" + key.replace("_", "-"), value)]
    bad_file = tmp_path / "bad.yaml"
    bad_file.write_text(f"output_dir: {tmp_path / 'r'}\nlearning_rate: fast\n")
    with pytest.raises(InputError) as exc:
        train(bad_file, model_name_or_path=str(tiny_model_dir), data_path=str(chat_file))
    assert str(exc.value) == _cli_error(["--config", str(bad_file), *flags[:4]], capsys)
    assert str(exc.value) == f"{bad_file}:2: learning_rate: expected a number, got 'fast'"

    with pytest.raises(InputError) as exc:  # a cross-flag check
        train(paths, max_seq_len=512, max_tokens_per_gpu=256)
    assert str(exc.value) == _cli_error([*flags, "--max-seq-len", "512", "--max-tokens-per-gpu", "256"], capsys)

    bad_data = write_jsonl(tmp_path / "bad.jsonl", [chat("hi", "there"), '{"messages": ['])
    with pytest.raises(InputError) as exc:  # found by the one-rank trainer after it took the signals
        train(paths, data_path=bad_data, on_demand_checkpointing=True)
    assert kept(handlers)
    assert str(exc.value) == _cli_error([*flags[:2], "--data-path", str(bad_data), *flags[4:]], capsys)
    assert f"{bad_data}:2" in str(exc.value)

    with pytest.raises(InputError, match=r"^unknown key 'learning_rat'; did you mean 'learning_rate'\?$"):
        train(paths, learning_rat=1e-5)
    with pytest.raises(InputError, match=r"^batch_size: expected a positive integer, got '-3'$"):
        train({**paths, "batch_size": -3})
    with pytest.raises(InputError, match=r"^the following arguments are required: --output-dir$"):
        train(model_name_or_path=paths["model_name_or_path"], data_path=paths["data_path"])  # no config: keywords only
    assert kept(handlers)


def test_a_call_from_another_thread_is_refused_before_anything_is_written(tiny_model_dir, chat_file, tmp_path,
                                                                         handlers):
    """Signal handlers can only be installed by the main thread: a web front end or job runner that
    calls train from a worker thread gets an InputError saying so (not Python's ValueError), and
    nothing is written."""
    caught = []
    settings = {"model_name_or_path": str(tiny_model_dir), "data_path": str(chat_file),
                "output_dir": str(tmp_path / "r")}
    worker = threading.Thread(target=lambda: caught.append(_raised(lambda: train(settings, max_steps=1))))
    worker.start()
    worker.join()
    (exc,) = caught
    assert isinstance(exc, InputError), exc
    assert str(exc) == ("osft.trainer.launch.api.train must be called from the main thread: it installs the checkpoint "
                        "signal handlers, which Python allows only there; from a worker thread, run osft-train "
                        "in a subprocess instead")
    assert not (tmp_path / "r").exists() and kept(handlers)


def _raised(call) -> BaseException | None:
    try:
        call()
    except BaseException as exc:  # noqa: BLE001 - the test inspects whatever the thread raised
        return exc
    return None


def test_the_guide_example_runs(tiny_model_dir, chat_file, tmp_path, monkeypatch, capsys):
    code = re.search(r"```python\n(.*?)```", GUIDE.read_text(), re.S).group(1)
    monkeypatch.chdir(tmp_path)  # the example's relative paths, with the tiny model as its model
    Path("models").mkdir()
    Path("models/SmolLM2-135M-Instruct").symlink_to(tiny_model_dir)
    namespace = {}
    exec(compile(code, str(GUIDE), "exec"), namespace)
    outcome = namespace["outcome"]
    assert (outcome.exit_code, outcome.reason) == (0, "completed")
    assert Path(outcome.export_dir, "model.safetensors").is_file()
    assert f"0 completed {outcome.step} {outcome.export_dir}" in capsys.readouterr().out


def test_the_import_path_of_earlier_releases_still_gives_the_api(monkeypatch):
    """``from osft.trainer.api import train`` (the path before ``osft.trainer.launch``) gives the same
    functions and warns once where they live now."""
    import importlib
    import sys

    monkeypatch.delitem(sys.modules, "osft.trainer.api", raising=False)
    with pytest.warns(DeprecationWarning, match="osft.trainer.api is osft.trainer.launch.api now"):
        old = importlib.import_module("osft.trainer.api")
    assert (old.train, old.InputError, old.TrainConfig) == (train, InputError, TrainConfig)
