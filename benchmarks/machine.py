"""The machine a benchmark ran on, and the revision of a checkout, recorded with its results."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path


def machine_info() -> dict:
    """CPU count, platform and library versions; torch threads as the workers saw them."""
    import peft
    import psutil
    import torch
    import transformers

    cpu_model = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return dict(cpu_count=os.cpu_count(), cpu_count_physical=psutil.cpu_count(logical=False), cpu_model=cpu_model,
                memory_bytes=psutil.virtual_memory().total, platform=platform.platform(),
                python=platform.python_version(), torch_version=torch.__version__,
                torch_threads=torch.get_num_threads(), transformers_version=transformers.__version__,
                peft_version=peft.__version__)


def git_revision(tree: Path) -> str | None:
    """The short commit hash of the checkout ``tree`` (None outside a git checkout)."""
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True)
    return done.stdout.strip() or None
