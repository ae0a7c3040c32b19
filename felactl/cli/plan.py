"""``felactl plan``: solve for stages, degrees, micro-batches and collective trees; write plan.yaml.

``felactl plan --cluster C --model M --global-batch B`` plans; ``felactl plan collectives`` (the
Blink trees of one group) is a sub-command of the same group.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from felactl import limits
from felactl.cli import output
from felactl.cli.options import HELP_SETTINGS, takes_options
from felactl.cli.plan_collectives import collective_result, register_collectives, resolve_devices
from felactl.errors import InputError
from felactl.fsutil import check_output_file
from felactl.limits import check_flag
from felactl.optimizer.cost import CostModel, MemoryHeadroom
from felactl.optimizer.planner import (
    BASELINE_NAMES,
    DEFAULT_MAX_STAGES,
    DEFAULT_TIME_LIMIT_S,
    make_baseline_plan,
    make_plan,
    plan_cost_model,
)
from felactl.optimizer.simulator import simulate
from felactl.spec import DeviceKind, Plan, Schedule, load_cluster, load_model, save
from felactl.spec.plan import SIMULATION_TOLERANCE
from felactl.spec.sync_modes import Execution, sync_help, sync_support

if TYPE_CHECKING:
    from felactl.spec import ClusterSpec, ModelSpec

plan_app = typer.Typer(
    help="Plan a training job: stages, degrees, micro-batches, collective trees.",
    no_args_is_help=False,
    **HELP_SETTINGS,
)


def plan_result(plan: Plan) -> dict:
    """The JSON object of ``--json``."""
    predicted, solver = plan.predicted, plan.solver
    return {
        "iteration_s": predicted.iteration_s,
        "samples_per_s": predicted.samples_per_s,
        "simulated_iteration_s": predicted.simulated_iteration_s,
        "simulation_agrees": predicted.simulation_agrees,
        "simulated_peak_memory_gb": dict(predicted.simulated_peak_memory_gb),
        "solve_s": solver.solve_s,
        "status": solver.status,
        "gap": solver.gap,
        "solver": solver.name,
        "baselines": dict(predicted.baselines),
        "baselines_missing": dict(predicted.baselines_missing),
        "speedup": {name: t / predicted.iteration_s for name, t in predicted.baselines.items()},
        "devices": list(plan.devices),
        "stages": [
            {
                "layers": [s.layer_start, s.layer_end],
                "micro_batch": s.micro_batch,
                "shard": s.shard,
                "workers": [
                    {"device": w.device, "share": w.share, "memory_gb": w.predicted_memory_gb} for w in s.workers
                ],
            }
            for s in plan.stages
        ],
        "collectives": [collective_result(c, 0.0) for c in plan.collectives],
    }


def render_summary(console, plan: Plan, out: Path | None) -> None:
    p = plan.predicted
    label = "plan" if plan_label(plan) == "felactl" else f"baseline {plan_label(plan)}"
    console.print(
        f"{label} for {plan.model.name} on {plan.cluster}: {len(plan.stages)} stage(s) on "
        f"{len(plan.devices)} device(s), global batch {plan.global_batch}, sync {plan.sync.mode.value}"
    )
    console.print(
        f"predicted iteration {p.iteration_s:.4g} s ({p.samples_per_s:.4g} samples/s); simulated "
        f"{p.simulated_iteration_s:.4g} s; solver {plan.solver.status} in {plan.solver.solve_s:.2f} s"
    )
    if not p.simulation_agrees:
        off = p.simulated_iteration_s / p.iteration_s - 1
        console.print(
            f"warning: the simulated iteration is {abs(off):.0%} {'above' if off > 0 else 'below'} the "
            f"predicted one (more than {SIMULATION_TOLERANCE:.0%}): the simulator runs this plan's tokens as "
            f"the runtime takes them, which the cost model prices only roughly here"
        )
    if p.simulated_peak_memory_gb:
        device, peak = max(p.simulated_peak_memory_gb.items(), key=lambda item: item[1])
        console.print(
            f"simulated peak memory {peak:.3g} GB on {device} (weights, optimizer state and the activations it holds)"
        )
    dp_s = p.baselines.get("dp")
    claims = sync_support(plan.sync.mode).data_parallel_tokens
    if plan_label(plan) == "felactl" and claims and dp_s and dp_s < p.iteration_s:
        console.print(
            f"note: data parallel as DDP runs it is predicted faster ({dp_s:.4g} s): under sync {plan.sync.mode.value} "
            f"each micro-batch is a token claimed through the store; `--sync bsp` plans without them"
        )
    if len(plan.stages) > 1 and "dp" in p.baselines_missing and not any(stage.shard for stage in plan.stages):
        console.print(
            f"note: the model is cut into stages as no whole replica fits a device (dp {p.baselines_missing['dp']})"
        )
    if any(stage.shard for stage in plan.stages):
        console.print(f"note: {_why_sharded(plan)}")
    elif plan.schedule is not Schedule.TOKENS and sync_support(plan.sync.mode).planned_as is not Execution.PIPELINE:
        chains = len(plan.pipelines)
        console.print(
            f"note: its stages are one chain of devices, so it runs as one static 1F1B pipeline "
            f"(sync {plan.sync.mode.value}; no worker could take another's micro-batch)"
            if chains == 1
            else f"note: its stages are {chains} chains of devices side by side, so it runs as {chains} static "
            f"1F1B pipelines (sync {plan.sync.mode.value}; predicted no slower than token scheduling)"
        )
    if out is not None:
        console.print(f"wrote {out}")


def _why_sharded(plan: Plan) -> str:
    """Why a plan shards its model: nothing replicated fits (what the baselines said), or it is faster."""
    p, workers = plan.predicted, len(plan.stages[0].workers)
    what = f"the model is sharded over its {workers} devices (FSDP2: each holds 1/{workers} of its weights, gradients and optimizer state)"
    if len(plan.stages) > 1:
        sharded = [s for s, stage in enumerate(plan.stages) if stage.shard]
        kept_whole = [s for s, stage in enumerate(plan.stages) if not stage.shard]
        which = f"each of its {len(plan.stages)} stages is" if not kept_whole else _stages(sharded, len(plan.stages))
        what = (
            f"{which} sharded over {workers} devices, one per pipeline "
            f"(FSDP2: each holds 1/{workers} of its stage's weights, gradients and optimizer state)"
        )
        if kept_whole:
            its = "its" if len(kept_whole) == 1 else "their"
            what += f"; {_stages(kept_whole)} replicated, as {its} replicas fit (one all-reduce a step, no gathers)"
    replicated = {name: s for name, s in p.baselines.items() if name not in ("fsdp", "no_trees")}
    if not replicated:
        reasons = "; ".join(f"{name}: {why}" for name, why in p.baselines_missing.items())
        return f"{what}: no plan of whole replicas fits ({reasons}){_left_out(plan)}"
    best = min(replicated, key=replicated.get)
    return f"{what}: predicted faster than {best} ({replicated[best]:.4g} s){_left_out(plan)}"


def _stages(indices: list[int], of: int | None = None) -> str:
    """``stage 0 is`` or ``stages 0, 2 are``; with ``of``: ``stage 0 of its 3 stages is``."""
    named = f"stage {indices[0]}" if len(indices) == 1 else f"stages {', '.join(map(str, indices))}"
    among = f" of its {of} stages" if of is not None else ""
    return f"{named}{among} {'is' if len(indices) == 1 else 'are'}"


def _left_out(plan: Plan) -> str:
    """Where the planner sharded over fewer devices than the ``fsdp`` baseline's all: why."""
    every = plan.predicted.baselines.get("fsdp")
    if plan_label(plan) == "fsdp" or every is None or every <= plan.predicted.iteration_s:
        return ""
    return f"; over every device (fsdp) {every:.4g} s a step: a slower device would set the pace of every gather"


def plan_label(plan: Plan) -> str:
    """``felactl`` for a solved plan, the baseline's name (``dp``) for a ``--baseline`` plan."""
    name = plan.solver.name if plan.solver else ""
    return name.split(":", 1)[1] if name.startswith("baseline:") else "felactl"


def render_compare(console, plan: Plan) -> None:
    table = Table(title="plan vs baselines (predicted, same cost model)")
    for column in ("plan", "iteration s", "speedup of the plan"):
        table.add_column(column)
    label = plan_label(plan)
    table.add_row(label if label == "felactl" else f"{label} (this plan)", f"{plan.predicted.iteration_s:.4g}", "1.00x")
    for name, t in plan.predicted.baselines.items():
        table.add_row(name, f"{t:.4g}", f"{t / plan.predicted.iteration_s:.2f}x")
    for name, why in plan.predicted.baselines_missing.items():
        table.add_row(name, "-", f"no plan: {why}")
    console.print(table)


def _render_explain(console, plan: Plan, cost: CostModel) -> None:
    table = Table(title="stages")
    for column in ("stage", "layers", "micro-batch", "devices (share)", "memory GB"):
        table.add_column(column)
    for s, st in enumerate(plan.stages):
        names = [cost.model.layers[i].name for i in (st.layer_start, st.layer_end - 1)]
        workers = ", ".join(f"{w.device} ({w.share:.2f})" for w in st.workers)
        memory = max(w.predicted_memory_gb or 0.0 for w in st.workers)
        table.add_row(
            f"{s} (sharded)" if st.shard else str(s),
            f"{st.layer_start}-{st.layer_end - 1} ({names[0]}..{names[1]})",
            str(st.micro_batch),
            workers,
            f"{memory:.3g}",  # a few MB on a small device is 0.0117, not 0.01
        )
    console.print(table)
    for c in plan.collectives:
        console.print(
            f"{c.group}: {_roots(c)}, {len(c.trees)} tree(s), {c.rate_gbps:.2f} GB/s "
            f"(bound {c.bound_gbps:.2f}, ring {c.ring_gbps:.2f})"
        )
        for tree in c.trees:
            console.print(f"  {tree.weight:.2f} GB/s: " + ", ".join(f"{a}->{b}" for a, b in tree.edges))
    console.print(gantt(plan, cost))


def _roots(collective) -> str:
    roots = collective.roots
    return f"root {roots[0]}" if len(roots) == 1 else f"roots {', '.join(roots)}"


def gantt(plan: Plan, cost: CostModel, width: int = 72) -> str:
    """A text Gantt chart of one simulated iteration: one row per device, one mark per time slice
    (F/B forward/backward of an even stage, f/b of an odd one, S sync, O optimizer step, z sleep,
    . idle)."""
    result = simulate(plan, cost)
    span = result.iteration_s or 1.0
    rows = [
        f"one iteration, {span:.4g} s, {width} columns ({span / width:.3g} s each); "
        "F/B forward/backward (stage shown as f/b when odd), S sync, O optimizer step, z sleep, . idle"
    ]
    name_width = max(len(d) for d in plan.devices)
    for device in plan.devices:
        cells = ["."] * width
        for iv in result.intervals:
            if iv.device != device:
                continue
            mark = {"sleep": "z"}.get(iv.label) or iv.label[0]
            if mark in "FB" and int(iv.label[1:]) % 2:
                mark = mark.lower()
            first = int(iv.start_s / span * width)
            for col in range(first, max(int(iv.end_s / span * width), first + 1)):
                cells[min(col, width - 1)] = mark
        rows.append(f"{device:>{name_width}} |{''.join(cells)}|")
    return "\n".join(rows)


@dataclass(frozen=True, kw_only=True)
class PlanCommandOptions:
    """The parameters of ``felactl plan`` (see ``felactl plan --help``)."""

    cluster: Annotated[Path | None, typer.Option("--cluster", help="Cluster spec (YAML).")] = None
    model: Annotated[Path | None, typer.Option("--model", help="Model spec (YAML, from felactl profile --model).")] = (
        None
    )
    global_batch: Annotated[int | None, typer.Option("--global-batch", help="Samples per iteration.")] = None
    sync: Annotated[
        str | None,
        typer.Option("--sync", help=f"Sync mode (default tokens; bsp with --baseline). {sync_help()}."),
    ] = None
    baseline: Annotated[
        str | None,
        typer.Option(
            "--baseline",
            help=f"Write a baseline's plan instead of solving: {'|'.join(BASELINE_NAMES)} (the stages "
            "--compare prices it by, BSP over rings, with its own prediction).",
        ),
    ] = None
    devices: Annotated[
        str | None,
        typer.Option("--devices", help="Comma-separated device names or indices to plan for (default: all)."),
    ] = None
    out: Annotated[Path | None, typer.Option("-o", "--output", help="Write the plan here (YAML).")] = None
    compare: Annotated[bool, typer.Option("--compare", help="Show the plan against each baseline.")] = False
    explain: Annotated[bool, typer.Option("--explain", help="Stages, trees and a Gantt chart of one iteration.")] = (
        False
    )
    figure: Annotated[
        Path | None,
        typer.Option("--figure", help="Draw the plan (stages, a simulated iteration's Gantt, trees) as a PNG here."),
    ] = None
    time_limit_s: Annotated[
        float | None,
        typer.Option("--time-limit", help="Seconds each ILP solve may take; the plan records the gap where it stops."),
    ] = DEFAULT_TIME_LIMIT_S
    no_trees: Annotated[bool, typer.Option("--no-trees", help="Sync over rings only.")] = False
    max_stages: Annotated[
        int,
        typer.Option(
            "--max-stages",
            help="Most stages the model is cut into (1: data parallel, or one sharded stage). Each stage's "
            "activations are priced at this many micro-batches in flight; where none fits, fewer are tried.",
        ),
    ] = DEFAULT_MAX_STAGES
    reserve_gb: Annotated[
        float,
        typer.Option("--reserve-gb", help="GB of each CUDA device the plan leaves to the CUDA context and workspaces."),
    ] = MemoryHeadroom.reserved_gb
    fragmentation: Annotated[
        float,
        typer.Option(
            "--fragmentation", help="Share of each device's memory the plan leaves to allocator fragmentation."
        ),
    ] = MemoryHeadroom.fraction
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")] = False

    def plan_flags(self) -> PlanFlags:
        """What the plan is solved for: every option but how it is shown (``--compare``, ``--explain``,
        ``--figure``, ``--json``)."""
        shown = ("compare", "explain", "figure", "as_json")
        return PlanFlags(**{field.name: getattr(self, field.name) for field in fields(self) if field.name not in shown})


@plan_app.callback(invoke_without_command=True)
@takes_options(PlanCommandOptions, context=True)
def plan(ctx: typer.Context, options: PlanCommandOptions) -> None:
    """Plan a model on a cluster: the ILP over stages, degrees, micro-batches, with Blink trees."""
    if ctx.invoked_subcommand is not None:
        return
    flags = options.plan_flags()
    if options.figure is not None:
        check_output_file(options.figure)
    cluster_spec, model_spec = load_cluster(flags.cluster), load_model(flags.model)
    debug = output.debug_enabled(ctx)
    lp_path = str((flags.out or Path("plan.yaml")).with_suffix(".lp")) if debug and flags.baseline is None else None
    result = _solve(flags, cluster_spec, model_spec, lp_path)
    if flags.out is not None:
        save(result, flags.out)
    cost = plan_cost_model(result, cluster_spec, model_spec, use_trees=flags.use_trees)
    _say_rough_prices(cost, result, cluster_spec, model_spec, flags.cluster, flags.model)
    if options.figure is not None:
        _draw(result, cost, options.figure)

    def render(console) -> None:
        render_summary(console, result, flags.out)
        if options.compare:
            render_compare(console, result)
        if options.explain:
            _render_explain(console, result, cost)
        if lp_path:
            console.print(f"wrote the ILP to {lp_path}")

    output.emit(plan_result(result), options.as_json, render)


def _draw(plan: Plan, cost: CostModel, path: Path) -> None:
    """The plan as ``felactl report`` draws a run's (:func:`felactl.report.figures.plan_figure`)."""
    from felactl.report.figures import plan_figure, save_png

    save_png(plan_figure(plan, simulate(plan, cost)), path)


@dataclass(frozen=True, kw_only=True)
class PlanFlags:
    """What ``felactl plan`` solves for, as given; checked before anything is read, each problem
    one line that names its flag."""

    cluster: Path | None
    model: Path | None
    global_batch: int | None
    sync: str | None
    baseline: str | None
    devices: str | None
    """Comma-separated device names or indices (:func:`resolve_devices`); None: all."""
    out: Path | None
    time_limit_s: float | None
    no_trees: bool
    max_stages: int
    reserve_gb: float
    fragmentation: float

    def __post_init__(self) -> None:
        missing = [
            flag
            for flag, value in (
                ("--cluster", self.cluster),
                ("--model", self.model),
                ("--global-batch", self.global_batch),
            )
            if value is None
        ]
        if missing:
            raise InputError(f"felactl plan needs {', '.join(missing)}")
        check_flag("--global-batch", self.global_batch, limits.BATCH)
        check_flag("--time-limit", self.time_limit_s, limits.SECONDS, above=0)
        check_flag("--max-stages", self.max_stages, limits.LAYERS)
        check_flag("--reserve-gb", self.reserve_gb, limits.MEMORY_GB)
        check_flag("--fragmentation", self.fragmentation, limits.SHARE)
        if self.fragmentation >= 1:
            raise InputError(
                f"--fragmentation must be below 1 (a share of each device's memory), got {self.fragmentation:g}"
            )
        if self.baseline is not None and self.baseline not in BASELINE_NAMES:
            raise InputError(f"--baseline: expected one of {', '.join(BASELINE_NAMES)}, got {self.baseline!r}")
        if self.baseline is not None and self.sync not in (None, "bsp"):
            raise InputError(f"--baseline plans sync bsp, as the baselines' systems do; got --sync {self.sync}")
        if self.out is not None:
            check_output_file(self.out)

    @property
    def use_trees(self) -> bool:
        """Whether the plan syncs over Blink trees: not with --no-trees, nor a baseline's (rings)."""
        return not self.no_trees and self.baseline is None


def _solve(flags: PlanFlags, cluster_spec: ClusterSpec, model_spec: ModelSpec, lp_path: str | None) -> Plan:
    """The baseline's plan, or the ILP's (with a status line while it solves)."""
    names = resolve_devices(cluster_spec, flags.devices) if flags.devices is not None else None
    headroom = MemoryHeadroom(reserved_gb=flags.reserve_gb, fraction=flags.fragmentation)
    if flags.baseline is not None:
        return make_baseline_plan(
            cluster_spec, model_spec, flags.global_batch, flags.baseline, devices=names, headroom=headroom
        )
    with output.stderr.status("solving the plan ...") as status:
        return make_plan(
            cluster_spec,
            model_spec,
            flags.global_batch,
            sync=flags.sync or "tokens",
            devices=names,
            time_limit_s=flags.time_limit_s,
            use_trees=flags.use_trees,
            debug_lp_path=lp_path,
            progress=lambda msg: status.update(msg),
            headroom=headroom,
            max_stages=flags.max_stages,
        )


def _say_rough_prices(
    cost: CostModel, result: Plan, cluster_spec: ClusterSpec, model_spec: ModelSpec, cluster: Path, model: Path
) -> None:
    """Notes on stderr where the plan's prices are rough: gradient sync between CPU slots (the link
    profile prices it several times too low), and devices the model has no timings of."""
    if cost.uncalibrated_cpu_groups([tuple(w.device for w in st.workers) for st in result.stages]):
        output.stderr.print(
            f"note: this plan syncs gradients between CPU slots, which the link profile prices "
            f"several times too low; `felactl profile --model {model_spec.source} --cluster "
            f"{cluster}` measures it on this machine's slots",
            soft_wrap=True,
        )

    untimed = cost.priced_from_flops(result.devices)
    if untimed:
        timed = ", ".join(sorted(model_spec.timed_device_models))
        cpus = all(cluster_spec.device(d).kind is DeviceKind.CPU for d in untimed)
        output.stderr.print(
            f"note: {', '.join(untimed)} {'is' if len(untimed) == 1 else 'are'} priced from FLOPs and "
            f"TFLOP/s: {model} has timings of {timed} only (to price them by measurement, `felactl "
            f"profile --model {model_spec.source}` on {'it' if len(untimed) == 1 else 'them'}"
            f"{', or with --testbed NAME in a testbed' if cpus else ''})",
            soft_wrap=True,
        )


register_collectives(plan_app)


def register(app: typer.Typer) -> None:
    app.add_typer(plan_app, name="plan")
