"""The ``osft-train`` launcher: starts one torchrun worker group in its own process session and
supervises it (docs/architecture.md section 6, Roles).

Before any rank starts it validates the flags, the data (tokenizing once into the data cache,
which the ranks then read) and, when resuming, the checkpoint. It writes ``run.json`` (pids, job
id, state) and passes torchrun ``--log-dir <output_dir>/logs`` so every rank's stdout/stderr lands
in its own file (and is teed to this console).

Signals to the launcher, with ``--on-demand-checkpointing``: each of SIGTERM, SIGINT, SIGUSR1,
SIGUSR2, SIGXCPU, SIGHUP and SIGQUIT is recorded in the job's trigger directory, which the ranks
poll at their safe points; torchrun's agent is never signalled with them (it has no SIGUSR1
handler, and it treats every signal it handles as "kill the job"). After a stop request the ranks
have ``--checkpoint-grace-seconds`` to finish the checkpoint; then the launcher kills the worker
group, torchrun and every rank (ranks run in sessions of their own), so nothing is left behind.
Without on-demand checkpointing SIGINT, SIGTERM and SIGHUP stop the job at once. A scheduler that
signals every process of the job (SLURM) reaches torchrun too: it runs with the checkpoint signals it
has no handler for ignored, and its failure on a SIGTERM after the ranks stopped with a checkpoint
still gives exit code 75.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
from rich.console import Console

from ..checkpoint.signals import (
    Action,
    TriggerDir,
    action_for_signal,
    install_handlers,
    restore_handlers,
    signal_name,
)
from ..config import TrainConfig
from ..config_file import worker_config_yaml
from ..contract import (
    AGENT_FAILURES_ENV,
    EXIT_COMPLETED,
    EXIT_FAILED,
    EXIT_STOPPED,
    JOB_ID_ENV,
    JOB_START_ENV,
    LAUNCHER_PID_ENV,
    VERIFIED_CHECKPOINT_ENV,
    Event,
    FinishReason,
    RunState,
    read_records,
)
from ..exit_codes import stopped_by_signal
from .failure_report import failure_paragraph, read_failures
from ..rundir import RunDir, write_text_atomic

#: Signals that stop the job at once when on-demand checkpointing is off.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: Seconds between the launcher's checks of its worker group.
POLL_S = 0.2
#: Checkpoint signals torchrun's agent has no handler for (it handles SIGTERM, SIGINT, SIGHUP and
#: SIGQUIT), whose default action would kill it. It is started with them ignored, so a scheduler
#: that signals every process of the job (srun's signal forwarding and ``scancel --signal`` reach
#: every process of a SLURM job step) leaves it running; the launcher and the ranks handle them.
AGENT_IGNORED_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGXCPU)


def preflight(cfg: TrainConfig, console: Console) -> TrainConfig:
    """Validate and tokenize the data (training, evaluation and retention sets) with the model's
    tokenizer, once, and resolve and verify the checkpoint to resume from, before any rank starts.

    Returns:
        the config the ranks get: ``--resume`` replaced by the checkpoint it found (or dropped).

    Raises:
        DataValidationError, ValueError, FileNotFoundError: bad data, model path or sample count,
            protected subspaces that do not fit the model, an input Gram matrix larger than
            ``--osft-protect-input-memory-gb``, ``--freeze-router`` for a model without
            MoE routers, or a warmup that would leave every step
            at learning rate 0 (:func:`osft.trainer.run.schedule.check_warmup`).
        CheckpointError: the checkpoint to resume from is incomplete or corrupt, or was saved with
            another world size, batch setting, data or OSFT setting.
    """
    from dataclasses import replace

    from ..data.cache import tokenize_source
    from ..model.build import load_protected_bases, meta_model, target_shapes
    from ..osft.input_grams import check_gram_budget
    from ..model.loading import load_tokenizer
    from ..osft.freeze import freeze_routers
    from .startup import check_data, check_start, choose_checkpoint, load_data, resume_requested

    tokenizer = load_tokenizer(cfg.model_name_or_path, chat_template=cfg.chat_template)

    def warn(message: str) -> None:
        console.print(f"warning: {message}", markup=False, highlight=False, soft_wrap=True)

    def say(message: str) -> None:
        console.print(message, markup=False, highlight=False, soft_wrap=True)

    data = load_data(cfg, tokenizer, warn, lambda path: tokenize_source(cfg, path, tokenizer, warn)[0])
    world_size = cfg.nproc_per_node * cfg.nnodes
    plan = check_data(cfg, data.train, world_size)  # absolute positions: error; rotary: the ranks warn
    say(f"data: {len(data.train)} samples validated")
    if not resume_requested(cfg):
        load_protected_bases(cfg)  # a file that does not fit the model fails here, before any rank starts
    if cfg.osft and cfg.osft_protect_basis == "inputs":  # a Gram larger than the budget fails here
        shapes = target_shapes(cfg.model_name_or_path, cfg.osft_target_patterns)
        check_gram_budget({name: shape[-1] for name, shape in shapes.items() if len(shape) == 2},  # banks: not collected
                          cfg.osft_protect_input_memory_gb * 1e9)
    if cfg.freeze_router:  # a model without MoE routers fails here
        freeze_routers(meta_model(cfg.model_name_or_path), cfg.model_name_or_path)
    choice = choose_checkpoint(cfg)
    for line in choice.skipped:
        say(f"resume: {line}")
    if choice.note:
        say(choice.note)
    check_start(cfg, choice.path, world_size, plan)  # its warnings are logged by the ranks
    if not cfg.resume:
        return cfg
    return replace(cfg, resume=False, resume_from_full_state_checkpoint=str(choice.path) if choice.path else None)


def torchrun_command(cfg: TrainConfig, run_dir: RunDir, job_id: str) -> list[str]:
    """The torchrun command line of this node's worker group (through :mod:`osft.trainer.launch.agent`, which writes
    down how failed ranks ended). Its shutdown timeout (how long it waits for ranks after
    forwarding a signal it received directly) is the checkpoint grace period. The ranks read their
    config from :meth:`.rundir.RunDir.worker_config`, which :func:`launch` writes."""
    cmd = [sys.executable, "-m", "osft.trainer.launch.agent", "--nproc-per-node", str(cfg.nproc_per_node),
           "--shutdown-timeout", str(cfg.checkpoint_grace_seconds)]
    if cfg.nnodes == 1 and not cfg.rdzv_endpoint:
        cmd += ["--standalone"]
    else:
        cmd += ["--nnodes", str(cfg.nnodes), "--node-rank", str(cfg.node_rank), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", cfg.rdzv_endpoint, "--rdzv-id", job_id]
    log_dir = run_dir.root / "logs" / f"node{cfg.node_rank}"
    cmd += ["--log-dir", str(log_dir), "--redirects", "3", "--tee", "3", "-m", "osft.trainer.worker"]
    return cmd + ["--config", str(run_dir.worker_config(job_id))]


def finished_record(run_dir: RunDir, node_rank: int, job_id: str) -> dict:
    """This job's last ``run_finished`` record in ``metrics/node<N>.jsonl`` ({} if none): its
    ``exit_code``, ``reason`` and ``export_dir`` (:func:`.contract.read_records` reads the file)."""
    path = run_dir.node_metrics(node_rank)
    records = read_records(path)[0] if path.is_file() else []
    return next((r for r in reversed(records) if r.get("event") == Event.RUN_FINISHED and r.get("job_id") == job_id), {})


def _ignore_agent_signals() -> None:
    """In the forked child, before torchrun starts: ignore :data:`AGENT_IGNORED_SIGNALS` (an
    ignored disposition survives exec; the ranks install their own handlers)."""
    for signum in AGENT_IGNORED_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def _kill_tree(procs: list[psutil.Process]) -> None:
    """SIGKILL every process in ``procs`` that still runs, and wait for them."""
    alive = []
    for p in procs:
        try:
            p.kill()
            alive.append(p)
        except psutil.NoSuchProcess:
            continue
    psutil.wait_procs(alive, timeout=10)


def launch(cfg: TrainConfig, console: Console, job_id: str, argv: list[str]) -> int:
    """Run the worker group to its end and return the exit code (:mod:`.exit_codes`): 0 completed,
    75 stopped after a complete checkpoint, 128 + N stopped by signal N without a checkpoint
    (on-demand checkpointing off), 1 failed, after printing what happened
    (:func:`osft.trainer.launch.failure_report.failure_paragraph`; ``argv``, the ``osft-train`` flags, make its
    resume command)."""
    run_dir = RunDir(cfg.output_dir, cfg.node_rank)
    run_dir.create()
    trigger = TriggerDir(job_id)
    trigger.create()
    cmd = torchrun_command(cfg, run_dir, job_id)
    run_dir.worker_config(job_id).parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(run_dir.worker_config(job_id), worker_config_yaml(cfg))
    failures = run_dir.root / "logs" / f"node{cfg.node_rank}" / f"failures-{job_id}.json"
    failures.unlink(missing_ok=True)
    env = dict(os.environ, **{JOB_ID_ENV: job_id, LAUNCHER_PID_ENV: str(os.getpid()), AGENT_FAILURES_ENV: str(failures)})
    env.setdefault(JOB_START_ENV, repr(time.time()))
    if cfg.resume_from_full_state_checkpoint:  # verified by preflight: rank 0 need not hash it again
        env[VERIFIED_CHECKPOINT_ENV] = cfg.resume_from_full_state_checkpoint
    deadline: list[float] = []
    stopped_by: list[int] = []
    started: list[subprocess.Popen] = []

    def on_signal(signum: int) -> None:
        if started and started[0].poll() is not None:
            return
        if not cfg.on_demand_checkpointing:
            if signum in STOP_SIGNALS:
                stopped_by.append(signum)
                if started:
                    started[0].send_signal(signal.SIGTERM)  # no checkpoint to wait for: torchrun stops the ranks
            else:
                console.print(f"osft-train: {signal_name(signum)} ignored: on-demand checkpointing is off "
                              "(--on-demand-checkpointing)", markup=False, highlight=False, soft_wrap=True)
            return
        trigger.record(signum)
        action = action_for_signal(signum, cfg.sigusr1_action)
        what = "checkpoint and exit" if action is Action.CHECKPOINT_AND_EXIT else "checkpoint, then continue"
        console.print(f"osft-train: {signal_name(signum)}: {what} requested; the ranks save at their next safe point",
                      markup=False, highlight=False, soft_wrap=True)
        if action is Action.CHECKPOINT_AND_EXIT and not deadline:
            deadline.append(time.monotonic() + cfg.checkpoint_grace_seconds)
            run_dir.update_run_json(state=RunState.CHECKPOINTING)

    previous = install_handlers(on_signal)  # before torchrun starts: a request during start-up is kept
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_ignore_agent_signals)
    started.append(proc)
    agent = psutil.Process(proc.pid)
    run_dir.update_run_json(state=RunState.RUNNING, torchrun_pids=[proc.pid], torchrun_cmd=cmd)
    if stopped_by:  # stopped while torchrun was being started
        proc.send_signal(signal.SIGTERM)
    family: dict[int, psutil.Process] = {}
    killed = False
    try:
        while proc.poll() is None:
            try:  # remember every rank: they run in sessions of their own
                family.update({p.pid: p for p in agent.children(recursive=True)})
            except psutil.NoSuchProcess:
                pass
            if deadline and time.monotonic() > deadline[0]:
                console.print(f"osft-train: no checkpoint within --checkpoint-grace-seconds "
                              f"{cfg.checkpoint_grace_seconds}; killing the worker group",
                              markup=False, highlight=False, soft_wrap=True)
                _kill_tree([agent, *family.values()])
                killed = True
                break
            time.sleep(POLL_S)
        code = proc.wait()
    finally:
        restore_handlers(previous)
        if proc.poll() is None:  # the launcher itself failed: never leave the worker group behind
            _kill_tree([agent, *family.values()])
        _kill_tree([p for p in family.values() if p.is_running()])
        trigger.remove()
    if stopped_by:
        return stopped_by_signal(stopped_by[0])
    finished = finished_record(run_dir, cfg.node_rank, job_id)
    stopped = finished.get("exit_code") == EXIT_STOPPED
    if finished.get("reason") == FinishReason.DIVERGED and not killed:
        return EXIT_FAILED  # the run ended itself after a divergence, with a checkpoint: the caller says so
    # A scheduler that signals every process of the job (SLURM's scancel and time limit send SIGTERM)
    # also stops torchrun's agent, which then fails even though the ranks saved and stopped.
    if killed or (code != 0 and not (deadline and stopped)):
        cause = (f"No complete checkpoint within --checkpoint-grace-seconds {cfg.checkpoint_grace_seconds} after "
                 "the stop request: the launcher killed the worker group." if killed else None)
        console.print(failure_paragraph(run_dir, job_id, code, read_failures(failures), argv, cause),
                      markup=False, highlight=False, soft_wrap=True)
        return EXIT_FAILED
    return EXIT_STOPPED if stopped else EXIT_COMPLETED
