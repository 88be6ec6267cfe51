"""Chat data pipeline: validate -> tokenize and label -> plan packed micro-batches -> collate.

- ``validate``: ``validate_chat_file``, ``Problem``, ``DataValidationError`` (light: stdlib only,
  so a launcher can check data before it starts any rank).
- ``tokenize``: ``tokenize_chat_file`` -> ``TokenizedChat`` (HF ``datasets``) and ``DataReport``.
- ``packing``: ``plan_micro_batches`` (LPT, numba).
- ``collate``: ``collate_packed`` (one packed row, shifted labels, restarting position ids).

Names are imported lazily, so importing this package (or ``validate``) does not pull in torch,
numba or datasets.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Problem": "validate",
    "DataValidationError": "validate",
    "validate_chat_file": "validate",
    "tokenize_chat_file": "tokenize",
    "TokenizedChat": "tokenize",
    "DataReport": "tokenize",
    "OverlongSampleError": "tokenize",
    "IGNORE_INDEX": "tokenize",
    "plan_micro_batches": "packing",
    "collate_packed": "collate",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
