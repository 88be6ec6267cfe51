"""The samples a run evaluates: its evaluation set (``--eval-data-path``, or ``--eval-split`` of the
training file) and its retention sets (``--retention-data-path``), each tokenized and validated like
the training data, and at most ``--eval-max-samples`` of each.

Selections are deterministic and spread over the file: ``n`` of ``R`` samples are the samples
``floor(i * R / n)`` for i = 0..n-1 (as ``osft-train make-retention-set --held-out`` picks rows).
``--eval-split`` holds out ``max(1, round(FRACTION * R))`` of the ``R`` usable training samples
this way; training then never sees them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..data.mixture import TrainingData
from ..data.tokenize import TokenizedChat
from ..data.validate import DataValidationError

#: ``EvalSet.kind`` of the evaluation set and of a retention set.
EVAL, RETENTION = "eval", "retention"


def spread_indices(total: int, n: int) -> np.ndarray:
    """``n`` of ``range(total)`` spread evenly: ``floor(i * total / n)`` for i = 0..n-1, int64 [n]
    (all of them when ``n >= total``)."""
    n = min(n, total)
    return np.arange(n, dtype=np.int64) * total // max(n, 1)


@dataclass
class EvalSet:
    """One set to evaluate: ``name`` (``eval``, or a retention file's stem), ``kind``
    (:data:`EVAL` or :data:`RETENTION`), the file, its tokenized samples and the selected ones
    (``indices`` into ``data``, int64 [n])."""

    name: str
    kind: str
    path: str
    data: TokenizedChat
    indices: np.ndarray

    def __len__(self) -> int:
        return len(self.indices)

    @property
    def lengths(self) -> np.ndarray:
        """Token length of each selected sample, int64 [len(self)]."""
        return self.data.lengths[self.indices]

    def sample(self, i: int) -> dict:
        """Selected sample ``i`` (a tokenized row: ``input_ids``, ``labels``, ``line``...)."""
        return self.data[int(self.indices[i])]

    def limited(self, max_samples: int | None) -> EvalSet:
        """The same set cut to at most ``max_samples`` samples, spread evenly (None: unchanged)."""
        if max_samples is None or len(self) <= max_samples:
            return self
        return EvalSet(self.name, self.kind, self.path, self.data, self.indices[spread_indices(len(self), max_samples)])


def split_training_data(data: TrainingData, fraction: float | None) -> tuple[TrainingData, EvalSet | None]:
    """Hold out ``fraction`` of the training samples as the evaluation set (``--eval-split``): the
    samples of one ``--data-path`` source spread evenly over it (:func:`spread_indices`).

    Returns:
        ``(training data, evaluation set)``; with ``fraction`` None, ``(data, None)``.

    Raises:
        ValueError: several sources (the split is of one file: give ``--eval-data-path``), or a
            split that would leave no training sample.
    """
    if not fraction:
        return data, None
    if len(data.parts) > 1:
        raise ValueError(f"--eval-split {fraction} holds out samples of one training file, but --data-path names "
                         f"{len(data.parts)} sources: give the evaluation set with --eval-data-path instead")
    [part] = data.parts
    path, total = part.report.path, len(part)
    held = spread_indices(total, max(1, round(fraction * total)))
    if len(held) >= total:
        raise ValueError(f"--eval-split {fraction} holds out all {total} usable samples of {path}: "
                         "nothing is left to train on")
    train = np.setdiff1d(np.arange(total, dtype=np.int64), held)
    kept = TokenizedChat(dataset=part.dataset.select(train), report=part.report)
    return TrainingData.build([kept], None), EvalSet(EVAL, EVAL, path, part, held)


def retention_names(paths: list[str]) -> list[str]:
    """A distinct name per retention file: its stem, with ``-2``, ``-3``... for repeated stems."""
    names: list[str] = []
    for path in paths:
        stem = Path(path).stem
        name, k = stem, 1
        while name in names or name == EVAL:
            k += 1
            name = f"{stem}-{k}"
        names.append(name)
    return names


def tokenize_files(paths: list[str], tokenize: Callable[[str], TokenizedChat],
                   eval_path: str | None = None) -> list[TokenizedChat]:
    """Tokenize every file with ``tokenize``, collecting the validation problems of all of them.

    Args:
        eval_path: the one of ``paths`` that is the evaluation file (the others are retention files),
            named as such in the error.

    Raises:
        DataValidationError: every problem of every file at once (each names its file and line),
            under a header naming the evaluation file and/or the retention files.
        ValueError: anything else ``tokenize`` raises (e.g. a file without any conversation).
    """
    done, problems, roles = [], [], {}
    for path in paths:
        try:
            done.append(tokenize(path))
        except DataValidationError as exc:
            problems += exc.problems
            roles[path == eval_path] = ("the evaluation file (--eval-data-path)" if path == eval_path
                                        else "the retention data (--retention-data-path)")
    if problems:
        raise DataValidationError(problems, header=f"{len(problems)} problem(s) in "
                                                   + " and ".join(roles[k] for k in sorted(roles, reverse=True)))
    return done


def load_eval_sets(eval_path: str | None, retention_paths: list[str] | None, split_set: EvalSet | None,
                   max_samples: int | None, tokenize: Callable[[str], TokenizedChat]) -> list[EvalSet]:
    """Every set a run evaluates, evaluation set first, each cut to ``max_samples``.

    Args:
        eval_path: ``--eval-data-path`` (None: the ``--eval-split`` set ``split_set``, or none).
        retention_paths: ``--retention-data-path`` files. tokenize: reads one chat file.

    Raises:
        DataValidationError: the problems of every file at once. ValueError: an unusable file, or
            one left without any usable sample.
    """
    paths = ([eval_path] if eval_path else []) + list(retention_paths or [])
    tokenized = tokenize_files(paths, tokenize, eval_path)
    sets = [split_set] if split_set is not None else []
    if eval_path:
        data = tokenized.pop(0)
        sets.append(EvalSet(EVAL, EVAL, eval_path, data, np.arange(len(data), dtype=np.int64)))
    for name, path, data in zip(retention_names(list(retention_paths or [])), retention_paths or [], tokenized):
        sets.append(EvalSet(name, RETENTION, path, data, np.arange(len(data), dtype=np.int64)))
    for s in sets:
        if not len(s):
            raise ValueError(f"{s.path}: no usable sample to evaluate (see its overlong and trainable-token counts)")
    return [s.limited(max_samples) for s in sets]
