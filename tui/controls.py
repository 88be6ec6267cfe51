"""The dashboard's controls: a widget without a picture that runs the flows behind the keys of
:data:`~.keys.CONTROLS` and posts what happened (:mod:`.messages`) to the dashboard.

The flows act on a run only through signals and ``control/`` files (:mod:`.processes`) and by
starting ``osft-train`` launchers (:mod:`.launch`): requests in :mod:`.request_flow`, launches and
resumes in :mod:`.launch_flow`, logs, copy, help and quit in :mod:`.screen_flow`.
"""

from __future__ import annotations

from pathlib import Path

from textual.widget import Widget

from .flow import Shown
from .keys import Control
from .launch_flow import LaunchFlow
from .request_flow import RequestFlow
from .screen_flow import ScreenFlow


class Controls(Widget):
    """The control flows of a dashboard; mounted in it (hidden), so that their messages bubble to it.

    Args:
        launcher: the command that runs ``osft-train`` (the launcher).
        readonly: quit at once (``--readonly``: nothing may stop or kill a run).
        runs: the directory of runs the run was chosen from (``escape`` lists them again), or None.

    Attributes:
        requests: checkpoint, stop, evaluate, kill, and the answers to requests.
        launches: new run, resume, and the launchers started here.
        screens: logs, copy, help, quit.
    """

    DEFAULT_CSS = "Controls { display: none; }"

    def __init__(self, launcher: list[str], readonly: bool = False, runs: Path | None = None) -> None:
        super().__init__(id="controls")
        self.requests = RequestFlow(self)
        self.launches = LaunchFlow(self, launcher, self.requests)
        self.screens = ScreenFlow(self, self.requests, self.launches, readonly, runs)

    def run(self, control: Control, shown: Shown) -> None:
        """Run ``control``'s flow (not a ``view`` control) on what is ``shown``."""
        getattr(getattr(self, control.flow), control.action)(shown)
