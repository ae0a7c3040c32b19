"""``felactl launch PLAN``: run a plan with the coordinator here and one agent per node."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.live import Live

from felactl.cli import output
from felactl.cli.runview import run_table
from felactl.spec import SyncMode


def launch(
    plan: Annotated[Optional[Path], typer.Argument(help="The plan to run (felactl plan -o plan.yaml).")] = None,
    run_id: Annotated[Optional[str], typer.Option(help="Name of the run directory under runs/.")] = None,
    steps: Annotated[Optional[int], typer.Option(
        min=1, help="Iterations (global batches) to train (default 100; --resume: the run's).")] = None,
    sync: Annotated[Optional[SyncMode], typer.Option(help="Override the plan's sync mode.")] = None,
    slowdown: Annotated[Optional[str], typer.Option(
        help="RANK=FACTOR[,RANK=FACTOR]: slow workers on purpose (sleep (factor-1) x compute).")] = None,
    straggler: Annotated[Optional[str], typer.Option(help="roundrobin:SECONDS or prob:P:SECONDS.")] = None,
    keep_checkpoints: Annotated[Optional[int], typer.Option(
        help="Keep the newest N complete checkpoints, delete older ones as the run goes (0: keep all; default 3, "
             "--resume: the run's).")] = None,
    checkpoint_every: Annotated[Optional[int], typer.Option(
        min=0, help="Checkpoint every K steps (0: never; --resume: the run's).")] = None,
    rdzv_endpoint: Annotated[Optional[str], typer.Option(
        help="HOST:PORT the control plane listens on (default: loopback, a free port).")] = None,
    nnodes: Annotated[int, typer.Option(min=1, help="Nodes (agents) to wait for.")] = 1,
    hostfile: Annotated[Optional[Path], typer.Option(help="DeepSpeed-style 'host slots=N' file: start agents over ssh.")] = None,
    node_name: Annotated[Optional[str], typer.Option(help="This machine's node name (default: short hostname).")] = None,
    runs_root: Annotated[Path, typer.Option(help="Where run directories go.")] = Path("runs"),
    resume: Annotated[Optional[str], typer.Option(
        help="Continue RUN from its newest complete checkpoint (no PLAN needed).")] = None,
    max_nproc_per_node: Annotated[Optional[int], typer.Option(
        help="Worker slots per node for felactl scale (default: GPUs, or a CPU node's cores).")] = None,
    scaling_policy: Annotated[str, typer.Option(
        help="When the job is rescaled: fixed-batch (same batch and lr) or linear-lr (batch ~ workers up to "
             "--max-batch, lr linear in the batch).")] = "fixed-batch",
    max_batch: Annotated[Optional[int], typer.Option(help="linear-lr: cap on the global batch (default 4x).")] = None,
    heartbeat_timeout: Annotated[float, typer.Option(help="Seconds without a heartbeat before a worker is dropped.")] = 5.0,
    collective_timeout: Annotated[float, typer.Option(
        help="Elastic jobs: seconds before a blocked collective fails (then the job re-forms).")] = 10.0,
    elastic: Annotated[bool, typer.Option(help="Run data-parallel bsp plans under live rescaling.")] = True,
    cluster: Annotated[Optional[Path], typer.Option(
        help="The cluster profile the plan was made from: felactl scale then re-plans with the planner.")] = None,
    model: Annotated[Optional[Path], typer.Option(
        help="The model profile the plan was made from (with --cluster).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as one JSON object on stdout.")] = False,
) -> None:
    """Train: start the coordinator and this machine's agent, run the plan, write runs/<id>/."""
    from felactl.launcher.launch import LaunchOptions, launch as run_launch
    from felactl.launcher.resume import run_counts

    from felactl.errors import InputError

    if (plan is None) == (resume is None):
        raise InputError("give a PLAN to launch, or --resume RUN to continue a run (not both)")
    counts = run_counts(resume, runs_root, steps=steps, checkpoint_every=checkpoint_every,
                        keep_checkpoints=keep_checkpoints)
    options = LaunchOptions(plan_path=plan or Path(), run_id=run_id, runs_root=runs_root, sync=sync,
                            slowdown=slowdown, straggler=straggler, **counts,
                            rdzv_endpoint=rdzv_endpoint, nnodes=nnodes, hostfile=hostfile, node_name=node_name,
                            resume=resume, max_nproc_per_node=max_nproc_per_node, scaling_policy=scaling_policy,
                            max_batch=max_batch, heartbeat_timeout_s=heartbeat_timeout, elastic=elastic,
                            collective_timeout_s=collective_timeout, cluster_path=cluster, model_path=model)
    with Live(console=output.stderr, refresh_per_second=4, transient=False) as live:
        def update(state) -> None:
            from felactl.agents.worker.metrics import summarize

            if state.records:
                live.update(run_table(summarize(state.records), f"run {state.run.run_id} (of {options.steps} steps)"))

        summary = run_launch(options, on_update=update)
    output.emit(summary, as_json, lambda console: console.print(
        f"run {summary['run']}: {summary['steps']} steps, final loss {summary['final_loss']:.4f}, "
        f"{summary['samples_per_s']:.1f} samples/s; results in {summary['run_dir']}"))


def register(app: typer.Typer) -> None:
    app.command("launch")(launch)
