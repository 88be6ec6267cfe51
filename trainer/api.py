"""The Python API at the import path it had before ``osft.trainer.launch`` existed:
``from osft.trainer.api import train`` keeps working and warns once that the API lives in
:mod:`osft.trainer.launch.api` (docs/python-api.md).
"""

import warnings

from .launch.api import InputError, TrainConfig, TrainOutcome, resolve_config, train

__all__ = ["InputError", "TrainConfig", "TrainOutcome", "resolve_config", "train"]

warnings.warn("osft.trainer.api is osft.trainer.launch.api now; import train from there",
              DeprecationWarning, stacklevel=2)
