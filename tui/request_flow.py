"""The request flows: checkpoint (``c``), checkpoint and stop (``s``), evaluate (``e``) and kill
(``K``), and the answers the run's records give to the requests sent.

Requests follow the roles of docs/architecture.md section 6 (:func:`~.processes.send_request`):
one signal to one process of the job asks the whole job; without a process on this host, a file
in ``control/``.
"""

from __future__ import annotations

import signal

from .components.modals import Choice
from .flow import Flow, Shown, gone
from .messages import Offered
from .processes import kill as kill_processes
from .processes import request_evaluation, send_request, this_host
from .requests import CHECKPOINT, STOP, PendingRequests


class RequestFlow(Flow):
    """Requests to a run and their answers.

    Attributes:
        pending: requests waiting for their checkpoint, one per kind.
    """

    def __init__(self, host) -> None:
        super().__init__(host)
        self.pending = PendingRequests()

    def unavailable(self, shown: Shown) -> str | None:
        """Why ``c``, ``s``, ``e`` and ``K`` cannot act now (None when they can): no run, its
        directory gone, or no process of the run alive on this host while its run.json names this
        host (a run on another host is asked through ``control/``)."""
        run = shown.run
        if run is None:
            return "no run"
        if run.gone:
            return gone(run.root)
        remote = bool(run.launchers) and not any(this_host(i.hostname) for i in run.launchers.values())
        if shown.live or remote:
            return None
        return f"no process of the run is alive on this host (run.json: {run.state})"

    def answer(self, record: dict, shown: Shown) -> None:
        """A ``checkpoint_requested`` or ``checkpoint_saved`` record arrived: a save that serves a
        pending request of ours answers it, in one toast titled with the request's kind."""
        action = (shown.run.run.config or {}).get("sigusr1_action") if shown.run else None
        kind = self.pending.take(record, action)
        if kind is not None:
            self.tell(f"checkpoint of step {record.get('step')} written to {record.get('path')}", title=kind)

    def request(self, shown: Shown, signum: int, kind: str) -> None:
        """Send the run a checkpoint request (``signum``: SIGUSR1 or SIGUSR2) unless one of its kind
        is pending (that is said once), and wait for its save."""
        why = self.unavailable(shown)
        if why is not None or shown.run is None or shown.view is None:
            self.tell(f"{kind}: nothing sent: {why}", severity="warning")
            return
        if kind in self.pending.steps:
            at = self.pending.steps[kind]
            if self.pending.first_time_asked_again(kind):
                self.tell(f"{kind} already requested at step {at if at is not None else 0}; waiting for its checkpoint",
                          title=kind)
            return
        try:
            what = send_request(shown.view, signum)
        except OSError as exc:
            self.tell(f"could not request a checkpoint: {exc}", severity="error")
            return
        step = shown.run.step
        self.pending.steps[kind] = step
        self.host.post_message(Offered())  # dimmed at once, not at the next once-a-second redraw
        message = f"{kind} requested at step {step if step is not None else 0}: {what}"
        self.say(message, "bold cyan")
        self.tell(message, title=kind)

    def checkpoint(self, shown: Shown) -> None:
        """Checkpoint now (SIGUSR1); training continues."""
        self.request(shown, signal.SIGUSR1, CHECKPOINT)

    def stop(self, shown: Shown) -> None:
        """Checkpoint and stop (SIGUSR2); the launcher exits with ``EXIT_STOPPED`` after a complete
        checkpoint."""
        self.request(shown, signal.SIGUSR2, STOP)

    def evaluate(self, shown: Shown) -> None:
        """Ask the run to evaluate its evaluation and retention sets at the next step boundary
        (``control/evaluate``, read by rank 0 wherever it runs); training goes on."""
        why = self.unavailable(shown)
        if why is not None or shown.run is None:
            self.tell(f"evaluate: nothing requested: {why}", severity="warning")
            return
        try:
            path = request_evaluation(shown.run.root)
        except OSError as exc:
            self.tell(f"could not request an evaluation: {exc}", severity="error")
            return
        step = shown.run.step
        message = f"evaluation requested at step {step if step is not None else 0}: wrote {path}"
        self.say(message, "bold cyan")
        self.tell(message, title="evaluate")

    def kill(self, shown: Shown) -> None:
        """SIGKILL every process of the run on this host, after a confirmation listing the pids."""
        if shown.view is None:
            self.tell("no run", severity="warning")
            return
        targets = shown.view.kill_targets()
        if not targets:
            self.tell("no process of this run runs on this host", severity="warning")
            return
        body = [f"SIGKILL to pid {t.pid}: {t.role}" for t in targets]
        body.append("No checkpoint is written: training since the last checkpoint is lost.")

        def done(answer: str | None) -> None:
            if answer == "kill":
                left = kill_processes(targets)
                msg = f"killed {len(targets) - len(left)} processes" + (f"; still alive: {left}" if left else "")
                self.tell(msg, severity="error" if left else "information")
                self.say(msg, "bold red")

        self.host.app.push_screen(Choice(f"Kill {len(targets)} processes?", body,
                                         [("cancel", "cancel", "primary"), ("kill", "kill", "error")]), done)
