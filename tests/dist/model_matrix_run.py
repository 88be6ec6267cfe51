"""Run under torchrun: train one step on every model directory given, one after the other, in this
one worker group (each a whole ``osft.trainer.worker`` run), so that the two-rank model matrix costs
one launch. The process group is joined once, here, and left after the last run: a run's trainer
finds it up (and joins nothing), and its end waits for the other rank instead of leaving the group.

Usage: torchrun --nproc-per-node 2 model_matrix_run.py DATA OUT_ROOT MODEL_DIR [MODEL_DIR ...] -- FLAGS

Each model's run writes to ``OUT_ROOT/<model dir name>``; the exit code is the first non-zero one.
"""

import sys
from pathlib import Path

import torch.distributed as dist

from osft.trainer.run import loop
from osft.trainer.distributed import exit_rank, shutdown_distributed
from osft.trainer.worker import main


def run_all(argv: list[str]) -> int:
    """Train each model of ``argv`` (the usage above); stop at the first failure."""
    split = argv.index("--")
    (data, out_root, *models), flags = argv[:split], argv[split + 1:]
    dist.init_process_group("gloo")
    loop.shutdown_distributed = dist.barrier  # the group is left once, after the last run
    for model in map(Path, models):
        code = main(["--model-name-or-path", str(model), "--data-path", data, "--output-dir",
                     str(Path(out_root) / model.name), *flags])
        if code:
            return code
    shutdown_distributed()
    return 0


if __name__ == "__main__":
    exit_rank(run_all(sys.argv[1:]))
