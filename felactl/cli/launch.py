"""``felactl launch PLAN``: run a plan with the coordinator here and one agent per node;
``felactl launch --script train.py [PLAN] -- ARGS``: run a torchrun-style script the same way."""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path
from typing import Annotated

import typer
import typer.core

from felactl.cli import output
from felactl.cli.runview import live_run
from felactl.spec import SyncMode

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


def launch(
    ctx: typer.Context,
    plan: Annotated[
        Path | None,
        typer.Argument(help="The plan to run (felactl plan -o plan.yaml); with --script, where its workers go."),
    ] = None,
    script: Annotated[
        Path | None,
        typer.Option(
            help="Run this torchrun-style script (python SCRIPT ARGS, ARGS after --) instead of a plan's training."
        ),
    ] = None,
    job: Annotated[
        str | None,
        typer.Option(
            help="Instead of a PLAN: train package.module:function (a felactl.TrainJob) data-parallel on "
            "--nproc-per-node local CPU workers, without profiling."
        ),
    ] = None,
    nproc_per_node: Annotated[
        int | None,
        typer.Option(
            "--nproc-per-node",
            help="--job: local workers; --script without PLAN: workers on this machine (default: its GPUs, else 2).",
        ),
    ] = None,
    max_restarts: Annotated[
        int | None,
        typer.Option(help="--script: restart every worker up to N times after a failure, as torchrun (default 0)."),
    ] = None,
    global_batch: Annotated[int | None, typer.Option(min=1, help="--job: samples per step.")] = None,
    micro_batch: Annotated[
        int | None, typer.Option(min=1, help="--job: samples per forward (default: each worker's share).")
    ] = None,
    config: Annotated[
        list[str] | None,
        typer.Option("--config", help="--job: a keyword argument of its function, key=value (repeat)."),
    ] = None,
    run_id: Annotated[str | None, typer.Option(help="Name of the run directory under runs/.")] = None,
    steps: Annotated[
        int | None, typer.Option(min=1, help="Iterations (global batches) to train (default 100; --resume: the run's).")
    ] = None,
    sync: Annotated[SyncMode | None, typer.Option(help="Override the plan's sync mode.")] = None,
    slowdown: Annotated[
        str | None,
        typer.Option(help="RANK=FACTOR[,RANK=FACTOR]: slow workers on purpose (sleep (factor-1) x compute)."),
    ] = None,
    straggler: Annotated[str | None, typer.Option(help="roundrobin:SECONDS or prob:P:SECONDS.")] = None,
    keep_checkpoints: Annotated[
        int | None,
        typer.Option(
            help="Keep the newest N complete checkpoints, delete older ones as the run goes (0: keep all; default 3, "
            "--resume: the run's)."
        ),
    ] = None,
    checkpoint_every: Annotated[
        int | None, typer.Option(min=0, help="Checkpoint every K steps (0: never; --resume: the run's).")
    ] = None,
    rdzv_endpoint: Annotated[
        str | None, typer.Option(help="HOST:PORT the control plane listens on (default: loopback, a free port).")
    ] = None,
    nnodes: Annotated[
        str,
        typer.Option(
            metavar="N|MIN:MAX",
            help="Nodes (agents) to wait for: N, or MIN:MAX as torchrun's (an elastic job goes on without "
            "nodes whose workers cannot start while MIN are left; the plan's nodes are MAX).",
        ),
    ] = "1",
    hostfile: Annotated[
        Path | None, typer.Option(help="DeepSpeed-style 'host slots=N' file: start agents over ssh.")
    ] = None,
    node_name: Annotated[str | None, typer.Option(help="This machine's node name (default: short hostname).")] = None,
    testbed: Annotated[
        str | None,
        typer.Option(
            help="Run on the nodes of this testbed (felactl testbed up SPEC --name NAME): each node's agent in its "
            "namespace and cgroup, gloo on its interface; the plan's nodes must be the testbed's."
        ),
    ] = None,
    runs_root: Annotated[Path, typer.Option(help="Where run directories go.")] = Path("runs"),
    resume: Annotated[
        str | None, typer.Option(help="Continue RUN from its newest complete checkpoint (no PLAN needed).")
    ] = None,
    max_nproc_per_node: Annotated[
        int | None, typer.Option(help="Worker slots per node for felactl scale (default: GPUs, or a CPU node's cores).")
    ] = None,
    scaling_policy: Annotated[
        str,
        typer.Option(
            help="When the job is rescaled: fixed-batch (same batch and lr) or linear-lr (batch ~ workers up to "
            "--max-batch, lr linear in the batch)."
        ),
    ] = "fixed-batch",
    max_batch: Annotated[int | None, typer.Option(help="linear-lr: cap on the global batch (default 4x).")] = None,
    heartbeat_timeout: Annotated[
        float, typer.Option(help="Seconds without a heartbeat before a worker is dropped.")
    ] = 5.0,
    collective_timeout: Annotated[
        float,
        typer.Option(
            help="Elastic jobs: seconds before a blocked collective fails (then the job re-forms); "
            "a new group's first step may take up to the start-up timeout."
        ),
    ] = 10.0,
    join_timeout: Annotated[
        float,
        typer.Option(
            help="Seconds for the nodes' agents to join, and for a worker `felactl scale --add` starts to "
            "be ready (import torch, build the model): raise it for slow nodes."
        ),
    ] = 60.0,
    elastic: Annotated[bool, typer.Option(help="Run data-parallel bsp plans under live rescaling.")] = True,
    cluster: Annotated[
        Path | None,
        typer.Option(help="The cluster profile the plan was made from: felactl scale then re-plans with the planner."),
    ] = None,
    model: Annotated[
        Path | None, typer.Option(help="The model profile the plan was made from (with --cluster).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as one JSON object on stdout.")] = False,
) -> None:
    """Train: start the coordinator and this machine's agent, run the plan (or --script), write runs/<id>/."""
    from felactl.cli.model_profile import parse_config
    from felactl.errors import InputError
    from felactl.launcher.launch import launch as run_launch
    from felactl.launcher.prepare import LaunchOptions, job_plan
    from felactl.launcher.resume import run_counts
    from felactl.limits import parse_count_range
    from felactl.spec import save

    script_args = ctx.meta.get(SCRIPT_ARGS)
    min_nodes, max_nodes = parse_count_range("--nnodes", nnodes)
    if script is not None:
        if testbed is not None:
            raise InputError("--testbed: runs a plan's training for now, not --script")
        plan_only = {
            "--steps": steps,
            "--sync": sync,
            "--slowdown": slowdown,
            "--straggler": straggler,
            "--keep-checkpoints": keep_checkpoints,
            "--checkpoint-every": checkpoint_every,
            "--resume": resume,
            "--max-nproc-per-node": max_nproc_per_node,
            "--cluster": cluster,
            "--model": model,
            "--max-batch": max_batch,
            "--job": job,
            "--global-batch": global_batch,
            "--micro-batch": micro_batch,
            "--config": config,
            "--nnodes MIN:MAX": None if min_nodes == max_nodes else nnodes,
        }
        given = [name for name, value in plan_only.items() if value is not None]
        if given:
            raise InputError(f"{given[0]} applies to a plan's training, not to --script (your script trains)")
        return _launch_script(
            script,
            script_args or (),
            plan,
            nproc_per_node,
            max_restarts,
            run_id=run_id,
            runs_root=runs_root,
            rdzv_endpoint=rdzv_endpoint,
            nnodes=max_nodes,
            hostfile=hostfile,
            node_name=node_name,
            as_json=as_json,
        )
    for name, value in {"--max-restarts": max_restarts, "arguments after --": script_args}.items():
        if value is not None:
            raise InputError(f"{name}: only with --script (a plan says its own workers)")
    if nproc_per_node is not None and job is None:
        raise InputError("--nproc-per-node: only with --job or --script (a plan says its own workers)")
    for name, value in {"--global-batch": global_batch, "--micro-batch": micro_batch, "--config": config}.items():
        if value is not None and job is None:
            raise InputError(f"{name}: only with --job (a plan says its own model and batch)")
    if sum(x is not None for x in (plan, resume, job)) != 1:
        raise InputError(
            "give a PLAN to launch, --job SOURCE to train on local workers, or --resume RUN "
            "to continue a run (one of them)"
        )
    scratch = contextlib.ExitStack()
    if job is not None:  # the run keeps its own copy of the plan: this one only has to outlive the start
        made = job_plan(job, parse_config(config), nproc_per_node, global_batch, micro_batch)
        plan = save(made, Path(scratch.enter_context(tempfile.TemporaryDirectory(prefix="felactl-job-"))) / "plan.yaml")
    counts = run_counts(
        resume,
        runs_root,
        steps=steps,
        checkpoint_every=checkpoint_every,
        keep_checkpoints=keep_checkpoints,
        slowdown=slowdown,
        straggler=straggler,
    )
    options = LaunchOptions(
        plan_path=plan or Path(),
        run_id=run_id,
        runs_root=runs_root,
        sync=sync,
        **counts,
        rdzv_endpoint=rdzv_endpoint,
        nnodes=max_nodes,
        min_nodes=min_nodes,
        hostfile=hostfile,
        node_name=node_name,
        testbed=testbed,
        resume=resume,
        max_nproc_per_node=max_nproc_per_node,
        scaling_policy=scaling_policy,
        max_batch=max_batch,
        heartbeat_timeout_s=heartbeat_timeout,
        elastic=elastic,
        collective_timeout_s=collective_timeout,
        join_timeout_s=join_timeout,
        cluster_path=cluster,
        model_path=model,
    )
    with (
        scratch,
        live_run(output.stderr, lambda run_id: f"run {run_id} (of {options.steps} steps)", options.steps) as update,
    ):
        summary = run_launch(options, on_update=update)
    output.emit(
        summary,
        as_json,
        lambda console: console.print(
            f"run {summary['run']}: {summary['steps']} steps, final loss {summary['final_loss']:.4f}, "
            f"{summary['samples_per_s']:.1f} samples/s; results in {summary['run_dir']}"
        ),
    )


def _launch_script(
    script: Path,
    args: tuple[str, ...],
    plan: Path | None,
    nproc_per_node: int | None,
    max_restarts: int | None,
    *,
    as_json: bool,
    **common,
) -> None:
    from felactl.launcher.script import ScriptOptions, launch_script

    options = ScriptOptions(
        script=script,
        args=args,
        plan_path=plan,
        nproc_per_node=nproc_per_node,
        max_restarts=0 if max_restarts is None else max_restarts,
        **common,
    )
    output.stderr.print(f"running {script} under felactl's agents")
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
