"""``--data-path`` values: ``PATH`` or ``PATH:WEIGHT``, checked before anything loads.

A weight is a positive number after the last colon, so a path that holds colons still works
(``/data/run:3/a.jsonl``, ``c:/x.parquet:0.2``). Several paths without weights are one dataset
(their samples concatenated, drawn as one); several paths with weights are a **mixture**
(:mod:`.mixture`). Either every path has a weight or none has. Light: stdlib only, for the launcher.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class DataSpec:
    """One ``--data-path`` value: the source's ``path`` and its ``weight`` (None: not given)."""

    path: str
    weight: float | None = None


def parse_data_spec(text: str) -> DataSpec:
    """``PATH`` or ``PATH:WEIGHT`` (the module docstring).

    Raises:
        ValueError: a weight that is not a finite number > 0.
    """
    head, sep, tail = text.rpartition(":")
    try:
        weight = float(tail) if sep and head else None
    except ValueError:
        weight = None
    if weight is None:
        return DataSpec(text)
    if not (math.isfinite(weight) and weight > 0):
        raise ValueError(f"--data-path {text}: the weight after the last colon must be a number > 0, got {tail}")
    return DataSpec(head, weight)


def parse_data_specs(texts: list[str]) -> list[DataSpec]:
    """Every ``--data-path`` value, checked together.

    Raises:
        ValueError: a bad weight, or some paths with a weight and some without.
    """
    specs = [parse_data_spec(t) for t in texts]
    if len(specs) > 1 and len({s.weight is None for s in specs}) > 1:
        raise ValueError("--data-path: give every path a weight (PATH:WEIGHT, a mixture) or none (one dataset): "
                         + ", ".join(texts))
    return specs


def check_sources(texts: list[str]) -> None:
    """Each source exists and has an accepted type (before anything loads).

    Raises:
        ValueError: naming the ``--data-path`` value and what is wrong with it.
    """
    from .sources import source_kind

    for spec in parse_data_specs(texts):
        if not Path(spec.path).exists():
            raise ValueError(f"--data-path {spec.path}: no such file or directory")
        source_kind(spec.path)
