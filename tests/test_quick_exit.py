"""How the launcher and torchrun's agent exit (:mod:`osft.trainer.launch.quick_exit`), and that
``osft-train`` is the entry point that does it."""

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.subprocess
def test_exit_without_final_gc_keeps_the_exit_code_atexit_and_unflushed_writes(tmp_path):
    """The collector's objects are frozen, yet ``atexit`` handlers run, a file left open is flushed
    when the interpreter tears the modules down, and the exit code is the one given."""
    code = ("import atexit, gc, sys\n"
            "from osft.trainer.launch.quick_exit import exit_without_final_gc\n"
            "atexit.register(lambda: print('atexit, frozen', gc.get_freeze_count() > 0))\n"
            f"log = open({str(tmp_path / 'left-open.txt')!r}, 'w')\n"
            "log.write('buffered, never flushed')\n"
            "print('out', end=' ')\n"
            "exit_without_final_gc(3)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (3, "out atexit, frozen True\n", "")
    assert (tmp_path / "left-open.txt").read_text() == "buffered, never flushed"


def test_the_osft_train_command_exits_through_run():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["osft-train"] == "osft.trainer.launch.cli:run"
