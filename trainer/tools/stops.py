"""Stop signals for the commands that write one output and train nothing (``make-retention-set``,
``protect-base``): SIGTERM, SIGINT or SIGHUP abandons the work in the main thread, the partial
output is not kept, and ``osft-train`` exits with 128 + the signal's number."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager

#: The signals that stop such a command.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class ToolStopped(Exception):
    """Signal ``signum`` stopped a command before its output was complete; the message says what was
    left as it was."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}{message}")
        self.signum = signum


@contextmanager
def stopped_by_signals(stopped: Callable[[int], ToolStopped]) -> Iterator[None]:
    """Inside: each of :data:`STOP_SIGNALS` not ignored by the caller (``nohup``, a background job
    of a shell) raises ``stopped(signum)`` in the main thread; the previous handlers are back after."""
    def stop(signum, _frame):
        raise stopped(signum)

    previous = {s: signal.signal(s, stop) for s in STOP_SIGNALS if signal.getsignal(s) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
