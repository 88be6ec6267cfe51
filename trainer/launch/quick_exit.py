"""Ending the launcher and torchrun's agent without the interpreter's last garbage-collector passes.

When Python finalizes, it clears every module and runs the cyclic garbage collector over what is
left. With torch, transformers and datasets loaded that is several hundred thousand tracked
objects: on a 2-core machine ``osft-train`` spent about 0.9 s between its last printed line and its
exit, and torchrun's agent about 0.5 s (``benchmarks/bench_launch.py`` measures both). Moving every
tracked object into the collector's permanent generation first (:func:`gc.freeze`) leaves those
passes nothing to traverse; the modules are still torn down, files closed and ``atexit`` handlers
run. The ranks themselves skip finalization altogether (:func:`.distributed.exit_rank`).
"""

from __future__ import annotations

import gc
import sys
from typing import NoReturn


def exit_without_final_gc(code: int) -> NoReturn:
    """Exit with ``code`` (:func:`sys.exit`) after :func:`gc.freeze`. Call it as the last statement
    of a process's entry point, never in a process that goes on (a test calling ``main``): objects
    in reference cycles alive at that moment are never collected, and their finalizers do not run,
    which CPython does not promise at exit anyway."""
    gc.freeze()
    sys.exit(code)
