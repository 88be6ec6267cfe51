"""Checkpoint requests this dashboard made and waits on: at most one per kind, each answered by the
run's own records.

The trainer writes ``checkpoint_requested`` (with the signal it served) when it starts the save at
a safe point, then ``checkpoint_saved``. One save serves every request pending at that safe point,
whichever dashboard sent it: a served stop answers a pending checkpoint too. A save with no
``checkpoint_requested`` before it (a periodic one) answers nothing.
"""

from __future__ import annotations

from osft.trainer.contract import Event

#: The kinds of request: checkpoint and go on (SIGUSR1), checkpoint and stop (SIGUSR2).
CHECKPOINT, STOP = "checkpoint", "checkpoint and stop"


def kind_of(signal: str, sigusr1_action: str | None, pending: dict[str, int | None]) -> str:
    """The kind of request a ``checkpoint_requested`` record's ``signal`` served: SIGUSR1 follows
    ``--sigusr1-action``; a control file (``control``) is taken for the pending stop if there is
    one; every other signal stops."""
    if signal == "SIGUSR1":
        return STOP if sigusr1_action == "checkpoint-and-exit" else CHECKPOINT
    if signal == "control":
        return STOP if STOP in pending else CHECKPOINT
    return STOP


class PendingRequests:
    """Requests sent and not yet answered.

    Attributes:
        steps: kind -> the run's step when it was sent.
    """

    def __init__(self) -> None:
        self.steps: dict[str, int | None] = {}
        self._served: str | None = None
        self._asked_again: set[str] = set()

    def clear(self) -> None:
        """Forget every request (another run is shown)."""
        self.steps.clear()
        self._served = None
        self._asked_again.clear()

    def first_time_asked_again(self, kind: str) -> bool:
        """Whether this is the first time the pending request of ``kind`` is asked for again (the
        user is told once that it waits, not at every press)."""
        first = kind not in self._asked_again
        self._asked_again.add(kind)
        return first

    def take(self, record: dict, sigusr1_action: str | None) -> str | None:
        """Feed one ``checkpoint_requested`` or ``checkpoint_saved`` record; returns the kind of our
        request that a ``checkpoint_saved`` answers (None: not ours, or a periodic save). Only
        global rank 0's records count (each node writes its own copy)."""
        if record.get("rank", 0) != 0:
            return None
        if record.get("event") == Event.CHECKPOINT_REQUESTED:
            self._served = kind_of(str(record.get("signal")), sigusr1_action, self.steps)
            return None
        kind, self._served = self._served, None
        if kind is None:
            return None
        answered = [k for k in ([kind, CHECKPOINT] if kind == STOP else [kind]) if k in self.steps]
        for k in answered:
            del self.steps[k]
            self._asked_again.discard(k)
        return kind if answered else None
