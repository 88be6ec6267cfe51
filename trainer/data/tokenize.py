"""Chat JSONL -> token ids and loss labels, with a visible policy for overlong samples.

Pipeline: validate every row (every problem of the file raised at once, before any rank starts),
render each conversation with the tokenizer's chat template, locate the assistant turns as character
spans, tokenize with offsets and mark the tokens whose start lies in an assistant span as trained
(per conversation: :mod:`.labels`). Then apply the overlong policy and account for every sample in a
``DataReport``. The work runs over shards of the file in parallel processes (:mod:`.prepare`), each
writing an Arrow file; the result does not depend on the number of processes.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

from . import prepare
from .labels import (  # the per-conversation names, also imported from here by their users
    IGNORE_INDEX,
    OVERLONG_POLICIES,
    DataReport,
    OverlongSampleError,
    SpanFinder,
    TokenizedChat,
    TokenizedSamples,
    assistant_char_spans,
    no_trainable_message,
)
from .shapes import DATA_FORMATS
from .sources import location_unit
from .validate import DataValidationError, Problem

__all__ = ["IGNORE_INDEX", "OVERLONG_POLICIES", "DataReport", "OverlongSampleError", "SpanFinder", "TokenizedChat",
           "TokenizedSamples", "assistant_char_spans", "no_trainable_message", "tokenize_chat_file"]


def tokenize_chat_file(path, tokenizer, max_seq_len: int, overlong: str = "drop", train_on_all: bool = False,
                       data_format: str = "auto", source_cache=None, train_reasoning: bool = True,
                       last_turn_only: bool = False, out_dir=None, num_proc: int | None = None,
                       shard_bytes: int | None = None) -> TokenizedChat:
    """Validate, render, tokenize and label a chat JSONL file.

    Args:
        path: the data source (``.jsonl``, ``.json``, ``.parquet``, ``.arrow`` or a ``save_to_disk``
            directory; :mod:`.sources`), rows of any shape of :mod:`.shapes`.
        data_format: its row shape (``auto``: detected).
        source_cache: where ``datasets`` may keep the Arrow conversion of a parquet or arrow file
            (None: a temporary directory).
        tokenizer: a fast HF tokenizer with a ``chat_template`` (offsets are needed).
        max_seq_len: token limit per sample (>= 1).
        overlong: policy for samples longer than ``max_seq_len`` tokens: ``"drop"`` (default,
            dropped and listed in the report), ``"error"`` (raise OverlongSampleError naming every
            such line and its token length) or ``"truncate"`` (keep the first ``max_seq_len``
            tokens; a sample left with 0 trained tokens is dropped and listed).
        train_on_all: train on every token instead of only the assistant turns.
        train_reasoning: train an assistant turn's ``reasoning_content`` (with its tags); False
            trains only what follows it.
        last_turn_only: train only the last assistant turn (a message's ``"train"`` overrides;
            :mod:`.turns`).
        out_dir: the directory the dataset's Arrow files are written to, one per shard (None: a
            temporary directory removed when the process exits); :mod:`.prepare`.
        num_proc: processes (None: every core this process may use); the result does not depend on it.
        shard_bytes: the JSON Lines shard size (None: :data:`.prepare.SHARD_BYTES`).

    Returns:
        TokenizedChat (dataset + DataReport).

    Raises:
        DataValidationError: any validation problem in the file, listed together with the valid
            rows that the policy would drop for lack of trained tokens (and, under the ``error``
            policy, the overlong ones); or a template that does not render prefixes consistently.
        OverlongSampleError: overlong samples under the ``error`` policy.
        DataValidationError: no sample left (every one dropped; rule ``no_usable_samples``, naming
            the count and the reasons), so an empty dataset is never returned or cached.
        ValueError: bad arguments, a file without any row, or a tokenizer without a chat template
            or offset support.
    """
    if overlong not in OVERLONG_POLICIES:
        raise ValueError(f"overlong must be one of {OVERLONG_POLICIES}, got {overlong!r}")
    if int(max_seq_len) < 1:
        raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("a fast tokenizer (with offset mapping) is required")
    if data_format not in DATA_FORMATS:
        raise ValueError(f"data format must be one of {', '.join(DATA_FORMATS)}, got {data_format!r}")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the tokenizer has no chat_template; cannot render {path}")
    max_seq_len = int(max_seq_len)
    if out_dir is None:
        out_dir = Path(tempfile.mkdtemp(prefix="osft-tokenized-"))
        atexit.register(shutil.rmtree, out_dir, True)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    prep = prepare.make_prep(path, tokenizer, out_dir, max_seq_len, overlong, train_on_all, data_format, source_cache,
                             train_reasoning, last_turn_only)
    report = DataReport(path=str(path), max_seq_len=max_seq_len, overlong=overlong, train_on_all=train_on_all,
                        unit=location_unit(path))
    shards = prepare.plan_shards(path, shard_bytes or prepare.SHARD_BYTES)
    files, problems, mismatch = prepare.merge(
        prepare.run_shards(prep, shards, prepare.default_num_proc() if num_proc is None else num_proc), report)
    if not report.rows and not problems:
        raise ValueError(f"{path}: no conversations (the file is empty or has only blank lines)")
    if not report.rows:
        raise DataValidationError(problems)
    if mismatch:
        raise DataValidationError(mismatch, header=(
            f"{len(mismatch)} row(s) whose assistant turns the chat template does not let us locate; "
            "use a template that renders each turn where its generation prompt ends, or --train-on-all"))
    overlong_problems = [
        Problem(str(path), line, None, "messages", "overlong",
                f"sample has {n} tokens, more than max_seq_len {max_seq_len} (overlong policy: error)", report.unit)
        for line, n in report.dropped_overlong] if overlong == "error" else []
    if problems:
        # Invalid rows stop the run; the rows that would be dropped for lack of trained tokens are
        # listed in the same pass (tests/test_data_tokenize.py::test_both_lines_reported_in_one_pass), so one run of the validator shows everything.
        untrainable = [Problem(str(path), line, None, "messages", "no_trainable_tokens",
                               no_trainable_message(max_seq_len, truncated=overlong == "truncate"), report.unit)
                       for line in report.dropped_no_trainable]
        raise DataValidationError(sorted(problems + untrainable + overlong_problems, key=lambda p: p.line))
    if overlong_problems:
        raise OverlongSampleError(overlong_problems, report)
    if not report.kept:  # never an empty dataset: a source that gives nothing is refused, naming why
        raise DataValidationError([Problem(str(path), 0, None, None, "no_usable_samples", report.nothing_kept(),
                                           report.unit)])
    return TokenizedChat(dataset=prepare.load_shards(files), report=report)
