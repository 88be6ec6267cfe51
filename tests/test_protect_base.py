"""``osft-train protect-base`` (``trainer/tools/protect_base.py``) on a tiny Llama: the directory it
writes (the base model's files unchanged, P of width 0 and Q the top input eigenspace of general
data per target), a chained run from it that trains every target but leaves W·Q as it was, and the
bad input refused with exit code 2 before the model is built."""

from __future__ import annotations

import filecmp
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import chat, write_jsonl
from safetensors.torch import load_file

from osft.trainer.checkpoint.subspaces import SUBSPACES_FILE, SUBSPACES_JSON, read_bases
from osft.trainer.config import TrainConfig
from osft.trainer.contract import EXIT_BAD_INPUT, EXIT_COMPLETED
from osft.trainer.launch.cli import main
from osft.trainer.model.build import target_shapes
from test_stop_rule import caught

WORDS = "red green blue cat dog sun moon tea cup map ink box".split()
#: The tiny Llama's OSFT targets: 7 per block, 2 blocks.
TARGETS = 14


def general_rows() -> list[dict]:
    return [chat(f"say {WORDS[i]} and {WORDS[(3 * i + 1) % 12]}", f"{WORDS[i]} {WORDS[(5 * i + 2) % 12]} ok")
            for i in range(12)]


def test_the_basis_is_the_top_input_eigenspace_of_the_drawn_rows_unless_the_cap_binds(tmp_path, tiny_model_dir):
    """:func:`write_protected_base` (what the sequence benchmark's ``osft_general`` arm runs as its
    stage 0): the directory holds the base model's files unchanged and, per target, P of width 0 and
    an orthonormal Q (M×p_R) spanning the top-p_R eigenspace of its inputs' Gram over the drawn rows
    (checked against a Gram of each sample run alone through the dense base model), p_R the fewest
    eigenvectors holding ε of the input energy unless the cap floor(cap·k_low) bound."""
    from osft.trainer.data.tokenize import tokenize_chat_file
    from osft.trainer.model.loading import load_model, load_tokenizer
    from osft.trainer.osft.input_grams import calibration_indices
    from osft.trainer.osft.plan import split_rank
    from osft.trainer.osft.protect import fold_cap
    from osft.trainer.tools.protect_base import JOB_ID, write_protected_base

    base, rows = tiny_model_dir, general_rows()
    general = write_jsonl(tmp_path / "general.jsonl", rows)
    energy, cap_ratio, samples = 0.8, 1.0, 8
    stage0 = tmp_path / "stage0"
    cfg = TrainConfig(str(base), str(general), str(stage0), osft_unfreeze_rank_ratio=0.25,
                      osft_protect_input_samples=samples, osft_protect_input_energy=energy,
                      osft_protect_max_rank_ratio=cap_ratio, max_seq_len=128, overlong="truncate",
                      max_tokens_per_gpu=1024, seed=0, device="cpu", dtype="float32")
    record = write_protected_base(cfg)
    assert sorted(p.name for p in stage0.iterdir()) == sorted([p.name for p in base.iterdir()]
                                                              + [SUBSPACES_FILE, SUBSPACES_JSON])
    assert all(filecmp.cmp(f, stage0 / f.name, shallow=False) for f in base.iterdir())
    assert not list(tmp_path.glob(".stage0.*"))  # the hidden sibling it was written under is gone
    meta = json.loads((stage0 / SUBSPACES_JSON).read_text())
    assert meta["basis"] == "auto" and meta["input_samples"] == samples and meta["input_seed"] == 0
    assert meta["input_data"] == str(general) and meta["input_passes"] == record["passes"] == 1
    assert meta["source"] == {"output_dir": str(stage0.resolve()), "job_id": JOB_ID, "step": 0}
    assert record["samples_drawn"] == record["samples_used"] == samples and record["modules"] == TARGETS
    assert record["inputs_modules"] == TARGETS and record["tokens"] > samples

    # an independent Gram per target: the drawn rows, each sample alone through the dense base model
    drawn = [rows[i] for i in calibration_indices([len(rows)], None, samples, 0)]
    tokens = tokenize_chat_file(write_jsonl(tmp_path / "drawn.jsonl", drawn), load_tokenizer(base), 128, "truncate")
    model = load_model(base)
    shapes = target_shapes(str(base), None)
    bases = read_bases(stage0 / SUBSPACES_FILE, shapes)
    assert len(bases) == TARGETS
    grams = {name: torch.zeros(model.get_submodule(name).in_features, model.get_submodule(name).in_features,
                               dtype=torch.float64) for name in bases}

    def hook(name):
        def record_inputs(_module, args):
            x = args[0].reshape(-1, args[0].shape[-1]).double()
            grams[name] += x.t() @ x
        return record_inputs

    handles = [model.get_submodule(name).register_forward_pre_hook(hook(name)) for name in bases]
    with torch.no_grad():
        for i in range(len(tokens)):
            model(input_ids=torch.tensor([tokens[i]["input_ids"]]))
    for h in handles:
        h.remove()
    assert sum(len(tokens[i]["input_ids"]) for i in range(len(tokens))) == record["tokens"]
    capped, p_right, kept = 0, [], []
    for name, (P, Q) in bases.items():
        mod = meta["modules"][name]
        n, m = shapes[name]
        p = Q.shape[1]
        assert P.shape == (n, 0) and Q.shape == (m, p) and p == mod["p_right"] and mod["p_left"] == 0, name
        torch.testing.assert_close(Q.t() @ Q, torch.eye(p), rtol=0, atol=1e-5)
        eig = torch.linalg.eigvalsh(grams[name]).flip(0)
        total, held = float(eig.sum()), float((Q.double() * (grams[name] @ Q.double())).sum())
        assert held == pytest.approx(float(eig[:p].sum()), rel=1e-4), name  # Q spans the top-p eigenspace
        assert mod["input_energy_kept"] == pytest.approx(held / total, rel=1e-4), name
        cap = fold_cap(split_rank(min(n, m), 0.25)[1], cap_ratio)  # k_low of a fresh run at URR 0.25
        if mod["input_cap_bound"]:
            capped += 1
            assert p == cap and held < energy * total, name
        else:
            assert p <= cap and float(eig[: p - 1].sum()) < energy * total <= float(eig[:p].sum()) * (1 + 1e-9), name
        p_right.append(p)
        kept.append(held / total)
    assert 0 < capped < len(bases)  # both sides of the cap are exercised
    assert record["cap_bound_share"] == capped / len(bases)
    assert (record["p_right"]["min"], record["p_right"]["max"]) == (min(p_right), max(p_right))
    assert record["input_energy_kept"]["min"] == pytest.approx(min(kept), rel=1e-4)


def test_protect_base_writes_a_directory_whose_chained_run_trains_and_keeps_w_q(tmp_path, tiny_model_dir, capsys):
    """``osft-train protect-base`` then a plain chained ``osft-train --model-name-or-path OUT`` run (one
    rank, in process, 2 steps): the command prints one summary line matching what it wrote; the run
    changes every target's weight but not on the protected input directions (‖ΔW·Q‖ ≤ 1e-3·‖ΔW‖),
    and its export protects at least those directions again. A second command with
    ``--overwrite-output-dir`` replaces the directory it wrote."""
    general = write_jsonl(tmp_path / "general.jsonl", general_rows())
    out = tmp_path / "protected"
    argv = ["protect-base", "--model-name-or-path", str(tiny_model_dir), "--data-path", str(general),
            "--output-dir", str(out), "--osft-protect-input-samples", "8", "--osft-protect-input-energy", "0.8",
            "--max-seq-len", "128", "--max-tokens-per-gpu", "1024", "--seed", "0"]
    assert main(argv) == EXIT_COMPLETED
    err = " ".join(capsys.readouterr().err.split())
    meta = json.loads((out / SUBSPACES_JSON).read_text())
    assert meta["input_samples"] == 8 and meta["input_energy"] == 0.8 and meta["max_rank_ratio"] == 0.5
    p_right = sorted(m["p_right"] for m in meta["modules"].values())
    assert all(m["p_left"] == 0 and m["basis"] == "inputs" for m in meta["modules"].values())
    assert max(p_right) <= 8  # floor(0.5 * k_low), k_low = 16 of a 64-wide module at URR 0.25
    median = (p_right[TARGETS // 2 - 1] + p_right[TARGETS // 2]) / 2
    assert re.search(rf"protect-base: {TARGETS} modules, {TARGETS} with input bases: p_R median {median:g} "
                     rf"\(min {p_right[0]}, max {p_right[-1]}\), .*; 8 of 8 drawn rows of {re.escape(str(general))}, "
                     rf".* -> {re.escape(str(out))}$", err), err
    bases = read_bases(out / SUBSPACES_FILE, target_shapes(str(out), None))
    assert all(Q.shape[1] > 0 for _, Q in bases.values())

    task = write_jsonl(tmp_path / "task.jsonl", [chat(f"q {w}", f"a {w} {w}") for w in WORDS])
    run = tmp_path / "run"
    assert main(["--model-name-or-path", str(out), "--data-path", str(task), "--output-dir", str(run),
                 "--max-steps", "2", "--batch-size", "4", "--max-seq-len", "128", "--max-tokens-per-gpu", "1024",
                 "--learning-rate", "1e-3", "--save-dtype", "float32", "--seed", "0"]) == EXIT_COMPLETED
    export = run / "hf_format" / "step_2"
    before, after = load_file(out / "model.safetensors"), load_file(export / "model.safetensors")
    for name, (_, Q) in bases.items():
        w0, w1 = before[f"{name}.weight"].double(), after[f"{name}.weight"].double()
        delta = w1 - w0
        assert delta.norm() > 1e-3 * w0.norm(), name  # trained
        assert (delta @ Q.double()).norm() <= 1e-3 * delta.norm(), name  # but not on the general inputs' directions
    later = json.loads((export / SUBSPACES_JSON).read_text())["modules"]
    assert all(later[name]["p_right"] >= meta["modules"][name]["p_right"] for name in bases)

    assert main([*argv, "--seed", "1", "--overwrite-output-dir"]) == EXIT_COMPLETED
    assert json.loads((out / SUBSPACES_JSON).read_text())["input_seed"] == 1
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def _bad_cases(tmp_path: Path, model: Path) -> dict[str, tuple[dict[str, list[str]], str]]:
    """Name -> (flags that replace the good ones, by flag, with their values; the error's pattern)."""
    exported = tmp_path / "export"
    shutil.copytree(model, exported)
    (exported / SUBSPACES_FILE).write_bytes(b"")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("keep me")
    bad_row = tmp_path / "bad.jsonl"
    bad_row.write_text(json.dumps(general_rows()[0]) + "\n\n" + json.dumps(general_rows()[1]) + "\n"
                       + json.dumps({"messages": [{"role": "gpt", "content": "x"}]}) + "\n")
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n  \n")
    good = str(tmp_path / "good.jsonl")
    parquet = tmp_path / "rows.parquet"
    parquet.write_bytes(b"PAR1")
    nowhere = tmp_path / "nowhere"
    return {
        "subspaces": ({"--model-name-or-path": [str(exported)]},
                      rf"--model-name-or-path {re.escape(str(exported))} already carries {SUBSPACES_FILE}"),
        "no model": ({"--model-name-or-path": [str(nowhere)]},
                     rf"--model-name-or-path {re.escape(str(nowhere))}: no such file or directory"),
        "output exists": ({"--output-dir": [str(theirs)]}, rf"--output-dir {re.escape(str(theirs))} exists: "),
        "not ours": ({"--output-dir": [str(theirs)], "--overwrite-output-dir": []},
                     rf"--output-dir {re.escape(str(theirs))} exists and was not written by protect-base"),
        "two files": ({"--data-path": [good, good]}, r"--data-path: one general chat file expected"),
        "weight": ({"--data-path": [f"{good}:0.5"]}, r"--data-path: one general chat file expected"),
        "parquet": ({"--data-path": [str(parquet)]},
                    rf"--data-path {re.escape(str(parquet))}: a JSON Lines chat file expected"),
        "no rows": ({"--data-path": [str(blank)]}, rf"--data-path {re.escape(str(blank))}: no rows"),
        "bad row": ({"--data-path": [str(bad_row)]},  # physical line 4: the blank line counts
                    rf"2 problem\(s\) in the 3 rows drawn from {re.escape(str(bad_row))}: "
                    rf"{re.escape(str(bad_row))}:4: .*\"gpt\".* {re.escape(str(bad_row))}:4: no assistant turn"),
    }


def test_bad_input_exits_2_naming_the_flag_or_file_before_the_model_is_built(tmp_path, tiny_model_dir, capsys,
                                                                             monkeypatch):
    """Each bad input of the command ends it with exit code 2 and one error naming the flag or the
    file (and line), before any model is built, and leaves no output directory (an existing one as it was)."""
    import osft.trainer.model.build as build

    def no_build(*args, **kwargs):
        raise AssertionError("the model was built")

    monkeypatch.setattr(build, "build_model", no_build)
    good = write_jsonl(tmp_path / "good.jsonl", general_rows())
    out = tmp_path / "out"
    flags = {"--model-name-or-path": [str(tiny_model_dir)], "--data-path": [str(good)], "--output-dir": [str(out)]}
    for name, (changed, pattern) in _bad_cases(tmp_path, tiny_model_dir).items():
        argv = ["protect-base"] + [word for flag, values in {**flags, **changed}.items() for word in [flag, *values]]
        assert main(argv) == EXIT_BAD_INPUT, name
        err = " ".join(capsys.readouterr().err.split())
        assert re.search(rf"osft-train: error: {pattern}", err), (name, err)
        assert not out.exists(), name
    assert [p.name for p in (tmp_path / "theirs").iterdir()] == ["notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


@pytest.mark.subprocess
def test_a_stop_signal_during_the_svds_ends_it_within_seconds_and_writes_nothing(tmp_path, tiny_model_dir):
    """SIGTERM while the command decomposes the targets (each SVD made 2 s slower by the test hook
    OSFT_TEST_SVD_DELAY_S: 28 s in all) ends it within 5 s with exit code 128 + 15 and one line, no
    traceback; no output directory and no hidden partial one is left."""
    general = write_jsonl(tmp_path / "general.jsonl", general_rows())
    out = tmp_path / "protected"
    cmd = [sys.executable, "-m", "osft.trainer.launch.cli", "protect-base", "--model-name-or-path", str(tiny_model_dir),
           "--data-path", str(general), "--output-dir", str(out), "--osft-protect-input-samples", "8"]
    proc = subprocess.Popen(cmd, env={**os.environ, "OSFT_TEST_SVD_DELAY_S": "2"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not caught(proc.pid, signal.SIGTERM):  # its handler is in: the work has begun
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.01)
    time.sleep(3.0)  # into the SVDs (the model loads in well under a second)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    assert time.monotonic() - sent < 5.0
    assert proc.returncode == 128 + signal.SIGTERM, output
    assert f"protect-base: stopped by SIGTERM: nothing written ({out} as it was)" in output
    assert "Traceback" not in output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["general.jsonl"]
