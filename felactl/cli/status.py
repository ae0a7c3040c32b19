"""``felactl status [RUN]``: how a running or finished job stands, and its history of events."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from felactl.cli import output
from felactl.cli.runview import events_table, run_table


def status(
    run: Annotated[str, typer.Argument(help="Run id or directory (default: the newest run).")] = "",
    runs_root: Annotated[Path, typer.Option(help="Where run directories are.")] = Path("runs"),
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")] = False,
) -> None:
    """Show a run: step, loss, samples/s, each worker's share and waiting, and its events."""
    from felactl.launcher.status import run_status

    result = run_status(run, runs_root)

    def render(console) -> None:
        console.print(f"run {result['run']} ({result['state']}) in {result['run_dir']}")
        if result.get("summary"):
            console.print(run_table(result["summary"], "progress"))
        if result["events"]:
            console.print(events_table(result["events"]))

    output.emit(result, as_json, render)


def register(app: typer.Typer) -> None:
    app.command("status")(status)
