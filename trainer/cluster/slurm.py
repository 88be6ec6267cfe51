"""``osft-train slurm-script``: a ready ``sbatch`` script for a multi-node run that checkpoints
before its time limit and requeues itself.

SLURM options the script uses (``#SBATCH`` lines):

- ``--nodes=N --ntasks-per-node=1``: one task per node, the node's ``osft-train`` launcher, which
  starts the node's ranks through torchrun.
- ``--gpus-per-node=G`` (left out for G = 0) and ``--cpus-per-task=C`` (when given).
- ``--time=T``: the time limit. At the limit SLURM sends SIGTERM to every process of the job and
  SIGKILL ``KillWait`` seconds later (slurm.conf, default 30 s): usually too short for a checkpoint.
- ``--signal=B:USR2@S``: S seconds before the time limit (SLURM may send it up to 60 s earlier)
  SIGUSR2 goes to the batch shell only (``B:``), not to the job steps. The shell passes it to its
  ``srun``, which forwards the signals it receives to its job step, where slurmstepd delivers them
  to every process of the step: every node's ``osft-train`` launcher and ranks record it (torchrun's
  agent runs with SIGUSR2 ignored), the ranks save one checkpoint and every node exits with code 75.
- ``--requeue``: the job may be requeued; the script then runs ``scontrol requeue $SLURM_JOB_ID``
  after exit code 75, the job waits in the queue again, and its script starts from the top,
  where ``--resume`` picks the newest complete checkpoint.
- ``--open-mode=append``: each (re)start appends to the same ``<output_dir>/logs/slurm-<job id>.out``.
- ``--chdir``: the directory the script was generated in, so relative paths mean the same.

Every cache (tokenized data, numba, Hugging Face, ``datasets``, Triton, TorchInductor, matplotlib)
goes to ``<output_dir>/cache/`` unless the submitting environment sets its variable
(:data:`osft.trainer.cluster.generator.CACHE_ENV`). Every value from the command line is shell-quoted in the script and
quoted for sbatch in the ``#SBATCH`` lines; a value with a control character is refused (exit 2).

Exit codes of the script: 0 training completed; 75 stopped after a complete checkpoint (requeued
unless the stop was a SIGTERM: ``scancel``, or a preemption that SLURM handles itself); any other
code is the failure of the training step.
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from .generator import (GRACE_MARGIN_S, TrainJob, cache_env, check_printable, cluster_parser, parse_train_flags,
                      positive_int)
from ..exit_codes import EXIT_STOPPED

#: SLURM's time formats: minutes, minutes:seconds, hours:minutes:seconds, days-hours,
#: days-hours:minutes, days-hours:minutes:seconds.
_TIME = re.compile(r"^(?:(\d+)-(\d+)(?::(\d+)(?::(\d+))?)?|(\d+)(?::(\d+)(?::(\d+))?)?)$")

#: Largest ``sig_time`` of ``--signal`` (seconds).
MAX_SIGNAL_S = 65535

#: Characters an ``#SBATCH`` argument may hold unquoted (sbatch gives none of them a meaning).
_SBATCH_PLAIN = re.compile(r"^[A-Za-z0-9_@%+=:,./-]+$")


def parse_time_limit(text: str) -> int:
    """Seconds of a SLURM ``--time`` value.

    Raises:
        ValueError: not one of SLURM's formats (``UNLIMITED`` included: the warning signal needs a
            time limit), or zero.
    """
    m = _TIME.match(text.strip())
    if not m:
        raise ValueError(f"--time {text!r}: expected minutes, minutes:seconds, hours:minutes:seconds, days-hours, "
                         "days-hours:minutes or days-hours:minutes:seconds")
    days, d_hours, d_min, d_sec, first, second, third = (int(g) if g else 0 for g in m.groups())
    if m.group(1) is not None:
        seconds = ((days * 24 + d_hours) * 60 + d_min) * 60 + d_sec
    elif m.group(7) is not None:  # hours:minutes:seconds
        seconds = (first * 60 + second) * 60 + third
    else:  # minutes[:seconds]
        seconds = first * 60 + second
    if seconds == 0:
        raise ValueError(f"--time {text!r}: the time limit must be longer than 0")
    return seconds


@dataclass(frozen=True)
class SlurmJob:
    """The scheduler side of a generated script (times in seconds except ``time``, SLURM's format)."""

    nodes: int
    gpus_per_node: int
    time: str
    signal_seconds: int
    job_name: str = "osft"
    partition: str | None = None
    account: str | None = None
    cpus_per_task: int | None = None
    rdzv_port: int | None = None


def _flag_lines(words: list[str], indent: str) -> str:
    """Shell words, one flag with its values per line."""
    lines: list[list[str]] = []
    for word in words:
        if not lines or (word.startswith("-") and not _is_number(word)):
            lines.append([])
        lines[-1].append(word)
    return "\n".join(indent + " ".join(line) for line in lines)


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


def sbatch_value(value: str) -> str:
    """``value`` as one argument of an ``#SBATCH`` line: as is when it holds only characters sbatch
    reads literally, else in double quotes with ``\\`` and ``"`` escaped by a backslash (sbatch splits
    a directive at whitespace, starts a comment at an unquoted ``#`` and removes quotes and
    backslashes, as a shell would; it expands nothing)."""
    if _SBATCH_PLAIN.match(value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render_sbatch(job: SlurmJob, train: TrainJob, workdir: Path, generated_by: list[str]) -> str:
    """The sbatch script of ``job`` running ``train`` on every node. Every value from the command
    line is shell-quoted in the script and quoted for sbatch in the ``#SBATCH`` lines.

    Args:
        workdir: the job's working directory (``#SBATCH --chdir``), for relative paths.
        generated_by: the command line that generated the script (written in a comment).

    Raises:
        ValueError: a value holds a control character (a line break would end a comment or an
            ``#SBATCH`` line), or the working directory holds ``%`` (sbatch reads ``--chdir`` as a
            file name pattern).
    """
    out = train.config.output_dir
    check_printable([*generated_by, str(workdir), out])
    if "%" in str(workdir):
        raise ValueError(f"the working directory {str(workdir)!r} contains '%', which #SBATCH --chdir reads as a "
                         "file name pattern: generate the script in another directory")
    nproc = train.config.nproc_per_node
    directives = [f"--job-name={sbatch_value(job.job_name)}", f"--nodes={job.nodes}", "--ntasks-per-node=1"]
    if job.gpus_per_node:
        directives.append(f"--gpus-per-node={job.gpus_per_node}")
    if job.cpus_per_task:
        directives.append(f"--cpus-per-task={job.cpus_per_task}")
    # In --output, % starts a file name pattern (%j: the job id) and %% is a literal %.
    log = out.replace("%", "%%") + "/logs/slurm-%j.out"
    directives += [f"--time={sbatch_value(job.time)}", f"--signal=B:USR2@{job.signal_seconds}", "--requeue", "--open-mode=append",
                   f"--output={sbatch_value(log)}", f"--chdir={sbatch_value(str(workdir))}"]
    if job.partition:
        directives.append(f"--partition={sbatch_value(job.partition)}")
    if job.account:
        directives.append(f"--account={sbatch_value(job.account)}")
    port = str(job.rdzv_port) if job.rdzv_port else "$((29500 + SLURM_JOB_ID % 1000))"
    # Shell words: the training command quoted; the per-node values are expanded by this shell, but
    # the node rank only inside each srun task (below).
    words = [*map(shlex.quote, [*train.launcher, *train.argv]),
             *train.node_flags('"$SLURM_NNODES"', '"$rdzv_host:$rdzv_port"')]
    head = "\n".join(f"#SBATCH {d}" for d in directives)
    cache_exports = "\n".join(f'export {name}="${{{name}:-{path}}}"' for name, path in cache_env("$out_dir").items())
    return f"""#!/bin/bash
# osft-train on {job.nodes} node(s) x {nproc} rank(s), stopped with a checkpoint {job.signal_seconds} s before
# the time limit and requeued until training completes. Generated by:
#   {shlex.join(generated_by)}
# Submit with: mkdir -p {shlex.quote(out + "/logs")} && sbatch THIS_FILE
{head}

set -u
out_dir={shlex.quote(out)}
# Every cache on the run volume (a value set where the job was submitted wins).
{cache_exports}
# The c10d rendezvous (torchrun's store) runs on the first node of the allocation.
rdzv_host=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
rdzv_port={port}
# A job id for each start of this SLURM job: the metrics tell the attempts apart, and a request
# left over from an earlier attempt never fires.
export OSFT_JOB_ID="slurm-$SLURM_JOB_ID-${{SLURM_RESTART_COUNT:-0}}"
echo "osft: job $SLURM_JOB_ID start ${{SLURM_RESTART_COUNT:-0}} on $SLURM_JOB_NODELIST," \\
    "rendezvous $rdzv_host:$rdzv_port"

train=(
{_flag_lines(words, "    ")}
)

# --signal=B:USR2@{job.signal_seconds} signals this shell only. bash runs a trap only between commands, so srun
# runs in the background and the shell waits for it with `wait`, which a trapped signal interrupts.
# The trap passes the signal on to srun, which forwards the signals it receives to its job step:
# slurmstepd delivers it to every process of the step on each node. Each node's osft-train launcher
# and ranks record it (the launcher starts torchrun with SIGUSR2 ignored), the ranks save one
# checkpoint together, and every node exits with code {EXIT_STOPPED}.
# SIGTERM (scancel, the time limit itself, a preemption) comes from SLURM to every process of the
# job, then SIGKILL KillWait seconds later (slurm.conf, default 30 s). The trap keeps this shell
# alive meanwhile (the job ends when the batch shell exits) and does not requeue: SLURM is ending
# the job, or requeues a preempted job itself. After a SIGUSR2, a SIGTERM is the time limit cutting
# a slow checkpoint short: the requeue is still tried.
stop=""
srun_pid=""
interrupted=""
forward() {{
    [ "$stop" = USR2 ] || stop=$1
    interrupted=1
    echo "osft: SIG$1 received: every node checkpoints and stops (exit code {EXIT_STOPPED})"
    if [ -n "$srun_pid" ]; then kill -s "$1" "$srun_pid" 2>/dev/null; fi
}}
trap 'forward USR2' USR2
trap 'forward TERM' TERM

# One task per node; $SLURM_NODEID is set by srun in each task, so the node rank is read there.
srun --nodes="$SLURM_NNODES" --ntasks-per-node=1 ${{SLURM_CPUS_PER_TASK:+--cpus-per-task="$SLURM_CPUS_PER_TASK"}} \\
    bash -c 'exec "$@" --node-rank "$SLURM_NODEID"' osft-node "${{train[@]}}" &
srun_pid=$!
if [ -n "$stop" ]; then kill -s "$stop" "$srun_pid"; fi
while :; do
    interrupted=""
    wait "$srun_pid"
    code=$?
    # A trapped signal ends `wait` early with 128 + its number while srun goes on: wait again.
    [ -n "$interrupted" ] && [ "$code" -gt 128 ] || break
done

case $code in
    0)
        echo "osft: training completed"
        exit 0 ;;
    {EXIT_STOPPED})
        if [ "$stop" = TERM ]; then
            echo "osft: stopped after a complete checkpoint (SIGTERM); not requeued: submit this script again to resume"
            exit {EXIT_STOPPED}
        fi
        echo "osft: stopped after a complete checkpoint; requeueing job $SLURM_JOB_ID, which resumes from it"
        scontrol requeue "$SLURM_JOB_ID" || echo "osft: scontrol requeue failed: submit this script again to resume" >&2
        exit {EXIT_STOPPED} ;;
    *)
        if [ -n "$stop" ]; then
            echo "osft: stopped by SIG$stop with exit code $code;" \
                "a new start resumes from the newest complete checkpoint" >&2
        else
            echo "osft: training failed with exit code $code; rank logs under $out_dir/logs" >&2
        fi
        exit "$code" ;;
esac
"""


def main(argv: list[str]) -> int:
    """``osft-train slurm-script [training flags] --nodes N --gpus-per-node G --time T ...``: print
    the sbatch script to stdout; returns 0.

    Raises:
        SystemExit: exit code 2 with argparse's usage and error line for a bad flag.
    """
    prog = "osft-train slurm-script"
    parser = cluster_parser(prog, "Print an sbatch script that runs osft-train on N nodes, checkpoints before the "
                                  "time limit (SIGUSR2 through --signal=B:USR2@S) and requeues itself until training "
                                  "completes.")
    parser.add_argument("--time", required=True,
                        help="time limit of each start: minutes, minutes:seconds, hours:minutes:seconds, days-hours, "
                             "days-hours:minutes or days-hours:minutes:seconds")
    parser.add_argument("--signal-seconds", type=positive_int, default=None,
                        help=f"seconds before the time limit at which the checkpoint is requested (default: "
                             f"--checkpoint-grace-seconds + {GRACE_MARGIN_S}; at most {MAX_SIGNAL_S})")
    parser.add_argument("--partition", default=None, help="SLURM partition")
    parser.add_argument("--account", default=None, help="SLURM account to charge")
    parser.add_argument("--cpus-per-task", type=positive_int, default=None,
                        help="CPUs of each node's task, shared by its ranks and their data loaders "
                             "(without it the cluster's default applies, often 1)")
    parser.add_argument("--rdzv-port", type=positive_int, default=None,
                        help="rendezvous port on the first node (default: 29500 + job id mod 1000)")
    args, train_argv = parser.parse_known_args(argv)
    try:
        limit = parse_time_limit(args.time)
    except ValueError as exc:
        parser.error(str(exc))
    train = parse_train_flags(prog, train_argv, args.gpus_per_node, args.launcher)
    grace = train.config.checkpoint_grace_seconds
    signal_s = args.signal_seconds or grace + GRACE_MARGIN_S
    if signal_s > MAX_SIGNAL_S:
        parser.error(f"--signal-seconds {signal_s} is more than SLURM's {MAX_SIGNAL_S}")
    if signal_s >= limit:
        parser.error(f"--signal-seconds {signal_s} is not shorter than --time {args.time} ({limit} s): "
                     "the checkpoint would be requested at once")
    if signal_s < grace:
        print(f"{prog}: warning: --signal-seconds {signal_s} is shorter than --checkpoint-grace-seconds {grace}: "
              "a checkpoint that takes longer is cut off by the time limit", file=sys.stderr)
    job = SlurmJob(args.nodes, args.gpus_per_node, args.time.strip(), signal_s, args.job_name, args.partition,
                   args.account, args.cpus_per_task, args.rdzv_port)
    try:
        script = render_sbatch(job, train, Path.cwd(), ["osft-train", "slurm-script", *argv])
    except ValueError as exc:
        parser.error(str(exc))
    sys.stdout.write(script)
    return 0
