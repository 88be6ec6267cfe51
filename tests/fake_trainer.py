"""A torch-free test double of the ``osft-train`` launcher and its ranks.

``python tests/fake_trainer.py --output-dir DIR [flags]`` behaves, as seen from the run
directory and from signals, like ``osft-train`` launching a torchrun worker group, but trains
nothing: every "step" is a sleep. Tests and benchmarks of the dashboard (``osft-tui``) use it to
get a live run within a fraction of a second, on any machine.

Contract followed (docs/architecture.md):

- section 3, run directory: ``run.json`` / ``run.node<N>.json`` written through
  :class:`osft.trainer.rundir.RunDir` with the fields of ``osft.trainer.launch.cli._train`` (state
  starting → running → checkpointing → stopped | failed | completed, exit code);
  ``metrics/node<N>.jsonl`` written by each node's local rank 0, ``metrics/rank<R>.jsonl`` for
  the other ranks' ``run_started``/``warning``/``error``; per-rank ``stdout.log``/``stderr.log``
  in torchrun's layout ``logs/node<N>/<run id>_<random>/attempt_0/<local rank>/``;
  ``full_state_checkpoints/step_<N>`` (written as ``step_<N>.tmp-<job>``, manifest last, then
  renamed); ``hf_format/step_<N>`` (a stub export) at the end.
- section 4, metrics records: every record has ``ts``, ``event``, ``node_rank``, ``rank``,
  ``local_rank``, ``world_size``, ``hostname``, ``job_id``; ``step``, ``run_started``,
  ``checkpoint_requested``, ``checkpoint_saved``, ``resumed``, ``warning``, ``error`` and
  ``run_finished`` carry the same fields, in the same order, as ``osft.trainer.run.loop`` writes.
- section 6, signals and control files: the launcher and (with ``--on-demand-checkpointing``)
  every rank install handlers for the seven checkpoint signals that only record the request in
  the job's :class:`~osft.trainer.checkpoint.signals.TriggerDir`; ``control/checkpoint`` and
  ``control/checkpoint-and-exit`` are read by global rank 0; exit code 75 after a stop with a
  complete checkpoint, 128 + N when stopped by signal N without on-demand checkpointing, 1 when a
  rank failed or the checkpoint grace period ran out, 2 for a checkpoint that cannot be resumed.

What differs from the real trainer, on purpose:

- No torchrun agent: the launcher starts the ranks itself (each in its own session, as torchrun
  does), so ``run.json`` has ``torchrun_pids: []``; find rank pids in the ``run_started`` records.
  Rank output is written to the log files only (not teed to the launcher's console). ``run.json``
  also has ``hostname``.
- Ranks cannot all_reduce. Global rank 0 decides alone, after every step, once every rank has
  finished that step (a file barrier): rank R > 0 writes ``control/.fake-rank<R>-<job>`` after
  each step (and touches it while it waits), rank 0 answers with ``control/.fake-step-<job>``
  (``{"step", "phase": "saving"|"done", "request", "saved", "stop"}``) and, when the run stops,
  also ``control/.fake-stop-<job>``. Files older than the reader's job start are ignored.
  Simulated nodes must share the output directory and, for signals sent to node N > 0's
  launcher to count, the host (they share the per-job trigger directory in /dev/shm).
- Every signal a launcher receives is appended to ``fake_signals.node<N>.log`` and every signal a
  rank receives to ``fake_signals.rank<R>.log``, one ``<signal name> <unix time>`` line each.

Fake-only flags: ``--fake-step-seconds`` (0.3), ``--fake-tokens-per-s`` (node throughput, 1000),
``--fake-slow-node N`` with ``--fake-slow-factor F`` (0.5), ``--fake-violations-at 3,5``,
``--fake-flood-lines-per-s L`` (numbered stderr lines per rank per second),
``--fake-crash-rank R --fake-crash-step S`` (that rank raises at step S and exits 3),
``--fake-save-seconds`` (0.2, time a checkpoint save takes). Unknown flags are ignored.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from pathlib import Path

from osft.trainer.checkpoint.manifest import (
    CheckpointError,
    describe_files,
    read_manifest,
    verify_files,
    write_manifest,
)
from osft.trainer.checkpoint.signals import (
    CONTROL_ACTIONS,
    Action,
    TriggerDir,
    action_for_signal,
    install_handlers,
    request_files,
    signal_name,
)
from osft.trainer.contract import (
    ALWAYS_RECORDED,
    EXIT_BAD_INPUT,
    EXIT_COMPLETED,
    EXIT_FAILED,
    EXIT_STOPPED,
    JOB_START_ENV,
)
from osft.trainer.rundir import STEP_DIR, RunDir, write_json_atomic

#: Exit code of the rank that ``--fake-crash-rank`` makes fail.
EXIT_CRASH = 3

#: Signals that stop the job at once when on-demand checkpointing is off (as the real launcher).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: Plain trainer state inside a checkpoint (the real file name).
TRAINER_STATE = "trainer_state.json"
STEPS_PER_EPOCH = 10
#: Launcher poll interval and rank wait tick, s.
LAUNCHER_POLL_S = 0.05
TICK_S = 0.01
HEARTBEAT_S = 0.2
#: Fake OSFT module names reported in violation warnings.
FAKE_MODULES = ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj")


def say(message: str) -> None:
    """One line on this process's stderr."""
    print(message, file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    """The real ``osft-train`` flags the fake understands, plus the ``--fake-*`` knobs."""
    p = argparse.ArgumentParser(prog="fake_trainer", allow_abbrev=False,
                                description="Torch-free stand-in for osft-train (a test double).")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--model-name-or-path")
    p.add_argument("--data-path")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--nproc-per-node", type=int, default=1)
    p.add_argument("--rdzv-endpoint")
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--learning-rate", type=float, default=2e-5)
    p.add_argument("--osft-unfreeze-rank-ratio", type=float, default=0.25)
    p.add_argument("--on-demand-checkpointing", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--resume-from-full-state-checkpoint", metavar="STEP_DIR")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--sigusr1-action", choices=["checkpoint", "checkpoint-and-exit"], default="checkpoint")
    p.add_argument("--checkpoint-grace-seconds", type=float, default=300)
    p.add_argument("--fake-step-seconds", type=float, default=0.3)
    p.add_argument("--fake-tokens-per-s", type=float, default=1000.0)
    p.add_argument("--fake-slow-node", type=int, default=None)
    p.add_argument("--fake-slow-factor", type=float, default=0.5)
    p.add_argument("--fake-violations-at", default="")
    p.add_argument("--fake-flood-lines-per-s", type=float, default=0.0)
    p.add_argument("--fake-crash-rank", type=int, default=None)
    p.add_argument("--fake-crash-step", type=int, default=None)
    p.add_argument("--fake-save-seconds", type=float, default=0.2)
    p.add_argument("--fake-gpus", action="store_true", help="step records list the node's GPUs, as on CUDA")
    # set by the launcher for the processes it starts
    p.add_argument("--fake-local-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--fake-resume-dir", default=None, help=argparse.SUPPRESS)
    return p


def config_dict(args: argparse.Namespace) -> dict:
    """The parsed flags, as ``run.json`` ``config`` and ``run_started`` ``config``."""
    return {k: v for k, v in vars(args).items() if k not in ("fake_local_rank", "fake_resume_dir")}


def job_id_for(args: argparse.Namespace) -> str:
    """``$OSFT_JOB_ID``, else as ``osft.trainer.launch.cli._job_id``: fresh for one node, derived from
    the output directory and rendezvous endpoint for several (so every node agrees)."""
    if os.environ.get("OSFT_JOB_ID"):
        return os.environ["OSFT_JOB_ID"]
    if args.nnodes == 1:
        return uuid.uuid4().hex[:12]
    key = f"{Path(args.output_dir).resolve()}|{args.rdzv_endpoint}"
    return hashlib.sha1(key.encode()).hexdigest()[:12]


def sync_file(output_dir: str | Path, kind: str, job_id: str) -> Path:
    """``control/.fake-<kind>-<job>``: the fake's replacement for the ranks' all_reduce."""
    return Path(output_dir) / "control" / f".fake-{kind}-{job_id}"


def read_fresh_json(path: Path, since: float) -> dict | None:
    """JSON content of ``path`` if it exists and was written at or after ``since`` (unix s)."""
    try:
        if path.stat().st_mtime < since:
            return None
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def append_signal_line(path: Path, signum: int) -> None:
    """``<signal name> <unix time>``, one line per received signal (safe in a signal handler)."""
    with open(path, "a") as f:
        f.write(f"{signal_name(signum)} {time.time():.6f}\n")


def verify_resumable(step_dir: Path, world_size: int) -> dict:
    """The trainer state of a complete checkpoint this job can resume from.

    Raises:
        CheckpointError: no valid manifest, a missing or changed file, no trainer state, or
            another world size; the message names the directory.
    """
    try:
        manifest = read_manifest(step_dir)
        verify_files(manifest)
        state = json.loads((step_dir / TRAINER_STATE).read_text())
        if not isinstance(state.get("step"), int):
            raise CheckpointError(f"{TRAINER_STATE} has no step")
    except (CheckpointError, OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot resume from {step_dir}: {exc}") from None
    if state.get("world_size") != world_size:
        raise CheckpointError(f"checkpoint {step_dir} was saved with {state.get('world_size')} ranks, now {world_size}: "
                              "a bit-identical resume needs the same world size")
    return state


def newest_complete(root: Path, world_size: int) -> Path | None:
    """The newest ``step_<N>`` under ``root`` that :func:`verify_resumable` accepts."""
    if not root.is_dir():
        return None
    found = sorted(((int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name))),
                   reverse=True)
    for _step, path in found:
        try:
            verify_resumable(path, world_size)
            return path
        except CheckpointError as exc:
            say(f"resume: {exc}")
    return None


# -- launcher ----------------------------------------------------------------------------------


class Launcher:
    """One node's launcher: ``run.json``, signal handling, the rank processes and their end."""

    def __init__(self, args: argparse.Namespace, argv: list[str]) -> None:
        self.args = args
        self.argv = argv
        self.node = args.node_rank
        self.world_size = args.nnodes * args.nproc_per_node
        self.run_dir = RunDir(args.output_dir, self.node)
        self.signal_log = Path(args.output_dir) / f"fake_signals.node{self.node}.log"
        self.procs: list[subprocess.Popen] = []
        self.finished = False
        self.deadline: float | None = None
        self.stopped_by: list[int] = []
        self.messages: list[str] = []  # printed by the main loop, never from a handler
        self.state_pending: str | None = None

    def on_signal(self, signum: int) -> None:
        """Record the request only (file appends; everything else happens in the main loop)."""
        append_signal_line(self.signal_log, signum)
        if self.finished:
            return
        args = self.args
        if not args.on_demand_checkpointing:
            if signum in STOP_SIGNALS:
                self.stopped_by.append(signum)
            else:
                self.messages.append(f"osft-train (fake): {signal_name(signum)} ignored: on-demand checkpointing is off")
            return
        self.trigger.record(signum)
        action = action_for_signal(signum, args.sigusr1_action)
        what = "checkpoint and exit" if action is Action.CHECKPOINT_AND_EXIT else "checkpoint, then continue"
        self.messages.append(f"osft-train (fake): {signal_name(signum)}: {what} requested")
        if action is Action.CHECKPOINT_AND_EXIT and self.deadline is None:
            self.deadline = time.monotonic() + args.checkpoint_grace_seconds
            self.state_pending = "checkpointing"

    def run(self) -> int:
        args = self.args
        if args.nnodes > 1 and not args.rdzv_endpoint:
            say("osft-train (fake): error: --nnodes > 1 needs --rdzv-endpoint HOST:PORT (the same on every node)")
            return EXIT_BAD_INPUT
        if not 0 <= args.node_rank < args.nnodes:
            say(f"osft-train (fake): error: --node-rank {args.node_rank} must be smaller than --nnodes {args.nnodes}")
            return EXIT_BAD_INPUT
        self.run_dir.create()
        self.job_id = job_id_for(args)
        self.run_dir.update_run_json(
            argv=sys.argv, config=config_dict(args), job_id=self.job_id, launcher_pid=os.getpid(),
            hostname=socket.gethostname(), torchrun_pids=[], nnodes=args.nnodes, nproc_per_node=args.nproc_per_node,
            start_time=time.time(), state="starting", exit_code=None,
        )
        try:
            resume_dir = self.resolve_resume()
        except CheckpointError as exc:
            self.run_dir.update_run_json(state="failed", exit_code=EXIT_BAD_INPUT)
            say(f"osft-train (fake): error: {exc}")
            return EXIT_BAD_INPUT
        self.trigger = TriggerDir(self.job_id)
        self.trigger.create()
        env = dict(os.environ, OSFT_JOB_ID=self.job_id, OSFT_LAUNCHER_PID=str(os.getpid()))
        env.setdefault(JOB_START_ENV, repr(time.time()))
        install_handlers(self.on_signal)  # before the ranks start: a request during start-up is kept
        try:
            self.spawn(env, resume_dir)
            self.run_dir.update_run_json(state="running")
            code = self.supervise()
        except BaseException:
            self.finished = True
            self.kill_all()
            self.run_dir.update_run_json(state="failed", exit_code=EXIT_FAILED)
            raise
        finally:
            self.trigger.remove()
        return self.finish(code)

    def resolve_resume(self) -> str:
        """The checkpoint the ranks resume from ("" for none), verified before any rank starts."""
        args = self.args
        if args.resume:
            found = newest_complete(RunDir(args.output_dir).checkpoints, self.world_size)
            if found is None:
                say(f"resume: no complete checkpoint under {RunDir(args.output_dir).checkpoints}; starting fresh")
            return str(found or "")
        if args.resume_from_full_state_checkpoint:
            verify_resumable(Path(args.resume_from_full_state_checkpoint), self.world_size)
            return args.resume_from_full_state_checkpoint
        return ""

    def spawn(self, env: dict, resume_dir: str) -> None:
        """Start this node's ranks in sessions of their own, output in torchrun's log layout."""
        args = self.args
        log_root = self.run_dir.root / "logs" / f"node{self.node}"
        log_root.mkdir(parents=True, exist_ok=True)
        attempt = Path(tempfile.mkdtemp(prefix=f"{self.job_id}_", dir=log_root)) / "attempt_0"
        script = os.path.abspath(__file__)
        for local in range(args.nproc_per_node):
            rank_dir = attempt / str(local)
            rank_dir.mkdir(parents=True)
            rank_env = dict(env, LOCAL_RANK=str(local), RANK=str(self.node * args.nproc_per_node + local),
                            GROUP_RANK=str(self.node), WORLD_SIZE=str(self.world_size),
                            LOCAL_WORLD_SIZE=str(args.nproc_per_node))
            cmd = [sys.executable, script, *self.argv, "--fake-local-rank", str(local), "--fake-resume-dir", resume_dir]
            with open(rank_dir / "stdout.log", "w") as out, open(rank_dir / "stderr.log", "w") as err:
                self.procs.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                                   env=rank_env, start_new_session=True))

    def supervise(self) -> str:
        """Wait for the ranks. Returns ``"done"`` (all exited 0), ``"signal"`` (stopped without a
        checkpoint), ``"failed"`` (a rank failed) or ``"timeout"`` (grace period ran out)."""
        sent_term = False
        while True:
            while self.messages:
                say(self.messages.pop(0))
            if self.state_pending:
                self.run_dir.update_run_json(state=self.state_pending)
                self.state_pending = None
            if self.stopped_by and not sent_term:
                for p in self.procs:
                    if p.poll() is None:
                        p.send_signal(signal.SIGTERM)
                sent_term = True
            codes = [p.poll() for p in self.procs]
            if all(c is not None for c in codes):
                self.finished = True
                if self.stopped_by:
                    return "signal"
                return "done" if all(c == 0 for c in codes) else "failed"
            if not self.stopped_by and any(c not in (None, 0) for c in codes):
                bad = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
                say(f"osft-train (fake): local rank {bad[0][0]} exited with code {bad[0][1]}; stopping the other ranks")
                self.finished = True
                self.kill_all()
                return "failed"
            if self.deadline is not None and time.monotonic() > self.deadline:
                say(f"osft-train (fake): no checkpoint within --checkpoint-grace-seconds "
                    f"{self.args.checkpoint_grace_seconds}; killing the ranks")
                self.finished = True
                self.kill_all()
                return "timeout"
            time.sleep(LAUNCHER_POLL_S)

    def kill_all(self) -> None:
        """SIGKILL every rank still running, and reap them all."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def finished_record(self) -> dict:
        """This job's last ``run_finished`` record in ``metrics/node<N>.jsonl`` ({} if none)."""
        path = self.run_dir.metrics / f"node{self.node}.jsonl"
        found: dict = {}
        if path.is_file():
            for line in path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(rec, dict) and rec.get("event") == "run_finished" and rec.get("job_id") == self.job_id:
                    found = rec
        return found

    def finish(self, outcome: str) -> int:
        """Write the final state to ``run.json`` and return the exit code (as ``cli._train``)."""
        if outcome == "signal":
            code = 128 + self.stopped_by[0]
            self.run_dir.update_run_json(state="stopped", exit_code=code)
            say(f"stopped by {signal_name(self.stopped_by[0])} without a checkpoint (--on-demand-checkpointing is off)")
            return code
        if outcome != "done":
            self.run_dir.update_run_json(state="failed", exit_code=EXIT_FAILED)
            say(f"osft-train (fake): the ranks failed; rank logs under {self.run_dir.root / 'logs'}")
            return EXIT_FAILED
        finished = self.finished_record()
        if finished.get("exit_code") == EXIT_STOPPED:
            self.run_dir.update_run_json(state="stopped", exit_code=EXIT_STOPPED)
            say(f"stopped after a complete full-state checkpoint (exit code {EXIT_STOPPED}); continue with --resume")
            return EXIT_STOPPED
        export = finished.get("export_dir")
        self.run_dir.update_run_json(state="completed", exit_code=EXIT_COMPLETED, export_dir=export)
        say(f"done: {self.world_size} ranks, export {export}")
        return EXIT_COMPLETED


# -- ranks -------------------------------------------------------------------------------------


class Metrics:
    """Appends records as ``osft.trainer.observe.metrics.MetricsLogger`` does (same file choice and gate)."""

    def __init__(self, output_dir: Path, node: int, rank: int, local: int, world: int, job_id: str) -> None:
        self.base = dict(node_rank=node, rank=rank, local_rank=local, world_size=world,
                         hostname=socket.gethostname(), job_id=job_id)
        self.local_main = local == 0
        metrics = output_dir / "metrics"
        metrics.mkdir(parents=True, exist_ok=True)
        self.path = metrics / (f"node{node}.jsonl" if self.local_main else f"rank{rank}.jsonl")
        self.file = None

    def log(self, event: str, **fields) -> None:
        if not self.local_main and event not in ALWAYS_RECORDED:
            return
        record = {"ts": time.time(), "event": event, **self.base}
        record.update({k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in fields.items()})
        if self.file is None:
            self.file = open(self.path, "a", encoding="utf-8")
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()


def rss_bytes() -> int:
    """Resident set size of this process."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Rank:
    """One fake rank: sleeps through its steps, writes records, serves checkpoint requests."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = Path(args.output_dir)
        self.local = args.fake_local_rank
        self.node = args.node_rank
        self.rank = self.node * args.nproc_per_node + self.local
        self.world = args.nnodes * args.nproc_per_node
        self.job_id = os.environ["OSFT_JOB_ID"]
        self.launcher_pid = int(os.environ["OSFT_LAUNCHER_PID"])
        self.job_start = float(os.environ.get(JOB_START_ENV) or time.time())
        self.trigger = TriggerDir(self.job_id)
        self.signal_log = self.out / f"fake_signals.rank{self.rank}.log"
        self.violations_at = {int(s) for s in args.fake_violations_at.split(",") if s.strip()}
        self.progress = sync_file(self.out, f"rank{self.rank}", self.job_id)
        self.marker = sync_file(self.out, "step", self.job_id)
        self.stop_file = sync_file(self.out, "stop", self.job_id)
        self.step = 0
        self.flood_t0 = time.monotonic()
        self.flood_n = 0
        self.last_beat = 0.0
        self.reported = False

    def on_signal(self, signum: int) -> None:
        append_signal_line(self.signal_log, signum)
        self.trigger.record(signum)

    # waiting (every wait floods, watches the launcher and keeps the heartbeat) -----------------
    def tick(self) -> None:
        if os.getppid() != self.launcher_pid:
            say(f"rank {self.rank}: the launcher (pid {self.launcher_pid}) is gone; exiting")
            sys.exit(EXIT_FAILED)
        rate = self.args.fake_flood_lines_per_s
        if rate > 0:
            now = time.monotonic()
            due = int((now - self.flood_t0) * rate)
            if due > self.flood_n:
                sys.stderr.write("".join(f"rank {self.rank} flood line {n} step {self.step} t={time.time():.3f}\n"
                                         for n in range(self.flood_n + 1, due + 1)))
                sys.stderr.flush()
                self.flood_n = due
        if self.reported and time.monotonic() - self.last_beat > HEARTBEAT_S:
            self.report()  # rewritten, not touched: rank 0 may have removed it as stale

    def report(self) -> None:
        """Rank R > 0: write ``control/.fake-rank<R>-<job>`` (the last step this rank finished)."""
        write_json_atomic(self.progress, {"step": self.step, "pid": os.getpid()})
        self.last_beat = time.monotonic()
        self.reported = True

    def sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while True:
            self.tick()
            left = end - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(TICK_S, left))

    def wait_for(self, ready) -> object:
        while not (result := ready()):
            self.tick()
            time.sleep(TICK_S)
        return result

    # the run ----------------------------------------------------------------------------------
    def main(self) -> int:
        args = self.args
        if args.on_demand_checkpointing:  # as early as possible: a request during start-up is kept
            self.trigger.create()
            install_handlers(self.on_signal)
        sys.stdout.reconfigure(line_buffering=True)
        sys.stderr.reconfigure(line_buffering=True)
        self.metrics = Metrics(self.out, self.node, self.rank, self.local, self.world, self.job_id)
        self.metrics.log("run_started", pid=os.getpid(), config=config_dict(args))
        print(f"rank {self.rank} (node {self.node}, local rank {self.local}) started, pid {os.getpid()}")
        try:
            code = self.train()
        except BaseException as exc:
            if not isinstance(exc, SystemExit):
                self.metrics.log("error", message=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
            raise
        self.progress.unlink(missing_ok=True)  # rank 0 needs it no more
        return code

    def train(self) -> int:
        args = self.args
        self.counters = {"ortho_violations_total": 0, "samples_seen": 0, "tokens_seen": 0}
        if self.rank == 0:
            self.remove_stale()
        if args.fake_resume_dir:
            state = json.loads((Path(args.fake_resume_dir) / TRAINER_STATE).read_text())
            self.step = state["step"]
            self.counters.update(state.get("counters", {}))
            self.metrics.log("resumed", from_step=self.step, path=str(args.fake_resume_dir))
            print(f"resumed from {args.fake_resume_dir} at step {self.step}")
        while self.step < args.max_steps:
            start = time.perf_counter()
            self.sleep(args.fake_step_seconds)
            self.step += 1
            if self.rank == args.fake_crash_rank and self.step == args.fake_crash_step:
                self.crash()
            record = self.step_numbers(time.perf_counter() - start)
            if record["ortho_violations"]:
                self.metrics.log("warning", message=f"step {self.step}: orthogonality violations in {list(FAKE_MODULES)}")
            self.counters["ortho_violations_total"] += record["ortho_violations"]
            self.counters["samples_seen"] += record["num_samples"]
            self.counters["tokens_seen"] += record["num_tokens"]
            gpus = self.gpus() if args.fake_gpus else None
            self.metrics.log("step", step=self.step, epoch=(self.step - 1) // STEPS_PER_EPOCH,
                             ortho_violations_total=self.counters["ortho_violations_total"], rss_bytes=rss_bytes(),
                             gpu_mem_bytes=gpus[self.local]["mem_bytes"] if gpus else None, gpus=gpus, **record)
            print(f"step {self.step} rank {self.rank} loss {record['loss']:.4f} "
                  f"tokens/s {record['tokens_per_s']:.0f} violations {self.counters['ortho_violations_total']}")
            decision = self.sync_rank0() if self.rank == 0 else self.sync_other()
            if decision.get("stop"):
                self.metrics.log("run_finished", reason="stopped", exit_code=EXIT_STOPPED, step=self.step,
                                 signal=decision["request"]["signal"], checkpoint=decision["saved"]["path"])
                print(f"stopped after step {self.step} on {decision['request']['signal']}")
                return 0
        export = self.out / "hf_format" / f"step_{self.step}"
        if self.rank == 0:
            export.mkdir(parents=True, exist_ok=True)
            write_json_atomic(export / "config.json", {"fake": True, "step": self.step, "job_id": self.job_id})
        self.metrics.log("run_finished", reason="completed", exit_code=0, step=self.step, export_dir=str(export))
        print(f"completed {self.step} steps")
        return 0

    def crash(self) -> None:
        try:
            raise RuntimeError(f"fake crash of rank {self.rank} at step {self.step} (--fake-crash-rank/--fake-crash-step)")
        except RuntimeError as exc:
            self.metrics.log("error", message=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc(),
                             exit_code=EXIT_CRASH)
            sys.stderr.write(traceback.format_exc())
            sys.stderr.flush()
        os._exit(EXIT_CRASH)

    def gpus(self) -> list[dict]:
        """The ``gpus`` field of this node's step records (``--fake-gpus``): local rank L uses
        (L + 1) GB and is 40 + 10·L % busy."""
        first = self.node * self.args.nproc_per_node
        return [{"rank": first + local, "local_rank": local, "mem_bytes": (local + 1) * 10**9, "util_pct": 40.0 + 10 * local}
                for local in range(self.args.nproc_per_node)]

    def step_numbers(self, elapsed: float) -> dict:
        """The numbers of one ``step`` record, in the order ``osft.trainer.run.step.TrainStep`` returns them."""
        args, s = self.args, self.step

        def node_rate(n: int) -> float:
            return args.fake_tokens_per_s * (args.fake_slow_factor if n == args.fake_slow_node else 1.0)

        node_tokens = [int(node_rate(n) * args.fake_step_seconds) for n in range(args.nnodes)]
        num_tokens = sum(node_tokens)
        elapsed = max(elapsed, 1e-6)
        violations = 2 if s in self.violations_at else 0
        return dict(
            loss=0.5 + 2.0 * math.exp(-s / 15) + 0.02 * math.sin(1.7 * s),
            grad_norm=1.5 / (1 + 0.1 * s) + 0.05 * math.cos(s),
            lr=args.learning_rate,
            num_tokens=num_tokens,
            num_loss_tokens=int(num_tokens * 0.6),
            num_samples=args.batch_size,
            step_time_s=elapsed,
            tokens_per_s=num_tokens / elapsed,
            node_tokens_per_s=node_tokens[self.node] / elapsed,
            samples_per_s=args.batch_size / elapsed,
            # a made-up model of 1e8 matmul parameters on ranks of 1e11 FLOP/s each
            model_flops=6e8 * num_tokens,
            flops_per_s=6e8 * num_tokens / elapsed,
            mfu=6e8 * num_tokens / elapsed / (1e11 * args.nnodes * args.nproc_per_node),
            node_mfu=6e8 * node_tokens[self.node] / elapsed / (1e11 * args.nproc_per_node),
            ortho_violations=violations,
            ortho_max_dev_deg=1.5 if violations else 0.01 + 0.001 * (s % 7),
        )

    # requests and the barrier -----------------------------------------------------------------
    def control_files(self) -> list[tuple[Path, Action, float]]:
        return [(path, CONTROL_ACTIONS[name], mtime) for name, path, mtime in request_files(self.out / "control")
                if name in CONTROL_ACTIONS]

    def remove_stale(self) -> None:
        """Rank 0: drop requests and sync files older than this job (a killed earlier run's)."""
        stale = []
        if self.args.on_demand_checkpointing:
            stale = [f"trigger {name}" for name in self.trigger.remove_stale(self.job_start)]
            for path, _action, mtime in self.control_files():
                if mtime < self.job_start:
                    path.unlink(missing_ok=True)
                    stale.append(f"control file {path}")
        for message in stale:
            self.metrics.log("warning", message=f"stale checkpoint request removed ({message}): it is older than this job")
        for path in (self.out / "control").glob(f".fake-*-{self.job_id}"):
            try:
                if path.stat().st_mtime < self.job_start:
                    path.unlink()
            except FileNotFoundError:
                pass

    def pending_request(self) -> tuple[dict | None, list[tuple[Path, float]]]:
        """The strongest pending request (triggers and control files), as ``RequestPoller`` encodes
        it, and the ``(file, mtime)`` pairs it was read from (:meth:`served` removes those only)."""
        code, seen = 0, []
        for t in self.trigger.files():
            code = max(code, int(action_for_signal(t.signum, self.args.sigusr1_action)) * 256 + t.signum)
            seen.append((t.path, t.mtime))
        for path, action, mtime in self.control_files():
            code = max(code, int(action) * 256)
            seen.append((path, mtime))
        if code == 0:
            return None, seen
        return {"action": Action(code // 256).name, "signal": signal_name(code % 256), "point": "after_step"}, seen

    @staticmethod
    def served(seen: list[tuple[Path, float]]) -> None:
        """Remove the request files a checkpoint served, unless written again since they were read.
        A request that arrived while the checkpoint was written stays pending for the next step, as
        in the trainer: a stop pressed during a checkpoint must still stop."""
        for path, mtime in seen:
            try:
                if path.stat().st_mtime <= mtime:
                    path.unlink()
            except FileNotFoundError:
                pass

    def others_done(self) -> bool:
        for r in range(1, self.world):
            data = read_fresh_json(sync_file(self.out, f"rank{r}", self.job_id), self.job_start)
            if data is None or data.get("step", -1) < self.step:
                return False
        return True

    def sync_rank0(self) -> dict:
        """Wait until every rank finished this step, then decide (and serve) alone."""
        self.wait_for(self.others_done)
        request, seen = self.pending_request() if self.args.on_demand_checkpointing else (None, [])
        if request is None:
            decision = {"step": self.step, "phase": "done", "request": None, "saved": None, "stop": False}
            write_json_atomic(self.marker, decision)
            return decision
        write_json_atomic(self.marker, {"step": self.step, "phase": "saving", "request": request, "saved": None,
                                        "stop": False})
        self.metrics.log("checkpoint_requested", signal=request["signal"], step=self.step, point=request["point"])
        print(f"{request['signal']}: saving a full-state checkpoint of step {self.step}")
        saved = self.save()
        self.served(seen)
        self.metrics.log("checkpoint_saved", **saved)
        print(f"checkpoint: {saved['path']} ({saved['bytes']} bytes in {saved['seconds']:.2f} s)")
        stop = request["action"] == Action.CHECKPOINT_AND_EXIT.name
        decision = {"step": self.step, "phase": "done", "request": request, "saved": saved, "stop": stop}
        if stop:
            write_json_atomic(self.stop_file, decision)
        write_json_atomic(self.marker, decision)
        return decision

    def sync_other(self) -> dict:
        """Report this step done, then follow rank 0's decision for it."""
        self.report()
        logged = False

        def decided() -> dict | None:
            nonlocal logged
            stop = read_fresh_json(self.stop_file, self.job_start)
            marker = read_fresh_json(self.marker, self.job_start)
            if marker and marker["step"] >= self.step:
                if marker["request"] and not logged:
                    self.metrics.log("checkpoint_requested", signal=marker["request"]["signal"], step=marker["step"],
                                     point=marker["request"]["point"])
                    logged = True
                if marker["phase"] == "done":
                    return marker
            return stop

        decision = self.wait_for(decided)
        if decision["request"] and not logged:
            self.metrics.log("checkpoint_requested", signal=decision["request"]["signal"], step=decision["step"],
                             point=decision["request"]["point"])
        if decision["saved"]:
            self.metrics.log("checkpoint_saved", **decision["saved"])
        return decision

    def save(self) -> dict:
        """Write ``step_<N>.tmp-<job>`` (files, then the manifest) and rename it to ``step_<N>``."""
        start = time.perf_counter()
        root = RunDir(self.out).checkpoints
        final, tmp = root / f"step_{self.step}", root / f"step_{self.step}.tmp-{self.job_id}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        state = {"step": self.step, "epoch": self.step // STEPS_PER_EPOCH, "counters": dict(self.counters),
                 "world_size": self.world, "total_steps": self.args.max_steps, "fake": True}
        (tmp / "fake_model.bin").write_bytes(os.urandom(64 * 1024))
        (tmp / TRAINER_STATE).write_text(json.dumps(state, indent=1))
        self.sleep(self.args.fake_save_seconds)
        files = describe_files(tmp, ["fake_model.bin", TRAINER_STATE], 0)
        write_manifest(tmp, files, kind="full_state", step=self.step, world_size=self.world, job_id=self.job_id,
                       created=time.time(), frozen=None, versions={"fake_trainer": "1"})
        if final.exists():  # the same step saved again
            old = root / f"step_{self.step}.replaced-{self.job_id}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        return {"step": self.step, "path": str(final), "bytes": sum(f["size"] for f in files.values()),
                "seconds": time.perf_counter() - start, "frozen_bytes": 0}


def main(argv: list[str] | None = None) -> int:
    """Entry point: the launcher, or (with the hidden ``--fake-local-rank``) one rank."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args, _unknown = build_parser().parse_known_args(argv)
    if args.fake_local_rank is not None:
        return Rank(args).main()
    return Launcher(args, argv).run()


if __name__ == "__main__":
    sys.exit(main())
