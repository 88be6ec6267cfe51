"""torchrun's agent for one node's worker group, which writes down how each failed rank ended.

``python -m osft.trainer.launch.agent <torchrun flags> -m osft.trainer.worker <flags>`` is
``torchrun`` (:func:`torch.distributed.run.run`), except that when ranks fail it writes
``$OSFT_AGENT_FAILURES`` (JSON: per global rank, the cause first (:func:`cause_first`), its local rank, pid,
exit code, the signal that killed it, and the message of its error file), prints torchrun's table of failed ranks and exits
with code 1 without a traceback: the
``osft-train`` launcher reads the file and reports which rank died and how
(:mod:`osft.trainer.launch.failure_report`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ..contract import AGENT_FAILURES_ENV


def cause_first(failures: dict) -> list:
    """``(rank, failure)`` pairs of torchrun's ``ProcessFailure`` by ``failures`` (global rank ->
    failure), the likely cause first: the earliest seen (``timestamp``, whole seconds), and among
    those seen together a rank killed by a signal other than SIGTERM (SIGKILL from the OOM killer
    or a user, SIGSEGV, SIGABRT) before ranks that exited with an error. A rank's death makes its
    peers' collectives fail at once, and those peers often exit in the same monitor interval; the
    agent itself stops the remaining ranks with SIGTERM, so SIGTERM marks a follower.
    (tests/test_stop_rule.py::test_a_dead_rank_ends_with_one_paragraph_and_a_worker_holds_start_up_signals)"""
    def key(item):
        rank, f = item
        killed = f.exitcode < 0 and f.signal_name() != "SIGTERM"
        return (f.timestamp, not killed, rank)

    return sorted(failures.items(), key=key)


def main(argv: list[str] | None = None) -> int:
    """Run torchrun with ``argv``; returns 0, or 1 after writing the ranks' failures."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from ..rundir import write_json_atomic

    try:
        run(parse_args(sys.argv[1:] if argv is None else argv))
    except ChildFailedError as exc:
        failures = {str(rank): {"local_rank": f.local_rank, "pid": f.pid, "exit_code": f.exitcode,
                                "signal": f.signal_name() if f.exitcode < 0 else None,
                                "message": f.message if os.path.isfile(f.error_file) else None}
                    for rank, f in cause_first(exc.failures)}
        if os.environ.get(AGENT_FAILURES_ENV):
            write_json_atomic(Path(os.environ[AGENT_FAILURES_ENV]), failures)
        print(exc.format_msg(), file=sys.stderr)  # torchrun's table of failed ranks, without its traceback
        return 1
    return 0


if __name__ == "__main__":
    from .quick_exit import exit_without_final_gc

    exit_without_final_gc(main())
