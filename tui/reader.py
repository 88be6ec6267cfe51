"""Reading a run directory in a process of its own.

A run can write tens of thousands of metrics records and log lines per second
(tests/test_bench_tui.py, tests/test_tui_reading.py).
Parsing them on the dashboard's UI thread would take the CPU the UI needs to answer a key press,
and a thread would not help (the GIL). So a child process runs the :class:`~.watcher.RunWatcher`
and sends the UI, once per poll, a snapshot of the :class:`~.run_state.RunModel` (a few KB) and at
most :data:`EVENTS_PER_UPDATE` event lines (rank log lines stay out: :data:`LOG_LINES_PER_UPDATE`
is 0, since the dashboard shows rank output only in its log view, which reads the log files
itself): the UI's work per poll no longer grows with the run's output.
"""

from __future__ import annotations

import os
import pickle
import signal
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from osft.trainer.rundir import RunDir

from .format import fmt_bytes
from .run_state import Event, PollResult, RunModel
from .watcher import RunWatcher

#: Event lines (run events, warnings, errors, malformed-line reports) per update at most.
EVENTS_PER_UPDATE = 40
#: Rank log lines per update at most: none, the event pane does not show rank output.
LOG_LINES_PER_UPDATE = 0
#: Bytes at the end of each metrics file a long run is first shown from (a few thousand step records).
QUICK_BYTES = 2 * 1024 * 1024
#: Share of each poll the reader spends on a long run's history until it has read it.
HISTORY_SHARE = 0.8
#: Frame header on the pipe: the pickle's length in bytes.
_HEADER = struct.Struct(">Q")


@dataclass
class Update:
    """What the reader sends after a poll.

    Attributes:
        model: the run as known now.
        events: the newest event and log lines (capped).
        dropped_events: event lines left out by the cap (all are in ``metrics/*.jsonl``).
        dropped_logs: log lines left out by the cap (``l`` shows a rank's log).
        checkpoint_records: every ``checkpoint_requested`` and ``checkpoint_saved`` record read, in
            order (never dropped: requests wait for them).
        read_s: seconds the reader spent on the polls merged here (s).
        read_at: unix time the newest poll merged here began: every file it read was read after it.
    """

    model: RunModel
    events: list[Event] = field(default_factory=list)
    dropped_events: int = 0
    dropped_logs: int = 0
    checkpoint_records: list[dict] = field(default_factory=list)
    read_s: float = 0.0
    read_at: float = float("-inf")

    def cap(self, events: int = EVENTS_PER_UPDATE, logs: int = LOG_LINES_PER_UPDATE) -> Update:
        """Keep every lifecycle line (:attr:`~.run_state.Event.lifecycle`: starts, requests, saves,
        resumes, errors, ends), the newest ``events`` of the other event lines (warnings) and the
        newest ``logs`` log lines, counting the rest; the order stays."""
        warnings = [e for e in self.events if e.level == "warning"]
        lines = [e for e in self.events if e.level == "log"]
        self.dropped_events += max(0, len(warnings) - events)
        self.dropped_logs += max(0, len(lines) - logs)
        kept = {id(e) for e in warnings[max(0, len(warnings) - events):] + lines[max(0, len(lines) - logs):]}
        self.events = [e for e in self.events if e.lifecycle or id(e) in kept]  # 0 keeps none
        return self

    def merge(self, later: Update) -> Update:
        """Take in an update sent after this one: its model, and its lines and records after ours."""
        self.model = later.model
        self.events += later.events
        self.dropped_events += later.dropped_events
        self.dropped_logs += later.dropped_logs
        self.checkpoint_records += later.checkpoint_records
        self.read_s += later.read_s
        self.read_at = later.read_at
        return self


class Reader:
    """A child process (``python -m osft.tui.reader``) that polls ``root`` every ``poll_s``
    seconds and sends :class:`Update` s through a pipe (length-prefixed pickles; both ends are
    this program).

    The child exits when the dashboard goes: a write to the closed pipe fails, and it also checks
    its parent pid each poll, so even a SIGKILLed dashboard leaves no reader behind.

    Args:
        root: the run directory.
        poll_s: seconds between polls (s).
    """

    def __init__(self, root: Path, poll_s: float) -> None:
        self._stderr = tempfile.TemporaryFile()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "osft.tui.reader", str(root), str(poll_s), str(os.getpid())],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self._stderr)
        assert self.process.stdout is not None
        self._fd = self.process.stdout.fileno()
        os.set_blocking(self._fd, False)
        self._buffer = bytearray()

    def _frames(self) -> list[Update]:
        """Read what the pipe holds; return the complete updates in it.

        Raises:
            RuntimeError: the reader process ended (with the last line of its stderr).
        """
        ended = False
        while True:
            try:
                chunk = os.read(self._fd, 1 << 20)
            except BlockingIOError:
                break
            if not chunk:
                ended = True
                break
            self._buffer += chunk
        updates = []
        while len(self._buffer) >= _HEADER.size:
            (size,) = _HEADER.unpack_from(self._buffer)
            if len(self._buffer) < _HEADER.size + size:
                break
            updates.append(pickle.loads(self._buffer[_HEADER.size : _HEADER.size + size]))
            del self._buffer[: _HEADER.size + size]
        if ended and not updates:
            self._stderr.seek(0)
            lines = self._stderr.read().decode(errors="replace").strip().splitlines()
            raise RuntimeError(f"the run-directory reader stopped (exit code {self.process.wait()})"
                               + (f": {lines[-1]}" if lines else ""))
        return updates

    def receive(self) -> Update | None:
        """Every update sent since the last call, merged into one (the newest model, events capped);
        None when nothing arrived.

        Raises:
            RuntimeError: the reader process ended.
        """
        merged: Update | None = None
        for update in self._frames():
            merged = update if merged is None else merged.merge(update)
        return merged.cap() if merged else None

    def close(self) -> None:
        """Stop the reader process and wait for it."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(2)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(2)
        assert self.process.stdout is not None
        self.process.stdout.close()
        self._stderr.close()


def main(argv: list[str] | None = None) -> int:
    """The reader process: ``python -m osft.tui.reader ROOT POLL_S PARENT_PID``."""
    root, poll_s, parent = (argv if argv is not None else sys.argv[1:])[:3]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # ctrl+c belongs to the dashboard
    out = sys.stdout.buffer
    reading = History(root, float(poll_s))
    while os.getppid() == int(parent):
        start, began = time.monotonic(), time.time()
        model, result = reading.poll()
        update = Update(model, result.events, checkpoint_records=result.checkpoint_records,
                        read_s=time.monotonic() - start, read_at=began)
        data = pickle.dumps(update.cap(), pickle.HIGHEST_PROTOCOL)
        try:
            out.write(_HEADER.pack(len(data)) + data)  # blocks while the dashboard is behind
            out.flush()
        except (BrokenPipeError, OSError):
            return 0
        time.sleep(max(0.0, float(poll_s) - (time.monotonic() - start)))
    return 0


class History:
    """The reader's watchers. A run whose metrics files hold more than :data:`QUICK_BYTES` is first
    shown from their last :data:`QUICK_BYTES` (a quick :class:`~.watcher.RunWatcher`: the latest
    step, rates and checkpoints at once), while a second watcher reads the whole files from their
    start for most of each poll, parsing before those last bytes only the records the charts and
    counters of the whole run need (:class:`~.thinning.Thinning`); once it has caught up, it replaces the quick one, and the charts
    cover the whole run. Only the quick watcher's event lines and checkpoint records are sent
    meanwhile (then the full one's that are newer): none is sent twice or lost.

    Args:
        root: the run directory.
        poll_s: seconds between polls; the history is read for :data:`HISTORY_SHARE` of each.
    """

    def __init__(self, root: str, poll_s: float) -> None:
        self.poll_s = poll_s
        size = _metrics_bytes(Path(root))
        self.quick: RunWatcher | None = RunWatcher(root, last=QUICK_BYTES) if size > QUICK_BYTES else None
        self.full = RunWatcher(root, thin=QUICK_BYTES if self.quick else None)
        self._size, self._started = size, time.monotonic()
        self._sent_ts = float("-inf")

    def poll(self) -> tuple[RunModel, PollResult]:
        """One poll: the model to show and the lines and records to send."""
        if self.quick is None:
            return self.full.model, self.full.poll()
        start = time.monotonic()
        result = self.quick.poll()
        if self._sent_ts == float("-inf"):
            result.events.insert(0, Event(time.time(), "info", f"reading the run's history ({fmt_bytes(self._size)} of "
                                                               "metrics) in the background: the charts show its end"))
        self._sent_ts = max([self._sent_ts, *(e.ts for e in result.events),
                             *(float(r.get("ts") or 0) for r in result.checkpoint_records)])
        while True:
            caught_up = self.full.poll()
            if self.full.backlog() == 0 or time.monotonic() - start > HISTORY_SHARE * self.poll_s:
                break
        if self.full.backlog():
            return self.quick.model, result
        self.quick = None  # caught up: the full model from now on, and its lines newer than those sent
        result.events += [e for e in caught_up.events if e.ts > self._sent_ts]
        result.checkpoint_records += [r for r in caught_up.checkpoint_records if float(r.get("ts") or 0) > self._sent_ts]
        result.events.append(Event(time.time(), "info", f"history read in {time.monotonic() - self._started:.1f} s: "
                                                        "the charts show the whole run"))
        return self.full.model, result


def _metrics_bytes(root: Path) -> int:
    """Bytes of the run's metrics files now (0 when there are none)."""
    try:
        return sum(p.stat().st_size for p in RunDir(root).metrics.glob("*.jsonl"))
    except OSError:
        return 0


if __name__ == "__main__":
    # Run the importable module's main, so the pickled Update is osft.tui.reader.Update, not __main__.Update.
    from osft.tui.reader import main as module_main

    sys.exit(module_main())
