"""The run line: the read-only badge, directory, state (as :func:`~..status.judge` weighs it), step /
max steps, then what a narrow terminal must not cut first: the stall warning, the ETA, why when the
state is not simply run.json's; then the age of the last step, elapsed time and the job's samples/s."""

from __future__ import annotations

from osft.trainer.contract import RunState
from rich.text import Text
from textual.widgets import Static

from ..format import fmt_duration, fmt_rate
from ..run_state import RunModel
from ..status import GONE, Status

#: Colour of each state.
STATE_STYLE = {RunState.RUNNING: "green", RunState.CHECKPOINTING: "yellow", RunState.STARTING: "cyan",
               RunState.STOPPED: "yellow", RunState.COMPLETED: "green", RunState.FAILED: "bold red", "dead": "bold red", "launch failed": "bold red",
               "unreadable run.json": "bold red",
               GONE: "bold red", "stale": "yellow"}


class RunHeader(Static):
    """One line about the whole run; :meth:`show` redraws it."""

    def show(self, model: RunModel | None, status: Status | None, readonly: bool = False) -> None:
        """Redraw from ``model`` and its ``status`` (None: no run)."""
        badge = Text.assemble((" read-only ", "bold reverse"), " ") if readonly else Text("")
        if model is None or status is None:
            self._draw(Text.assemble(badge, "no run" if readonly else "no run: press n for a new run"))
            return
        text = Text.assemble(badge, ("run ", "dim"), (str(model.root), "bold"), "  ",
                             (status.state, STATE_STYLE.get(status.state, "")))
        step = "-" if status.step is None else str(status.step)
        text.append(f"  step {step}/{model.max_steps or '?'}")
        # what matters most first (a narrow terminal cuts the end): the stall, the ETA, the reason
        if status.stalled:
            text.append(" (stalled?)", "bold yellow")
        if status.eta_s is not None:
            text.append(f"  ETA {fmt_duration(status.eta_s)}")
        if status.detail:
            text.append(f"  {status.detail}", "red" if "red" in STATE_STYLE.get(status.state, "") else "yellow")
        if status.last_step_age_s is not None and status.state in (RunState.RUNNING, RunState.CHECKPOINTING):
            text.append(f"  last step {fmt_duration(status.last_step_age_s)} ago",
                        "bold yellow" if status.stalled else "dim")
        text.append(f"  elapsed {fmt_duration(status.elapsed_s)}")
        samples = next((s.samples_per_s for _, s in sorted(model.nodes.items()) if s.samples_per_s is not None), None)
        if samples is not None:  # the job's rate (the records carry no per-node value): once, here
            text.append(f"  {fmt_rate(samples, 2)} samples/s")
        self._draw(text)

    def _draw(self, text: Text) -> None:
        """Show ``text`` unless it is already shown (the reader polls 4 times a second, the line
        changes at most once a second); height 1 (CSS): no screen layout."""
        if text != getattr(self, "_shown_text", None):
            self._shown_text = text
            self.update(text, layout=False)
