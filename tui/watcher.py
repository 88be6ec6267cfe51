"""Reading a run directory incrementally into a :class:`~.run_state.RunModel`.

:class:`RunWatcher` polls ``run.json`` (and ``run.node<N>.json``), tails every metrics file and
every rank's stderr incrementally, and lists the checkpoints. It imports nothing that trains (no
torch), so it reads runs started by hand, by ``osft-train``, by the dashboard or on a cluster.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from osft.trainer.checkpoint.manifest import MANIFEST, CheckpointError, read_manifest, verify_files
from osft.trainer.rundir import STEP_DIR, RunDir, read_launcher_record

from .run_state import CheckpointEntry, Event, PollResult, RunModel
from .tail import JsonlTail, LogTail

_RUN_NODE_JSON = re.compile(r"^run(?:\.node(\d+))?\.json$")
#: One failure in torchrun's report of a failed worker group (torch.distributed.elastic
#: ``ChildFailedError``): global rank, exit code (negative: killed by that signal) and pid.
_TORCHRUN_FAILURE = re.compile(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+) \(pid: (\d+)\)")
_TMP_DIR = re.compile(r"^step_(\d+)\.tmp-")


class RunWatcher:
    """Reads a run directory incrementally into :attr:`model`; call :meth:`poll` a few times per
    second.

    Args:
        root: the run directory (``--output-dir``).
        log_lines: lines of each rank's stderr kept in memory.
        last: read only the last ``last`` bytes each metrics file has when first found (a quick
            picture of a long run; :class:`~.tail.JsonlTail`), None: whole files.
        thin: read every record only in the last ``thin`` bytes each metrics file has when first
            found, before them the ones the whole run's charts and counters need
            (:class:`~.thinning.Thinning`); None: every record.
    """

    def __init__(self, root: str | Path, log_lines: int = 200, last: int | None = None,
                 thin: int | None = None) -> None:
        self.model = RunModel(root)
        self.root = Path(root)
        self.rundir = RunDir(self.root)
        self.log_lines = log_lines
        self.last = last
        self.thin = thin
        self._tails: dict[Path, JsonlTail] = {}
        self._logs: dict[tuple[int, int], LogTail] = {}
        self._launcher_logs: dict[int, LogTail] = {}
        self._json_mtimes: dict[Path, float] = {}
        self._json_errors: dict[str, str] = {}
        self._ckpt_cache: dict[Path, tuple[float, CheckpointEntry]] = {}
        self._seen = False

    def _read_run_jsons(self) -> None:
        try:
            entries = list(self.root.iterdir())
        except FileNotFoundError:
            return
        for path in entries:
            m = _RUN_NODE_JSON.match(path.name)
            if not m:
                continue
            try:
                mtime = path.stat().st_mtime
                if self._json_mtimes.get(path) == mtime:
                    continue
                data = read_launcher_record(path)
            except OSError:
                continue  # being replaced; the next poll reads it
            except ValueError as exc:  # written in place and cut short, or by something else: say so
                self._json_errors[path.name] = f"{path.name}: {exc}"
                continue
            self._json_errors.pop(path.name, None)
            self._json_mtimes[path] = mtime
            self.model.set_launcher(int(m.group(1) or 0), data)
        self.model.run_json_error = "; ".join(self._json_errors[k] for k in sorted(self._json_errors)) or None

    def _log_files(self) -> dict[tuple[int, int], Path]:
        """``(node rank, local rank) -> stderr.log`` of each node's newest torchrun run id."""
        found: dict[tuple[int, int], Path] = {}
        logs = self.root / "logs"
        try:
            nodes = [p for p in logs.iterdir() if p.is_dir() and p.name.startswith("node") and p.name[4:].isdigit()]
        except FileNotFoundError:
            return found
        for node_dir in nodes:
            runs = sorted((p for p in node_dir.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
            if not runs:
                continue
            attempts = sorted(runs[-1].glob("attempt_*"), key=lambda p: p.name)
            if not attempts:
                continue
            for local_dir in attempts[-1].iterdir():
                if local_dir.name.isdigit():
                    found[(int(node_dir.name[4:]), int(local_dir.name))] = local_dir / "stderr.log"
        return found

    def _checkpoint(self, path: Path, step: int) -> CheckpointEntry:
        mtime = _mtime(path) or 0.0
        manifest_mtime = _mtime(path / MANIFEST)
        key = manifest_mtime or mtime
        cached = self._ckpt_cache.get(path)
        if cached and cached[0] == key:
            return cached[1]
        if _TMP_DIR.match(path.name):
            entry = CheckpointEntry(step, path, False, _du(path), mtime, "being written, or abandoned")
        else:
            try:
                manifest = read_manifest(path)
                verify_files(manifest, checksums=False)
                size = sum(int(f["size"]) for f in manifest.files.values())
                entry = CheckpointEntry(step, path, True, size, manifest_mtime or mtime)
            except CheckpointError as exc:
                entry = CheckpointEntry(step, path, False, _du(path), mtime, str(exc))
        self._ckpt_cache[path] = (key, entry)
        return entry

    def _read_checkpoints(self) -> None:
        root = self.rundir.checkpoints
        try:
            entries = [p for p in root.iterdir() if p.is_dir()]
        except FileNotFoundError:
            self.model.checkpoints = []
            return
        found = []
        for p in entries:
            m = STEP_DIR.match(p.name) or _TMP_DIR.match(p.name)
            if m:
                found.append(self._checkpoint(p, int(m.group(1))))
        self.model.checkpoints = sorted(found, key=lambda e: (e.step, e.complete), reverse=True)

    def poll(self, checkpoints: bool = True) -> PollResult:
        """Read what changed since the last poll; ``checkpoints`` also rescans the checkpoint list."""
        model = self.model
        result = PollResult()
        here = self.root.is_dir()
        self._seen = self._seen or here
        model.gone = self._seen and not here
        self._read_run_jsons()
        try:
            for path in self.rundir.metrics.glob("*.jsonl"):
                if path not in self._tails:
                    self._tails[path] = JsonlTail(path, last=self.last, thin=self.thin)
        except OSError:
            pass
        for tail in self._tails.values():
            batch = tail.poll()
            for record in batch.records:
                model.apply(record, result)
            model.records_read[tail.path.name] = tail.records_read
            for problem in batch.problems:
                model.problems.append(problem)
                result.events.append(Event(time.time(), "warning", problem))
        result.events.sort(key=lambda e: e.ts)  # files are read one after the other
        model.log_paths = self._log_files()
        for key, path in model.log_paths.items():
            tail = self._logs.get(key)
            if tail is None or tail.path != path:
                tail = self._logs[key] = LogTail(path, self.log_lines)
            rank = model.rank_of(*key)
            new = tail.poll()
            result.events.extend(Event(time.time(), "log", f"[rank {rank}] {line}") for line in new[-self.log_lines :])
        self._read_launcher_logs()
        if checkpoints:
            self._read_checkpoints()
        for event in result.events:
            model.event_counts[event.level] = model.event_counts.get(event.level, 0) + 1
        model.consumed_bytes = {str(t.path): t.consumed for t in [*self._tails.values(), *self._logs.values()]}
        model.log_buffers = {f"node{n}/local{lr}": {"lines": len(t.lines), "max_lines": t.lines.maxlen or 0,
                                                     "skipped_bytes": t.skipped_bytes}
                             for (n, lr), t in sorted(self._logs.items())}
        return result

    def backlog(self) -> int:
        """Bytes of the metrics files not read yet (0: caught up with them)."""
        left = 0
        for tail in self._tails.values():
            try:
                left += max(0, tail.path.stat().st_size - tail.offset)
            except OSError:
                continue
        return left

    def _read_launcher_logs(self) -> None:
        """Exit codes of ranks that died without a record, from torchrun's report in the output of
        launchers the dashboard started (``logs/launcher.node<N>.log``)."""
        for node_rank in self.model.launchers:
            tail = self._launcher_logs.get(node_rank)
            if tail is None:
                tail = self._launcher_logs[node_rank] = LogTail(self.rundir.launcher_log(node_rank), 400)
            if not tail.poll():
                continue
            for rank, (code, pid) in torchrun_failures("\n".join(tail.lines)).items():
                info = self.model.ranks.get(rank)
                if info is not None and info.pid == pid and info.exit_code is None:
                    info.exit_code = code


def torchrun_failures(text: str) -> dict[int, tuple[int, int]]:
    """``rank -> (exit code, pid)`` from torchrun's failure report in a launcher's output. A rank
    killed by a signal (the kernel's OOM killer, SIGSEGV) writes no record of its own; this report
    is the only place its exit code appears."""
    return {int(m.group(1)): (int(m.group(2)), int(m.group(3))) for m in _TORCHRUN_FAILURE.finditer(text)}


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def _du(path: Path) -> int:
    """Bytes of the regular files under ``path`` (files that vanish meanwhile count 0)."""
    total = 0
    for p in path.rglob("*"):
        try:
            if p.is_file():
                total += p.stat().st_size
        except OSError:
            continue
    return total
