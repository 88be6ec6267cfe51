"""Stop signals for the commands that write one output and train nothing (``make-retention-set``,
``protect-base``): SIGTERM, SIGINT or SIGHUP abandons the work in the main thread, the partial
output is not kept, and ``osft-train`` exits with 128 + the signal's number.

The handler raises in the main thread wherever it is. Where that is a finalizer (``__del__``, e.g.
of a compiled ``regex`` pattern's nodes while a tokenizer loads) or a weakref callback, Python
ignores the exception (it reports it to ``sys.unraisablehook``) and the work would go on; so within
:func:`stopped_by_signals` such an ignored stop is sent again to the main thread
(``signal.pthread_kill``, :data:`REDELIVER_S` later, from a timer thread: after the finalizer) until
it is raised where it unwinds the work."""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

#: The signals that stop such a command.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
#: Seconds after Python ignored a stop until it is sent again.
REDELIVER_S = 0.05


class ToolStopped(Exception):
    """Signal ``signum`` stopped a command before its output was complete; the message says what was
    left as it was."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}{message}")
        self.signum = signum


@contextmanager
def stopped_by_signals(stopped: Callable[[int], ToolStopped]) -> Iterator[None]:
    """Inside: each of :data:`STOP_SIGNALS` not ignored by the caller (``nohup``, a background job
    of a shell) raises ``stopped(signum)`` in the main thread, again whenever Python ignored it (see
    the module docstring); the previous handlers and ``sys.unraisablehook`` are back after. Call it
    from the main thread."""
    main, lock, inside = threading.main_thread().ident, threading.Lock(), [True]

    def stop(signum, _frame):
        raise stopped(signum)

    def send(signum: int) -> None:
        with lock:  # never once the context is left
            if inside[0]:
                signal.pthread_kill(main, signum)

    def ignored(unraisable) -> None:
        if isinstance(unraisable.exc_value, ToolStopped):
            again = threading.Timer(REDELIVER_S, send, (unraisable.exc_value.signum,))
            again.daemon = True
            again.start()
        else:
            hook(unraisable)

    previous = {s: signal.signal(s, stop) for s in STOP_SIGNALS if signal.getsignal(s) is not signal.SIG_IGN}
    hook, sys.unraisablehook = sys.unraisablehook, ignored
    try:
        yield
    finally:
        inside[0] = False  # no send starts after this
        try:
            with lock:  # one under way has ended (its stop, raised here, still puts everything back)
                pass
        finally:
            sys.unraisablehook = hook
            for s, handler in previous.items():
                signal.signal(s, handler)
