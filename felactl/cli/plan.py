"""``felactl plan``: solve for stages, degrees, micro-batches and collective trees; write plan.yaml.

``felactl plan --cluster C --model M --global-batch B`` plans; ``felactl plan collectives`` (the
Blink trees of one group) is a sub-command of the same group.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from felactl.cli import output
from felactl.cli.plan_collectives import collective_result, register_collectives, resolve_devices
from felactl.errors import InputError
from felactl.optimizer.cost import CostModel
from felactl.optimizer.planner import DEFAULT_TIME_LIMIT_S, SYNC_MODES, make_plan
from felactl.optimizer.simulator import simulate
from felactl.spec import Plan, load_cluster, load_model, save

plan_app = typer.Typer(help="Plan a training job: stages, degrees, micro-batches, collective trees.",
                       no_args_is_help=False, context_settings={"help_option_names": ["-h", "--help"]})


def plan_result(plan: Plan) -> dict:
    """The JSON object of ``--json``."""
    predicted, solver = plan.predicted, plan.solver
    return {
        "iteration_s": predicted.iteration_s,
        "samples_per_s": predicted.samples_per_s,
        "simulated_iteration_s": predicted.simulated_iteration_s,
        "solve_s": solver.solve_s,
        "status": solver.status,
        "gap": solver.gap,
        "baselines": dict(predicted.baselines),
        "speedup": {name: t / predicted.iteration_s for name, t in predicted.baselines.items()},
        "devices": list(plan.devices),
        "stages": [{"layers": [s.layer_start, s.layer_end], "micro_batch": s.micro_batch,
                    "workers": [{"device": w.device, "share": w.share, "memory_gb": w.predicted_memory_gb}
                                for w in s.workers]} for s in plan.stages],
        "collectives": [collective_result(c, 0.0) for c in plan.collectives],
    }


def render_summary(console, plan: Plan, out: Path | None) -> None:
    p = plan.predicted
    console.print(f"plan for {plan.model.name} on {plan.cluster}: {len(plan.stages)} stage(s) on "
                  f"{len(plan.devices)} device(s), global batch {plan.global_batch}, sync {plan.sync.mode.value}")
    console.print(f"predicted iteration {p.iteration_s:.4g} s ({p.samples_per_s:.4g} samples/s); simulated "
                  f"{p.simulated_iteration_s:.4g} s; solver {plan.solver.status} in {plan.solver.solve_s:.2f} s")
    if out is not None:
        console.print(f"wrote {out}")


def render_compare(console, plan: Plan) -> None:
    table = Table(title="plan vs baselines (predicted, same cost model)")
    for column in ("plan", "iteration s", "speedup of the plan"):
        table.add_column(column)
    table.add_row("felactl", f"{plan.predicted.iteration_s:.4g}", "1.00x")
    for name, t in plan.predicted.baselines.items():
        table.add_row(name, f"{t:.4g}", f"{t / plan.predicted.iteration_s:.2f}x")
    console.print(table)


def _render_explain(console, plan: Plan, cost: CostModel) -> None:
    table = Table(title="stages")
    for column in ("stage", "layers", "micro-batch", "devices (share)", "memory GB"):
        table.add_column(column)
    for s, st in enumerate(plan.stages):
        names = [cost.model.layers[i].name for i in (st.layer_start, st.layer_end - 1)]
        workers = ", ".join(f"{w.device} ({w.share:.2f})" for w in st.workers)
        memory = max(w.predicted_memory_gb or 0.0 for w in st.workers)
        table.add_row(str(s), f"{st.layer_start}-{st.layer_end - 1} ({names[0]}..{names[1]})", str(st.micro_batch),
                      workers, f"{memory:.2f}")
    console.print(table)
    for c in plan.collectives:
        console.print(f"{c.group}: root {c.root}, {len(c.trees)} tree(s), {c.rate_gbps:.2f} GB/s "
                      f"(bound {c.bound_gbps:.2f}, ring {c.ring_gbps:.2f})")
        for tree in c.trees:
            console.print(f"  {tree.weight:.2f} GB/s: " + ", ".join(f"{a}->{b}" for a, b in tree.edges))
    console.print(gantt(plan, cost))


def gantt(plan: Plan, cost: CostModel, width: int = 72) -> str:
    """A text Gantt chart of one simulated iteration: one row per device, one mark per time slice
    (F/B forward/backward of an even stage, f/b of an odd one, S sync, O optimizer step, > send, z sleep,
    . idle)."""
    result = simulate(plan, cost)
    span = result.iteration_s or 1.0
    rows = [f"one iteration, {span:.4g} s, {width} columns ({span / width:.3g} s each); "
            "F/B forward/backward (stage shown as f/b when odd), S sync, O optimizer step, > send, z sleep, . idle"]
    name_width = max(len(d) for d in plan.devices)
    for device in plan.devices:
        cells = ["."] * width
        for iv in result.intervals:
            if iv.device != device:
                continue
            mark = {"send": ">", "sleep": "z"}.get(iv.label) or iv.label[0]
            if mark in "FB" and int(iv.label[1:]) % 2:
                mark = mark.lower()
            first = int(iv.start_s / span * width)
            for col in range(first, max(int(iv.end_s / span * width), first + 1)):
                cells[min(col, width - 1)] = mark
        rows.append(f"{device:>{name_width}} |{''.join(cells)}|")
    return "\n".join(rows)


@plan_app.callback(invoke_without_command=True)
def plan(
    ctx: typer.Context,
    cluster: Annotated[Optional[Path], typer.Option("--cluster", help="Cluster spec (YAML).")] = None,
    model: Annotated[Optional[Path], typer.Option("--model", help="Model spec (YAML, from felactl profile --model).")] = None,
    global_batch: Annotated[Optional[int], typer.Option("--global-batch", help="Samples per iteration.")] = None,
    sync: Annotated[str, typer.Option("--sync", help=f"Sync mode: {'|'.join(SYNC_MODES)}.")] = "tokens",
    devices: Annotated[Optional[str], typer.Option(
        "--devices", help="Comma-separated device names or indices to plan for (default: all).")] = None,
    out: Annotated[Optional[Path], typer.Option("-o", "--output", help="Write the plan here (YAML).")] = None,
    compare: Annotated[bool, typer.Option("--compare", help="Show the plan against each baseline.")] = False,
    explain: Annotated[bool, typer.Option("--explain", help="Stages, trees and a Gantt chart of one iteration.")] = False,
    time_limit: Annotated[Optional[float], typer.Option(
        "--time-limit", help="Seconds each ILP solve may take; the plan records the gap where it stops.")
    ] = DEFAULT_TIME_LIMIT_S,
    no_trees: Annotated[bool, typer.Option("--no-trees", help="Sync over rings only.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")] = False,
) -> None:
    """Plan a model on a cluster: the ILP over stages, degrees, micro-batches, with Blink trees."""
    if ctx.invoked_subcommand is not None:
        return
    missing = [flag for flag, value in (("--cluster", cluster), ("--model", model), ("--global-batch", global_batch))
               if value is None]
    if missing:
        raise InputError(f"felactl plan needs {', '.join(missing)}")
    if global_batch < 1:
        raise InputError(f"--global-batch must be >= 1, got {global_batch}")
    if time_limit is not None and time_limit <= 0:
        raise InputError(f"--time-limit must be > 0, got {time_limit:g}")
    cluster_spec, model_spec = load_cluster(cluster), load_model(model)
    names = resolve_devices(cluster_spec, devices) if devices is not None else None
    debug = bool(ctx.find_root().obj and ctx.find_root().obj.get("debug"))
    lp_path = str((out or Path("plan.yaml")).with_suffix(".lp")) if debug else None
    with output.stderr.status("solving the plan ...") as status:
        result = make_plan(cluster_spec, model_spec, global_batch, sync=sync, devices=names, time_limit_s=time_limit,
                           use_trees=not no_trees, debug_lp_path=lp_path, progress=lambda msg: status.update(msg))
    if out is not None:
        save(result, out)
    cost = CostModel(cluster_spec.subset(result.devices), model_spec, use_trees=not no_trees,
                     sync_reference=cluster_spec)
    if cost.uncalibrated_cpu_groups([tuple(w.device for w in st.workers) for st in result.stages]):
        output.stderr.print(f"note: this plan syncs gradients between CPU slots, which the link profile prices "
                            f"several times too low; `felactl profile --model {model_spec.source} --cluster "
                            f"{cluster}` measures it on this machine's slots", soft_wrap=True)

    def render(console) -> None:
        render_summary(console, result, out)
        if compare:
            render_compare(console, result)
        if explain:
            _render_explain(console, result, cost)
        if lp_path:
            console.print(f"wrote the ILP to {lp_path}")
    output.emit(plan_result(result), as_json, render)


register_collectives(plan_app)


def register(app: typer.Typer) -> None:
    app.add_typer(plan_app, name="plan")
