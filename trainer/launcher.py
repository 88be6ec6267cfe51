"""The ``osft-train`` launcher: starts one torchrun worker group in its own process session and
supervises it.

Before any rank starts it validates the flags and the data (tokenizing once into the data cache,
which the ranks then read). It writes ``run.json`` (pids, job id, state) and passes torchrun
``--log-dir <output_dir>/logs`` so every rank's stdout/stderr lands in its own file (and is teed to
this console). SIGINT/SIGTERM/SIGHUP to the launcher are forwarded to torchrun, which forwards them
to the ranks.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from rich.console import Console

from .config import TrainConfig, config_to_argv
from .rundir import RunDir

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def preflight(cfg: TrainConfig, console: Console) -> None:
    """Validate and tokenize the data with the model's tokenizer, once, before any rank starts.

    Raises:
        DataValidationError, ValueError, FileNotFoundError: bad data, model path or sample count.
    """
    from .data.cache import tokenize_chat_file_cached
    from .loop import check_enough_samples
    from .model_loading import load_tokenizer

    tokenizer = load_tokenizer(cfg.model_name_or_path)
    data, _ = tokenize_chat_file_cached(cfg.data_path, tokenizer, cfg.max_seq_len, cfg.overlong, cfg.train_on_all,
                                        cache_dir=cfg.data_cache_dir)
    check_enough_samples(len(data), cfg.nproc_per_node * cfg.nnodes)
    console.print(f"data: {len(data)} samples validated", markup=False, highlight=False)


def torchrun_command(cfg: TrainConfig, run_dir: RunDir, job_id: str) -> list[str]:
    """The torchrun command line of this node's worker group."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(cfg.nproc_per_node)]
    if cfg.nnodes == 1 and not cfg.rdzv_endpoint:
        cmd += ["--standalone"]
    else:
        cmd += ["--nnodes", str(cfg.nnodes), "--node-rank", str(cfg.node_rank), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", cfg.rdzv_endpoint, "--rdzv-id", job_id]
    log_dir = run_dir.root / "logs" / f"node{cfg.node_rank}"
    cmd += ["--log-dir", str(log_dir), "--redirects", "3", "--tee", "3", "-m", "osft.trainer.worker"]
    return cmd + config_to_argv(cfg)


def launch(cfg: TrainConfig, console: Console, job_id: str) -> int:
    """Run the worker group to its end and return its exit code (0 completed)."""
    run_dir = RunDir(cfg.output_dir)
    run_dir.create()
    cmd = torchrun_command(cfg, run_dir, job_id)
    env = dict(os.environ, OSFT_JOB_ID=job_id)
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    run_dir.update_run_json(state="running", torchrun_pids=[proc.pid], torchrun_cmd=cmd)

    def forward(signum, _frame):
        if proc.poll() is None:
            proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in FORWARDED_SIGNALS}
    try:
        return proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if proc.poll() is None:  # the launcher itself failed: never leave the worker group behind
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
