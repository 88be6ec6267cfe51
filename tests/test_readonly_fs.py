"""A read-only install and home: a run where the install directory and ``$HOME`` are read-only (a container with
``readOnlyRootFilesystem``, OpenShift's random user with ``HOME=/``) trains; no cache is required to
start. The read-only view is a private mount namespace (``unshare -rm``) with read-only bind mounts
of the installed package, the virtual environments, the model and a fresh home directory."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import QA, chat, write_jsonl

import osft.trainer

#: Variables that would point a cache at a writable place and hide the fault.
CACHE_VARIABLES = ("OSFT_DATA_CACHE", "NUMBA_CACHE_DIR", "HF_HOME", "HF_DATASETS_CACHE", "XDG_CACHE_HOME",
                   "MPLCONFIGDIR", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")


def _can_unshare() -> bool:
    try:
        return subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _package_dirs() -> list[Path]:
    """The installed osft package and every site-packages directory this interpreter imports from."""
    import numba
    import torch

    dirs = {Path(osft.trainer.__file__).resolve().parents[1], Path(sys.prefix).resolve(),
            Path(numba.__file__).resolve().parents[1], Path(torch.__file__).resolve().parents[1]}
    return sorted(dirs)


@pytest.mark.torchrun
@pytest.mark.skipif(not _can_unshare(), reason="needs a private mount namespace (unshare -rm)")
def test_trains_with_read_only_install_and_home_with_and_without_a_data_cache_dir(tiny_model_dir, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    data = write_jsonl(tmp_path / "train.jsonl", [chat(q, a) for q, a in QA])
    read_only = [*_package_dirs(), Path(tiny_model_dir).resolve(), home]
    common = ["--model-name-or-path", str(tiny_model_dir), "--data-path", str(data), "--batch-size", "2",
              "--max-tokens-per-gpu", "96", "--max-seq-len", "64", "--max-steps", "2"]
    train = [sys.executable, "-m", "osft.trainer.launch.cli", *common]
    script = "\n".join([
        "set -e",
        *(f"mount --bind -o ro {shlex.quote(str(d))} {shlex.quote(str(d))}" for d in read_only),
        f"! touch {shlex.quote(str(read_only[0] / 'probe'))} 2>/dev/null",  # the view is read-only indeed
        "set +e",
        shlex.join([*train, "--output-dir", str(tmp_path / "with"), "--data-cache-dir", str(tmp_path / "cache")]),
        "echo exit-with=$?",
        shlex.join([*train, "--output-dir", str(tmp_path / "without")]),
        "echo exit-without=$?",
    ])
    env = {k: v for k, v in os.environ.items() if k not in CACHE_VARIABLES and not k.startswith("XDG_")}
    env.update(HOME=str(home), PYTHONDONTWRITEBYTECODE="1")
    run = subprocess.run(["unshare", "-rm", "bash", "-c", script], env=env, capture_output=True, text=True,
                         timeout=600)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    assert "exit-with=0" in output and "exit-without=0" in output, output
    assert list((tmp_path / "cache").iterdir()), "the writable --data-cache-dir was not used"
    for name in ("with", "without"):
        assert (tmp_path / name / "hf_format" / "step_2" / "config.json").is_file(), output
    # the default cache (under the read-only home) is named in a warning, and the run went on uncached
    assert "is not writable" in output and "--data-cache-dir" in output, output
    assert not list(home.iterdir())
