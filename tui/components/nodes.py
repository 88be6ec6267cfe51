"""Per-node table: step, throughput (the straggler marked on its row), step time, loss, lr, grad
norm, MFU, CPU and memory."""

from __future__ import annotations

from rich.text import Text

from ..format import fit_name, fmt_bytes, fmt_compact, fmt_num
from ..run_state import NodeStats, RunModel
from .sortable import SortableTable

#: Columns, most telling first (an 80-column terminal shows the first seven), and their widths
#: (fixed, so the header never lags rows that arrive later).
COLUMNS = (("node", 9), ("host", 10), ("step", 6), ("tokens/s", 8), ("step time", 9), ("loss", 7), ("lr", 8),
           ("grad norm", 9), ("MFU", 4), ("ranks", 5), ("CPU %", 5), ("RSS", 8), ("GPU mem", 8))
HOST_WIDTH = dict(COLUMNS)["host"]
#: How a straggler's node and tokens/s cells look.
SLOW = "b red"
#: How a stalled node's cell looks.
STALLED = "b yellow"


class NodeTable(SortableTable):
    """One row per node (key ``node<N>``, column keys the names in :data:`COLUMNS`). A straggler
    (:meth:`~..run_state.RunModel.stragglers`) reads ``N slow`` in red, its tokens/s in red. CPU %
    and RSS are psutil's, summed over the node's ranks on this host; for a node on another host
    RSS is its reporting rank's ``rss_bytes``. Fixed formats: a cell never changes its precision.
    A click on a column's header sorts by it (:class:`~.sortable.SortableTable`).

    Its height (header and rows, CSS caps it) is set when the number of rows changes, not left to
    ``height: auto``: with that, every cell update laid the whole screen out again (under a flood,
    ``benchmarks/bench_tui.py --quick`` measured about 0.7 s from key to screen at p95 instead of 0.1-0.4 s).
    """

    home = ("node", False)

    def on_mount(self) -> None:
        self.cursor_type = "row"
        self.fixed_columns = 1  # the node stays when the table scrolls sideways
        for name, width in COLUMNS:
            self.add_column(name, key=name, width=width)

    def show(self, model: RunModel, usage: dict[int, tuple[float | None, int | None]],
             stalled: set[int] = frozenset()) -> None:
        """Redraw every row; ``usage`` maps node rank to (CPU %, RSS bytes) measured here; the nodes in
        ``stalled`` (:func:`~..status.stalled_nodes`) read ``N stalled``."""
        slow, moved = model.stragglers(), False
        nodes = sorted(set(model.nodes) | {r.node_rank for r in model.ranks.values()})
        for n in nodes:
            s = model.nodes.get(n) or NodeStats(n)
            ranks = sorted(r.rank for r in model.ranks.values() if r.node_rank == n and r.job_id == model.job_id)
            cpu, rss = usage.get(n, (None, None))
            host = s.hostname if n in model.nodes else next((r.hostname for r in model.ranks.values() if r.node_rank == n), "?")
            tokens = fmt_compact(s.tokens_per_s)
            row = (
                f"[{STALLED}]{n} stalled[/]" if n in stalled else f"[{SLOW}]{n} slow[/]" if n in slow else str(n),
                Text(fit_name(host, HOST_WIDTH)),
                "-" if s.step is None else str(s.step),
                f"[{SLOW}]{tokens}[/]" if n in slow else tokens,
                fmt_num(s.step_time_s, ".2f") + (" s" if s.step_time_s is not None else ""),
                fmt_num(s.loss, ".4f"), fmt_num(s.lr, ".2e"), fmt_num(s.grad_norm, ".3f"),
                "-" if s.mfu is None else f"{s.mfu:.0%}",
                _ranks(ranks),
                "-" if cpu is None else f"{cpu:.0f}",
                fmt_bytes(rss if rss is not None else s.rss_bytes), fmt_bytes(s.gpu_mem_bytes),
            )
            key = f"node{n}"
            if key in self.rows:
                for (name, _), value in zip(COLUMNS, row):
                    if self.get_cell(key, name) != value:  # an unchanged cell costs a redraw too
                        self.update_cell(key, name, value)
                        moved = moved or (self.sorted_by is not None and self.sorted_by[0] == name)
            else:
                self.add_row(*row, key=key)
                moved = True
        if moved:
            self.resort()
        height = max(2, self.row_count + 1)
        if self.styles.height is None or self.styles.height.value != height:
            self.styles.height = height


def _ranks(ranks: list[int]) -> str:
    """``0-3`` for a contiguous list, else ``0,2``."""
    if not ranks:
        return "-"
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 1:
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))
