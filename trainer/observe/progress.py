"""Console progress of a training run (rich), shown on each node's LOCAL_RANK 0."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class TrainProgress:
    """A progress bar with step, loss, lr, tokens/s, MFU and orthogonality violations.

    Use as a context manager; :meth:`update` after every optimizer step. With ``enabled=False``
    nothing is printed.
    """

    def __init__(self, total_steps: int, console: Console, enabled: bool = True) -> None:
        self.enabled = enabled
        self.total_steps = total_steps
        # Not a terminal (torchrun's redirected rank logs, CI): one plain line per update instead.
        self._lines = enabled and not console.is_terminal
        self._console = console
        self._progress = Progress(
            TextColumn("[bold]step"),
            MofNCompleteColumn(),
            BarColumn(),
            TextColumn("{task.fields[stats]}"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=console,
            disable=not enabled or self._lines,
        )
        self._task = self._progress.add_task("train", total=total_steps, stats="")

    def __enter__(self) -> "TrainProgress":
        self._progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._progress.__exit__(*exc)

    def update(self, step: int, loss: float, lr: float, tokens_per_s: float, violations_total: int,
               mfu: float | None = None, evaluation: str = "") -> None:
        """Show optimizer step ``step`` (1-based) and its numbers (``mfu``: a fraction, None unknown;
        ``evaluation``: the latest evaluation loss and forgetting, as text, "" before the first)."""
        style = "red" if violations_total else "green"
        shown = "" if mfu is None else f"MFU {mfu:.1%}  "
        stats = (
            f"loss {loss:.4f}  lr {lr:.2e}  {tokens_per_s:,.0f} tok/s  {shown}"
            f"[{style}]violations {violations_total}[/{style}]" + (f"  {evaluation}" if evaluation else "")
        )
        self._progress.update(self._task, completed=step, stats=stats)
        if self._lines:
            self._console.print(f"step {step}/{self.total_steps}  {stats}", soft_wrap=True)

    def print(self, message: str) -> None:
        """Print a line above the bar."""
        if self.enabled:
            self._console.print(message)
