"""`--report-to`: the step metrics and events of the JSONL also go to TensorBoard / W&B (global rank 0)."""

import importlib.machinery
import json
import sys
import types
from pathlib import Path

import pytest
from helpers import QA, chat, write_jsonl
from osft.trainer.observe import trackers
from osft.trainer.launch.cli import main
from osft.trainer.config import TrainConfig, build_parser, config_from_args, config_to_argv
from osft.trainer.contract import read_records
from osft.trainer.observe.plot import run_series


@pytest.fixture()
def chat_file(tmp_path):
    return write_jsonl(tmp_path / "train.jsonl", [chat(q, a) for q, a in QA[:4]] * 3)


def tiny_run(model_dir, data, out, *flags):
    return main([
        "--model-name-or-path", str(model_dir), "--data-path", str(data), "--output-dir", str(out),
        "--batch-size", "4", "--max-tokens-per-gpu", "96", "--max-seq-len", "64", "--max-steps", "3",
        "--report-to", "tensorboard", *flags,
    ])


def test_tensorboard_gets_the_jsonl_steps_and_events_and_a_resume_replaces_the_replayed_step(
        tiny_model_dir, chat_file, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    every = ("--ortho-check-every", "1")  # orthogonality and indicator values on every step
    assert tiny_run(tiny_model_dir, chat_file, out, "--checkpoint-every-steps", "2", *every) == 0
    assert tiny_run(tiny_model_dir, chat_file, out, "--resume", *every) == 0  # from step 2: step 3 is replayed
    records, problems = read_records(out / "metrics" / "node0.jsonl")
    assert not problems
    steps = [r for r in records if r["event"] == "step"]
    assert [r["step"] for r in steps] == [1, 2, 3, 3]
    assert [r["from_step"] for r in records if r["event"] == "resumed"] == [2]

    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    latest = {r["step"]: r for r in steps}  # the resumed run's step 3 wins
    loss = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert [s for s, _ in loss] == [1, 2, 3]
    assert [v for _, v in loss] == pytest.approx([latest[s]["loss"] for s in (1, 2, 3)], rel=1e-6)
    for tag, field in [("train/lr", "lr"), ("train/grad_norm", "grad_norm"), ("train/tokens_per_s", "tokens_per_s"),
                       ("train/node0_tokens_per_s", "node_tokens_per_s"), ("osft/ortho_violations", "ortho_violations"),
                       ("osft/ortho_max_dev_deg", "ortho_max_dev_deg"), ("osft/dw_rel_max", "osft_dw_rel_max"),
                       ("osft/dw_rel_median", "osft_dw_rel_median"), ("osft/gap_max", "osft_gap_max"),
                       ("osft/gap_median", "osft_gap_median")]:
        assert [e.value for e in acc.Scalars(tag)] == pytest.approx([latest[s][field] for s in (1, 2, 3)], rel=1e-6), tag
    texts = {tag.split("/")[1] for tag in acc.Tags()["tensors"] if tag.startswith("events/")}
    assert {"run_started", "checkpoint_saved", "resumed", "run_finished"} <= texts
    # osft-train plot reads the two segments the same way.
    assert run_series(out).loss.steps == [1, 2, 3]
    assert run_series(out).loss.values == [latest[s]["loss"] for s in (1, 2, 3)]


def test_missing_tracker_package_is_an_input_error_naming_the_extra(tiny_model_dir, chat_file, tmp_path, capsys,
                                                                    monkeypatch):
    base = ["--model-name-or-path", str(tiny_model_dir), "--data-path", str(chat_file), "--output-dir", str(tmp_path / "r")]
    assert main([*base, "--report-to", "wandb"]) == 2  # wandb is not installed here
    err = capsys.readouterr().err
    assert "--report-to wandb: the wandb package is not installed" in err and "pip install 'osft[wandb]'" in err
    real = trackers.find_spec
    monkeypatch.setattr(trackers, "find_spec", lambda name: None if name == "tensorboard" else real(name))
    assert main([*base, "--report-to", "tensorboard"]) == 2
    assert "pip install 'osft[tensorboard]'" in capsys.readouterr().err
    assert main([*base, "--report-to", "none", "tensorboard"]) == 2
    assert "--report-to none excludes other trackers" in capsys.readouterr().err
    assert not (tmp_path / "r" / "metrics").exists()  # nothing started


def test_report_to_parses_and_round_trips_to_worker_flags():
    parser = build_parser()
    paths = ["--model-name-or-path", "m", "--data-path", "d", "--output-dir", "o"]
    assert config_from_args(parser.parse_args(paths)).report_to is None
    cfg = config_from_args(parser.parse_args([*paths, "--report-to", "tensorboard", "wandb"]))
    assert cfg.report_to == ["tensorboard", "wandb"]
    assert config_from_args(parser.parse_args(config_to_argv(cfg))) == cfg


class FakeRun:
    def __init__(self, **kwargs):
        self.init, self.logged, self.finished = kwargs, [], False

    def log(self, values, step):
        self.logged.append((step, values))

    def finish(self):
        self.finished = True

def test_a_tracker_installed_but_not_importable_is_refused_before_any_rank_starts(tiny_model_dir, chat_file, tmp_path,
                                                                                   capsys, monkeypatch):
    """A broken install (here a shim package that fails on import) passes a check that only finds the
    package: the check imports what the tracker uses (torch.utils.tensorboard's SummaryWriter, wandb)."""
    shim = tmp_path / "shim"
    for name in ("tensorboard", "wandb"):
        (shim / name).mkdir(parents=True)
        (shim / name / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'google.protobuf'\")\n")
    monkeypatch.syspath_prepend(str(shim))
    for module in [m for m in sys.modules if m.split(".")[0] in ("tensorboard", "wandb") or
                   m.startswith("torch.utils.tensorboard")]:
        monkeypatch.delitem(sys.modules, module)
    base = ["--model-name-or-path", str(tiny_model_dir), "--data-path", str(chat_file),
            "--output-dir", str(tmp_path / "r")]
    for name, module in (("tensorboard", "torch.utils.tensorboard"), ("wandb", "wandb")):
        for ranks in ("1", "2"):
            assert main([*base, "--report-to", name, "--nproc-per-node", ranks]) == 2
            assert (f"--report-to {name}: {name} is installed but cannot be imported ({module}): ModuleNotFoundError: "
                    f"No module named 'google.protobuf'; repair it") in " ".join(capsys.readouterr().err.split())
    assert not (tmp_path / "r").exists()  # nothing started, nothing written


def test_wandb_tracker_logs_offline_with_the_config_and_never_goes_back_a_step(monkeypatch, tmp_path):
    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    fake.init = FakeRun
    monkeypatch.setitem(sys.modules, "wandb", fake)
    config = TrainConfig("m", "d", str(tmp_path), report_to=["wandb"]).to_json()
    (tracker,) = trackers.open_trackers(["wandb"], tmp_path, config, "job1")
    common = {"ts": 1.0, "node_rank": 0, "rank": 0, "local_rank": 0, "world_size": 1, "hostname": "h", "job_id": "job1"}
    tracker.record({**common, "event": "resumed", "from_step": 4, "path": "p"})
    tracker.record({**common, "event": "step", "step": 5, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 10.0,
                    "node_tokens_per_s": 10.0, "ortho_violations": 0, "ortho_max_dev_deg": None})
    tracker.record({**common, "event": "checkpoint_requested", "step": 3, "signal": "SIGUSR1"})
    tracker.close()
    run = tracker.run
    assert run.init == {"mode": "offline", "dir": str(tmp_path), "project": "osft", "name": "job1", "config": config}
    assert run.logged == [
        (4, {"events/resumed": '{"from_step": 4, "path": "p"}'}),
        (5, {"train/loss": 2.5, "train/lr": 1e-3, "train/grad_norm": 0.5, "train/tokens_per_s": 10.0,
             "osft/ortho_violations": 0.0, "train/node0_tokens_per_s": 10.0}),
        (5, {"events/checkpoint_requested": '{"signal": "SIGUSR1", "step": 3}'}),
    ]
    assert run.finished


def test_eval_records_become_scalars_at_their_step():
    """An ``eval`` record is a scalar per set (loss; forgetting for a retention set), not a text event."""

    class Recorder(trackers.Tracker):
        def __init__(self):
            super().__init__()
            self.got = []

        def scalars(self, step, values, ts):
            self.got.append(("scalars", step, values))

        def event(self, step, event, fields, ts):
            self.got.append(("event", step, event))

    sink = Recorder()
    sink.record({"ts": 1.0, "event": "eval", "step": 4, "set": "eval", "kind": "eval", "eval_loss": 2.5,
                 "forgetting": None})
    sink.record({"ts": 1.0, "event": "eval", "step": 4, "set": "chat", "kind": "retention", "eval_loss": 2.25,
                 "forgetting": 0.125})
    assert sink.got == [("scalars", 4, {"eval/eval/loss": 2.5}),
                        ("scalars", 4, {"retention/chat/loss": 2.25, "retention/chat/forgetting": 0.125})]


@pytest.mark.slow
def test_mlflow_tracker_writes_a_local_file_store_with_the_config_steps_and_events(tmp_path):
    """Offline: the run in ``<output_dir>/mlruns`` read back with MLflow's own client."""
    from mlflow.tracking import MlflowClient

    config = TrainConfig("m", "d", str(tmp_path), report_to=["mlflow"]).to_json()
    (tracker,) = trackers.open_trackers(["mlflow"], tmp_path, config, "job1")
    common = {"ts": 1.0, "node_rank": 0, "rank": 0, "local_rank": 0, "world_size": 1, "hostname": "h", "job_id": "job1"}
    for step, loss in ((1, 3.0), (2, 2.5)):
        tracker.record({**common, "event": "step", "step": step, "loss": loss, "lr": 1e-3, "grad_norm": 0.5,
                        "tokens_per_s": 10.0, "node_tokens_per_s": 10.0, "ortho_violations": 0,
                        "ortho_max_dev_deg": None})
    tracker.record({**common, "event": "eval", "step": 2, "set": "heldout", "kind": "eval", "eval_loss": 2.75})
    tracker.record({**common, "event": "checkpoint_saved", "step": 2, "path": "p2", "bytes": 1, "seconds": 0.5})
    tracker.close()
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("osft").experiment_id])
    assert run.info.run_name == "job1" and run.info.status == "FINISHED"
    assert run.data.params["model_name_or_path"] == "m" and run.data.params["report_to"] == '["mlflow"]'
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/loss")] == [(1, 3.0), (2, 2.5)]
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "eval/heldout/loss")] == [(2, 2.75)]
    events = (Path(client.download_artifacts(run.info.run_id, "events.jsonl", str(tmp_path / "dl")))).read_text()
    assert [json.loads(line) for line in events.splitlines()] == [
        {"step": 2, "event": "checkpoint_saved", "ts": 1.0, "path": "p2", "bytes": 1, "seconds": 0.5}]
