"""The run line: directory, state, elapsed time, step / max steps and ETA."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from ..run_state import RunModel
from ..format import fmt_duration

#: Colour of each run.json state.
STATE_STYLE = {"running": "green", "checkpointing": "yellow", "starting": "cyan", "stopped": "yellow",
               "completed": "green", "failed": "bold red"}


class RunHeader(Static):
    """One line about the whole run; :meth:`show` redraws it."""

    def show(self, model: RunModel | None, live: bool | None) -> None:
        """Redraw from ``model``; ``live`` says whether a process of the run runs on this host
        (None: unknown, e.g. the run is on another host)."""
        if model is None:
            self.update("no run: press n for a new run", layout=False)
            return
        state = model.state
        text = Text.assemble(("run ", "dim"), (str(model.root), "bold"), "  ", (state, STATE_STYLE.get(state, "")))
        if live is False and state in ("starting", "running", "checkpointing"):
            text.append(" (no process left on this host)", "bold red")
        step = "-" if model.step is None else str(model.step)
        text.append(f"  step {step}/{model.max_steps or '?'}")
        text.append(f"  elapsed {fmt_duration(model.elapsed_s())}")
        if not model.finished:
            text.append(f"  ETA {fmt_duration(model.eta_s())}")
        self.update(text, layout=False)  # height 1 (CSS): no screen layout per poll
