"""``felactl demo``: the main job on this machine with defaults — profile, plan, train gpt-mini."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from felactl.cli import output
from felactl.cli.model_profile import layer_table
from felactl.cli.profile import render_cluster
from felactl.cli.runview import live_run
from felactl.launcher.rundir import DEFAULT_RUNS_ROOT


def demo(
    nproc_per_node: Annotated[int, typer.Option("--nproc-per-node", min=1, help="Worker slots on this machine.")] = 2,
    steps: Annotated[int, typer.Option(min=1, help="Training steps.")] = 300,
    global_batch: Annotated[int, typer.Option(min=1, help="Samples per step, over all workers.")] = 32,
    out_dir: Annotated[Path, typer.Option(help="Where cluster.yaml, model.yaml and plan.yaml go.")] = Path(
        "felactl-demo"
    ),
    runs_root: Annotated[Path, typer.Option(help="Where the run directory goes.")] = DEFAULT_RUNS_ROOT,
    run_id: Annotated[str | None, typer.Option(help="Name of the run directory.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")] = False,
) -> None:
    """Profile this machine and gpt-mini, plan, and train it on local workers; say where results are."""
    from felactl.cli.plan import render_compare, render_summary
    from felactl.quickstart import QuickstartOptions, as_dict, quickstart, too_noisy

    options = QuickstartOptions(
        nproc=nproc_per_node,
        steps=steps,
        global_batch=global_batch,
        out_dir=out_dir,
        runs_root=runs_root,
        run_id=run_id,
    )
    console = output.stderr
    with live_run(console, lambda run_id: f"training run {run_id} ({steps} steps)", steps) as update:

        def say(message: str) -> None:
            console.rule(message, align="left")

        def show(what: str, result) -> None:
            if as_json:
                return
            if what == "cluster":
                render_cluster(console, result)
            elif what == "model":
                output.wide(console).print(layer_table(result))
            elif what == "plan":
                render_summary(console, result, out_dir / "plan.yaml")
                render_compare(console, result)

        result = quickstart(options, say, show, on_update=update)
    summary = result["summary"]
    trust = f" ({too_noisy(result['model_spec'])})" if result["model_spec"].untrusted() else ""
    output.emit(
        as_dict(result),
        as_json,
        lambda c: c.print(
            f"done: {summary['steps']} steps, loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f}, "
            f"{summary['samples_per_s']:.0f} samples/s (predicted {result['plan_spec'].predicted.samples_per_s:.0f}"
            f"{trust}).\n"
            f"inputs in {out_dir}/ (cluster.yaml, model.yaml, plan.yaml); results in {summary['run_dir']}/ "
            f"(metrics.jsonl, events.jsonl, summary.json, logs/); `felactl status {summary['run']}` shows them again."
        ),
    )


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)
