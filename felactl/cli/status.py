"""``felactl status [RUN]``: how a running or finished job stands, and its history of events."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from felactl.cli import output
from felactl.cli.runview import duration, events_table, run_table
from felactl.launcher.rundir import DEFAULT_RUNS_ROOT


def status(
    run: Annotated[str, typer.Argument(help="Run id or directory (default: the newest run).")] = "",
    runs_root: Annotated[Path, typer.Option(help="Where run directories are.")] = DEFAULT_RUNS_ROOT,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")] = False,
) -> None:
    """Show a run: step, loss, samples/s, each worker's share and waiting, and its events."""
    from felactl.launcher.rundir import RESUME_HINT
    from felactl.launcher.status import run_status

    result = run_status(run, runs_root)

    def render(console) -> None:
        console.print(f"run {result['run']} ({result['state']}) in {result['run_dir']}")
        if result["state_reason"]:
            hint = f"; {RESUME_HINT.format(run=result['run'])}" if result["state"] == "lost" else ""
            console.print(f"  {result['state']}: {result['state_reason']}{hint}")
        if result.get("progress"):
            console.print(f"  {eta_line(result['progress'])}")
        summary = result.get("summary")
        if summary and "script" in summary:  # felactl launch --script: no metrics, only how it ended
            console.print(
                f"  {summary['script']}: exit code {summary['exit_code']} on {summary['num_workers']} "
                f"worker(s) after {summary['attempts']} attempt(s), {summary['wall_s']:.1f} s"
            )
        elif summary:
            console.print(run_table(summary, "progress"))
        if result["history"]:
            console.print(history_table(result["history"]))
        if result["events"]:
            console.print(events_table(result["events"]))

    output.emit(result, as_json, render)


def eta_line(progress: dict) -> str:
    """``step 20 of 300 at 2.00 steps/s: ETA 0:02:20`` (no rate yet: no ETA)."""
    line = f"step {progress['steps']} of {progress['steps_total']}"
    if progress["eta_s"] is None:
        return line
    return line + f" at {progress['steps_per_s']:.2f} steps/s: ETA {duration(progress['eta_s'])}"


def history_table(history: list[dict]) -> Table:
    """One row per membership change: who was in before and after, the pause, what was replicated,
    and how the new generation was planned (the planner's predicted iteration where it ran)."""
    table = Table(title="membership history", title_justify="left")
    for col in ("time", "kind", "gen", "before", "after", "pause_s", "replicated", "planned by", "from / why"):
        table.add_column(col)
    for e in history:
        sources = ", ".join(f"{w}: {b / 1e6:.2f} MB" for w, b in (e.get("replicated_from") or {}).items())
        planned = e.get("planned_by", "")
        if e.get("predicted_iteration_s"):
            planned += f" ({e['predicted_iteration_s'] * 1e3:.1f} ms/it)"
        table.add_row(
            time.strftime("%H:%M:%S", time.localtime(e.get("time", 0))),
            e["kind"],
            str(e.get("generation", "")),
            str(e.get("members_before", e.get("members", ""))),
            str(e.get("members_after", "")),
            "" if e.get("pause_s") is None else f"{e['pause_s']:.3f}",
            f"{e.get('replicated_bytes', 0) / 1e6:.2f} MB" if e.get("replicated_bytes") else "",
            planned,
            sources
            or (f"{e['key']}: " if e.get("key") else "") + e.get("reason", "")
            or (f"from step {e['from_step']}" if "from_step" in e else "")
            or (f"agent of node {e['node']} joined" if "node" in e else "")
            or (f"Slurm job {e['job']}: {', '.join(e.get('nodes', []))}" if "job" in e else ""),
        )
    return table


def register(app: typer.Typer) -> None:
    app.command("status")(status)
