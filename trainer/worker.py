"""torchrun entry point of one rank: ``torchrun --nproc-per-node K -m osft.trainer.worker <flags>``.

Takes the same flags as ``osft-train`` (the launch flags are ignored: torchrun already placed this
process). Exit codes: 0 completed, 1 failed (the error is also written to the metrics as an
``error`` record by whichever rank raised it), 2 bad input.
"""

from __future__ import annotations

import sys
import traceback

from rich.console import Console

from .config import build_parser, check_config, config_from_args
from .config_file import ConfigFileError, config_to_yaml, parse_with_config_file


def main(argv: list[str] | None = None) -> int:
    """Run this rank's part of the job; returns the exit code."""
    from .data.validate import DataValidationError
    from .loop import Trainer
    from .monitor import EXIT_DIVERGED

    console = Console(stderr=True)
    try:
        args = parse_with_config_file(build_parser("osft.trainer.worker"), sys.argv[1:] if argv is None else argv)
    except ConfigFileError as exc:
        console.print(f"osft worker: error: {exc}", markup=False, highlight=False, soft_wrap=True)
        return 2
    cfg = config_from_args(args)
    if args.print_config:
        sys.stdout.write(config_to_yaml(cfg))
        return 0
    try:
        check_config(cfg)
        trainer = Trainer(cfg, console)
    except (ValueError, FileNotFoundError) as exc:
        console.print(f"osft worker: error: {exc}", markup=False, highlight=False, soft_wrap=True)
        return 2
    try:
        trainer.prepare()
        result = trainer.run()
    except (DataValidationError, ValueError, FileNotFoundError) as exc:
        trainer.metrics.log("error", message=str(exc), exit_code=2)
        console.print(f"osft worker: error: {exc}", markup=False, highlight=False, soft_wrap=True)
        return 2
    except BaseException as exc:
        # An uncaught exception ends the interpreter with exit code 1; the record says so for watchers.
        code = exc.code if isinstance(exc, SystemExit) else 1
        trainer.metrics.log("error", message=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc(),
                            exit_code=code)
        raise
    # A stop on request exits 0 (the launcher reads exit code 75 from the run_finished record); a
    # divergence fails the worker group.
    return EXIT_DIVERGED if result.exit_code == EXIT_DIVERGED else 0


if __name__ == "__main__":
    sys.exit(main())
