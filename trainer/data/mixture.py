"""The run's training data: one or several sources (``--data-path``, :mod:`.specs`), each
tokenized (and cached) on its own, concatenated into one indexable dataset.

Several paths with weights are a **mixture**: each step draws from source *i* a share
``w_i / sum(w)`` of the global batch (:class:`.sampler.MixtureSampler`); without weights the
sources are drawn as one dataset. A single path's weight does not matter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .specs import parse_data_specs
from .tokenize import TokenizedChat, TokenizedSamples


@dataclass
class TrainingData(TokenizedSamples):
    """The tokenized sources of a run, as one indexable dataset.

    ``parts`` are the sources' :class:`.tokenize.TokenizedChat` in ``--data-path`` order, ``dataset``
    their concatenation (sample ``j`` of part ``i`` is ``offsets[i] + j``), ``weights`` the
    normalized mixture weights (None: one dataset, drawn as one), ``inputs`` the fingerprint of
    the run's inputs a checkpoint records (:func:`.fingerprint.run_inputs`; set by
    :func:`..startup.load_data`).
    """

    parts: list[TokenizedChat]
    weights: list[float] | None
    dataset: object
    inputs: dict | None = None

    @classmethod
    def build(cls, parts: list[TokenizedChat], weights: list[float] | None) -> TrainingData:
        """Concatenate ``parts``; ``weights`` (given for a mixture) are normalized to sum 1."""
        from datasets import concatenate_datasets

        dataset = parts[0].dataset if len(parts) == 1 else concatenate_datasets([p.dataset for p in parts])
        if weights is not None and len(parts) > 1:
            weights = [w / sum(weights) for w in weights]
        else:
            weights = None
        return cls(parts, weights, dataset)

    @property
    def sizes(self) -> list[int]:
        """Samples of each part."""
        return [len(p) for p in self.parts]

    @property
    def names(self) -> list[str]:
        """Each part's path."""
        return [p.report.path for p in self.parts]

    def counts(self, indices) -> dict[str, int]:
        """Samples of each part among ``indices`` (of :attr:`dataset`), by path."""
        bounds = np.cumsum(self.sizes)
        found = np.bincount(np.searchsorted(bounds, np.asarray(indices, dtype=np.int64), side="right"),
                            minlength=len(self.parts))
        return {name: int(n) for name, n in zip(self.names, found)}

    def report_dict(self) -> dict:
        """``data_report.json``: one source's :class:`.tokenize.DataReport`, or for several
        ``{"datasets": [report + weight, ...]}`` (weight None when they are drawn as one)."""
        if len(self.parts) == 1:
            return self.parts[0].report.to_dict()
        weights = self.weights or [None] * len(self.parts)
        return {"datasets": [dict(p.report.to_dict(), weight=w) for p, w in zip(self.parts, weights)]}

    def summary_lines(self) -> list[str]:
        """Each part's summary; a mixture's first line says each source's share of a batch."""
        lines = []
        if self.weights:
            lines.append("mixture: " + ", ".join(f"{n} {w:.3g}" for n, w in zip(self.names, self.weights))
                         + " of every batch")
        for part in self.parts:
            lines += part.report.summary_lines()
        return lines

    @property
    def dropped(self) -> int:
        """Samples dropped (overlong or without a trained token) over every part."""
        return sum(len(p.report.dropped_overlong) + len(p.report.dropped_no_trainable) for p in self.parts)


def tokenize_for_run(cfg, tokenizer, warn: Callable[[str], None]) -> tuple[TrainingData, bool]:
    """Tokenize every ``--data-path`` source as the run's flags say (:func:`.cache.tokenize_source`).

    Returns:
        ``(data, hit)``: the :class:`TrainingData` and whether every source came from the cache.

    Raises:
        DataValidationError: the problems of every source at once. ValueError: see
            :func:`parse_data_specs` and :func:`.tokenize.tokenize_chat_file`.
    """
    from .cache import tokenize_source
    from .validate import DataValidationError

    specs = parse_data_specs(cfg.data_path)
    parts, hits, errors = [], [], []
    for spec in specs:
        try:
            part, hit = tokenize_source(cfg, spec.path, tokenizer, warn)
        except DataValidationError as e:  # every source is checked before the run stops
            errors.append(e)
            continue
        parts.append(part)
        hits.append(hit)
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise DataValidationError([p for e in errors for p in e.problems])
    weights = [s.weight for s in specs] if specs[0].weight is not None else None
    return TrainingData.build(parts, weights), all(hits)
