"""The signals that end ``osft-tui``: held by its entry point (:mod:`osft.trainer.launch.cli`) from the first line, before
Textual is imported, and handled by the app (:mod:`.app`) once it runs. A module of its own so that
both import it without importing each other (tests/test_import_graph.py)."""

from __future__ import annotations

import signal

#: SIGTERM (a process manager) and SIGHUP (a closed terminal); the exit code is 128 + the signal.
ENDING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
