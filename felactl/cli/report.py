"""``felactl report RUN``: a run's figures and one HTML page that holds them (no server needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from felactl.cli import output
from felactl.launcher.rundir import DEFAULT_RUNS_ROOT


def report(
    run: Annotated[str, typer.Argument(help="Run id or directory (default: the newest run).")] = "",
    out: Annotated[
        Path | None, typer.Option("-o", "--output", help="Directory to write into (default: the run's report/).")
    ] = None,
    runs_root: Annotated[Path, typer.Option(help="Where run directories are.")] = DEFAULT_RUNS_ROOT,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")] = False,
) -> None:
    """Draw a run (finished, running or lost): loss and samples/s with its events, each worker's
    share and time, measured vs predicted, the plan; as PNGs and one self-contained report.html."""
    from felactl.report.page import write_report

    result = write_report(run, runs_root, out)

    def render(console) -> None:
        console.print(f"run {result['run']} ({result['state']}): {result['html']}")
        for name, path in result["figures"].items():
            console.print(f"  {name}: {path}")
        for name, why in result["left_out"].items():
            console.print(f"  {name}: not drawn ({why})")

    output.emit(result, as_json, render)


def register(app: typer.Typer) -> None:
    app.command("report")(report)
