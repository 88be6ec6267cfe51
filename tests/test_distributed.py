"""Distributed training on CPU with gloo: real torchrun worker groups started by `osft-train`."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import QA, chat, float64_grad_norm, write_jsonl
from safetensors.torch import load_file

from osft.trainer.launch.cli import main
from osft.trainer.config import build_parser, config_from_args
from osft.trainer.run.loop import Trainer

ROOT = Path(__file__).resolve().parents[1]
@pytest.fixture(scope="module")
def tiny(tiny_model_dir, tmp_path_factory):
    data = write_jsonl(tmp_path_factory.mktemp("dist") / "train.jsonl", [chat(q, a) for q, a in QA] * 5)
    return tiny_model_dir, data


def run(tiny, out, *flags, env=None):
    model, data = tiny
    argv = ["--model-name-or-path", str(model), "--data-path", str(data), "--output-dir", str(out),
            "--batch-size", "5", "--max-tokens-per-gpu", "96", "--max-seq-len", "64", "--learning-rate", "2e-3",
            "--weight-decay", "0.1", "--save-dtype", "float32", *flags]
    return main(argv)


def steps(out, node=0):
    return [r for r in map(json.loads, (out / "metrics" / f"node{node}.jsonl").read_text().splitlines()) if r["event"] == "step"]


def weights(out, step):
    return load_file(out / "hf_format" / f"step_{step}" / "model.safetensors")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_ranks(tiny, tmp_path_factory):
    """One 10-step run on 2 ranks with the default (factored) V projection: the reference of the
    one-rank comparison and of the other projection modes (constant learning rate, so steps 1-10
    are the same whatever --max-steps)."""
    out = tmp_path_factory.mktemp("two") / "two"
    assert run(tiny, out, "--max-steps", "10", "--nproc-per-node", "2") == 0
    return out


@pytest.mark.torchrun
def test_two_ranks_train_like_one(tiny, two_ranks, tmp_path):
    assert run(tiny, tmp_path / "one", "--max-steps", "10") == 0
    one, two = steps(tmp_path / "one"), steps(two_ranks)
    assert [r["step"] for r in two] == list(range(1, 11))
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        assert (b["num_tokens"], b["num_loss_tokens"], b["world_size"]) == (a["num_tokens"], a["num_loss_tokens"], 2)
        assert b["ortho_violations"] == 0
    assert two[-1]["loss"] < two[0]["loss"]
    w1, w2 = weights(tmp_path / "one", 10), weights(two_ranks, 10)
    assert set(w1) == set(w2)
    for key in w1:
        torch.testing.assert_close(w2[key], w1[key], rtol=1e-4, atol=1e-5, msg=key)
    run_json = json.loads((two_ranks / "run.json").read_text())
    assert run_json["state"] == "completed" and run_json["nproc_per_node"] == 2 and run_json["torchrun_pids"]
    logs = list((two_ranks / "logs").rglob("stderr.log"))
    assert len(logs) == 2


@pytest.mark.torchrun
def test_projection_modes_give_the_same_parameters_and_local_rank_1_warnings_reach_the_run_dir(
        tiny, two_ranks, tmp_path, monkeypatch):
    """Gram and uncached V projection (each V basis gathered at every use) end at the parameters of
    the factored run with the gathered bases kept, the default on CPU ranks. The Gram run also carries
    a test warning from local rank 1 at step 2 (it changes nothing in training): it reaches
    ``metrics/rank1.jsonl``, and step records stay on local rank 0."""
    monkeypatch.setenv("OSFT_TEST_WARN_AT", "2:1")
    assert run(tiny, tmp_path / "gram", "--max-steps", "10", "--nproc-per-node", "2", "--osft-v-projection", "gram") == 0
    monkeypatch.delenv("OSFT_TEST_WARN_AT")
    assert run(tiny, tmp_path / "uncached", "--max-steps", "10", "--nproc-per-node", "2", "--no-osft-cache-v-high") == 0
    reference = weights(two_ranks, 10)
    for name in ("gram", "uncached"):
        other = weights(tmp_path / name, 10)
        for key, value in reference.items():
            torch.testing.assert_close(other[key], value, rtol=1e-4, atol=1e-5, msg=f"{name}: {key}")
    records = [json.loads(line) for line in (tmp_path / "gram" / "metrics" / "rank1.jsonl").read_text().splitlines()]
    warnings = [r for r in records if r["event"] == "warning"]
    assert [(w["rank"], w["local_rank"], w["message"]) for w in warnings] == [(1, 1, "test warning from local rank 1 at step 2")]
    assert not [r for r in records if r["event"] == "step"]  # step records stay on local rank 0


@pytest.mark.torchrun
@pytest.mark.parametrize("ranks", [2, 3])
def test_uneven_shards_give_the_single_process_projection(tmp_path, ranks):
    out = tmp_path / "result.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
           str(ROOT / "tests" / "dist" / "projection_check.py"), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = torch.load(out, weights_only=False)
    assert len(results) == ranks
    # map_over_ranks: item i computed by rank i mod world size, every result on rank 0 in order
    assert [r.pop("mapped") for r in results] == [[(i, i % ranks) for i in range(7)]] + [None] * (ranks - 1)
    # its check is called by every rank before each round of one item per rank: ceil(7 / ranks) times
    assert [r.pop("rounds") for r in results] == [list(range(-(-7 // ranks)))] * ranks
    for per_rank in results:
        assert set(per_rank) == {"factored", "gram", "cached"}
        for mode, r in per_rank.items():
            assert r["diff"] < 1e-5, mode
            assert r["max_dev_deg"] == pytest.approx(r["ref_max_dev_deg"], abs=1e-4), mode
            if mode == "gram":  # no coefficients, no bound
                assert r["bound_deg"] is None and r["ref_bound_deg"] is None
            else:  # the sharded bound (norms summed over ranks) is the single-process one, and bounds the check
                assert r["bound_deg"] == pytest.approx(r["ref_bound_deg"], rel=1e-3), mode
                assert r["max_dev_deg"] <= r["bound_deg"] < 1.0, mode
    v_rows = [r["factored"]["local_rows"][0] for r in results]  # module 0's V_high: 7 rows over the ranks
    assert sum(v_rows) == 7 and len(set(v_rows)) > 1  # uneven shards


@pytest.mark.torchrun
def test_two_nodes_train_together(tiny, tmp_path):
    model, data = tiny
    out = tmp_path / "nodes"
    endpoint = f"127.0.0.1:{free_port()}"
    base = [sys.executable, "-m", "osft.trainer.launch.cli", "--model-name-or-path", str(model), "--data-path", str(data),
            "--output-dir", str(out), "--batch-size", "5", "--max-tokens-per-gpu", "96", "--max-seq-len", "64",
            "--max-steps", "3", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", endpoint]
    nodes = [subprocess.Popen(base + ["--node-rank", str(i)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    outputs = [p.communicate(timeout=600)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    for node in (0, 1):
        records = steps(out, node)
        assert [r["step"] for r in records] == [1, 2, 3]
        assert {r["node_rank"] for r in records} == {node} and {r["world_size"] for r in records} == {2}
        assert all(0 < r["node_tokens_per_s"] < r["tokens_per_s"] for r in records)
    assert {r["rank"] for n in (0, 1) for r in steps(out, n)} == {0, 1}
    assert (out / "run.json").is_file() and (out / "run.node1.json").is_file()
    assert all("step 3/3" in o for o in outputs)  # progress visible on both nodes


def test_fewer_samples_than_ranks_fails_at_start(tiny, tmp_path, capsys):
    model, _ = tiny
    data = write_jsonl(tmp_path / "three.jsonl", [chat(q, a) for q, a in QA[:3]])
    code = main(["--model-name-or-path", str(model), "--data-path", str(data), "--output-dir", str(tmp_path / "r"),
                 "--nproc-per-node", "4", "--max-seq-len", "64", "--max-tokens-per-gpu", "96"])
    assert code == 2
    assert "dataset has 3 usable samples, fewer than world size 4" in capsys.readouterr().err
    assert not (tmp_path / "r" / "logs").exists()  # no rank was started


@pytest.mark.torchrun
def test_uneven_last_batch_keeps_every_rank_in_step(tiny, tmp_path):
    """An uneven last batch: 5 samples, world size 2, batch 2, last batch kept: 3 steps on every
    rank, the last with one sample (one rank runs an empty micro-batch instead of skipping
    collectives)."""
    model, _ = tiny
    data = write_jsonl(tmp_path / "five.jsonl", [chat(q, a) for q, a in QA])
    out = tmp_path / "r"
    code = main(["--model-name-or-path", str(model), "--data-path", str(data), "--output-dir", str(out),
                 "--nproc-per-node", "2", "--batch-size", "2", "--max-seq-len", "64", "--max-tokens-per-gpu", "96"])
    assert code == 0
    records = steps(out)
    assert [(r["step"], r["num_samples"]) for r in records] == [(1, 2), (2, 2), (3, 1)]
    assert all(r["loss"] > 0 for r in records)


def test_osft_cache_v_env_sets_the_flag_default(monkeypatch):
    from osft.trainer.config import build_parser

    argv = ["--model-name-or-path", "m", "--data-path", "d", "--output-dir", "o"]
    monkeypatch.setenv("OSFT_CACHE_V", "1")
    assert build_parser().parse_args(argv).osft_cache_v_high is True
    assert build_parser().parse_args(argv + ["--no-osft-cache-v-high"]).osft_cache_v_high is False
    monkeypatch.setenv("OSFT_CACHE_V", "0")
    assert build_parser().parse_args(argv).osft_cache_v_high is False
    monkeypatch.delenv("OSFT_CACHE_V")
    assert build_parser().parse_args(argv).osft_cache_v_high is None  # decided by device


def test_v_bases_are_cached_on_cpu_ranks_unless_set_and_the_setting_reaches_the_workers(tmp_path, monkeypatch):
    from osft.trainer.config import build_parser, config_from_args
    from osft.trainer.config_file import parse_with_config_file, worker_config_yaml
    from osft.trainer.osft.plan import OSFTSettings

    monkeypatch.delenv("OSFT_CACHE_V", raising=False)
    argv = ["--model-name-or-path", "m", "--data-path", "d", "--output-dir", "o"]
    for flags, cpu, cuda in (([], True, False), (["--osft-cache-v-high"], True, True),
                             (["--no-osft-cache-v-high"], False, False)):
        cfg = config_from_args(build_parser().parse_args(argv + flags))
        settings = OSFTSettings.from_config(cfg)
        assert (settings.caches_v_basis(torch.device("cpu")), settings.caches_v_basis(torch.device("cuda"))) == (cpu, cuda)
        path = tmp_path / "worker.yaml"
        path.write_text(worker_config_yaml(cfg))  # the launcher's config to the ranks
        assert config_from_args(parse_with_config_file(build_parser("osft.trainer.worker"), ["--config", str(path)])) == cfg
    path.write_text(worker_config_yaml(config_from_args(build_parser().parse_args(argv))))  # None: decided later
    monkeypatch.setenv("OSFT_CACHE_V", "1")  # ... or by the ranks' environment, as with no flag on their command line
    worker = config_from_args(parse_with_config_file(build_parser("osft.trainer.worker"), ["--config", str(path)]))
    assert worker.osft_cache_v_high is True


@pytest.mark.torchrun
def test_two_ranks_grad_norm_equals_a_float64_reference(tiny, two_ranks, tmp_path):
    """The gradient norm on two ranks (OSFT on): step 1's reported gradient norm against the float64
    reference of the same batch, computed in this process (tests/test_grad_norm.py: one rank)."""
    model, data = tiny
    argv = ["--model-name-or-path", str(model), "--data-path", str(data), "--output-dir", str(tmp_path / "ref"),
            "--batch-size", "5", "--max-tokens-per-gpu", "96", "--max-seq-len", "64", "--max-steps", "10"]
    trainer = Trainer(config_from_args(build_parser().parse_args(argv)))
    trainer.prepare()  # the same SVD factors as the two-rank run, and its first batch
    want = float64_grad_norm(trainer, trainer.sampler.batch(0, 0))
    assert steps(two_ranks)[0]["grad_norm"] == pytest.approx(want, rel=1e-6)


@pytest.mark.subprocess
def test_exit_rank_flushes_what_was_written_and_exits_with_the_code():
    """exit_rank skips the interpreter's finalization (os._exit): what the process printed or logged
    must still arrive, and the exit code is the one given."""
    code = ("import logging, sys\n"
            "from osft.trainer.distributed import exit_rank\n"
            "logging.basicConfig(stream=sys.stderr, format='%(message)s')\n"
            "print('out, no newline', end='')\n"
            "sys.stderr.write('err, no newline')\n"
            "logging.getLogger('x').warning(' logged')\n"
            "exit_rank(3)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (3, "out, no newline", "err, no newline logged\n")


def test_map_on_threads_calls_its_check_before_each_round_and_stops_where_it_raises(monkeypatch):
    """Rounds of one item per intra-op thread: 7 items on 3 threads are 3 rounds, each checked
    first on the calling thread; an exception from the check before round 1 leaves items 3-6 undone."""
    from osft.trainer.distributed import map_on_threads

    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    rounds, done = [], []

    def square(x: int) -> int:
        done.append(x)
        return x * x

    assert map_on_threads(square, list(range(7)), rounds.append) == [x * x for x in range(7)]
    assert rounds == [0, 1, 2]

    def stop_at_round_1(r: int) -> None:
        if r == 1:
            raise KeyboardInterrupt

    done.clear()
    with pytest.raises(KeyboardInterrupt):
        map_on_threads(square, list(range(7)), stop_at_round_1)
    assert sorted(done) == [0, 1, 2]
