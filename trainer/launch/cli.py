"""``osft-train``: the command line.

``osft-train [flags]`` trains; ``osft-train fetch-demo [--dir DIR]`` prepares the demo model and
data; ``osft-train demo [flags]`` prepares them and trains on them with demo-sized defaults;
``osft-train plot RUN_DIR [--out PNG]`` draws a run's metrics (:mod:`osft.trainer.observe.plot`);
``osft-train make-retention-set [flags]`` writes a model's greedy replies as chat jsonl (:mod:`osft.trainer.tools.retention_set`);
``osft-train protect-base [flags]`` copies a base model directory with protected subspaces of its
input directions on general data, for chained runs (:mod:`osft.trainer.tools.protect_base`);
``osft-train slurm-script [flags]`` and ``osft-train k8s-manifest [flags]`` print a multi-node job
for SLURM (:mod:`osft.trainer.cluster.slurm`) or Kubernetes (:mod:`osft.trainer.cluster.kubernetes`); ``osft-train estimate-memory MODEL
[flags]`` prints the peak memory per rank of a run (:mod:`osft.trainer.tools.memory_plan`).

``--config FILE`` reads flag values from a YAML file (:mod:`.config_file`); ``--print-config``
prints the resolved config as such a file and exits with code 0.

Exit codes: the table in :mod:`.exit_codes` (a run ended by the forgetting budget or early
stopping completed: 0, with the reason printed and in ``run_finished``; a divergence failed: 1).
Bad input is reported on one line (data problems: one line per problem) before any training
starts; a failed worker group with one paragraph (:mod:`osft.trainer.launch.failure_report`). Every checkpoint
signal is held from the first line of :func:`main` (:func:`.checkpoint.signals.hold_signals`), so
a request during start-up is served at the first safe point (the rule: :mod:`.checkpoint.requests`).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import NamedTuple, NoReturn

from rich.console import Console
from rich.markup import escape

from ..checkpoint.signals import hold_signals, release_held_signals
from ..config import build_parser, check_config, config_from_args
from ..config_file import ConfigFileError, config_to_yaml, parse_with_config_file
from ..contract import EXIT_BAD_INPUT, EXIT_COMPLETED, EXIT_FAILED, EXIT_SIGNAL_BASE, EXIT_STOPPED, JOB_ID_ENV, FinishReason, RunState
from .failure_report import best_effort

#: Subcommands that do not train: signals keep their default handling there.
NOT_TRAINING = ("fetch-demo", "plot", "make-retention-set", "protect-base", "slurm-script", "k8s-manifest",
                "estimate-memory")

#: Demo run: SmolLM2-135M-Instruct on chit-chat, sized for a few minutes on two CPU cores.
DEMO_DEFAULTS = dict(
    output_dir="runs/demo",
    max_steps=30,
    batch_size=4,
    max_seq_len=256,
    max_tokens_per_gpu=1024,
    learning_rate=5e-5,
    lr_scheduler="cosine",
    eval_every_steps=15,
    eval_max_samples=16,
)
#: The demo's retention set: the base model's greedy replies to this many of the user turns of
#: :data:`DEMO_RETENTION_ROWS` rows of the chit-chat evaluation file (``make-retention-set
#: --from-chat eval.jsonl --held-out 16``, prompts spread evenly), written once into the run directory;
#: fewer when ``--eval-max-samples`` evaluates fewer (the same prompts an evaluation of the 16 would read).
DEMO_RETENTION_ROWS = 16
DEMO_RETENTION_PROMPTS = 16
DEMO_RETENTION_NEW_TOKENS = 48


def _fetch_demo(argv: list[str], console: Console):
    from ..tools.demo_assets import fetch_demo

    parser = argparse.ArgumentParser(prog="osft-train fetch-demo", description="Prepare the offline demo model and data.")
    parser.add_argument("--dir", type=Path, default=None, help="target directory (default: user cache dir, or $OSFT_DEMO_DIR)")
    args = parser.parse_args(argv)
    return fetch_demo(args.dir, console)


class InputError(Exception):
    """Bad flags, data or model path, found before training starts (exit code 2)."""


def _plot(argv: list[str], console: Console) -> None:
    """``osft-train plot RUN_DIR [--out PNG]``.

    Raises:
        InputError: no metrics to plot in RUN_DIR, or matplotlib is missing.
    """
    from ..observe.plot import PlotError, plot_run

    parser = argparse.ArgumentParser(prog="osft-train plot", description="Plot a run's metrics (loss, learning rate, "
                                     "tokens/s per node, orthogonality; checkpoints and resumes marked) into a PNG.")
    parser.add_argument("run_dir", metavar="RUN_DIR", type=Path, help="the run directory (--output-dir of the run)")
    parser.add_argument("--out", metavar="PNG", type=Path, default=None, help="PNG to write (default: RUN_DIR/plot.png)")
    args = parser.parse_args(argv)
    try:
        out, data = plot_run(args.run_dir, args.out)
    except PlotError as exc:
        raise InputError(str(exc)) from exc
    for problem in data.problems:
        console.print(f"warning: {problem}", markup=False, highlight=False, soft_wrap=True)
    console.print(f"plot: {out}", markup=False, highlight=False, soft_wrap=True)


DEMO_PROMPT = "Hi! What do you like to do on the weekend?"


def _demo_retention_set(path: Path, assets, console: Console, evaluated: int | None) -> None:
    """Make the demo's retention set at ``path`` unless it exists (see :data:`DEMO_RETENTION_ROWS`):
    replies to :data:`DEMO_RETENTION_PROMPTS` prompts, or to the ``evaluated`` of them
    (``--eval-max-samples``) when that is fewer."""
    from ..run.eval_sets import spread_indices
    from ..tools.retention_set import chat_prompts, make_retention_set

    if path.is_file():
        return
    prompts, _lines = chat_prompts(assets.eval_path, DEMO_RETENTION_ROWS)
    prompts = [prompts[i] for i in spread_indices(len(prompts), DEMO_RETENTION_PROMPTS)]
    prompts = [prompts[i] for i in spread_indices(len(prompts), evaluated or len(prompts))]
    # one generate call for all prompts: 6.6 s instead of 9.5 s in batches of 8 on 2 cores, the same replies
    made = make_retention_set(assets.model_dir, path, prompts, max_new_tokens=DEMO_RETENTION_NEW_TOKENS,
                              batch_size=len(prompts))
    console.print(f"retention set: the base model's replies to {made.rows} prompts of {assets.eval_path} -> {path}",
                  markup=False, highlight=False, soft_wrap=True)


def _demo_reply(export_dir: str, console: Console) -> None:
    """Reload the demo's HF export as a user would and print its answer to :data:`DEMO_PROMPT`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(export_dir)
    model = AutoModelForCausalLM.from_pretrained(export_dir)
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": DEMO_PROMPT}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    out = model.generate(**inputs, max_new_tokens=40, do_sample=False)
    reply = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()
    console.print(f"[bold]user:[/bold] {escape(DEMO_PROMPT)}\n[bold]fine-tuned model:[/bold] {escape(reply)}")


class TrainingEnd(NamedTuple):
    """How :func:`run_training` ended: the exit code (:mod:`.exit_codes`), the final export (None
    unless completed) and the job id (its records in the metrics carry it)."""

    exit_code: int
    export_dir: str | None
    job_id: str


def run_training(cfg, console: Console, argv: list[str], command: list[str]) -> TrainingEnd:
    """Check ``cfg`` (:func:`.config.check_config`), then train in this process (one rank) or
    through a torchrun worker group: what ``osft-train`` does once its flags are parsed, and what
    the Python API (:mod:`osft.trainer.launch.api`) calls.

    Args:
        cfg: the resolved config.
        console: where progress and the end of the run are printed.
        argv: ``osft-train`` flags that make this run, for the resume command of a failure report.
        command: the command line recorded as ``argv`` in ``run.json``, program first (the
            dashboard relaunches its arguments).

    Returns:
        the exit code with the run's export: 0 and the export (the final one, or ``hf_format/best``
        after the forgetting budget ended the run, None when no evaluation was within budget), or
        :data:`EXIT_STOPPED`, :data:`EXIT_FAILED` (the launcher printed what happened, or a
        divergence) or 128 + N and None.

    Raises:
        InputError: bad flags together (:func:`.config.check_config`), bad data, model path or
            sample count (before any training), or an output directory that another job owns or
            an earlier run left without --resume or --overwrite-output-dir (before anything is
            written).
    """
    from .ownership import Heartbeat, OutputDirInUse, check_output_dir, clear_previous_run, process_identity
    from ..rundir import RunDir, write_text_atomic
    from .startup import resume_requested

    try:
        check_config(cfg)
    except ValueError as exc:
        raise InputError(str(exc)) from exc
    run_dir = RunDir(cfg.output_dir, cfg.node_rank)
    resuming = resume_requested(cfg)
    job_id = os.environ.get(JOB_ID_ENV) or _job_id(cfg)
    try:  # before anything is written: another job's directory stays as it is
        previous = check_output_dir(run_dir, resuming, cfg.overwrite_output_dir, job_id)
    except OutputDirInUse as exc:
        raise InputError(str(exc)) from exc
    if previous and cfg.overwrite_output_dir and not resuming and cfg.node_rank == 0:
        console.print(f"overwrite: removing the checkpoints, exports and metrics of {previous.describe()} "
                      f"in {run_dir.root}", markup=False, highlight=False, soft_wrap=True)
        clear_previous_run(run_dir)
    if cfg.node_rank == 0 and (problem := _prepare_checkpoint_root(cfg, run_dir.checkpoints, console)):
        console.print(f"osft-train: {problem}", markup=False, highlight=False, soft_wrap=True)
        return TrainingEnd(EXIT_FAILED, None, job_id)
    run_dir.create()
    if cfg.node_rank == 0:
        write_text_atomic(run_dir.config_yaml, config_to_yaml(cfg))
    run_dir.update_run_json(
        argv=command, config=cfg.to_json(), job_id=job_id, launcher_pid=os.getpid(), hostname=socket.gethostname(), torchrun_pids=[],
        nnodes=cfg.nnodes, nproc_per_node=cfg.nproc_per_node, start_time=time.time(), state=RunState.STARTING, exit_code=None,
        **process_identity(),
    )
    with Heartbeat(run_dir, job_id):
        return TrainingEnd(*_run(cfg, console, run_dir, job_id, argv), job_id)


def _run(cfg, console: Console, run_dir, job_id: str, argv: list[str]) -> tuple[int, str | None]:
    """:func:`run_training` once the run directory is this job's: prepare, train, record the end in ``run.json``."""
    from ..data.validate import DataValidationError
    from .launcher import finished_record, launch, preflight

    in_process = cfg.nproc_per_node == 1 and cfg.nnodes == 1
    trainer, ready = None, False
    try:
        if in_process:
            from ..run.loop import Trainer  # the launcher of a worker group never loads the training stack

            trainer = Trainer(cfg, console, job_id)
            ready = trainer.prepare()  # False: stopped during the start-up SVDs, nothing trained
        else:
            cfg = preflight(cfg, console)
    except (DataValidationError, ValueError, FileNotFoundError) as exc:
        run_dir.update_run_json(state=RunState.FAILED, exit_code=EXIT_BAD_INPUT)
        raise InputError(str(exc)) from exc
    except Exception as exc:
        if not in_process:
            raise
        return _failed_in_process(trainer, cfg, console, run_dir, job_id, argv, exc), None
    try:
        if in_process:
            if ready:
                run_dir.update_run_json(state=RunState.RUNNING)
            result = trainer.run()
            code, reason, export_dir, checkpoint = result.exit_code, result.reason, result.export_dir, result.checkpoint
            summary = result.summary()
        else:
            code = launch(cfg, console, job_id, argv)
            if code > EXIT_SIGNAL_BASE:
                run_dir.update_run_json(state=RunState.STOPPED, exit_code=code)
                console.print(f"stopped by {signal.Signals(code - EXIT_SIGNAL_BASE).name} without a checkpoint "
                              "(--on-demand-checkpointing is off)", markup=False, highlight=False)
                return code, None
            finished = finished_record(run_dir, cfg.node_rank, job_id)
            reason, export_dir = finished.get("reason") or FinishReason.COMPLETED, finished.get("export_dir")
            checkpoint = finished.get("checkpoint")
            if code == EXIT_FAILED and reason != FinishReason.DIVERGED:  # the launcher printed what happened
                best_effort(lambda: run_dir.update_run_json(state=RunState.FAILED, exit_code=EXIT_FAILED))
                return code, None
            summary = f"{cfg.nproc_per_node * cfg.nnodes} ranks"
    except Exception as exc:
        if not in_process:
            best_effort(lambda: run_dir.update_run_json(state=RunState.FAILED, exit_code=EXIT_FAILED))
            raise
        return _failed_in_process(trainer, cfg, console, run_dir, job_id, argv, exc), None
    except BaseException:
        best_effort(lambda: run_dir.update_run_json(state=RunState.FAILED, exit_code=EXIT_FAILED))
        raise
    if code == EXIT_STOPPED:
        run_dir.update_run_json(state=RunState.STOPPED, exit_code=EXIT_STOPPED)
        if checkpoint is None:  # a stop during the start-up SVDs (CheckpointManager.answer_start_up)
            console.print(f"[yellow]stopped[/yellow] during start-up before step 0 (exit code {EXIT_STOPPED}): "
                          "nothing trained, no checkpoint; run again to start", soft_wrap=True)
        else:
            console.print(f"[yellow]stopped[/yellow] after a complete full-state checkpoint (exit code {EXIT_STOPPED}); "
                          "continue with --resume", soft_wrap=True)
        return code, None
    if reason == FinishReason.DIVERGED:
        run_dir.update_run_json(state=RunState.FAILED, exit_code=code, reason=reason)
        console.print(f"[bold red]diverged[/bold red]: training stopped with a checkpoint of the last good step "
                      f"(exit code {code}); see the divergence record in {run_dir.metrics}", soft_wrap=True)
        return code, None
    run_dir.update_run_json(state=RunState.COMPLETED, exit_code=EXIT_COMPLETED, export_dir=export_dir, reason=reason)
    ended = "" if reason == FinishReason.COMPLETED else f" ({reason.replace('_', ' ')})"
    console.print(f"[green]done[/green]{ended}: {escape(summary)}, export {escape(str(export_dir))}", soft_wrap=True)
    return code, export_dir


def _prepare_checkpoint_root(cfg, root: Path, console: Console) -> str | None:
    """Node 0, before anything of the new job is written: remove the partial checkpoints a dead
    job left (:func:`.checkpoint.store.remove_orphans`, one line saying what and how many bytes),
    then check there is room for the next checkpoint (:func:`.checkpoint.store.room_problem`).
    Returns why the run cannot start, or None."""
    from ..checkpoint.store import megabytes, remove_orphans, room_problem

    removed = remove_orphans(root)
    if removed:
        console.print(f"checkpoints: removed {len(removed)} partial checkpoint(s) left by a job that is no longer "
                      f"running ({megabytes(sum(b for _, b in removed))}): "
                      + ", ".join(f"{name} ({megabytes(size)})" for name, size in removed),
                      markup=False, highlight=False, soft_wrap=True)
    return room_problem(root) if cfg.checkpointing else None


def _write_tool(argv: list[str], console: Console) -> int:
    """``make-retention-set`` or ``protect-base`` (:mod:`osft.trainer.tools.retention_set`,
    :mod:`osft.trainer.tools.protect_base`): exit 0 when it wrote its output, 128 + N when signal N
    stopped it (:class:`osft.trainer.tools.stops.ToolStopped`, nothing kept).

    Raises:
        InputError: the tool's own input error (its message names the file or flag).
    """
    from ..tools.stops import ToolStopped

    if argv[0] == "make-retention-set":
        from ..tools.retention_set import RetentionSetError as ToolError
        from ..tools.retention_set import main as tool
    else:
        from ..tools.protect_base import ProtectBaseError as ToolError
        from ..tools.protect_base import main as tool
    try:
        tool(argv[1:], console)
    except ToolError as exc:
        raise InputError(str(exc)) from exc
    except ToolStopped as stop:
        console.print(f"{argv[0]}: {stop}", markup=False, highlight=False, soft_wrap=True)
        return EXIT_SIGNAL_BASE + stop.signum
    return EXIT_COMPLETED


def _failed_in_process(trainer, cfg, console: Console, run_dir, job_id: str, argv: list[str], exc: Exception) -> int:
    """A one-rank run failed in this process: as a worker group's failure is reported (the error's
    own line first when it has one, :func:`osft.trainer.launch.failure_report.headline`, then the failure paragraph; no
    traceback), with an ``error`` record (traceback included) and ``run.json`` failed. Every write
    here is best effort (:func:`osft.trainer.launch.failure_report.best_effort`): a full disk never makes the report
    fail. The trainer's signal handlers and trigger directory are released. Returns exit code 1."""
    from .failure_report import failure_paragraph, headline, in_process_failure, record_error

    record_error(trainer.metrics if trainer is not None else None, run_dir.metrics, job_id, exc, EXIT_FAILED)
    best_effort(lambda: run_dir.update_run_json(state=RunState.FAILED, exit_code=EXIT_FAILED))
    if trainer is not None:
        best_effort(trainer.release)
    console.print(failure_paragraph(run_dir, job_id, EXIT_FAILED, in_process_failure(exc, EXIT_FAILED), argv,
                                    in_process=True, first_line=headline(exc)), markup=False, highlight=False,
                  soft_wrap=True)
    return EXIT_FAILED


def _job_id(cfg) -> str:
    """A fresh id for a one-node job; for several nodes one that every node derives alike (from
    the output directory and the rendezvous endpoint), since it is also torchrun's rendezvous id."""
    if cfg.nnodes == 1:
        return uuid.uuid4().hex[:12]
    key = f"{Path(cfg.output_dir).resolve()}|{cfg.rdzv_endpoint}"
    return hashlib.sha1(key.encode()).hexdigest()[:12]


def run() -> NoReturn:
    """The ``osft-train`` command (and ``python -m osft.trainer.launch.cli``): :func:`main` on
    ``sys.argv``, then exit with its code (:func:`osft.trainer.launch.quick_exit.exit_without_final_gc`). A crash in
    native code (SIGSEGV, SIGABRT) first writes every thread's Python stack to stderr, as a worker
    rank does: a one-rank run trains in this process (its background checkpoint writer included)."""
    import faulthandler

    from .quick_exit import exit_without_final_gc

    faulthandler.enable(all_threads=True)
    exit_without_final_gc(main())


def main(argv: list[str] | None = None) -> int:
    """What ``osft-train`` does with ``argv`` (default ``sys.argv[1:]``); returns the process exit
    code (:mod:`.exit_codes`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] not in ([name] for name in NOT_TRAINING):
        hold_signals()  # before anything slow is imported (test_stop_rule.py)
    try:
        return _main(argv)
    finally:
        release_held_signals(deliver=False)  # held signals that no run took over: the command has ended


def _main(argv: list[str]) -> int:
    console = Console(stderr=True)
    try:
        if argv[:1] == ["fetch-demo"]:
            _fetch_demo(argv[1:], console)
            return EXIT_COMPLETED
        if argv[:1] == ["plot"]:
            _plot(argv[1:], console)
            return EXIT_COMPLETED
        if argv[:1] == ["estimate-memory"]:
            from ..tools.memory_plan import main as estimate_memory

            estimate_memory(argv[1:], console)
            return EXIT_COMPLETED
        if argv[:1] in (["make-retention-set"], ["protect-base"]):
            return _write_tool(argv, console)
        if argv[:1] == ["slurm-script"]:
            from ..cluster.slurm import main as slurm_script

            return slurm_script(argv[1:])
        if argv[:1] == ["k8s-manifest"]:
            from ..cluster.kubernetes import main as k8s_manifest

            return k8s_manifest(argv[1:])
        demo = argv[:1] == ["demo"]
        if demo:
            parser = build_parser("osft-train demo", require_paths=False)
            demo_dir = None
            if "--dir" in argv:
                at = argv.index("--dir")
                demo_dir, argv = argv[at + 1], argv[:at] + argv[at + 2 :]
            parser.set_defaults(**DEMO_DEFAULTS)
            args = parse_with_config_file(parser, argv[1:])  # --help ends here, before anything is fetched
            assets = _fetch_demo(["--dir", demo_dir] if demo_dir else [], console)
            for name, path in (("model_name_or_path", assets.model_dir), ("data_path", assets.train_path),
                               ("eval_data_path", assets.eval_path)):
                if getattr(args, name) is None:  # not given on the command line or in a --config file
                    setattr(args, name, str(path))
            made_here = args.retention_data_path is None
            if made_here:
                args.retention_data_path = [str(Path(args.output_dir) / "retention.jsonl")]
        else:
            args = parse_with_config_file(build_parser(), argv)
        cfg = config_from_args(args)
        if not cfg.on_demand_checkpointing:
            release_held_signals()  # no request to serve: what arrived takes its default action now
        if args.print_config:
            sys.stdout.write(config_to_yaml(cfg))
            return EXIT_COMPLETED
        if demo and made_here:
            Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
            _demo_retention_set(Path(cfg.retention_data_path[0]), assets, console, cfg.eval_max_samples)
        end = run_training(cfg, console, argv, sys.argv)
        if demo and end.export_dir:
            _demo_reply(end.export_dir, console)
        return end.exit_code
    except (InputError, ConfigFileError) as exc:
        console.print("[bold red]osft-train: error:[/bold red]", escape(str(exc)), highlight=False, soft_wrap=True)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    run()
