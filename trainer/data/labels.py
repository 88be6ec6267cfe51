"""One conversation -> token ids and loss labels: the chat template's rendering, the assistant
spans, the labels, the overlong policy and the ``DataReport`` every sample is counted in. The
file-level driver (:func:`.tokenize.tokenize_chat_file`, over shards in parallel: :mod:`.prepare`)
calls these per row.

Assistant spans: for assistant message ``i``, the span starts after
``render(messages[:i], add_generation_prompt=True)`` (so the role header is not trained) and ends at
the end of ``render(messages[:i+1])`` minus trailing whitespace (so the content and its end-of-turn
token, e.g. ``<|im_end|>``, are trained, the newline after it is not). When both renderings are
prefixes of the full rendering for every turn, the conversation is one sample. A template that
renders earlier turns differently (Qwen3-style templates drop their reasoning) gives a turn that is
not rendered as for generation a sample of its own (:mod:`.turns`). Tool calls, tool results and
the row's ``tools`` are rendered by the template like any other field.
That reference method costs 2 renders per assistant turn; ``SpanFinder`` gets the same spans with one
render per conversation (content markers), checked against the reference.
Text the template inserts before an assistant content (an empty reasoning block) is then cut from
the span, and it and a default system prompt are counted per sample in the report
(:mod:`.template_text`).

Labels are NOT shifted here (``labels[j]`` is ``input_ids[j]`` or -100); ``collate.py`` shifts them.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from operator import itemgetter

import numpy as np

from . import template_text
from .template_text import CLOSE, OPEN
from .turns import Sample, rstrip_end, split_samples, trained_turns
from .validate import DataValidationError, Problem, render

IGNORE_INDEX = -100
OVERLONG_POLICIES = ("drop", "error", "truncate")
_MAX_LISTED = 10



@dataclass
class DataReport:
    """What happened to every row of a data file; written to ``<output_dir>/data_report.json``.

    ``rows``: valid rows read; ``kept``: samples in the dataset; ``dropped_overlong``:
    ``(line, tokens)`` of samples over ``max_seq_len`` dropped by the drop policy (or refused by the
    error policy); ``truncated``: ``(line, tokens before truncation, loss tokens kept)`` of kept
    truncated samples; ``dropped_no_trainable``: lines dropped because no trained token was left
    (after truncation to ``max_seq_len``); ``total_tokens``/``total_loss_tokens``: sums over kept
    samples (loss tokens unshifted); ``unit``: what the numbers in those lists count, ``"line"`` (JSON
    Lines) or ``"row"`` (other sources); ``template_inserted``: text the chat template inserted that the
    data does not contain (:func:`.template_text.summarize`: where, text, samples, tokens per sample);
    ``split``: ``(line, samples)`` of each row split into several samples, one per assistant turn the
    template renders differently as history (:mod:`.turns`); ``reasoning_trained``: under
    ``--no-train-reasoning``, the lines of assistant turns still trained with reasoning tags in them
    (a ``<think>`` without its ``</think>``: the reasoning cannot be told from the answer).
    """

    path: str
    max_seq_len: int
    overlong: str
    train_on_all: bool = False
    unit: str = "line"
    rows: int = 0
    kept: int = 0
    dropped_overlong: list[tuple[int, int]] = field(default_factory=list)
    truncated: list[tuple[int, int, int]] = field(default_factory=list)
    dropped_no_trainable: list[int] = field(default_factory=list)
    total_tokens: int = 0
    total_loss_tokens: int = 0
    template_inserted: list[dict] = field(default_factory=list)
    split: list[tuple[int, int]] = field(default_factory=list)
    reasoning_trained: list[int] = field(default_factory=list)

    def summary_lines(self) -> list[str]:
        """Human-readable summary for the console (one string per line)."""
        def listed(items, fmt):
            shown = ", ".join(fmt(x) for x in items[:_MAX_LISTED])
            more = len(items) - _MAX_LISTED
            return shown + (f" and {more} more" if more > 0 else "")

        out = [f"data {self.path}: {self.rows} rows, {self.kept} kept, "
               f"{self.total_tokens} tokens ({self.total_loss_tokens} trained), "
               f"max_seq_len {self.max_seq_len}, overlong policy {self.overlong}"]
        if self.dropped_overlong:
            verb = "refused" if self.overlong == "error" else "dropped"
            out.append(f"  {verb} {len(self.dropped_overlong)} overlong (> {self.max_seq_len} tokens): "
                       + listed(self.dropped_overlong, lambda x: f"{self.unit} {x[0]} ({x[1]} tokens)"))
        if self.truncated:
            out.append(f"  truncated {len(self.truncated)} to {self.max_seq_len} tokens: "
                       + listed(self.truncated,
                                lambda x: f"{self.unit} {x[0]} ({x[1]} tokens, {x[2]} trained tokens kept)"))
        if self.dropped_no_trainable:
            why = no_trainable_message(self.max_seq_len, self.overlong == "truncate")
            out.append(f"  dropped {len(self.dropped_no_trainable)} with {why}: "
                       + listed(self.dropped_no_trainable, lambda x: f"{self.unit} {x}"))
        if self.split:
            out.append(f"  split {len(self.split)} rows whose earlier turns the chat template renders differently "
                       "into one sample per such assistant turn: "
                       + listed(self.split, lambda x: f"{self.unit} {x[0]} ({x[1]} samples)"))
        if self.reasoning_trained:
            out.append(f"  warning: {len(self.reasoning_trained)} assistant turns hold <think> without a closing "
                       "</think>, so their reasoning is trained in spite of --no-train-reasoning: "
                       + listed(self.reasoning_trained, lambda x: f"{self.unit} {x}"))
        return out + template_text.describe(self.template_inserted, self.train_on_all)

    def nothing_kept(self) -> str:
        """Why no sample was kept: ``all 5 samples were dropped (longer than --max-seq-len 200)``."""
        overlong = (f"longer than --max-seq-len {self.max_seq_len}", len(self.dropped_overlong))
        untrained = (f"with {no_trainable_message(self.max_seq_len, self.overlong == 'truncate')}",
                     len(self.dropped_no_trainable))
        reasons = [(why, n) for why, n in (overlong, untrained) if n]
        total = sum(n for _, n in reasons)
        why = reasons[0][0] if len(reasons) == 1 else ", ".join(f"{n} {why}" for why, n in reasons)
        return f"all {total} sample{'s' if total != 1 else ''} were dropped ({why})"

    def to_dict(self) -> dict:
        """Plain-data form (tuples become lists)."""
        return json.loads(json.dumps(asdict(self)))

    def to_json(self) -> str:
        """JSON text of ``to_dict()`` (indented), for the run directory."""
        return json.dumps(asdict(self), indent=2)


def no_trainable_message(max_seq_len: int, truncated: bool = True) -> str:
    """The fixed message for a sample left without trained tokens."""
    return f"0 trainable tokens after truncation to {max_seq_len}" if truncated else "0 trainable tokens"


class OverlongSampleError(DataValidationError):
    """Raised by the ``error`` policy; ``problems`` name each overlong line and its token length,
    ``report`` is the DataReport of the file."""

    def __init__(self, problems: list[Problem], report: DataReport):
        self.report = report
        super().__init__(problems, header=f"{len(problems)} sample(s) longer than max_seq_len "
                                          f"{report.max_seq_len} (overlong policy: error)")


class TokenizedSamples:
    """Indexing shared by every holder of tokenized samples in a ``dataset`` attribute (a
    ``datasets.Dataset`` with one row per sample and the columns of :class:`TokenizedChat`)."""

    dataset: object

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict:
        return self.dataset[int(i)]

    @property
    def lengths(self) -> np.ndarray:
        """Token length of each sample, int64 array of shape [len(self)] (for the packer)."""
        return np.asarray(self.dataset["length"], dtype=np.int64)


@dataclass
class TokenizedChat(TokenizedSamples):
    """Tokenized samples and their report.

    ``dataset`` (a ``datasets.Dataset``) has one row per kept sample with columns ``input_ids``
    (list[int32], length ``length`` <= max_seq_len), ``labels`` (same length, -100 = not trained,
    not shifted), ``length``, ``num_loss_tokens`` and ``line`` (physical line in the file).
    """

    dataset: object
    report: DataReport


def assistant_char_spans(tokenizer, messages: list[dict], rendered: str,
                         tools: list[dict] | None = None) -> list[tuple[int, int]] | str:
    """Character spans ``[start, end)`` of the trained part of each assistant turn in ``rendered``.

    The reference (prefix-rendering) method: 2 renders per assistant turn. Returns the spans, or a
    string saying why the template does not render prefixes consistently (the caller turns it into
    a located problem).
    """
    spans = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        try:
            before = render(tokenizer, messages[:i], tools, add_generation_prompt=True)
            upto = render(tokenizer, messages[: i + 1], tools)
        except Exception as e:  # noqa: BLE001 - reported with the row's line
            return f"rendering the conversation up to messages[{i}] failed: {type(e).__name__}: {e}"
        if not (rendered.startswith(before) and rendered.startswith(upto) and len(before) <= len(upto)):
            return (f"the chat template does not render the conversation prefix up to messages[{i}] "
                    "as a prefix of the whole conversation, so the assistant tokens cannot be located")
        spans.append((len(before), rstrip_end(rendered, len(before), len(upto))))
    return spans


_MARKERS = re.compile(f"([{OPEN}{CLOSE}])")
_PROBE = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."},
          {"role": "user", "content": "Thanks"}, {"role": "assistant", "content": "Bye."}]


class SpanFinder:
    """Finds assistant spans with one extra render per conversation, falling back to the reference.

    Fast path: render the conversation once with each assistant content wrapped in private-use
    marker characters; the markers give the content positions (the rendering without them must
    equal the plain one). The end-of-turn text after the content (e.g. ``<|im_end|>``), and any
    text the template puts between the generation prompt and the content, are learned once from
    a probe conversation with the reference method, and checked on every row. The fast path is
    used only if, on the probe and on the first ``verify_rows`` conversations, it gives exactly
    the reference spans; any row it cannot handle takes the reference path.
    """

    def __init__(self, tokenizer, verify_rows: int = 16):
        self.tokenizer = tokenizer
        self.verify_left = verify_rows
        self.suffixes = self._learn_suffixes()

    def _learn_suffixes(self) -> tuple[str, str, str] | None:
        """(text between generation prompt and content, end-of-turn text mid-conversation, at the end)."""
        try:
            rendered = render(self.tokenizer, _PROBE)
        except Exception:  # noqa: BLE001
            return None
        ref = assistant_char_spans(self.tokenizer, _PROBE, rendered)
        content = self._content_spans(_PROBE, rendered)
        if isinstance(ref, str) or content is None:
            return None
        gaps = {rendered[r[0]:c[0]] if r[0] <= c[0] else None for r, c in zip(ref, content)}
        if len(gaps) != 1 or None in gaps:
            return None  # the generation prompt does not end where the rendered header does
        mid, last = (rendered[c[1]:r[1]] for r, c in zip(ref, content))
        return gaps.pop(), mid, last

    def _content_spans(self, messages, rendered, tools=None) -> list[tuple[int, int]] | None:
        """Positions of the assistant contents in ``rendered``, or None if markers do not work."""
        marked = []
        for m in messages:
            if OPEN in m["content"] or CLOSE in m["content"]:
                return None
            marked.append(dict(m, content=OPEN + m["content"] + CLOSE) if m["role"] == "assistant" else m)
        try:
            text = render(self.tokenizer, marked, tools)
        except Exception:  # noqa: BLE001
            return None
        spans, pos, start, plain = [], 0, None, []
        for piece in _MARKERS.split(text):
            if piece == OPEN:
                if start is not None:
                    return None
                start = pos
            elif piece == CLOSE:
                if start is None:
                    return None
                spans.append((start, pos))
                start = None
            else:
                plain.append(piece)
                pos += len(piece)
        n_assistant = sum(m["role"] == "assistant" for m in messages)
        if start is not None or len(spans) != n_assistant or "".join(plain) != rendered:
            return None
        return spans

    def _fast(self, rendered, content, is_last) -> list[tuple[int, int]] | None:
        if content is None:
            return None
        gap, mid, last = self.suffixes
        spans = []
        for (start, end), final in zip(content, is_last):
            suffix = last if final else mid
            start -= len(gap)
            if start < 0 or not rendered.startswith(gap, start) or not rendered.startswith(suffix, end):
                return None
            spans.append((start, rstrip_end(rendered, start, end + len(suffix))))
        return spans

    def spans(self, messages: list[dict], rendered: str, tools=None) -> list[tuple[int, int]] | str:
        """Like ``assistant_char_spans`` (same result), usually with one render instead of 2 per turn."""
        content = self._content_spans(messages, rendered, tools) if self.suffixes is not None else None
        return self._turn_spans(messages, rendered, content, tools)

    def trained_spans(self, messages: list[dict], rendered: str, tools=None,
                      train_reasoning: bool = True) -> tuple[list, list] | str:
        """``(trained spans, inserted ranges)``: :meth:`spans` without the text the template inserted
        before each assistant content (and without the reasoning unless ``train_reasoning``), and
        those ranges (:func:`.template_text.split_inserted`); or the string of :meth:`spans` saying
        why the row cannot be handled."""
        content = self._content_spans(messages, rendered, tools)
        turns = self._turn_spans(messages, rendered, content if self.suffixes is not None else None, tools)
        if isinstance(turns, str):
            return turns
        assistants = [m for m in messages if m["role"] == "assistant"]
        return template_text.split_inserted(rendered, assistants, turns, content, train_reasoning)

    def sample_spans(self, sample: Sample, tools, train_reasoning: bool) -> tuple[list, list] | str:
        """As :meth:`trained_spans` for the turns a :class:`.turns.Sample` trains (their spans are known)."""
        content = self._content_spans(sample.messages, sample.text, tools)
        assistants = [m for m in sample.messages if m["role"] == "assistant"]
        return template_text.split_inserted(sample.text, [assistants[j] for j in sample.turns], sample.spans,
                                            None if content is None else [content[j] for j in sample.turns],
                                            train_reasoning)

    def _turn_spans(self, messages, rendered, content, tools=None) -> list[tuple[int, int]] | str:
        is_last = [i == len(messages) - 1 for i, m in enumerate(messages) if m["role"] == "assistant"]
        fast = self._fast(rendered, content, is_last) if self.suffixes is not None else None
        if fast is None or self.verify_left > 0:
            ref = assistant_char_spans(self.tokenizer, messages, rendered, tools)
            if fast is not None:
                self.verify_left -= 1
                if fast != ref:
                    self.suffixes = None  # never trust the fast path for this template again
            return ref
        return fast


def _encode_with_offsets(tokenizer, texts: list[str]):
    """Token ids and character offsets of each text, without adding special tokens.

    Uses the Rust backend directly when it has no truncation/padding configured (saves building a
    BatchEncoding), otherwise the tokenizer's own call.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and backend.truncation is None and backend.padding is None:
        encs = backend.encode_batch(texts, add_special_tokens=False)
        return [e.ids for e in encs], [e.offsets for e in encs]
    enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    return enc["input_ids"], enc["offset_mapping"]


def _label_batch(batch, tokenizer, max_seq_len: int, truncate: bool, train_on_all: bool):
    """datasets.map function (batched): tokenize with offsets, mask, optionally truncate."""
    ids_list, offsets_list = _encode_with_offsets(tokenizer, batch["text"])
    out = {k: [] for k in ("input_ids", "labels", "length", "num_loss_tokens", "full_length", "line",
                           "inserted_tokens")}
    for ids, offsets, spans, inserted, line in zip(ids_list, offsets_list, batch["spans"], batch["inserted"],
                                                   batch["line"]):
        ids = np.array(ids, dtype=np.int32)
        # a token belongs to a span when it starts inside it (a token straddling the start of a
        # span, e.g. a header newline merged with the content's leading spaces, does not)
        starts = np.fromiter(map(itemgetter(0), offsets), dtype=np.int64, count=len(ids))
        out["inserted_tokens"].append([[key, int(((starts >= a) & (starts < b)).sum())] for a, b, key in inserted])
        if train_on_all:
            trained = np.ones(len(ids), dtype=bool)
        else:
            trained = np.zeros(len(ids), dtype=bool)
            for a, b in spans:
                trained |= (starts >= a) & (starts < b)
        labels = np.where(trained, ids, np.int32(IGNORE_INDEX)).astype(np.int32)
        out["full_length"].append(len(ids))
        if truncate and len(ids) > max_seq_len:
            ids, labels = ids[:max_seq_len], labels[:max_seq_len]
        out["input_ids"].append(ids)
        out["labels"].append(labels)
        out["length"].append(len(ids))
        out["num_loss_tokens"].append(int((labels != IGNORE_INDEX).sum()))
        out["line"].append(line)
    return out


def _samples(finder, tokenizer, conversation, text, train_reasoning, last_turn_only) -> list[tuple] | str:
    """``(text, trained spans, inserted ranges)`` of each sample of one conversation (usually one;
    :mod:`.turns` when the template renders earlier turns differently), or a string saying why its
    turns cannot be located."""
    if finder is None:  # --train-on-all: one sample, every token trained
        return [(text, [], [])]
    line, messages, tools = conversation
    trained = trained_turns(messages, last_turn_only)
    found = finder.trained_spans(messages, text, tools, train_reasoning)
    if not isinstance(found, str):
        return [(text, [s for s, keep in zip(found[0], trained) if keep], found[1])]
    samples = split_samples(tokenizer, conversation, text, trained)
    if isinstance(samples, str):
        return samples
    out = []
    for sample in samples:
        spans = finder.sample_spans(sample, tools, train_reasoning)
        if isinstance(spans, str):
            return spans
        out.append((sample.text, *spans))
    return out or [(text, [], [])]  # no turn trained: kept as one sample, dropped for lack of trained tokens


def _apply_policy(out: dict, report: DataReport) -> np.ndarray:
    """Add one batch of :func:`_label_batch`'s samples to the report's per-sample lists and totals;
    returns the boolean keep mask over the batch."""
    lines = np.asarray(out["line"], dtype=np.int64)
    full = np.asarray(out["full_length"], dtype=np.int64)
    loss = np.asarray(out["num_loss_tokens"], dtype=np.int64)
    length = np.asarray(out["length"], dtype=np.int64)
    over = full > report.max_seq_len
    if report.overlong == "truncate":  # overlong rows were cut to max_seq_len by _label_batch
        keep = loss > 0
        cut = over & keep
        report.truncated += [(int(a), int(b), int(c)) for a, b, c in zip(lines[cut], full[cut], loss[cut])]
        no_trainable = ~keep
    else:
        keep = ~over & (loss > 0)
        report.dropped_overlong += [(int(a), int(b)) for a, b in zip(lines[over], full[over])]
        no_trainable = ~over & (loss == 0)
    report.dropped_no_trainable += [int(a) for a in lines[no_trainable]]
    report.kept += int(keep.sum())
    report.total_tokens += int(length[keep].sum())
    report.total_loss_tokens += int(loss[keep].sum())
    return keep
