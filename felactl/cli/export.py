"""``felactl export RUN``: a run's checkpoint as one plain ``state_dict`` of the whole model."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from felactl.cli import output
from felactl.launcher.rundir import DEFAULT_RUNS_ROOT


def export(
    run: Annotated[str, typer.Argument(help="Run id or directory.")],
    out: Annotated[
        Path | None, typer.Option("-o", "--output", help="File to write (default: runs/<id>/model.pt).")
    ] = None,
    step: Annotated[
        int | None, typer.Option(min=0, help="The checkpoint of this step (default: the newest complete one).")
    ] = None,
    runs_root: Annotated[Path, typer.Option(help="Where run directories are.")] = DEFAULT_RUNS_ROOT,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")] = False,
) -> None:
    """Write the model of a run's checkpoint, stages merged, as one state_dict for load_state_dict."""
    from felactl.launcher.export import export_model

    result = export_model(run, runs_root, out, step).to_dict()

    def render(console) -> None:
        console.print(
            f"run {result['run']}: step {result['step']} ({result['num_stages']} stage(s), "
            f"{result['num_params']:,} parameters) -> {result['output']}"
        )

    output.emit(result, as_json, render)


def register(app: typer.Typer) -> None:
    app.command("export")(export)
