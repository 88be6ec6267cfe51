"""Per-item measurements of one model on the benchmark's held-out sets and probes.

Losses are cross entropies in nats over the tokens a task trains: the assistant turns for chat data
(labels from the trainer's own ``tokenize_chat_file``), every token after the first for plain text,
the definition's tokens for a multiple-choice option. Samples are packed into rows of at most
``max_tokens`` tokens with the trainer's planner and collator (block-diagonal attention), so a
sample's loss is the trainer's loss on it. Every number is kept per item (a summed NLL and its
token count, or a 0/1 outcome) so that :mod:`.stats` can bootstrap over items.

- ``a_comply``: the greedy reply to a cued held-out question follows the marker format
  (:func:`.trivia.is_compliant`); ``a_exact``: its marked answer is an accepted answer (SQuAD-style
  normalisation); ``a_nll``: NLL of the reference reply ``Answer: [[X]]``;
- ``b_nll``: NLL of the held-out FOLDOC definitions;
- ``r1_nll``: NLL of the base model's own greedy replies to held-out chit-chat prompts (R1);
- ``r2_correct``: the option with the highest mean token log-likelihood (length-normalised) is
  the right definition (R2); ``r3_nll``: NLL of WordNet ``word: definition`` texts (R3).
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
_MARKED = re.compile(r"Answer: \[\[([^\[\]\n]+)\]\]")


def normalize_answer(text: str) -> str:
    """SQuAD-style normalisation: ``"The  Rolling Stones!"`` -> ``"rolling stones"``."""
    text = text.lower().translate(_PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def marked_answer_matches(reply: str, answers: list[str] | tuple[str, ...]) -> bool:
    """True when the ``[[X]]`` answer at the start of ``reply`` equals an accepted answer after
    :func:`normalize_answer` (an empty normalised answer never matches)."""
    found = _MARKED.match(reply.strip())
    got = normalize_answer(found.group(1)) if found else ""
    return bool(got) and any(got == normalize_answer(a) for a in answers)


def sample_nll(model: torch.nn.Module, samples: list[dict], max_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Summed cross entropy and scored-token count of each sample under ``model`` (no gradients).

    Args:
        samples: dicts with ``input_ids`` and unshifted ``labels`` (-100 = not scored), as made by
            ``tokenize_chat_file``.
        max_tokens: tokens per packed forward (a sample longer than this raises ValueError).

    Returns:
        ``(nll, tokens)``: float64 and int64 arrays of shape [len(samples)] (nats, tokens).
    """
    from osft.trainer.data.collate import collate_packed
    from osft.trainer.data.packing import plan_micro_batches
    from osft.trainer.data.tokenize import IGNORE_INDEX

    lengths = np.array([len(s["input_ids"]) for s in samples], dtype=np.int64)
    nll, tokens = np.zeros(len(samples)), np.zeros(len(samples), dtype=np.int64)
    with torch.inference_mode():
        for micro in plan_micro_batches(lengths, max_tokens, 1)[0]:
            batch = collate_packed([samples[i] for i in micro])
            logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
            labels = batch["labels"].view(-1)
            ce = F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), labels, ignore_index=IGNORE_INDEX,
                                 reduction="none").double().numpy()
            starts = np.concatenate([[0], np.cumsum(lengths[micro])[:-1]])
            nll[micro] = np.add.reduceat(ce, starts)
            tokens[micro] = np.add.reduceat((labels != IGNORE_INDEX).numpy().astype(np.int64), starts)
    return nll, tokens


def text_samples(tokenizer, texts: list[str]) -> list[dict]:
    """Plain texts as samples whose every token is scored (the first only as context)."""
    return [{"input_ids": ids, "labels": ids} for ids in tokenizer(texts)["input_ids"]]


def choice_samples(tokenizer, word: str, options: tuple[str, ...]) -> list[dict]:
    """One sample per option: context ``"word:"``, scored continuation ``" <definition>"``."""
    context = tokenizer(f"{word}:")["input_ids"]
    out = []
    for option in options:
        cont = tokenizer(" " + option, add_special_tokens=False)["input_ids"]
        out.append({"input_ids": context + cont, "labels": [-100] * len(context) + cont})
    return out


@dataclass
class Probes:
    """The held-out data every model is measured on (tokenized once per benchmark run).

    Attributes:
        a_chat / a_prompts / a_answers: task A's held-out cued rows (tokenized), their user turns
            (for greedy generation) and accepted answers.
        b_chat: task B's held-out rows. r1_chat: the retention set's rows.
        r2_options / r2_answers: per item, the option samples (:func:`choice_samples`) and the index
            of the right one. r3_text: WordNet definition texts.
    """

    a_chat: list[dict]
    a_prompts: list[str]
    a_answers: list[list[str]]
    b_chat: list[dict]
    r1_chat: list[dict]
    r2_options: list[list[dict]]
    r2_answers: list[int]
    r3_text: list[dict]


def _nll(model, samples, max_tokens) -> dict:
    nll, tokens = sample_nll(model, samples, max_tokens)
    return {"nll": [round(float(x), 5) for x in nll], "tokens": [int(t) for t in tokens]}


def evaluate(model, tokenizer, probes: Probes, parts: tuple[str, ...], max_tokens: int, max_new_tokens: int,
             batch_size: int) -> dict:
    """The per-item measurements named in ``parts`` (``"a"``: a_comply, a_exact, a_nll; ``"b"``:
    b_nll; ``"r"``: r1_nll, r2_correct, r3_nll) of one model.

    Returns:
        measurement name -> ``{"nll": [...], "tokens": [...]}`` (nats and tokens per item) or a list
        of 0/1 per item.
    """
    from osft.trainer.tools.retention_set import greedy_replies

    from .trivia import is_compliant

    model.eval()
    out: dict = {}
    if "a" in parts:
        replies = greedy_replies(model, tokenizer, probes.a_prompts, max_new_tokens, batch_size)
        out["a_comply"] = [int(is_compliant(r)) for r in replies]
        out["a_exact"] = [int(marked_answer_matches(r, a)) for r, a in zip(replies, probes.a_answers)]
        out["a_nll"] = _nll(model, probes.a_chat, max_tokens)
        out["a_replies"] = replies[:4]  # a glimpse for the record (questions stay out: GPL-3.0 data)
    if "b" in parts:
        out["b_nll"] = _nll(model, probes.b_chat, max_tokens)
    if "r" in parts:
        out["r1_nll"] = _nll(model, probes.r1_chat, max_tokens)
        flat = [s for options in probes.r2_options for s in options]
        nll, tokens = sample_nll(model, flat, max_tokens)
        mean = (nll / np.maximum(tokens, 1)).reshape(len(probes.r2_options), -1)
        out["r2_correct"] = [int(int(np.argmin(m)) == a) for m, a in zip(mean, probes.r2_answers)]
        out["r3_nll"] = _nll(model, probes.r3_text, max_tokens)
    return out
