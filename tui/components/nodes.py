"""Per-node table (throughput, MFU, loss, CPU, memory, straggler flag) and the history sparklines."""

from __future__ import annotations

from rich.markup import escape
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import DataTable, Label, Sparkline

from ..run_state import RunModel
from ..format import fmt_bytes, fmt_rate

COLUMNS = ("node", "host", "ranks", "step", "tokens/s", "MFU", "samples/s", "loss", "CPU %", "RSS", "GPU mem", "")
#: Column widths (fixed, so the header never lags rows that arrive later).
WIDTHS = (4, 10, 5, 6, 9, 5, 9, 7, 5, 8, 8, 9)


class NodeTable(DataTable):
    """One row per node (key ``node<N>``). CPU % and RSS are psutil's, summed over the node's
    ranks on this host; for a node on another host RSS is its reporting rank's ``rss_bytes``."""

    def on_mount(self) -> None:
        self.cursor_type = "row"
        for name, width in zip(COLUMNS, WIDTHS):
            self.add_column(name, key=name or "flag", width=width)

    def show(self, model: RunModel, usage: dict[int, tuple[float | None, int | None]]) -> None:
        """Redraw every row; ``usage`` maps node rank to (CPU %, RSS bytes) measured here."""
        slow = model.stragglers()
        nodes = sorted(set(model.nodes) | {r.node_rank for r in model.ranks.values()})
        for n in nodes:
            stats = model.nodes.get(n)
            ranks = sorted(r.rank for r in model.ranks.values() if r.node_rank == n and r.job_id == model.job_id)
            cpu, rss = usage.get(n, (None, None))
            host = stats.hostname if stats else next((r.hostname for r in model.ranks.values() if r.node_rank == n), "?")
            row = (
                str(n), escape(host), _ranks(ranks),
                "-" if stats is None or stats.step is None else str(stats.step),
                fmt_rate(stats.tokens_per_s if stats else None),
                "-" if stats is None or stats.mfu is None else f"{stats.mfu:.0%}",
                fmt_rate(stats.samples_per_s if stats else None),
                "-" if stats is None or stats.loss is None else f"{stats.loss:.4f}",
                "-" if cpu is None else f"{cpu:.0f}",
                fmt_bytes(rss if rss is not None else (stats.rss_bytes if stats else None)),
                fmt_bytes(stats.gpu_mem_bytes) if stats and stats.gpu_mem_bytes is not None else "-",
                "[b red]straggler[/]" if n in slow else "",
            )
            key = f"node{n}"
            if key in self.rows:
                for name, value in zip(COLUMNS, row):
                    if self.get_cell(key, name or "flag") != value:  # an unchanged cell costs a redraw too
                        self.update_cell(key, name or "flag", value)
            else:
                self.add_row(*row, key=key)


def _ranks(ranks: list[int]) -> str:
    """``0-3`` for a contiguous list, else ``0,2``."""
    if not ranks:
        return "-"
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 1:
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


class Histories(Vertical):
    """A tokens/s sparkline per node and the loss sparkline (node 0's step records)."""

    def compose(self) -> ComposeResult:
        yield Label("loss", classes="history-label", id="loss-label")
        yield Sparkline([], id="loss-history")

    def reset(self) -> None:
        """Forget every node's sparkline and the loss history (another run is shown)."""
        for spark in self.query(".node-history"):
            spark.remove()
        self.query_one("#loss-history", Sparkline).data = []

    def show(self, model: RunModel) -> None:
        """Update the sparklines, mounting one for each node seen for the first time."""
        for n, stats in sorted(model.nodes.items()):
            spark_id = f"tokens-node{n}"
            found = self.query(f"#{spark_id}")
            if not found:
                self.mount(Label(f"node {n} tokens/s", classes="history-label node-history"),
                           Sparkline(list(stats.tokens_history), id=spark_id, classes="node-history"),
                           before="#loss-label")
            else:
                found.first(Sparkline).data = list(stats.tokens_history)
        self.query_one("#loss-history", Sparkline).data = list(model.loss_history)
