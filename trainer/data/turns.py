"""Which assistant turns a conversation trains, and its samples when the chat template renders
earlier turns differently from how it rendered them when they were the newest turn.

Labels are built **turn by turn**: assistant turn *k* is trained on the text the template renders
for it as the newest turn, i.e. what follows ``render(messages[:k], add_generation_prompt=True)`` in
``render(messages[:k+1])`` (the text a model generates at that point). Where the rendering of the
whole conversation holds exactly that text at that place (every turn of most templates), the turn is
trained in the conversation's sample. Where it does not (Qwen3-style templates drop the reasoning
of assistant turns before the last user message, and give the newest turn a reasoning block),
the conversation is **split**: that turn gets a sample of its own, ``render(messages[:k+1])``, in
which only it is trained; the earlier turns in that sample are context, rendered as the template
renders history. So every turn is trained once, with its own reasoning, in the context the model
sees when it generates it.

A turn is trained unless its message says ``"train": false``; with ``--train-last-turn-only`` only
the last assistant turn is, unless a message says ``"train": true``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .validate import Conversation, render


def rstrip_end(text: str, start: int, end: int) -> int:
    """``end`` moved left over trailing whitespace of ``text[start:end]``."""
    while end > start and text[end - 1].isspace():
        end -= 1
    return end


def trained_turns(messages: list[dict], last_turn_only: bool) -> list[bool]:
    """Whether each assistant turn (in order) is trained (see the module docstring)."""
    assistants = [m for m in messages if m["role"] == "assistant"]
    return [m.get("train", j == len(assistants) - 1 or not last_turn_only) for j, m in enumerate(assistants)]


@dataclass
class Sample:
    """One sample of a split conversation: the ``messages`` it renders (a prefix of the
    conversation), its ``text``, and the assistant turns it trains (``turns``: their index among
    the assistant turns of ``messages``) with their ``spans`` in ``text``."""

    messages: list[dict]
    text: str
    turns: list[int] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)


def split_samples(tokenizer, conversation: Conversation, rendered: str, trained: list[bool]) -> list[Sample] | str:
    """The samples of a conversation whose prefixes the template renders differently.

    Args:
        rendered: the whole conversation's rendering.
        trained: :func:`trained_turns` of its messages.

    Returns:
        the conversation's own sample (when it trains any turn) followed by one sample per trained
        turn it does not hold as rendered for generation; or a string saying why a turn cannot be
        located even in its own sample (the generation prompt is not a prefix of the turn's rendering).
    """
    messages, tools = conversation.messages, conversation.tools
    whole, own = Sample(messages, rendered), []
    j = -1
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        j += 1
        if not trained[j]:
            continue
        before = render(tokenizer, messages[:i], tools, add_generation_prompt=True)
        upto = render(tokenizer, messages[: i + 1], tools)
        if not (upto.startswith(before) and len(before) < len(upto)):
            return (f"the chat template's generation prompt is not where it renders messages[{i}], so the "
                    "assistant tokens cannot be located")
        span = (len(before), rstrip_end(upto, len(before), len(upto)))
        if rendered.startswith(before) and rendered.startswith(upto):
            whole.turns.append(j)
            whole.spans.append(span)
        else:
            own.append(Sample(messages[: i + 1], upto, [j], [span]))
    return ([whole] if whole.turns else []) + own
