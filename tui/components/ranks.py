"""Per-rank table: pid, host, state (running, exited with its code), CPU % and RSS from psutil, and on
CUDA ranks the GPU's utilisation and memory from the node's latest step record (``gpus``)."""

from __future__ import annotations

from osft.trainer.checkpoint.signals import signal_name
from osft.trainer.contract import ended_well
from rich.text import Text
from textual.coordinate import Coordinate

from ..format import fit_name, fmt_bytes
from .sortable import SortableTable
from ..processes import ProcStats
from ..run_state import RankInfo

#: Rank and state first: an 80-column terminal shows both.
COLUMNS = ("rank", "state", "node", "local", "pid", "host", "CPU %", "RSS", "GPU %", "GPU mem")
#: Column widths (fixed, so the header never lags rows that arrive later).
WIDTHS = (4, 20, 4, 5, 8, 10, 6, 9, 5, 9)
#: How a failed or killed rank's state looks.
ALARM = "b red"


class RankTable(SortableTable):
    """One row per rank of the current job (key ``rank<R>``); a click on a column's header sorts by it."""

    home = ("rank", False)

    def on_mount(self) -> None:
        self.cursor_type = "row"
        self.fixed_columns = 1  # the rank stays when the table scrolls sideways
        for name, width in zip(COLUMNS, WIDTHS):
            self.add_column(name, key=name, width=width)

    def show(self, ranks: list[RankInfo], stats: dict[int, ProcStats | None], node_codes: dict[int, int],
             gpus: dict[int, dict] | None = None) -> None:
        """Redraw; ``stats[rank]`` is None for a rank on another host; ``node_codes`` maps each node
        whose launcher ended to its exit code; ``gpus[rank]``: its GPU in the step records
        (:meth:`..run_state.RunModel.gpus_by_rank`; a rank without one shows ``-``)."""
        moved = False
        for info in ranks:
            s, gpu = stats.get(info.rank), (gpus or {}).get(info.rank, {})
            util = gpu.get("util_pct")
            row = (str(info.rank), rank_state(info, s, node_codes.get(info.node_rank)), str(info.node_rank),
                   str(info.local_rank), str(info.pid), Text(fit_name(info.hostname, WIDTHS[COLUMNS.index("host")])),
                   "-" if not s or s.cpu_percent is None else f"{s.cpu_percent:.0f}",
                   fmt_bytes(s.rss_bytes) if s and s.rss_bytes is not None else "-",
                   "-" if util is None else f"{util:.0f}", fmt_bytes(gpu.get("mem_bytes")))
            key = f"rank{info.rank}"
            if key in self.rows:
                for name, value in zip(COLUMNS, row):
                    if self.get_cell(key, name) != value:  # an unchanged cell costs a redraw too
                        self.update_cell(key, name, value)
                        moved = moved or (self.sorted_by is not None and self.sorted_by[0] == name)
            else:
                self.add_row(*row, key=key)
                moved = True
        if moved:
            self.resort()

    def selected_rank(self) -> int | None:
        """The rank under the cursor, if any (whatever the sort)."""
        if not 0 <= self.cursor_row < self.row_count:
            return None
        return int(str(self.coordinate_to_cell_key(Coordinate(self.cursor_row, 0)).row_key.value).removeprefix("rank"))


def rank_state(info: RankInfo, stats: ProcStats | None, node_code: int | None = None) -> Text:
    """``running``, ``exited (code N)``, ``failed: message`` (red), ``ended (node code N)`` (a
    rank that wrote no exit record of its own, of a node whose launcher ended), or ``remote``
    (another host); the rank's error message is plain text."""
    if info.exit_code is None and not info.error and node_code is not None and not (stats and stats.alive):
        ended = f"ended (node code {node_code})"
        return Text(ended, "" if ended_well(node_code) else ALARM)
    if stats is None:
        return Text("remote" if info.exit_code is None else f"exited (code {info.exit_code})")
    if stats.alive:
        return Text("running")
    if info.error:
        code = "" if info.exit_code is None else f" (exit code {info.exit_code})"
        return Text.assemble((f"failed{code}", ALARM), ": ", info.error[:60])
    if info.exit_code is not None and info.exit_code < 0:
        try:
            by = signal_name(-info.exit_code)
        except ValueError:
            by = f"signal {-info.exit_code}"
        return Text.assemble((f"killed by {by}", ALARM), f" (exit code {info.exit_code})")
    if info.exit_code is not None:
        exited = f"exited (code {info.exit_code})"
        return Text(exited, "" if ended_well(info.exit_code) else ALARM)
    return Text.assemble(("gone", ALARM), " (no exit record)")
