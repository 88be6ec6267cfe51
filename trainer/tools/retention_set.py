"""``osft-train make-retention-set``: a model's own greedy replies, kept as a chat file.

A retention set records what a model says *before* it is fine-tuned: its greedy replies to a
list of prompts, written as chat jsonl rows ``{"messages": [user, assistant]}``. The tuned model's
loss on these rows minus the base model's (both token means over the assistant turns, as the trainer
computes its loss) measures how far fine-tuning moved the model on inputs it was not trained on.
The continual-learning benchmark uses it as a forgetting probe (``benchmarks/continual.py``).

Prompts come from one of

- a prompts file: one prompt per line, or jsonl rows with a string field ``prompt`` (a file whose
  first non-blank line starts with ``{`` is read as jsonl); blank lines are skipped;
- the user turns of a chat jsonl file (``--from-chat FILE --held-out N``): N rows spread evenly
  over the file's valid rows (row ``floor(i * R / N)`` for i = 0..N-1 of R rows), and from each
  row the last user turn before each assistant turn; repeated prompts are kept once;
- the model itself (``--self-prompts N``): N distinct prompts it writes when given only the start
  of a user turn, sampled with ``--seed`` (:mod:`.self_prompts`), so the file is general chat data
  of the model's own (e.g. for ``osft-train protect-base``) where the user has none.

Replies are greedy (``model.generate(do_sample=False)``), batched with left padding, on the prompt
rendered by the tokenizer's chat template with the generation prompt; so they do not depend on the
batch size beyond float rounding, and the same model and prompts give the same file. Rows whose
reply is empty after stripping whitespace are left out (the trainer rejects an empty assistant
turn) and counted.

A stop signal (SIGTERM, SIGINT, SIGHUP) while the model loads or the replies are generated ends
the command (:func:`main`) at once (Python runs the handler within one token's forward pass) with one line and
exit code 128 + N: nothing is written, an existing output file is left as it was
(:class:`RetentionSetStopped`). The file itself is written atomically.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import test_hooks
from .stops import ToolStopped, stopped_by_signals


class RetentionSetError(ValueError):
    """A prompts or chat file that cannot be read; the message names the file and line."""


class RetentionSetStopped(ToolStopped):
    """Signal ``signum`` stopped :func:`make_retention_set` before it wrote ``out_path``."""

    def __init__(self, signum: int, out_path: Path) -> None:
        super().__init__(signum, f" before the replies were complete: nothing written ({out_path} unchanged)")


def read_prompts(path: Path) -> list[str]:
    """The prompts of a prompts file (one per line, or jsonl with ``prompt``), in file order.

    Raises:
        RetentionSetError: the file is missing, not UTF-8, has a broken jsonl row or a row without a
            non-empty string ``prompt`` (``FILE:LINE: ...``), or holds no prompt.
    """
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError as e:
        raise RetentionSetError(f"{path}: prompts file not found") from e
    except UnicodeDecodeError as e:
        raise RetentionSetError(f"{path}: not UTF-8 ({e.reason} at byte {e.start + 1})") from e
    numbered = [(n, line) for n, line in enumerate(lines, 1) if line.strip()]
    as_jsonl = bool(numbered) and numbered[0][1].lstrip().startswith("{")
    prompts = []
    for number, line in numbered:
        if not as_jsonl:
            prompts.append(line.strip())
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise RetentionSetError(f"{path}:{number}: invalid JSON: {e.msg} (column {e.colno})") from e
        prompt = row.get("prompt") if isinstance(row, dict) else None
        if not isinstance(prompt, str) or not prompt.strip():
            raise RetentionSetError(f'{path}:{number}: row needs a non-empty string field "prompt"')
        prompts.append(prompt)
    if not prompts:
        raise RetentionSetError(f"{path}: no prompts")
    return prompts


def chat_prompts(path: Path, held_out: int) -> tuple[list[str], list[int]]:
    """Prompts from the user turns of ``held_out`` rows of a chat jsonl file (see the module docstring).

    Returns:
        ``(prompts, lines)``: the distinct prompts in order, and the physical line numbers of the
        rows they were taken from.

    Raises:
        RetentionSetError: the file does not pass the trainer's validation (the first problem, as
            ``FILE:LINE: ...``), ``held_out`` < 1, or fewer valid rows than ``held_out``.
    """
    from ..data.validate import validate_chat_file

    path = Path(path)
    if held_out < 1:
        raise RetentionSetError(f"--held-out must be at least 1, got {held_out}")
    try:
        records, problems = validate_chat_file(path)
    except OSError as e:
        raise RetentionSetError(f"{path}: cannot read the chat file: {e}") from e
    if problems:
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise RetentionSetError(f"{problems[0]}{more}")
    if held_out > len(records):
        raise RetentionSetError(f"{path}: --held-out {held_out} but the file has {len(records)} valid rows")
    chosen = [records[i * len(records) // held_out] for i in range(held_out)]
    prompts: list[str] = []
    for _, messages, _ in chosen:
        last_user = None
        for message in messages:
            if message["role"] == "user":
                last_user = message["content"]
            elif message["role"] == "assistant" and last_user is not None and last_user not in prompts:
                prompts.append(last_user)
    return prompts, [c.line for c in chosen]


def greedy_replies(model, tokenizer, prompts: list[str], max_new_tokens: int, batch_size: int) -> list[str]:
    """Greedy replies to single-turn chat prompts, whitespace-stripped, in prompt order.

    Each prompt is rendered as ``[{"role": "user", "content": prompt}]`` by the tokenizer's chat
    template with the generation prompt; batches of ``batch_size`` are left-padded and generated
    with ``model.generate(do_sample=False, max_new_tokens=...)`` (transformers' greedy decoding);
    replies are decoded without special tokens. The tokenizer's ``padding_side`` is restored after.
    """
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    replies: list[str] = []
    try:
        with torch.inference_mode():
            for start in range(0, len(prompts), batch_size):
                time.sleep(test_hooks.generate_delay())  # test hook (.test_hooks.GENERATE_DELAY_ENV)
                texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                       add_generation_prompt=True)
                         for p in prompts[start : start + batch_size]]
                enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
                out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                     pad_token_id=tokenizer.pad_token_id)
                replies += tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    finally:
        tokenizer.padding_side = side
    return [r.strip() for r in replies]


@dataclass(frozen=True)
class RetentionSet:
    """What :func:`make_retention_set` wrote: ``rows`` written, ``dropped_empty`` prompts left out
    for an empty reply, and ``source_lines`` (the chat file's rows used, ``--from-chat`` only)."""

    out_path: Path
    rows: int
    dropped_empty: int
    source_lines: list[int]


def retention_rows(model_dir: Path, prompts: list[str], max_new_tokens: int = 64, batch_size: int = 8,
                   seed: int = 0, self_prompts: int = 0) -> list[dict]:
    """``model_dir``'s greedy replies to ``prompts`` as chat rows ``{"messages": [user, assistant]}``,
    in prompt order, without the prompts whose reply is empty. With ``self_prompts`` = N > 0 the
    prompts (``prompts`` then empty) are N the model writes itself first
    (:func:`.self_prompts.sample_prompts` with ``seed``, at most ``max_new_tokens`` tokens each).

    The model is loaded in float32 on CPU (``load_model``); ``seed`` seeds torch first (greedy
    decoding draws nothing, the seed only pins any randomness of the model code).

    Raises:
        ValueError / FileNotFoundError: ``model_dir`` is not a loadable model with a chat template,
            or fewer than N distinct prompts were written (:func:`.self_prompts.sample_prompts`).
    """
    from ..model.loading import load_model, load_tokenizer
    from .self_prompts import sample_prompts

    torch.manual_seed(seed)
    tokenizer = load_tokenizer(model_dir)
    model = load_model(model_dir, torch.float32, "cpu")
    if self_prompts:
        prompts = sample_prompts(model, tokenizer, self_prompts, seed, max_new_tokens, batch_size)
    replies = greedy_replies(model, tokenizer, prompts, max_new_tokens, batch_size)
    return [{"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": r}]}
            for p, r in zip(prompts, replies) if r]


def write_retention_set(out_path: Path, rows: list[dict], prompts: int, source_lines: list[int] | None = None
                        ) -> RetentionSet:
    """Write ``rows`` (:func:`retention_rows` of ``prompts`` prompts) as chat jsonl at ``out_path``, atomically."""
    from ..rundir import write_text_atomic

    write_text_atomic(Path(out_path), "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    return RetentionSet(Path(out_path), len(rows), prompts - len(rows), source_lines or [])


def make_retention_set(model_dir: Path, out_path: Path, prompts: list[str], max_new_tokens: int = 64,
                       batch_size: int = 8, seed: int = 0, source_lines: list[int] | None = None,
                       self_prompts: int = 0) -> RetentionSet:
    """Write ``model_dir``'s greedy replies to ``prompts`` (or to ``self_prompts`` = N prompts it
    writes itself) as chat jsonl at ``out_path`` (:func:`retention_rows`, then :func:`write_retention_set`).

    Raises:
        ValueError / FileNotFoundError: from :func:`retention_rows`.
    """
    rows = retention_rows(model_dir, prompts, max_new_tokens, batch_size, seed, self_prompts)
    return write_retention_set(out_path, rows, self_prompts or len(prompts), source_lines)


def build_parser() -> argparse.ArgumentParser:
    """Flags of ``osft-train make-retention-set``."""
    from ..config import positive_int

    p = argparse.ArgumentParser(prog="osft-train make-retention-set",
                                description="Write a model's greedy replies to prompts as chat jsonl (a retention "
                                            "set: its loss after fine-tuning shows how far the model moved).")
    p.add_argument("--model", required=True, type=Path, help="Hugging Face model directory (with a chat template)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompts", type=Path, help="one prompt per line, or jsonl rows with a \"prompt\" string")
    src.add_argument("--from-chat", type=Path, metavar="FILE",
                     help="chat jsonl: the last user turn before each assistant turn of --held-out rows")
    src.add_argument("--self-prompts", type=positive_int, metavar="N",
                     help="N prompts the model writes itself from its chat template's start of a user turn "
                          "(sampled with --seed): general chat data without a file")
    p.add_argument("--held-out", type=positive_int, default=None, metavar="N",
                   help="with --from-chat: N rows spread evenly over the file (row floor(i*R/N) of R rows)")
    p.add_argument("--out", required=True, type=Path, help="chat jsonl to write")
    p.add_argument("--max-new-tokens", type=positive_int, default=64,
                   help="reply length limit in tokens (and, with --self-prompts, prompt length limit)")
    p.add_argument("--batch-size", type=positive_int, default=8, help="prompts per generate call")
    p.add_argument("--seed", type=int, default=0, help="torch seed set before loading the model")
    return p


def main(argv: list[str], console) -> RetentionSet:
    """``osft-train make-retention-set``: parse ``argv``, read the prompts, write the set.

    Raises:
        RetentionSetError: bad prompts/chat file or flags (the CLI exits with code 2).
        RetentionSetStopped: a stop signal arrived while the model loaded or generated (the CLI
            exits with code 128 + N).
    """
    args = build_parser().parse_args(argv)
    lines = None
    if args.from_chat is not None:
        if args.held_out is None:
            raise RetentionSetError("--from-chat needs --held-out N")
        prompts, lines = chat_prompts(args.from_chat, args.held_out)
        console.print(f"{len(prompts)} prompts from lines {lines} of {args.from_chat}", markup=False,
                      highlight=False, soft_wrap=True)
    elif args.held_out is not None:
        raise RetentionSetError("--held-out goes with --from-chat, not --prompts or --self-prompts")
    else:
        prompts = [] if args.self_prompts else read_prompts(args.prompts)
    try:
        with stopped_by_signals(lambda signum: RetentionSetStopped(signum, args.out)):
            made = make_retention_set(args.model, args.out, prompts, args.max_new_tokens, args.batch_size,
                                      args.seed, lines, self_prompts=args.self_prompts or 0)
    except (ValueError, FileNotFoundError) as e:
        raise RetentionSetError(str(e)) from e
    console.print(f"retention set: {made.rows} rows -> {made.out_path}"
                  + (f" ({made.dropped_empty} prompts left out: empty reply)" if made.dropped_empty else ""),
                  markup=False, highlight=False, soft_wrap=True)
    return made
