"""Orthogonality-violation counters: this step, total, worst deviation; alert state when non-zero."""

from __future__ import annotations

from textual.widgets import Static

from ..run_state import Violations


class ViolationCounters(Static):
    """Shows :class:`~osft.tui.run_state.Violations`; has CSS class ``alert`` while a violation is
    recent (:attr:`~osft.tui.run_state.Violations.alert`; the trainer re-projects each step, so a
    violation means the frozen subspace moved)."""

    def show(self, v: Violations) -> None:
        """Redraw from ``v`` when it differs from what is shown (it changes only with a step record)."""
        if v == getattr(self, "_shown_violations", None):
            return
        self._shown_violations = v
        worst = "-" if v.worst_dev_deg is None else f"{v.worst_dev_deg:.3f}°"
        last = "" if v.last_at is None else f" (last at step {v.last_at})"
        self.update(f"orthogonality violations  this step [b]{v.this_step}[/b]  total [b]{v.total}[/b]{last}"
                    f"  worst deviation from 90° [b]{worst}[/b]", layout=False)  # height 1 (CSS)
        self.set_class(v.alert, "alert")
