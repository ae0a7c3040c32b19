"""``felactl launch PLAN``: run a plan with the coordinator here and one agent per node;
``felactl launch --script train.py [PLAN] -- ARGS``: run a torchrun-style script the same way."""

from __future__ import annotations

import contextlib
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
import typer.core

from felactl.cli import output
from felactl.cli.options import takes_options
from felactl.cli.runview import live_run
from felactl.errors import InputError
from felactl.launcher.launch_defaults import (
    COLLECTIVE_TIMEOUT_S,
    HEARTBEAT_TIMEOUT_S,
    JOIN_TIMEOUT_S,
    PLAN_MAX_RESTARTS,
)
from felactl.launcher.rundir import DEFAULT_RUNS_ROOT
from felactl.launcher.scale_plan import ScalingPolicy
from felactl.spec import SyncMode
from felactl.spec.sync_modes import rescalable_mode_names, sync_help

if TYPE_CHECKING:
    from felactl.launcher.launch_flags import LaunchFlags

SCRIPT_ARGS = "felactl.script_args"


class LaunchCommand(typer.core.TyperCommand):
    """Everything after the first ``--`` is the script's, verbatim: it is set aside before click
    parses the rest (click would otherwise take its first word for PLAN)."""

    def parse_args(self, ctx, args):
        if "--" in args:
            cut = args.index("--")
            ctx.meta[SCRIPT_ARGS] = tuple(args[cut + 1 :])
            args = args[:cut]
        return super().parse_args(ctx, args)


@dataclass(frozen=True, kw_only=True)
class LaunchCommandOptions:
    """The parameters of ``felactl launch`` (see ``felactl launch --help``)."""

    plan: Annotated[
        Path | None,
        typer.Argument(help="The plan to run (felactl plan -o plan.yaml); with --script, where its workers go."),
    ] = None
    script: Annotated[
        Path | None,
        typer.Option(
            help="Run this torchrun-style script (python SCRIPT ARGS, ARGS after --) instead of a plan's training."
        ),
    ] = None
    job: Annotated[
        str | None,
        typer.Option(
            help="Instead of a PLAN: train package.module:function (a felactl.TrainJob) data-parallel on "
            "--nproc-per-node local CPU workers, without profiling."
        ),
    ] = None
    nodes: Annotated[
        str | None,
        typer.Option(
            "--nodes",
            help="--job: the nodes its workers go on, NODE[,NODE...] (each agent's --node-name, its "
            "hostname by default; default: this machine, or a Slurm allocation's nodes).",
        ),
    ] = None
    nproc_per_node: Annotated[
        int | None,
        typer.Option(
            "--nproc-per-node",
            help="--job: local workers; --script without PLAN: workers on this machine (default: its GPUs, else 2).",
        ),
    ] = None
    max_restarts: Annotated[
        int | None,
        typer.Option(
            help=(
                "Restart every worker up to N times after a failure: --script as torchrun (default 0); "
                f"a plan that does not rescale live, from its newest checkpoint (default {PLAN_MAX_RESTARTS})."
            )
        ),
    ] = None
    global_batch: Annotated[int | None, typer.Option(min=1, help="--job: samples per step.")] = None
    micro_batch: Annotated[
        int | None, typer.Option(min=1, help="--job: samples per forward (default: each worker's share).")
    ] = None
    config: Annotated[
        list[str] | None,
        typer.Option("--config", help="--job: a keyword argument of its function, key=value (repeat)."),
    ] = None
    shard: Annotated[
        bool,
        typer.Option(
            "--shard",
            help="--job: split the model's weights, gradients and optimizer state among the workers (FSDP2; "
            "sync bsp), for a model one worker cannot hold.",
        ),
    ] = False
    run_id: Annotated[str | None, typer.Option(help="Name of the run directory under runs/.")] = None
    steps: Annotated[
        int | None, typer.Option(min=1, help="Iterations (global batches) to train (default 100; --resume: the run's).")
    ] = None
    sync: Annotated[SyncMode | None, typer.Option(help=f"Override the plan's sync mode. {sync_help()}.")] = None
    slowdown: Annotated[
        str | None,
        typer.Option(help="RANK=FACTOR[,RANK=FACTOR]: slow workers on purpose (sleep (factor-1) x compute)."),
    ] = None
    straggler: Annotated[str | None, typer.Option(help="roundrobin:SECONDS or prob:P:SECONDS.")] = None
    keep_checkpoints: Annotated[
        int | None,
        typer.Option(
            help="Keep the newest N complete checkpoints, delete older ones as the run goes (0: keep all; default 3, "
            "--resume: the run's)."
        ),
    ] = None
    checkpoint_every: Annotated[
        int | None, typer.Option(min=0, help="Checkpoint every K steps (0: never; --resume: the run's).")
    ] = None
    rdzv_endpoint: Annotated[
        str | None, typer.Option(help="HOST:PORT the control plane listens on (default: loopback, a free port).")
    ] = None
    nnodes: Annotated[
        str,
        typer.Option(
            metavar="N|MIN:MAX",
            help="Nodes (agents) to wait for: N, or MIN:MAX as torchrun's (an elastic job goes on without "
            "nodes whose workers cannot start while MIN are left; the plan's nodes are MAX).",
        ),
    ] = "1"
    hostfile: Annotated[
        Path | None, typer.Option(help="DeepSpeed-style 'host slots=N' file: start agents over ssh.")
    ] = None
    node_name: Annotated[str | None, typer.Option(help="This machine's node name (default: short hostname).")] = None
    testbed: Annotated[
        str | None,
        typer.Option(
            help="Run on the nodes of this testbed (felactl testbed up SPEC --name NAME): each node's agent in its "
            "namespace and cgroup, gloo on its interface; the plan's nodes must be the testbed's."
        ),
    ] = None
    slurm: Annotated[
        bool,
        typer.Option(
            "--slurm/--no-slurm",
            help="Inside a Slurm allocation (SLURM_JOB_ID set): run on its nodes, an agent per node as a job step "
            "(srun), the coordinator on this node; a --job trains on --nproc-per-node slots of each node. "
            "--no-slurm: this machine only, as outside one.",
        ),
    ] = True
    runs_root: Annotated[Path, typer.Option(help="Where run directories go.")] = DEFAULT_RUNS_ROOT
    resume: Annotated[
        str | None, typer.Option(help="Continue RUN from its newest complete checkpoint (no PLAN needed).")
    ] = None
    max_nproc_per_node: Annotated[
        int | None, typer.Option(help="Worker slots per node for felactl scale (default: GPUs, or a CPU node's cores).")
    ] = None
    scaling_policy: Annotated[
        str,
        typer.Option(
            help="When the job is rescaled: fixed-batch (same batch and lr) or linear-lr (batch ~ workers up to "
            "--max-batch, lr linear in the batch)."
        ),
    ] = ScalingPolicy.name
    max_batch: Annotated[int | None, typer.Option(help="linear-lr: cap on the global batch (default 4x).")] = None
    heartbeat_timeout_s: Annotated[
        float, typer.Option("--heartbeat-timeout", help="Seconds without a heartbeat before a worker is dropped.")
    ] = HEARTBEAT_TIMEOUT_S
    collective_timeout_s: Annotated[
        float,
        typer.Option(
            "--collective-timeout",
            help="Elastic jobs: seconds before a blocked collective fails (then the job re-forms); "
            "a new group's first step may take up to the start-up timeout.",
        ),
    ] = COLLECTIVE_TIMEOUT_S
    join_timeout_s: Annotated[
        float,
        typer.Option(
            "--join-timeout",
            help="Seconds for the nodes' agents to join, and for a worker `felactl scale --add` starts to "
            "be ready (import torch, build the model): raise it for slow nodes.",
        ),
    ] = JOIN_TIMEOUT_S
    elastic: Annotated[
        bool,
        typer.Option(help=f"Run data-parallel plans under live rescaling (sync {rescalable_mode_names()})."),
    ] = True
    cluster: Annotated[
        Path | None,
        typer.Option(help="The cluster profile the plan was made from: felactl scale then re-plans with the planner."),
    ] = None
    model: Annotated[Path | None, typer.Option(help="The model profile the plan was made from (with --cluster).")] = (
        None
    )
    tensorboard: Annotated[
        Path | None,
        typer.Option(
            "--tensorboard",
            help="Write loss, samples/s, lr, each worker's share and waits, and the job's evaluate "
            "numbers here for TensorBoard as the run trains.",
        ),
    ] = None
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as one JSON object on stdout.")] = False

    def launch_flags(self, script_args: tuple[str, ...] | None) -> LaunchFlags:
        """The launcher's flags: every option but how the run is shown (``--tensorboard``,
        ``--json``), and what followed ``--`` (None: no ``--``)."""
        from felactl.launcher.launch_flags import LaunchFlags

        shown = ("tensorboard", "as_json")
        given = {field.name: getattr(self, field.name) for field in fields(self) if field.name not in shown}
        return LaunchFlags(**given, script_args=script_args)


@takes_options(LaunchCommandOptions, context=True)
def launch(ctx: typer.Context, options: LaunchCommandOptions) -> None:
    """Train: start the coordinator and this machine's agent, run the plan (or --script), write runs/<id>/."""
    flags = options.launch_flags(script_args=ctx.meta.get(SCRIPT_ARGS))
    if options.script is not None:
        if options.tensorboard is not None:
            raise InputError("--tensorboard: a --script run records no metrics of felactl's to show")
        _launch_script(flags, options.as_json)
    else:
        _launch_plan(flags, options.as_json, options.tensorboard)


def _launch_plan(flags: LaunchFlags, as_json: bool, tensorboard: Path | None = None) -> None:
    """A plan's launch (a ``--job``'s plan made first), followed in the live view, then its summary."""
    from felactl.cli.model_profile import parse_config
    from felactl.launcher.launch import launch as run_launch
    from felactl.launcher.launch_flags import check_plan_flags, job_nodes, plan_options
    from felactl.launcher.prepare import job_plan
    from felactl.report.tensorboard import TensorBoardFollower
    from felactl.spec import save

    check_plan_flags(flags)
    with contextlib.ExitStack() as scratch:
        followers = [TensorBoardFollower(tensorboard)] if tensorboard is not None else []
        for follower in followers:  # the last steps written, whatever ends the launch
            scratch.callback(follower.close)
        plan = flags.plan
        if flags.job is not None:  # the run keeps its own copy of the plan: this one only has to outlive the start
            made = job_plan(
                flags.job,
                parse_config(flags.config),
                flags.nproc_per_node,
                flags.global_batch,
                flags.micro_batch,
                shard=flags.shard,
                nodes=job_nodes(flags),
            )
            plan = save(
                made, Path(scratch.enter_context(tempfile.TemporaryDirectory(prefix="felactl-job-"))) / "plan.yaml"
            )
        options = plan_options(flags, plan)
        with live_run(
            output.stderr, lambda run_id: f"run {run_id} (of {options.steps} steps)", options.steps
        ) as update:
            summary = run_launch(options, on_update=_each(update, *followers))
    output.emit(
        summary,
        as_json,
        lambda console: console.print(
            f"run {summary['run']}: {summary['steps']} steps, final loss {summary['final_loss']:.4f}, "
            f"{summary['samples_per_s']:.1f} samples/s{_restarts(summary)}; results in {summary['run_dir']}"
        ),
    )


def _each(*callbacks: Callable[[Any], None]) -> Callable[[Any], None]:
    """One ``on_update`` that calls each of ``callbacks`` in turn (the live view, TensorBoard)."""

    def call(state) -> None:
        for callback in callbacks:
            callback(state)

    return call


RESTART_REASONS = {"restart": "after a failure", "scale-out": "to scale out", "scale-in": "to scale in"}


def _restarts(summary: dict) -> str:
    """``, restarted 3 times: 2 after a failure, 1 to scale out (pauses 8.1, 12.3, 2.0 s)``: what a
    job that restarts its workers did (``, restarted once after a failure (pause 4.4 s)``)."""
    changes = summary.get("restarts") or []
    if not changes:
        return ""
    pauses = [f"{c['pause_s']:.1f}" for c in changes if c.get("pause_s") is not None]
    counts = Counter(RESTART_REASONS.get(c["kind"], c["kind"]) for c in changes)
    times = "once" if len(changes) == 1 else f"{len(changes)} times"
    if len(counts) == 1:
        said = f", restarted {times} {next(iter(counts))}"
    else:
        said = f", restarted {times}: " + ", ".join(f"{n} {reason}" for reason, n in counts.items())
    return said + (f" (pause{'s' if len(pauses) > 1 else ''} {', '.join(pauses)} s)" if pauses else "")


def _launch_script(flags: LaunchFlags, as_json: bool) -> None:
    """A ``--script`` launch, then its summary."""
    from felactl.launcher.launch_flags import script_options
    from felactl.launcher.script import launch_script

    options = script_options(flags)
    output.stderr.print(f"running {options.script} under felactl's agents")
    summary = launch_script(options)
    output.emit(
        summary,
        as_json,
        lambda console: console.print(
            f"run {summary['run']}: {summary['script']} exited 0 on {summary['num_workers']} worker(s) after "
            f"{summary['attempts']} attempt(s), {summary['wall_s']:.1f} s; logs in {summary['run_dir']}/logs"
        ),
    )


def register(app: typer.Typer) -> None:
    app.command("launch", cls=LaunchCommand)(launch)
