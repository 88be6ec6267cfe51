"""The file-level driver of data preparation: a source cut into shards, each validated, rendered,
tokenized and labelled by one process of a pool, written as a memory-mapped Arrow file.

Shards: a JSON Lines file is cut at the first line start at or after every :data:`SHARD_BYTES`
bytes (the line number at each cut counted in the parent), so the shards, their files and the
result depend on the file only, never on the number of processes. Every other source (a JSON
array, parquet, arrow, a ``save_to_disk`` directory) is one shard.

What the first rows decide for the whole file is decided once, in the parent, before the pool
starts, exactly as one pass over the file decides it: the row shape (the first row that has one;
earlier rows are read as ``messages``), whether the template requires alternating roles, the
template's default system prompt, and whether :class:`.tokenize.SpanFinder`'s fast path is trusted
(its verification over the first rows; see :func:`_calibrated`).

Each shard process holds one shard's rows at a time (:data:`SHARD_BYTES` of JSON and their
renderings), writes its kept samples to ``<out_dir>/<shard>.arrow`` and returns its report
(:class:`ShardResult`: problems with file and line, the policy's lists, the inserted-text summary);
the parent merges the reports in shard order, so every list stays in file order.
Processes: ``spawn`` (no fork of a parent that may hold threads), one Rust tokenizer thread each.
"""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from itertools import pairwise
from multiprocessing import get_context
from pathlib import Path

from . import template_text
from .shapes import detect_shape
from .sources import json_lines, location_unit, read_rows, source_kind
from .template_text import BEFORE_ASSISTANT, SYSTEM_PROMPT
from .labels import DataReport, SpanFinder, _apply_policy, _label_batch, _samples
from .validate import Problem, scan_row, template_requires_alternation

#: Target size of one JSON Lines shard (bytes of the source).
SHARD_BYTES = 8 << 20
#: Rows the parent reads at most to verify the span finder's fast path (beyond: the reference method).
PROBE_ROWS = 2000
_BATCH = 512


def default_num_proc() -> int:
    """The CPU cores this process may run on, shared among the node's ranks when it is one of them
    (``LOCAL_WORLD_SIZE``, set by torchrun: a rank prepares data itself under ``--no-data-cache``)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


@dataclass(frozen=True)
class Shard:
    """Bytes ``[start, stop)`` of a JSON Lines file whose first line is ``first_line``; ``start``
    None: the whole source."""

    index: int
    start: int | None = None
    stop: int | None = None
    first_line: int = 1


def plan_shards(path, shard_bytes: int = SHARD_BYTES) -> list[Shard]:
    """The shards of ``path`` (see the module docstring)."""
    path = Path(path)
    if source_kind(path) != "json" or location_unit(path) != "line":
        return [Shard(0)]
    size = path.stat().st_size
    cuts, lines = [0], [1]
    with open(path, "rb") as f:
        while cuts[-1] + shard_bytes < size:
            f.seek(cuts[-1] + shard_bytes)
            f.readline()
            if f.tell() >= size:
                break
            cuts.append(f.tell())
        cuts.append(size)
        f.seek(0)
        for a, b in pairwise(cuts[:-1]):
            lines.append(lines[-1] + _count_newlines(f, b - a))
    return [Shard(i, a, b, line) for i, (a, b, line) in enumerate(zip(cuts, cuts[1:], lines, strict=False))]


def _count_newlines(f, n: int) -> int:
    count = 0
    while n > 0:
        block = f.read(min(n, 1 << 22))
        count += block.count(b"\n")
        n -= len(block)
    return count


@dataclass
class Prep:
    """Everything a shard process needs (pickled once per process)."""

    path: str
    tokenizer: object
    out_dir: str
    max_seq_len: int
    overlong: str
    train_on_all: bool
    train_reasoning: bool
    last_turn_only: bool
    source_cache: str | None
    strict: bool
    shape: str | None
    shape_line: int
    finder: SpanFinder | None
    system: template_text.DefaultSystem | None

    def shape_of(self, line: int) -> str:
        """The row shape of the row at ``line`` (rows before the first one with a shape: ``messages``)."""
        return self.shape if self.shape is not None and line >= self.shape_line else "messages"


@dataclass
class ShardResult:
    """One shard's part of the :class:`.tokenize.DataReport`, its problems and its Arrow file."""

    file: str
    report: DataReport
    problems: list[Problem] = field(default_factory=list)
    mismatch: list[Problem] = field(default_factory=list)
    keys: list[tuple[str, str]] = field(default_factory=list)


def make_prep(path, tokenizer, out_dir, max_seq_len: int, overlong: str, train_on_all: bool, data_format: str,
              source_cache, train_reasoning: bool, last_turn_only: bool) -> Prep:
    """The decisions of the first rows (see the module docstring), read in this process."""
    prep = Prep(str(path), tokenizer, str(out_dir), max_seq_len, overlong, train_on_all, train_reasoning,
                last_turn_only, None if source_cache is None else str(source_cache),
                template_requires_alternation(tokenizer), None if data_format == "auto" else data_format, 0,
                None if train_on_all else SpanFinder(tokenizer), template_text.default_system_prompt(tokenizer))
    _calibrated(prep)
    return prep


def _calibrated(prep: Prep) -> None:
    """Find the row shape and run the span finder over the first rows, as one pass over the file
    would, until its fast path is verified or refused; after :data:`PROBE_ROWS` rows without that, the
    reference method is used for every row. The finder then starts every shard verified."""
    unit = location_unit(prep.path)
    finder = prep.finder
    for n, located in enumerate(read_rows(prep.path, prep.source_cache)):
        if located.error is None and prep.shape is None:
            prep.shape = detect_shape(located.row)
            prep.shape_line = located.where
        settled = finder is None or finder.suffixes is None or finder.verify_left <= 0
        if settled and prep.shape is not None:
            break
        if settled:
            continue
        if n >= PROBE_ROWS:
            finder.suffixes = None
            continue
        scanned = scan_row(located, prep.shape_of(located.where), prep.strict, prep.tokenizer, prep.path, unit)
        if not isinstance(scanned, list):
            _samples(finder, prep.tokenizer, scanned[0], scanned[1], prep.train_reasoning, prep.last_turn_only)
    if finder is not None:
        finder.verify_left = 0


def run_shard(prep: Prep, shard: Shard) -> ShardResult:
    """Validate, render, tokenize and label one shard; writes its kept samples to ``<out_dir>/<index>.arrow``."""
    from datasets import Features, List, Value
    from datasets.arrow_writer import ArrowWriter

    features = Features({"input_ids": List(Value("int32")), "labels": List(Value("int32")), "length": Value("int64"),
                         "num_loss_tokens": Value("int64"), "line": Value("int64")})
    unit = location_unit(prep.path)
    report = DataReport(path=prep.path, max_seq_len=prep.max_seq_len, overlong=prep.overlong,
                        train_on_all=prep.train_on_all, unit=unit)
    result = ShardResult(str(Path(prep.out_dir) / f"{shard.index:05d}.arrow"), report)
    rows = (read_rows(prep.path, prep.source_cache) if shard.start is None
            else json_lines(prep.path, shard.start, shard.stop, shard.first_line))
    columns = {"line": [], "text": [], "spans": [], "inserted": []}
    keys: dict[tuple[str, str], int] = {}
    for located in rows:
        scanned = scan_row(located, prep.shape_of(located.where), prep.strict, prep.tokenizer, prep.path, unit)
        if isinstance(scanned, list):
            result.problems += scanned
            continue
        report.rows += 1
        _add_samples(prep, scanned[0], scanned[1], columns, keys, result)
    counts = []
    with ArrowWriter(features=features, path=result.file) as writer:
        for i in range(0, len(columns["line"]), _BATCH):
            out = _label_batch({k: v[i:i + _BATCH] for k, v in columns.items()}, prep.tokenizer, prep.max_seq_len,
                               prep.overlong == "truncate", prep.train_on_all)
            keep = _apply_policy(out, report)
            counts += [c for c, k in zip(out["inserted_tokens"], keep) if k]
            writer.write_batch({name: [v for v, k in zip(out[name], keep) if k] for name in features})
        writer.finalize()
    result.keys = list(keys)
    report.template_inserted = template_text.summarize(result.keys, counts)
    return result


def _add_samples(prep: Prep, conversation, text: str, columns: dict, keys: dict, result: ShardResult) -> None:
    """Append the samples of one valid row to ``columns`` (``line``, ``text``, trained ``spans``, ``inserted``
    ranges as ``[start, end, key]`` with ``keys`` numbering the distinct ``(where, text)``), or its problem;
    without ``train_reasoning``, the line of each trained turn left with reasoning tags in it to the report."""
    line, messages, _ = conversation
    found = _samples(prep.finder, prep.tokenizer, conversation, text, prep.train_reasoning, prep.last_turn_only)
    if isinstance(found, str):
        result.mismatch.append(Problem(prep.path, line, None, "messages", "template_prefix_mismatch", found,
                                       result.report.unit))
        return
    if len(found) > 1:
        result.report.split.append((line, len(found)))
    system = prep.system
    for sample_text, spans, inserted in found:
        ranges = [(a, b, (BEFORE_ASSISTANT, sample_text[a:b])) for a, b in inserted]
        if system and messages[0]["role"] != "system" and sample_text.startswith(system.text, system.start):
            ranges.insert(0, (system.start, system.start + len(system.text), (SYSTEM_PROMPT, system.text)))
        if not prep.train_reasoning:
            result.report.reasoning_trained += [line for a, b in spans
                                                if template_text.holds_reasoning_tag(sample_text[a:b])]
        columns["line"].append(line)
        columns["text"].append(sample_text)
        columns["spans"].append([list(span) for span in spans])
        columns["inserted"].append([[a, b, keys.setdefault(key, len(keys))] for a, b, key in ranges])


_PREP: Prep | None = None


def _start_process(prep: Prep) -> None:
    global _PREP
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _PREP = prep


def _run_in_process(shard: Shard) -> ShardResult:
    return run_shard(_PREP, shard)


def run_shards(prep: Prep, shards: list[Shard], num_proc: int):
    """The :class:`ShardResult` of every shard, in order, from ``num_proc`` processes (1: this one)."""
    if min(num_proc, len(shards)) <= 1:
        yield from (run_shard(prep, shard) for shard in shards)
        return
    with ProcessPoolExecutor(min(num_proc, len(shards)), mp_context=get_context("spawn"),
                             initializer=_start_process, initargs=(prep,)) as pool:
        yield from pool.map(_run_in_process, shards)


def merge(results, report: DataReport) -> tuple[list[str], list[Problem], list[Problem]]:
    """Fold shard results (in order) into ``report``; returns the Arrow files, the validation
    problems and the rows whose turns cannot be located, each in file order."""
    files, problems, mismatch = [], [], []
    order: dict[tuple[str, str], int] = {}
    inserted: dict[tuple[str, str], dict] = {}
    for result in results:
        part = result.report
        files.append(result.file)
        problems += result.problems
        mismatch += result.mismatch
        for name in ("dropped_overlong", "truncated", "dropped_no_trainable", "split", "reasoning_trained"):
            getattr(report, name).extend(getattr(part, name))
        for name in ("rows", "kept", "total_tokens", "total_loss_tokens"):
            setattr(report, name, getattr(report, name) + getattr(part, name))
        for key in result.keys:
            order.setdefault(key, len(order))
        for entry in part.template_inserted:
            key = (entry["where"], entry["text"])
            if key not in inserted:
                inserted[key] = dict(entry)
                continue
            seen = inserted[key]
            seen.update(samples=seen["samples"] + entry["samples"], tokens_total=seen["tokens_total"] + entry["tokens_total"],
                        tokens_min=min(seen["tokens_min"], entry["tokens_min"]),
                        tokens_max=max(seen["tokens_max"], entry["tokens_max"]))
    report.template_inserted = [inserted[key] for key in sorted(inserted, key=order.__getitem__)]
    return files, problems, mismatch


def load_shards(files) -> object:
    """The ``datasets.Dataset`` of the shard files, in order, memory-mapped."""
    from datasets import Dataset, concatenate_datasets

    return concatenate_datasets([Dataset.from_file(str(f)) for f in files])
