"""The view of a run, live (``felactl launch``) or after the fact (``felactl status``)."""

from __future__ import annotations

import time
from typing import Any

from rich.table import Table
from rich.text import Text


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
