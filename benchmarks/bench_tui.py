"""osft-tui under a flood: key-press-to-screen latency, dashboard CPU and memory,
and whether every record written is counted once while ranks write thousands of lines per second.

Writers: ``--ranks`` separate processes (this script with ``--writer``), each writing
``--lines-per-s`` lines per second for ``--seconds`` s, paced in ``--tick-ms`` batches:
``--metrics-fraction`` of them JSONL records in the trainer's schema, the rest stderr lines in
torchrun's log layout (``logs/node<N>/<run id>/attempt_0/<local rank>/stderr.log``). A node's local
rank 0 writes ``step`` records to ``metrics/node<N>.jsonl`` (2 orthogonality violations and their
``warning`` every 97th step); any other rank writes ``warning`` records to ``metrics/rank<R>.jsonl``
(besides ``run_started`` and ``error`` the only events the trainer lets it record). Each writer
counts what it wrote. ``--ranks-per-node`` lists the topologies, each run in a fresh process one
after the other: ``2`` (2 nodes of 2 ranks: step records and a warning flood, the event pane's
worst case) and ``1`` (4 nodes of 1 rank: step records only).

Dashboard: ``OsftTui(run_dir)`` in this process, headless (``App.run_test``, 140x42), its driver made
to render every frame into terminal bytes (then dropped) as a real terminal driver does. A thread
playing the terminal's input thread sends ``?`` (help opens) and ``escape`` (it closes) alternately
through the driver every ``--press-interval`` s ±20 % (random phase against the poll timer);
latency = from sending the key to the end of writing the first frame that shows the new screen
(``App._display``). A few presses before the writers start give the idle baseline. Goal (printed,
never asserted): p95 < 100 ms during the flood.

Measured: latency p50/p95/max; this process's CPU time over the flood window as % of one core, and
that of the dashboard's reader process (it parses the files; the writers are other processes); the CPU share other processes of the machine used meanwhile; peak
RSS (sampled, and ``ru_maxrss``); each poll's duration; the unread backlog; the time to catch up
once the writers stop. Then, when the dashboard has read every byte: per metrics file records read
== records written, per node ``steps_seen`` == step records written, the violation counters and
the warning events == what the writers wrote, each node's tokens/s cell == its last record's value,
the event pane within its ``max_lines``, no exception. A failed check exits 1. Before each flood
the script waits (``--idle-wait``) for the machine to go quiet; on a shared machine read the
latencies next to ``others_cpu_share_of_machine``.

Usage::

    python benchmarks/bench_tui.py                  # 4 ranks x 5,000 lines/s x 30 s -> results/bench_tui.json
    python benchmarks/bench_tui.py --quick --out /tmp/t.json      # 4 ranks x 500 lines/s x 3 s, 2 per node (CI)
    python benchmarks/bench_tui.py --ranks-per-node 1 --profile /tmp/tui.prof   # cProfile of the UI thread
    python benchmarks/bench_tui.py --baseline /work/main     # each flood again with another checkout's code, side by side
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from machine import git_revision

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "benchmarks" / "results" / "bench_tui.json"
GOAL_P95_MS = 100.0
#: Every this many steps a node's writer records 2 orthogonality violations (and a warning).
VIOLATION_EVERY = 97
#: Seconds from starting the writers to their common start time (their start-up).
WRITER_START_S = 1.5
#: Seconds a key press may take to show before it counts as lost.
PRESS_TIMEOUT_S = 30.0
#: Seconds the dashboard may take to read everything once the writers stopped.
DRAIN_TIMEOUT_S = 300.0


# -- writers (separate processes) ------------------------------------------------------------------


def step_fields(step: int, node: int, per_s: float) -> dict:
    """The numbers of one ``step`` record, in the order ``osft.trainer.run.loop`` writes them (as
    ``tests/fake_trainer.py``); ``node_tokens_per_s`` changes every step, so a stale value shows."""
    step_time = 1.0 / per_s
    node_tokens = 1000 + 7 * (step % 50) + 100 * node
    violations = 2 if step % VIOLATION_EVERY == 0 else 0
    return dict(
        loss=0.5 + 2.0 * math.exp(-step / 5000) + 0.02 * math.sin(1.7 * step),
        grad_norm=1.5 / (1 + 0.001 * step), lr=2e-5, num_tokens=2 * node_tokens, num_loss_tokens=node_tokens,
        num_samples=16, step_time_s=step_time, tokens_per_s=2 * node_tokens / step_time,
        node_tokens_per_s=node_tokens / step_time, samples_per_s=16 / step_time, ortho_violations=violations,
        ortho_max_dev_deg=1.5 if violations else 0.01 + 0.001 * (step % 7),
    )


def writer_main(spec: dict) -> int:
    """One fake rank: paced metrics records and stderr lines; prints what it wrote (JSON)."""
    rank, node, local = spec["rank"], spec["node"], spec["local"]
    base = dict(node_rank=node, rank=rank, local_rank=local, world_size=spec["world"],
                hostname=socket.gethostname(), job_id=spec["job_id"])
    main_rank = local == 0
    metrics_path = Path(spec["root"]) / "metrics" / (f"node{node}.jsonl" if main_rank else f"rank{rank}.jsonl")
    per_s, seconds, tick = spec["lines_per_s"], spec["seconds"], spec["tick_s"]
    m_rate = per_s * spec["metrics_fraction"]
    l_rate = per_s - m_rate
    events: Counter = Counter()
    state = {"step": 0, "violations_total": 0, "ortho_sum": 0, "last_tokens": None}

    def line(event: str, **fields) -> str:
        events[event] += 1
        return json.dumps({"ts": time.time(), "event": event, **base, **fields}) + "\n"

    def metrics_slot(n: int) -> str:
        if not main_rank:
            return line("warning", message=f"bench_tui warning {n} from rank {rank}")
        state["step"] += 1
        s = state["step"]
        rec = step_fields(s, node, m_rate)
        out = ""
        if rec["ortho_violations"]:
            out = line("warning", message=f"step {s}: orthogonality violations in ['model.layers.0.self_attn.q_proj']")
        state["violations_total"] += rec["ortho_violations"]
        state["ortho_sum"] += rec["ortho_violations"]
        state["last_tokens"] = rec["node_tokens_per_s"]
        return out + line("step", step=s, epoch=0, ortho_violations_total=state["violations_total"],
                          rss_bytes=50_000_000, gpu_mem_bytes=None, **rec)

    with open(metrics_path, "a", encoding="utf-8") as mf, open(spec["log_path"], "a", encoding="utf-8") as lf:
        time.sleep(max(0.0, spec["t0"] - time.time()))
        mf.write(line("run_started", pid=os.getpid(), config={"max_steps": spec["max_steps"]}))
        mf.flush()
        t0 = time.time()
        cpu0 = time.process_time()
        m_n = l_n = 0
        max_gap, last = 0.0, time.monotonic()
        while True:
            elapsed = min(time.time() - t0, seconds)
            m_due, l_due = int(elapsed * m_rate), int(elapsed * l_rate)
            if m_due > m_n:
                mf.write("".join(metrics_slot(n) for n in range(m_n + 1, m_due + 1)))
                mf.flush()
                m_n = m_due
            if l_due > l_n:
                clock = time.strftime("%H:%M:%S")
                lf.write("".join(f"[rank {rank}] {clock} step {state['step']} loss 0.{n % 9973:04d} "
                                 f"tokens/s {1000 + n % 777} (bench_tui line {n})\n" for n in range(l_n + 1, l_due + 1)))
                lf.flush()
                l_n = l_due
            now = time.monotonic()
            max_gap, last = max(max_gap, now - last), now
            if elapsed >= seconds:
                break
            time.sleep(max(0.0, tick - (time.time() - t0 - elapsed)))
        active = time.time() - t0
        cpu_s = time.process_time() - cpu0
        if main_rank:
            mf.write(line("run_finished", reason="completed", exit_code=0, step=state["step"], export_dir=None))
            mf.flush()
    print(json.dumps({
        "rank": rank, "node": node, "local": local, "metrics_file": metrics_path.name, "records": dict(events),
        "records_total": sum(events.values()), "metrics_lines": sum(events.values()) - events["run_started"]
        - events["run_finished"], "log_lines": l_n, "active_s": active, "cpu_s": cpu_s,
        "max_gap_ms": 1000 * max_gap, "steps": state["step"], "ortho_sum": state["ortho_sum"],
        "violations_total": state["violations_total"], "last_node_tokens_per_s": state["last_tokens"],
        "log_bytes": os.path.getsize(spec["log_path"]),
    }), flush=True)
    return 0


# -- the run directory -----------------------------------------------------------------------------


def make_run(root: Path, ranks: int, per_node: int, job_id: str, max_steps: int) -> list[Path]:
    """``run.json`` / ``run.node<N>.json`` of a running job; returns each rank's stderr.log path."""
    from osft.trainer.rundir import RunDir

    nodes = math.ceil(ranks / per_node)
    for n in range(nodes):
        rd = RunDir(root, n)
        rd.create()
        rd.update_run_json(argv=["osft-train", "--output-dir", str(root)], job_id=job_id, launcher_pid=None,
                           hostname=socket.gethostname(), torchrun_pids=[], nnodes=nodes, nproc_per_node=per_node,
                           config={"max_steps": max_steps, "checkpoint_grace_seconds": 300},
                           start_time=time.time(), state="running", exit_code=None)
    logs = []
    for r in range(ranks):
        d = root / "logs" / f"node{r // per_node}" / f"{job_id}_bench" / "attempt_0" / str(r % per_node)
        d.mkdir(parents=True, exist_ok=True)
        (d / "stdout.log").touch()
        logs.append(d / "stderr.log")
    return logs


def finish_run(root: Path, nodes: int) -> None:
    from osft.trainer.rundir import RunDir

    for n in range(nodes):
        RunDir(root, n).update_run_json(state="completed", exit_code=0)


# -- measuring -------------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1), linear interpolation; None for no values."""
    if not values:
        return None
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def summary_ms(seconds: list[float]) -> dict:
    ms = [1000 * s for s in seconds]
    return {"n": len(ms), "p50": pct(ms, 0.5), "p95": pct(ms, 0.95), "max": max(ms) if ms else None,
            "mean": statistics.fmean(ms) if ms else None}


def latency_summary(presses: list[dict]) -> dict:
    """p50/p95/max over every press (and per key); a press never shown (``timeouts``) counts as
    ``PRESS_TIMEOUT_S``, a lower bound of its latency."""

    def seconds(ps: list[dict]) -> list[float]:
        return [PRESS_TIMEOUT_S if p["ms"] is None else p["ms"] / 1000 for p in ps]

    out = summary_ms(seconds(presses)) | {"timeouts": sum(p["ms"] is None for p in presses),
                                         "timeout_counted_as_ms": 1000 * PRESS_TIMEOUT_S}
    for key, name in (("?", "open_help"), ("escape", "close_help")):
        out[name] = summary_ms(seconds([p for p in presses if p["key"] == key]))
    return out


def machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy (all cores)."""
    import psutil

    t = psutil.cpu_times()
    return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)


def wait_for_quiet(budget_s: float, threshold: float) -> tuple[float, float]:
    """Wait (at most ``budget_s`` s) until the machine's CPUs are at most ``threshold`` busy over
    0.5 s (nothing of this benchmark runs yet). Returns (seconds waited, the last busy share)."""
    import psutil

    waited, share = 0.0, psutil.cpu_percent(interval=0.5) / 100
    while share > threshold and waited < budget_s:
        share = psutil.cpu_percent(interval=0.5) / 100
        waited += 0.5
    return waited, share


class Presser(threading.Thread):
    """Plays the terminal's input thread: sends ``?`` / ``escape`` through the driver at jittered
    times from ``start`` to ``end`` (unix s), each time waiting for the frame that shows the new
    screen (:meth:`displayed` is called after each frame)."""

    def __init__(self, app, help_cls, start: float, end: float, interval: float, seed: int) -> None:
        super().__init__(daemon=True, name="bench-presser")
        self.app, self.help_cls, self.start_t, self.end_t, self.interval = app, help_cls, start, end, interval
        self.rng = random.Random(seed)
        self.presses: list[dict] = []
        self.lock = threading.Lock()
        self.pending: tuple | None = None  # (predicate on the displayed screen, threading.Event, [shown time])

    def displayed(self, screen) -> None:
        """Called on the UI thread after each frame is written for ``screen``."""
        with self.lock:
            pending = self.pending
            if pending is None or not pending[0](screen):
                return
            pending[2].append(time.perf_counter())
            self.pending = None
        pending[1].set()

    def press(self, key: str, char: str | None, predicate) -> float | None:
        from textual import events

        done, shown = threading.Event(), []
        with self.lock:
            self.pending = (predicate, done, shown)
        sent = time.perf_counter()
        self.app._driver.send_message(events.Key(key, char))  # what the terminal driver's input thread does
        if not done.wait(PRESS_TIMEOUT_S):
            with self.lock:
                self.pending = None
            return None
        return shown[0] - sent

    def run(self) -> None:
        help_cls = self.help_cls
        at, opening = self.start_t, True
        while True:
            time.sleep(max(0.0, at - time.time()))
            if opening and time.time() >= self.end_t:
                return
            t = time.time() - self.start_t
            if opening:
                latency = self.press("question_mark", "?", lambda s: isinstance(s, help_cls))
            else:
                latency = self.press("escape", "\x1b", lambda s: not isinstance(s, help_cls))
            self.presses.append({"key": "?" if opening else "escape", "t_s": round(t, 3),
                                 "ms": None if latency is None else 1000 * latency})
            opening = not opening
            at = max(at + self.interval * self.rng.uniform(0.8, 1.2), time.time())


class Sampler(threading.Thread):
    """Every 0.2 s: this process's RSS, the bytes the dashboard has not read yet, the event pane's
    line count."""

    def __init__(self, dash, richlog) -> None:
        import psutil

        super().__init__(daemon=True, name="bench-sampler")
        self.proc = psutil.Process()
        self.dash, self.richlog = dash, richlog
        self.stop = threading.Event()
        self.samples: list[dict] = []

    def backlog(self) -> int:
        """Bytes written but not yet taken in by the dashboard's reader (as of its last update)."""
        total = 0
        for path, consumed in dict(self.dash.run.consumed_bytes).items():
            try:
                total += max(0, os.path.getsize(path) - consumed)
            except OSError:
                continue
        return total

    def run(self) -> None:
        while True:
            self.samples.append({"t": time.time(), "rss": self.proc.memory_info().rss, "backlog": self.backlog(),
                                 "richlog_lines": len(self.richlog.lines)})
            if self.stop.wait(0.2):
                return


def make_rendering(driver) -> type:
    """Make the headless driver render each frame into terminal bytes (then dropped) as the Linux
    driver does (``App._display`` skips that work for a headless driver); returns its class, whose
    ``bytes_written`` counts them."""

    class RenderingDriver(type(driver)):
        bytes_written = 0

        @property
        def is_headless(self) -> bool:
            return False

        def write(self, data: str) -> None:
            RenderingDriver.bytes_written += len(data)

    driver.__class__ = RenderingDriver
    return RenderingDriver


async def run_flood(args, root: Path, logs: list[Path], job_id: str, max_steps: int, per_node: int) -> dict:
    """Start the dashboard, press keys while idle, start the writers, press keys during the flood,
    let the dashboard catch up, then compare what it counted with what was written."""
    import asyncio

    import psutil
    from osft.tui.app import OsftTui
    from osft.tui.components.modals import HelpScreen
    from textual.widgets import RichLog

    app = OsftTui(root, poll_s=args.poll_s)
    dash = app.dashboard
    poll_s_list: list[float] = []
    read_s_list: list[float] = []
    inner_poll, inner_receive = dash.poll, dash.reader.receive

    def timed_poll() -> None:
        t = time.perf_counter()
        inner_poll()
        poll_s_list.append(time.perf_counter() - t)

    def timed_receive():
        update = inner_receive()
        if update is not None:
            read_s_list.append(update.read_s)
        return update

    dash.poll = timed_poll  # before mount: on_mount's set_interval takes this attribute
    dash.reader.receive = timed_receive
    reader = psutil.Process(dash.reader.process.pid)
    nodes = math.ceil(args.ranks / per_node)
    profiler = None
    writers: list[subprocess.Popen] = []
    out: dict = {}
    try:
        async with app.run_test(size=(140, 42)) as pilot:
            driver_cls = make_rendering(app._driver)
            display = app._display
            current: list[Presser] = []

            def shown(screen, renderable) -> None:
                display(screen, renderable)
                if renderable is not None and current:
                    current[0].displayed(screen)

            app._display = shown
            await pilot.pause()
            richlog = dash.query_one("#events", RichLog)

            async def presses(start: float, end: float, interval: float, seed: int) -> Presser:
                current[:] = [Presser(app, HelpScreen, start, end, interval, seed)]
                current[0].start()
                while current[0].is_alive():
                    await asyncio.sleep(0.05)
                return current[0]

            now = time.time()
            idle = await presses(now, now + (1.5 if args.quick else 3.0), 0.3, 1)  # the first pair warms up
            t0 = time.time() + WRITER_START_S
            for r in range(args.ranks):
                spec = {"root": str(root), "rank": r, "node": r // per_node, "local": r % per_node,
                        "world": args.ranks, "job_id": job_id, "t0": t0, "seconds": args.seconds,
                        "lines_per_s": args.lines_per_s, "metrics_fraction": args.metrics_fraction,
                        "tick_s": args.tick_ms / 1000, "log_path": str(logs[r]), "max_steps": max_steps}
                writers.append(subprocess.Popen([sys.executable, __file__, "--writer", json.dumps(spec)],
                                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
            sampler = Sampler(dash, richlog)
            await asyncio.sleep(max(0.0, t0 - time.time()))
            polls0, bytes0 = len(poll_s_list), driver_cls.bytes_written
            if args.profile:
                import cProfile

                profiler = cProfile.Profile()
                profiler.enable()
            cpu0, wall0, busy0 = time.process_time(), time.perf_counter(), machine_busy_s()
            reader_cpu0 = sum(reader.cpu_times()[:2])
            sampler.start()
            flood_task = asyncio.ensure_future(presses(t0 + 0.25, t0 + args.seconds, args.press_interval, 29))
            while time.time() < t0 + args.seconds:
                await asyncio.sleep(0.05)
            cpu_s, wall_s, busy_s = time.process_time() - cpu0, time.perf_counter() - wall0, machine_busy_s() - busy0
            reader_cpu_s = sum(reader.cpu_times()[:2]) - reader_cpu0
            if profiler:
                profiler.disable()
            window_polls = poll_s_list[polls0:]
            frame_bytes = driver_cls.bytes_written - bytes0
            flood = await flood_task  # its last press
            alive_at_end = app.is_running and app._exception is None
            reports = []
            for p in writers:
                while p.poll() is None:
                    await asyncio.sleep(0.05)
                stdout, stderr = p.communicate()
                if p.returncode != 0:
                    raise RuntimeError(f"writer failed ({p.returncode}):\n{stderr[-3000:]}")
                reports.append(json.loads(stdout.strip().splitlines()[-1]))
            finish_run(root, nodes)
            stopped = time.perf_counter()
            expected = {r["metrics_file"] for r in reports}

            def drained() -> bool:
                run = dash.run
                if not expected <= set(run.records_read) or len(run.log_paths) < args.ranks:
                    return False
                return all(os.path.getsize(path) == consumed for path, consumed in run.consumed_bytes.items())

            while not drained():
                if time.perf_counter() - stopped > DRAIN_TIMEOUT_S:
                    raise RuntimeError(f"the dashboard did not read every written byte within {DRAIN_TIMEOUT_S:.0f} s")
                await asyncio.sleep(0.05)
            drain_s = time.perf_counter() - stopped
            await asyncio.sleep(2 * args.poll_s)  # one more poll: run.json state, widgets
            sampler.stop.set()
            sampler.join()
            out = check_counts(reports, dash, richlog)
            writers_cpu = sum(r["cpu_s"] for r in reports)
            samples = sampler.samples
            out["dashboard"] = {
                "cpu_s": cpu_s, "wall_s": wall_s, "cpu_percent_of_one_core": 100 * cpu_s / wall_s,
                "writers_cpu_percent_of_one_core": 100 * writers_cpu / wall_s,
                "reader_cpu_percent_of_one_core": 100 * reader_cpu_s / wall_s,
                "others_cpu_share_of_machine": max(0.0, busy_s - cpu_s - reader_cpu_s - writers_cpu)
                / (wall_s * (os.cpu_count() or 1)),
                "peak_rss_bytes": max(s["rss"] for s in samples),
                "rss_first_sample_bytes": samples[0]["rss"], "rss_last_sample_bytes": samples[-1]["rss"],
                "ru_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "polls_in_window": len(window_polls), "poll_ms": summary_ms(window_polls),
                "reader_poll_ms": summary_ms(read_s_list),
                "max_backlog_bytes": max(s["backlog"] for s in samples),
                "max_event_pane_lines": max(s["richlog_lines"] for s in samples),
                "drain_after_writers_s": drain_s, "terminal_bytes_per_s": frame_bytes / wall_s,
                "alive_and_no_exception_during_window": alive_at_end,
            }
            out["idle_presses"], out["presses"], out["writers"] = idle.presses[2:], flood.presses, reports
            out["timeline"] = [{"t_s": round(s["t"] - t0, 2), "rss_mb": round(s["rss"] / 1e6, 1),
                                "backlog_kb": round(s["backlog"] / 1e3, 1)} for s in samples[::5]]
    finally:
        for p in writers:
            if p.poll() is None:
                p.kill()
                p.wait()
    out["exception"] = None if app._exception is None else repr(app._exception)
    if profiler:
        import pstats

        profiler.dump_stats(args.profile)
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(30)
    return out


def check_counts(reports: list[dict], dash, richlog) -> dict:
    """Written vs read per file and per node; what the dashboard shows; bounded buffers."""
    from osft.tui.format import fmt_compact
    from osft.tui.components.nodes import NodeTable

    w, table = dash.run, dash.query_one(NodeTable)
    files, steps, shown = {}, {}, {}
    for r in reports:
        read = w.records_read.get(r["metrics_file"], 0)
        files[r["metrics_file"]] = {"written": r["records_total"], "read": read, "ok": read == r["records_total"]}
        if r["local"] != 0:
            continue
        node = w.nodes.get(r["node"])
        steps[str(r["node"])] = {"written": r["steps"], "seen": node.steps_seen if node else 0,
                                 "last_step": node.step if node else None,
                                 "ok": (node.steps_seen if node else 0) == r["steps"]
                                 and (node.step if node else None) == (r["steps"] or None)}
        if r["last_node_tokens_per_s"] is not None and node is not None:
            cell = str(table.get_cell(f"node{r['node']}", "tokens/s"))
            shown[str(r["node"])] = {"written": r["last_node_tokens_per_s"], "read": node.tokens_per_s, "cell": cell,
                                     "ok": cell == fmt_compact(r["last_node_tokens_per_s"])
                                     and node.tokens_per_s == r["last_node_tokens_per_s"]}
    node0 = next(r for r in reports if r["node"] == 0 and r["local"] == 0)
    v = w.violations
    violations = {"records_sum_written": node0["ortho_sum"], "records_sum_read": v.records_sum,
                  "total_written": node0["violations_total"], "total_read": v.total,
                  "ok": v.records_sum == node0["ortho_sum"] and v.total == node0["violations_total"]}
    written = sum(r["records"].get("warning", 0) for r in reports)
    seen = w.event_counts.get("warning", 0)
    warnings = {"written": written, "events": seen, "problems": len(w.problems),
                "ok": seen == written and not w.problems}
    tails = w.log_buffers
    bounded = {"event_pane_lines": len(richlog.lines), "event_pane_max_lines": richlog.max_lines, "log_tails": tails,
               "ok": len(richlog.lines) <= richlog.max_lines
               and all(0 < t["max_lines"] and t["lines"] <= t["max_lines"] for t in tails.values())}
    no_loss = (all(f["ok"] for f in files.values()) and all(s["ok"] for s in steps.values())
               and violations["ok"] and warnings["ok"])
    return {"counts": {"files": files, "steps_per_node": steps, "violations": violations, "warnings": warnings,
                       "tokens_per_s_shown": shown, "no_loss_or_duplicates": no_loss,
                       "throughput_correct": all(s["ok"] for s in shown.values())},
            "memory_bounded": bounded}


def run_topology(args, per_node: int, console) -> dict:
    """One flood with ``per_node`` ranks per node; its JSON section."""
    import asyncio

    waited, busy = wait_for_quiet(args.idle_wait, args.quiet_threshold)
    job_id = f"bench{os.getpid()}n{per_node}"
    max_steps = int(args.lines_per_s * args.metrics_fraction * args.seconds) + 1
    with tempfile.TemporaryDirectory(prefix="bench_tui_") as tmp:
        root = Path(tmp) / "run"
        logs = make_run(root, args.ranks, per_node, job_id, max_steps)
        res = asyncio.run(run_flood(args, root, logs, job_id, max_steps, per_node))
    reports = res["writers"]
    rates = [(r["metrics_lines"] + r["log_lines"]) / r["active_s"] for r in reports]
    latency = latency_summary(res["presses"])
    run = {
        "ranks_per_node": per_node, "nodes": math.ceil(args.ranks / per_node),
        "files": sorted({r["metrics_file"] for r in reports}),
        "quiet_before": {"waited_s": waited, "machine_busy_share": busy},
        "achieved": {"lines_per_s_per_rank": rates, "lines_per_s_per_rank_mean": statistics.fmean(rates),
                     "metrics_records_total": sum(r["records_total"] for r in reports),
                     "log_lines_total": sum(r["log_lines"] for r in reports),
                     "writer_max_gap_ms": max(r["max_gap_ms"] for r in reports)},
        "latency_ms": latency, "latency_idle_ms": latency_summary(res["idle_presses"]),
        "goal_met": latency["timeouts"] == 0 and latency["p95"] is not None and latency["p95"] < GOAL_P95_MS,
        "dashboard": res["dashboard"], "counts": res["counts"], "memory_bounded": res["memory_bounded"],
        "exception": res["exception"],
    }
    run["checks"] = {"no_loss_or_duplicates": run["counts"]["no_loss_or_duplicates"],
                     "throughput_correct": run["counts"]["throughput_correct"],
                     "memory_bounded": run["memory_bounded"]["ok"],
                     "no_exception": run["exception"] is None and run["dashboard"]["alive_and_no_exception_during_window"]}
    run |= {"idle_presses": res["idle_presses"], "presses": res["presses"], "timeline": res["timeline"], "writers": reports}
    print_report(args, run, console)
    return run


# -- report ----------------------------------------------------------------------------------------


def print_report(args, run: dict, console) -> None:
    from rich.table import Table

    lat, idle, d, a, c = run["latency_ms"], run["latency_idle_ms"], run["dashboard"], run["achieved"], run["counts"]

    def trio(s: dict) -> str:
        return " / ".join("-" if s[k] is None else f"{s[k]:.0f}" for k in ("p50", "p95", "max"))

    def ok(flag: bool, bad: str = "MISMATCH") -> str:
        return "ok" if flag else f"[red]{bad}[/red]"

    t = Table(title=f"osft-tui flood: {args.ranks} ranks on {run['nodes']} nodes x {args.lines_per_s:,} lines/s x "
                    f"{args.seconds:g} s (achieved {a['lines_per_s_per_rank_mean']:,.0f} lines/s/rank, "
                    f"{args.metrics_fraction:.0%} JSONL)")
    for col, justify in (("measure", "left"), ("value", "right"), ("note", "left")):
        t.add_column(col, justify=justify)
    verdict = "[green]met[/green]" if run["goal_met"] else "[red]NOT met[/red]"
    t.add_row("key -> screen p50 / p95 / max ms", trio(lat),
              f"{lat['n']} presses, {lat['timeouts']} lost (counted as {PRESS_TIMEOUT_S:g} s); "
              f"goal p95 < {GOAL_P95_MS:g} ms {verdict}")
    t.add_row("  help opens / closes p95 ms", f"{trio(lat['open_help']).split(' / ')[1]} / "
              f"{trio(lat['close_help']).split(' / ')[1]}", "")
    t.add_row("  idle, before the flood", trio(idle), f"{idle['n']} presses")
    t.add_row("dashboard CPU: UI / reader", f"{d['cpu_percent_of_one_core']:.0f} % / "
              f"{d['reader_cpu_percent_of_one_core']:.0f} %",
              f"of one core over {d['wall_s']:.1f} s; writers {d['writers_cpu_percent_of_one_core']:.0f} %, "
              f"other processes {d['others_cpu_share_of_machine']:.0%} of the machine")
    t.add_row("peak RSS sampled / ru_maxrss", f"{d['peak_rss_bytes'] / 1e6:.0f} / {d['ru_maxrss_bytes'] / 1e6:.0f} MB",
              f"first sample {d['rss_first_sample_bytes'] / 1e6:.0f} MB, last {d['rss_last_sample_bytes'] / 1e6:.0f} MB")
    t.add_row("poll p50 / p95 / max ms", trio(d["poll_ms"]), f"{d['polls_in_window']} polls in the window "
              f"(timer every {args.poll_s} s); reader poll {trio(d['reader_poll_ms'])}")
    t.add_row("max unread backlog", f"{d['max_backlog_bytes'] / 1e6:.1f} MB",
              f"all read {d['drain_after_writers_s']:.1f} s after the writers stopped")
    for name, f in c["files"].items():
        t.add_row(f"records {name} written / read", f"{f['written']:,} / {f['read']:,}", ok(f["ok"]))
    for node, s in c["steps_per_node"].items():
        t.add_row(f"steps node {node} written / seen", f"{s['written']:,} / {s['seen']:,}", ok(s["ok"]))
    v, wn = c["violations"], c["warnings"]
    t.add_row("violations sum, total written / read",
              f"{v['records_sum_written']}, {v['total_written']} / {v['records_sum_read']}, {v['total_read']}", ok(v["ok"]))
    t.add_row("warning events written / read", f"{wn['written']:,} / {wn['events']:,}", ok(wn["ok"]))
    t.add_row("tokens/s cells", ", ".join(s["cell"] for s in c["tokens_per_s_shown"].values()),
              ok(c["throughput_correct"], "WRONG"))
    m = run["memory_bounded"]
    t.add_row("event pane lines / max_lines", f"{m['event_pane_lines']} / {m['event_pane_max_lines']}",
              ok(m["ok"], "UNBOUNDED"))
    t.add_row("exception", str(run["exception"]), ok(run["checks"]["no_exception"], "raised"))
    console.print(t)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--ranks-per-node", default="2,1", help="comma-separated: one flood per topology")
    p.add_argument("--lines-per-s", type=int, default=5000, help="lines per second per rank (JSONL + stderr)")
    p.add_argument("--metrics-fraction", type=float, default=0.5, help="share of the lines that are JSONL records")
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--tick-ms", type=float, default=10.0, help="writers write their due lines every tick")
    p.add_argument("--poll-s", type=float, default=0.25, help="the dashboard's poll interval (OsftTui's default)")
    p.add_argument("--press-interval", type=float, default=0.5, help="mean seconds between key presses (±20%%)")
    p.add_argument("--idle-wait", type=float, default=60.0,
                   help="seconds to wait at most, before each flood, for the machine to go quiet")
    p.add_argument("--quiet-threshold", type=float, default=0.15, help="busy share of the CPUs counted as quiet")
    p.add_argument("--quick", action="store_true", help="4 ranks (2 per node) x 500 lines/s x 3 s, no idle wait (CI)")
    p.add_argument("--profile", type=Path, default=None, help="cProfile the UI thread over the flood into this file")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--baseline", type=Path, default=None,
                   help="another checkout: each flood runs again right after with its code and its bench_tui.py")
    p.add_argument("--baseline-python", default=None, help="the baseline's interpreter (default: its .venv's)")
    p.add_argument("--writer", help=argparse.SUPPRESS)
    p.add_argument("--run-json", type=Path, help=argparse.SUPPRESS)
    return p


def _flood(program: list[str], argv: list[str], n: str) -> dict:
    """One topology's flood in a process of its own (``program`` + ``argv``): its run record."""
    with tempfile.TemporaryDirectory(prefix="bench_tui_run_") as tmp:
        path = Path(tmp) / "run.json"
        done = subprocess.run([*program, *argv, "--run-json", str(path)], check=False)
        if done.returncode != 0 or not path.exists():
            raise SystemExit(f"the flood with {n} ranks per node failed ({program[-1]}, exit code {done.returncode})")
        return json.loads(path.read_text())


def _without_baseline(argv: list[str]) -> list[str]:
    """``argv`` without ``--baseline`` and ``--baseline-python`` (and their values)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--baseline", "--baseline-python"):
            skip = True
        elif not arg.startswith(("--baseline=", "--baseline-python=")):
            out.append(arg)
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.writer:
        return writer_main(json.loads(args.writer))
    from rich.console import Console

    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    if args.quick:
        args.lines_per_s, args.seconds, args.ranks_per_node, args.idle_wait = 500, 3.0, "2", 0.0
    if args.run_json:  # one topology, in a process of its own (RSS, caches and the idle baseline start fresh)
        run = run_topology(args, int(args.ranks_per_node), console)
        args.run_json.write_text(json.dumps(run))
        return 0
    runs, baseline_runs = [], []
    given = _without_baseline(sys.argv[1:] if argv is None else argv)
    for n in (n.strip() for n in args.ranks_per_node.split(",") if n.strip()):
        extra = ["--profile", str(args.profile.with_name(f"{args.profile.stem}.rpn{n}{args.profile.suffix}"))] \
            if args.profile else []
        runs.append(_flood([sys.executable, __file__], [*given, "--ranks-per-node", n, *extra], n))
        if args.baseline:  # the same flood right after, with the baseline checkout's code and its own script
            base = [args.baseline_python or str(args.baseline / ".venv" / "bin" / "python"),
                    str(args.baseline / "benchmarks" / "bench_tui.py")]
            baseline_runs.append(_flood(base, [*given, "--ranks-per-node", n], n))
    out = {
        "benchmark": "bench_tui", "quick": args.quick, "goal_p95_ms_below": GOAL_P95_MS,
        "params": {"ranks": args.ranks, "lines_per_s_per_rank": args.lines_per_s,
                   "metrics_fraction": args.metrics_fraction, "seconds": args.seconds, "tick_ms": args.tick_ms,
                   "poll_s": args.poll_s, "press_interval_s": args.press_interval, "terminal_size": [140, 42],
                   "profiled": args.profile is not None},
        "machine": {"cpu_count": os.cpu_count(), "loadavg_at_end": os.getloadavg(), "python": sys.version.split()[0]},
        "summary": [{"ranks_per_node": r["ranks_per_node"], "p50_ms": r["latency_ms"]["p50"],
                     "p95_ms": r["latency_ms"]["p95"], "max_ms": r["latency_ms"]["max"],
                     "open_help_p95_ms": r["latency_ms"]["open_help"]["p95"],
                     "lost_presses": r["latency_ms"]["timeouts"], "goal_met": r["goal_met"],
                     "cpu_percent": r["dashboard"]["cpu_percent_of_one_core"],
                     "peak_rss_bytes": r["dashboard"]["peak_rss_bytes"], **r["checks"]} for r in runs],
        "runs": runs,
    }
    if args.baseline:
        out["baseline"] = {"checkout": str(args.baseline), "rev": git_revision(args.baseline),
                           "summary": [{"ranks_per_node": r["ranks_per_node"], "p50_ms": r["latency_ms"]["p50"],
                                        "p95_ms": r["latency_ms"]["p95"], "max_ms": r["latency_ms"]["max"],
                                        "open_help_p95_ms": r["latency_ms"]["open_help"]["p95"]}
                                       for r in baseline_runs],
                           "runs": baseline_runs}
        for ours, theirs in zip(out["summary"], out["baseline"]["summary"]):
            print(f"ranks per node {ours['ranks_per_node']}: key -> screen p50 / p95 ms {ours['p50_ms']:.0f} / "
                  f"{ours['p95_ms']:.0f} (baseline {theirs['p50_ms']:.0f} / {theirs['p95_ms']:.0f})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    failed = [f"ranks_per_node={r['ranks_per_node']}: {k}" for r in runs for k, good in r["checks"].items() if not good]
    if failed:
        print("FAILED checks: " + "; ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
