"""Prompts a chat model writes itself: general chat data without a data file.

An aligned chat model given only the start of a user turn (its chat template rendered up to where
the user's text begins, the pre-query template) continues it with a request of the kind it was
tuned to answer (Xu et al. 2024, "Magpie: Alignment Data Synthesis from Scratch by Prompting
Aligned LLMs with Nothing", arXiv 2406.08464). ``osft-train make-retention-set --self-prompts N``
uses such prompts, with the model's greedy replies, as general data of the base model where the
user has none (e.g. for ``osft-train protect-base``).

Sampling (:func:`sample_prompts`): ``torch.manual_seed(seed)``, then rounds of ``batch_size``
continuations of the pre-query template by ``model.generate(do_sample=True, temperature=1.0,
top_p=1.0, top_k=0)`` (transformers' multinomial sampling from the full distribution), each cut at
its first special token (the end of the user turn) and stripped of whitespace. Empty prompts and
repeats are dropped; the first ``count`` distinct prompts are kept in the order drawn. On one device
the same model, seed and batch size give the same prompts.
"""

from __future__ import annotations

import re

import torch

#: Stands for the user's text when the chat template is rendered, to find where that text begins.
_MARK = "\x00osft-self-prompt\x00"
#: Continuations :func:`sample_prompts` may draw per prompt asked for before it gives up.
SAMPLES_PER_PROMPT = 4


def pre_query_template(tokenizer) -> str:
    """The chat template of ``tokenizer`` rendered for one user turn up to where its text begins
    (a default system turn, if the template adds one, included).

    Raises:
        ValueError: the tokenizer has no chat template, or its rendering does not hold the user's
            text verbatim (so there is no place where a user turn begins).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("self-written prompts need a chat template: the tokenizer has none")
    text = tokenizer.apply_chat_template([{"role": "user", "content": _MARK}], tokenize=False,
                                         add_generation_prompt=False)
    if _MARK not in text:
        raise ValueError("self-written prompts: the chat template does not render the user's text verbatim")
    return text[: text.index(_MARK)]


def sample_prompts(model, tokenizer, count: int, seed: int = 0, max_new_tokens: int = 64,
                   batch_size: int = 8) -> list[str]:
    """``count`` distinct user prompts sampled from ``model`` on its pre-query template (see the
    module docstring), in the order drawn.

    Args:
        model: a causal LM with ``generate`` (eval mode). tokenizer: its tokenizer, with a chat template.
        count: prompts wanted (≥ 1). seed: ``torch.manual_seed`` before the first round.
        max_new_tokens: the longest prompt, in tokens. batch_size: continuations per ``generate`` call.

    Raises:
        ValueError: from :func:`pre_query_template`, or fewer than ``count`` distinct non-empty
            prompts after ``SAMPLES_PER_PROMPT·count`` continuations.
    """
    prefix = pre_query_template(tokenizer)
    enc = tokenizer(prefix, return_tensors="pt", add_special_tokens=False)
    specials = [t for t in tokenizer.all_special_tokens if t]
    cut = re.compile("|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True))) if specials else None
    torch.manual_seed(seed)
    prompts: dict[str, None] = {}  # in the order drawn
    drawn = 0
    with torch.inference_mode():
        while len(prompts) < count and drawn < SAMPLES_PER_PROMPT * count:
            n = min(batch_size, SAMPLES_PER_PROMPT * count - drawn)
            out = model.generate(input_ids=enc["input_ids"].expand(n, -1),
                                 attention_mask=enc["attention_mask"].expand(n, -1), do_sample=True,
                                 temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=max_new_tokens,
                                 pad_token_id=tokenizer.pad_token_id)
            drawn += n
            for text in tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=False):
                prompt = (cut.split(text, 1)[0] if cut else text).strip()
                if prompt and len(prompts) < count:
                    prompts.setdefault(prompt)
    if len(prompts) < count:
        raise ValueError(f"self-written prompts: {len(prompts)} distinct non-empty prompts in {drawn} samples, "
                         f"{count} asked for")
    return list(prompts)
