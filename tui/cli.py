"""``osft-tui``: the command line.

``osft-tui`` opens the new-run form (prefilled with the demo job); ``osft-tui RUN_DIR`` attaches
to a run directory; ``osft-tui DIR`` on a directory of run directories lists them (the run
browser). Exit codes: 0 quit; 1 the dashboard ended on an error (its traceback is printed); 2 bad
arguments; 128 + N ended by signal N (SIGTERM, SIGHUP), after restoring the terminal and leaving
the run running; such a signal during start-up is held and ends the app as soon as it runs.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from osft.trainer.checkpoint.signals import hold_signals, take_held_signals

from .ending import ENDING_SIGNALS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="osft-tui", description="Launch, watch, checkpoint and resume osft training runs.")
    parser.add_argument("run_dir", nargs="?", type=Path, help="run directory (--output-dir of a run) to attach to, or a directory of run directories "
                             "to choose one from")
    parser.add_argument("--readonly", action="store_true", help="watch only: no key sends a signal")
    parser.add_argument("--poll-interval", type=float, default=0.25, metavar="S",
                        help="seconds between reads of the run directory (default 0.25)")
    parser.add_argument("--launcher", default=None, metavar="CMD",
                        help="command that runs osft-train when launching or resuming (default: this Python's "
                             "osft-train), e.g. a wrapper script")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``osft-tui``; returns the exit code."""
    hold_signals(ENDING_SIGNALS)  # before Textual is imported: the app ends on them once it runs
    try:
        return _main(argv)
    finally:
        take_held_signals()


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.run_dir is not None and not args.run_dir.is_dir():
        parser.error(f"{args.run_dir}: not a directory (a run's --output-dir)")
    if not args.poll_interval > 0:
        parser.error("--poll-interval must be positive")
    from .app import OsftTui

    app = OsftTui(args.run_dir, shlex.split(args.launcher) if args.launcher else None, args.readonly, args.poll_interval)
    code = app.run()
    if isinstance(code, int):
        return code
    return app.return_code or 0  # 1 when the app ended on an exception (Textual printed it)


if __name__ == "__main__":
    sys.exit(main())
