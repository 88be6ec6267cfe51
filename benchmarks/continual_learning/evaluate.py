"""Held-out measurements of one model: chat loss, plain-text loss and trivia exact match.

Losses are token means of the cross entropy (nats per token) over the tokens a task trains: the
assistant turns for chat data (labels from the trainer's own ``tokenize_chat_file``), every token
after the first for plain text. Samples are packed into rows of at most ``max_tokens`` tokens with
the trainer's planner and collator, so the numbers are exactly the trainer's loss on that data.

Exact match follows SQuAD's answer normalisation (lower case, punctuation and the articles a/an/the
removed, whitespace collapsed): a greedy answer counts when its first line, normalised, equals one
of the accepted answers, normalised.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD-style normalisation: ``"The  Rolling Stones!"`` -> ``"rolling stones"``."""
    text = text.lower().translate(_PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def is_exact_match(prediction: str, answers: list[str] | tuple[str, ...]) -> bool:
    """True when the first line of ``prediction`` equals an accepted answer after :func:`normalize_answer`."""
    lines = prediction.strip().splitlines()
    first = normalize_answer(lines[0]) if lines else ""
    return bool(first) and any(first == normalize_answer(a) for a in answers)


def packed_loss(model: torch.nn.Module, samples: list[dict], max_tokens: int) -> tuple[float, int]:
    """Token-mean cross entropy of ``samples`` under ``model`` (no gradients).

    Args:
        samples: dicts with ``input_ids`` and unshifted ``labels`` (-100 = not scored), as made by
            ``tokenize_chat_file``.
        max_tokens: tokens per packed forward (a sample longer than this raises ValueError).

    Returns:
        ``(loss in nats per scored token, scored tokens)``.
    """
    from osft.trainer.data.collate import collate_packed
    from osft.trainer.data.packing import plan_micro_batches
    from osft.trainer.data.tokenize import IGNORE_INDEX

    lengths = np.array([len(s["input_ids"]) for s in samples], dtype=np.int64)
    total, count = 0.0, 0
    with torch.inference_mode():
        for micro in plan_micro_batches(lengths, max_tokens, 1)[0]:
            batch = collate_packed([samples[i] for i in micro])
            logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
            total += float(F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), batch["labels"].view(-1),
                                           ignore_index=IGNORE_INDEX, reduction="sum"))
            count += batch["num_loss_tokens"]
    return total / count, count


def text_samples(tokenizer, texts: list[str]) -> list[dict]:
    """Plain texts as samples whose every token is scored (the first only as context)."""
    return [{"input_ids": ids, "labels": ids} for ids in tokenizer(texts)["input_ids"]]


def generate_answers(model, tokenizer, questions: list[str], max_new_tokens: int, batch_size: int) -> list[str]:
    """Greedy replies to single-turn chat prompts (left-padded batches), decoded without special tokens."""
    tokenizer.padding_side = "left"
    replies = []
    with torch.inference_mode():
        for start in range(0, len(questions), batch_size):
            chunk = questions[start : start + batch_size]
            prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                     add_generation_prompt=True) for q in chunk]
            enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
            replies += tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return [r.strip() for r in replies]


@dataclass
class EvalSets:
    """The held-out data every model is measured on (built once per benchmark run).

    Attributes:
        chat_a: task A (chit-chat) eval samples (tokenized, assistant tokens scored).
        chat_b: task B (trivia) eval samples.
        text_c: plain-text samples of the untouched set (word definitions).
        questions / answers: trivia eval questions for exact match and their accepted answers.
    """

    chat_a: list[dict]
    chat_b: list[dict]
    text_c: list[dict]
    questions: list[str]
    answers: list[list[str]]


def evaluate(model, tokenizer, sets: EvalSets, max_tokens: int, max_new_tokens: int, batch_size: int,
             with_c: bool = True) -> dict:
    """Every measurement of one model (the loss on C only ``with_c``).

    Returns:
        ``{"loss_a", "loss_b", "loss_c"}`` (nats/token; ``loss_c`` None without ``with_c``),
        ``"exact_match_b"`` (fraction of ``sets.questions``), ``"predictions"`` (the first 8 greedy
        answers by question index, for the record; the questions themselves are GPL-3.0 data and
        stay out of the results).
    """
    model.eval()
    loss_a, _ = packed_loss(model, sets.chat_a, max_tokens)
    loss_b, _ = packed_loss(model, sets.chat_b, max_tokens)
    loss_c = packed_loss(model, sets.text_c, max_tokens)[0] if with_c else None
    replies = generate_answers(model, tokenizer, sets.questions, max_new_tokens, batch_size)
    hits = [is_exact_match(r, a) for r, a in zip(replies, sets.answers)]
    return {"loss_a": loss_a, "loss_b": loss_b, "loss_c": loss_c, "exact_match_b": sum(hits) / len(hits),
            "predictions": [{"index": i, "reply": r, "correct": h} for i, (r, h) in enumerate(zip(replies[:8], hits))]}
