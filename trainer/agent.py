"""torchrun's agent for one node's worker group, which writes down how each failed rank ended.

``python -m osft.trainer.agent <torchrun flags> -m osft.trainer.worker <flags>`` is
``torchrun`` (:func:`torch.distributed.run.run`), except that when ranks fail it writes
``$OSFT_AGENT_FAILURES`` (JSON: per global rank, the first failure first, its local rank, pid,
exit code, the signal that killed it, and the message of its error file), prints torchrun's table of failed ranks and exits
with code 1 without a traceback: the
``osft-train`` launcher reads the file and reports which rank died and how
(:mod:`.failure_report`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from .contract import AGENT_FAILURES_ENV


def main(argv: list[str] | None = None) -> int:
    """Run torchrun with ``argv``; returns 0, or 1 after writing the ranks' failures."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from .rundir import write_json_atomic

    try:
        run(parse_args(sys.argv[1:] if argv is None else argv))
    except ChildFailedError as exc:
        first, _ = exc.get_first_failure()
        failures = {str(rank): {"local_rank": f.local_rank, "pid": f.pid, "exit_code": f.exitcode,
                                "signal": f.signal_name() if f.exitcode < 0 else None,
                                "message": f.message if os.path.isfile(f.error_file) else None}
                    for rank, f in sorted(exc.failures.items(), key=lambda item: item[0] != first)}
        if os.environ.get(AGENT_FAILURES_ENV):
            write_json_atomic(Path(os.environ[AGENT_FAILURES_ENV]), failures)
        print(exc.format_msg(), file=sys.stderr)  # torchrun's table of failed ranks, without its traceback
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
