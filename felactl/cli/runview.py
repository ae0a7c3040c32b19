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
def live_run(
    console: Console,
    title: Callable[[str], str],
    steps: int | None = None,
    *,
    clock: Callable[[], float] = time.monotonic,
) -> Iterator[Callable[[Any], None]]:
    """The ``on_update`` of a training run (it takes the launcher's ``LaunchState``): the run's
    table, titled ``title(run_id)``, redrawn in place on a terminal. Elsewhere (a log, a pipe) a
    plain progress line every few seconds (:class:`ProgressLines`, of ``steps``), and the last
    table once when the run ends, on lines of its own: rich's Live writes it there without a
    final newline, and the next line (the launch's result) was glued to it. Either way the table
    left on screen is drawn when the run has ended (finished, failed or stopped), from every step
    recorded by then: what the stop line and felactl status say."""

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
    lines = ProgressLines(console, steps, clock=clock)

    def remember(state) -> None:
        last.update(state=state)
        lines(state)

    try:
        yield remember
    finally:
        table = view(last["state"]) if last else None
        if table is not None:
            console.print(table)


class ProgressLines:
    """Where there is no terminal to redraw a table on (stderr piped to a log), a plain line
    every :data:`every_s` seconds, the first :data:`first_s` after the start, as pip and
    torchrun print theirs: a log that said nothing for minutes after "training 300 steps" looked
    hung. Each says the step, the loss, samples/s and, given the run's ``steps``, the ETA."""

    first_s = 3.0
    every_s = 10.0

    def __init__(self, console: Console, steps: int | None, *, clock: Callable[[], float] = time.monotonic):
        self.console, self.steps, self.clock = console, steps, clock
        self.next_at = clock() + self.first_s

    def __call__(self, state) -> None:
        now = self.clock()
        if now < self.next_at:
            return
        summary = state.summary_so_far()
        if summary is None:  # no step yet: the first line comes with the first step
            return
        self.console.print(progress_line(summary, state.records, self.steps), markup=False, highlight=False)
        self.next_at = now + self.every_s


def progress_line(summary: dict[str, Any], records: list[dict[str, Any]], steps: int | None) -> str:
    """``step 40/300   loss 2.1234   512.0 samples/s   ETA 0:01:04`` (the ETA at the recent step rate)."""
    from felactl.control.metrics import progress

    loss = summary.get("final_loss")
    line = f"step {summary['steps']}" + (f"/{steps}" if steps else "")
    line += (f"   loss {loss:.4f}" if loss is not None else "") + f"   {summary['samples_per_s']:.1f} samples/s"
    eta = progress(summary, records, steps)["eta_s"] if steps else None
    return line + (f"   ETA {duration(eta)}" if eta is not None else "")


def duration(seconds: float) -> str:
    """``0:02:15`` as tqdm writes it, up to 99 hours; then days, then years (a run's --steps may
    not finish within the age of the universe: it is allowed, and this says so)."""
    if seconds < 100 * 3600:
        whole = round(seconds)
        return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"
    days = seconds / 86400
    return f"{days:.3g} days" if days < 1000 else f"{days / 365.25:.3g} years"


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
    # each worker's share of its own stage's samples: a pipeline's stages each compute every sample
    stage_samples: dict[int, int] = {}
    for w in workers:
        stage_samples[w.get("stage", 0)] = stage_samples.get(w.get("stage", 0), 0) + w["samples"]
    for w in workers:
        of_stage = stage_samples[w.get("stage", 0)]
        table.add_row(
            str(w["rank"]),
            str(w.get("stage", 0)),
            str(w["steps"]),
            str(w["samples"]),
            f"{w['samples'] / of_stage:.0%}" if of_stage else "-",
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
