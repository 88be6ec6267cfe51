"""Samples against the model's position limit, read from its config without loading weights.

Packed samples restart their position ids at 0, so only each sample's own length counts. A model
with learned absolute positions (GPT-2, OPT: no rotary settings in the config) cannot run a sample
longer than ``max_position_embeddings`` (an index error deep in the model): every such sample is a
located problem, before any rank starts. A rotary model runs it, but at positions it was never
trained on: a warning lists the samples. In both cases ``--max-seq-len`` at the limit applies the
overlong policy to them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .validate import DataValidationError, Problem

if TYPE_CHECKING:
    from .mixture import TrainingData

_MAX_LISTED = 10


@dataclass(frozen=True)
class PositionLimit:
    """The model's longest sample in tokens and whether its positions are learned absolute ones."""

    limit: int
    absolute: bool


def position_limit(model_path: str | os.PathLike) -> PositionLimit | None:
    """``max_position_embeddings`` (GPT-2's ``n_positions``) of the model's config, None when it has
    none; rotary when the config has rotary settings (``rope_parameters``, ``rope_theta``)."""
    from ..model.loading import load_config

    config = load_config(model_path)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    limit = getattr(config, "max_position_embeddings", None)
    if not isinstance(limit, int) or limit <= 0:
        return None
    rotary = any(getattr(config, key, None) is not None for key in ("rope_parameters", "rope_theta", "rope_scaling"))
    return PositionLimit(limit, absolute=not rotary)


def check_positions(data: TrainingData, limit: PositionLimit | None) -> str | None:
    """Compare every kept sample of every source with the model's position limit.

    Returns:
        a warning naming the limit and the samples beyond it for a rotary model, else None.

    Raises:
        DataValidationError: a model with absolute positions and samples longer than its limit,
            one problem per sample (file, line or row, tokens, the limit).
    """
    if limit is None:
        return None
    over = [(part.report, int(line), int(n)) for part in data.parts
            for line, n in zip(part.dataset["line"], part.lengths) if n > limit.limit]
    if not over:
        return None
    if limit.absolute:
        raise DataValidationError(
            [Problem(report.path, line, None, "messages", "beyond_position_limit",
                     f"sample has {n} tokens, more than the model's {limit.limit} positions "
                     "(learned absolute positions)", report.unit) for report, line, n in over],
            header=(f"{len(over)} sample(s) longer than the model's position limit {limit.limit} "
                    f"(max_position_embeddings); --max-seq-len {limit.limit} applies --overlong to them"))
    several = len(data.parts) > 1
    shown = ", ".join(f"{report.path + ' ' if several else ''}{report.unit} {line} ({n} tokens)"
                      for report, line, n in over[:_MAX_LISTED])
    more = f" and {len(over) - _MAX_LISTED} more" if len(over) > _MAX_LISTED else ""
    return (f"{len(over)} sample(s) of {', '.join(data.names)} are longer than the model's max_position_embeddings {limit.limit} "
            f"(rotary positions beyond it were never trained): {shown}{more}; --max-seq-len {limit.limit} "
            "applies --overlong to them")
