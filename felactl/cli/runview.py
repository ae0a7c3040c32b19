"""The view of a run, live (``felactl launch``) or after the fact (``felactl status``)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text


@contextlib.contextmanager
def live_run(console: Console, title: Callable[[str], str]) -> Iterator[Callable[[Any], None]]:
    """The ``on_update`` of a training run (it takes the launcher's ``LaunchState``): the run's
    table, titled ``title(run_id)``, redrawn in place on a terminal. Elsewhere (a log, a pipe) the
    last table is printed once when the run ends, on lines of its own: rich's Live writes it there
    without a final newline, and the next line (the launch's result) was glued to it. Either way
    the table left on screen is drawn when the run has ended (finished, failed or stopped), from
    every step recorded by then: what the stop line and felactl status say."""

    def view(state) -> Table | None:
        summary = state.summary_so_far()
        return None if summary is None else run_table(summary, title(state.run.run_id))

    last: dict[str, Any] = {}
    if console.is_terminal:
        with Live(console=console, refresh_per_second=4, transient=False) as live:

            def redraw(state) -> None:
                last.update(state=state)
                table = view(state)
                if table is not None:
                    live.update(table)

            try:
                yield redraw
            finally:  # the steps since the last redraw (a graceful stop's drain trains a few)
                table = view(last["state"]) if last else None
                if table is not None:
                    live.update(table, refresh=True)
        return
    try:
        yield lambda state: last.update(state=state)
    finally:
        table = view(last["state"]) if last else None
        if table is not None:
            console.print(table)


def run_table(summary: dict[str, Any], title: str) -> Table:
    """Step, loss and samples/s; then a line per worker with its share of the work and its waiting."""
    loss = summary.get("final_loss")
    caption = (
        f"step {summary.get('steps', 0)}   loss {loss:.4f}   "
        if loss is not None
        else f"step {summary.get('steps', 0)}   "
    ) + f"{summary.get('samples_per_s', 0.0):.1f} samples/s   compute {summary.get('compute_fraction', 0.0):.0%}"
    table = Table(title=title, caption=caption, title_justify="left", caption_justify="left")
    for col in ("rank", "stage", "steps", "samples", "share", "tokens", "compute s", "comm s", "wait s"):
        table.add_column(col, justify="right")
    workers = summary.get("workers", [])
    total_samples = sum(w["samples"] for w in workers) or 1
    for w in workers:
        table.add_row(
            str(w["rank"]),
            str(w.get("stage", 0)),
            str(w["steps"]),
            str(w["samples"]),
            f"{w['samples'] / total_samples:.0%}",
            str(w.get("tokens", 0)),
            f"{w['compute_s']:.2f}",
            f"{w['comm_s']:.2f}",
            f"{w['wait_s']:.2f}",
        )
    return table


def events_table(events: list[dict[str, Any]]) -> Table:
    table = Table(title="events", title_justify="left")
    for col in ("time", "kind", "details"):
        table.add_column(col)
    for e in events:
        details = ", ".join(f"{k}={v}" for k, v in e.items() if k not in ("time", "kind"))
        table.add_row(
            time.strftime("%H:%M:%S", time.localtime(e.get("time", 0))),
            e.get("kind", "?"),
            Text(details, overflow="fold"),
        )
    return table
