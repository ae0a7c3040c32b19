"""``felactl launch``'s flags as the user gave them, and the options each kind of launch takes from
them: a script's (:class:`~felactl.launcher.script.ScriptOptions`) or a plan's
(:class:`~felactl.launcher.prepare.LaunchOptions`). A flag given to a kind of launch it does not
apply to is refused with one line that names it, before anything starts."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from felactl.errors import InputError
from felactl.launcher.prepare import LaunchOptions
from felactl.launcher.resume import run_counts
from felactl.launcher.script import ScriptOptions
from felactl.launcher.slurm import Allocation, current_allocation, requeued_run, slurm_applies
from felactl.limits import parse_count_range, split_items
from felactl.spec import SyncMode


@dataclass(frozen=True, kw_only=True)
class LaunchFlags:
    """Every flag of ``felactl launch`` as given (None: not given; see ``felactl launch --help``)."""

    plan: Path | None
    script: Path | None
    script_args: tuple[str, ...] | None
    """What followed ``--`` on the command line (None: no ``--``)."""
    job: str | None
    nproc_per_node: int | None
    max_restarts: int | None
    global_batch: int | None
    micro_batch: int | None
    config: list[str] | None
    """``--config key=value``, unparsed (only a ``--job`` reads it)."""
    shard: bool
    nodes: str | None
    """``--nodes NODE[,NODE...]``: the nodes a ``--job``'s workers go on (their agents' names)."""
    run_id: str | None
    steps: int | None
    sync: SyncMode | None
    slowdown: str | None
    straggler: str | None
    keep_checkpoints: int | None
    checkpoint_every: int | None
    rdzv_endpoint: str | None
    nnodes: str
    """``N`` or ``MIN:MAX``."""
    hostfile: Path | None
    node_name: str | None
    testbed: str | None
    slurm: bool
    """Inside a Slurm allocation, run on its nodes (``--no-slurm``: False)."""
    runs_root: Path
    resume: str | None
    max_nproc_per_node: int | None
    scaling_policy: str
    max_batch: int | None
    heartbeat_timeout_s: float
    collective_timeout_s: float
    join_timeout_s: float
    elastic: bool
    cluster: Path | None
    model: Path | None


def script_options(flags: LaunchFlags) -> ScriptOptions:
    """The options of a ``--script`` launch; a flag of a plan's training is refused."""
    min_nodes, max_nodes = parse_count_range("--nnodes", flags.nnodes)
    if flags.testbed is not None:
        raise InputError("--testbed: runs a plan's training for now, not --script")
    plan_only = {
        "--steps": flags.steps,
        "--sync": flags.sync,
        "--slowdown": flags.slowdown,
        "--straggler": flags.straggler,
        "--keep-checkpoints": flags.keep_checkpoints,
        "--checkpoint-every": flags.checkpoint_every,
        "--resume": flags.resume,
        "--max-nproc-per-node": flags.max_nproc_per_node,
        "--cluster": flags.cluster,
        "--model": flags.model,
        "--max-batch": flags.max_batch,
        "--job": flags.job,
        "--global-batch": flags.global_batch,
        "--micro-batch": flags.micro_batch,
        "--config": flags.config,
        "--shard": flags.shard or None,
        "--nodes": flags.nodes,
        "--nnodes MIN:MAX": None if min_nodes == max_nodes else flags.nnodes,
    }
    given = [name for name, value in plan_only.items() if value is not None]
    if given:
        raise InputError(f"{given[0]} applies to a plan's training, not to --script (your script trains)")
    return ScriptOptions(
        script=flags.script,
        args=flags.script_args or (),
        plan_path=flags.plan,
        nproc_per_node=flags.nproc_per_node,
        max_restarts=0 if flags.max_restarts is None else flags.max_restarts,
        run_id=flags.run_id,
        runs_root=flags.runs_root,
        rdzv_endpoint=flags.rdzv_endpoint,
        nnodes=max_nodes,
        hostfile=flags.hostfile,
        node_name=flags.node_name,
        slurm=allocation(flags),
    )


def job_nodes(flags: LaunchFlags) -> tuple[str, ...]:
    """The nodes a ``--job``'s workers go on: ``--nodes``, else the Slurm allocation's, else ()
    (this machine)."""
    if flags.nodes is not None:
        nodes = split_items("--nodes", flags.nodes, "NODE[,NODE...]")
        if len(set(nodes)) != len(nodes):
            raise InputError(f"--nodes {flags.nodes}: a node is named twice (each node's agent runs its workers)")
        return tuple(nodes)
    slurm = allocation(flags)
    return slurm.nodes if slurm is not None else ()


def allocation(flags: LaunchFlags) -> Allocation | None:
    """The Slurm allocation a launch runs on: the one this process is in (``SLURM_JOB_ID``),
    unless ``--no-slurm``, or ``--testbed``, ``--hostfile`` or ``--rdzv-endpoint`` (agents started
    by hand join there) say where the nodes are, as for ``felactl profile``."""
    return (
        current_allocation() if slurm_applies(flags.slurm, flags.testbed, flags.hostfile, flags.rdzv_endpoint) else None
    )


def check_plan_flags(flags: LaunchFlags) -> None:
    """Refuse the flags a plan's launch does not take (a script's; a ``--job``'s without it), and
    anything but exactly one of PLAN, ``--job`` and ``--resume``."""
    parse_count_range("--nnodes", flags.nnodes)
    if flags.script_args is not None:
        raise InputError("arguments after --: only with --script (a plan says its own workers)")
    if flags.nproc_per_node is not None and flags.job is None:
        raise InputError("--nproc-per-node: only with --job or --script (a plan says its own workers)")
    job_only = {
        "--global-batch": flags.global_batch,
        "--micro-batch": flags.micro_batch,
        "--config": flags.config,
        "--shard": flags.shard or None,
        "--nodes": flags.nodes,
    }
    for name, value in job_only.items():
        if value is not None and flags.job is None:
            raise InputError(f"{name}: only with --job (a plan says its own model and batch)")
    if flags.shard and flags.sync not in (None, SyncMode.BSP):
        raise InputError(
            f"--shard runs under sync bsp (its workers gather every block together, step by step), not --sync {flags.sync.value}"
        )
    if flags.job is not None and flags.nodes is None and parse_count_range("--nnodes", flags.nnodes)[1] > 1:
        if allocation(flags) is None:
            raise InputError(
                f"--nnodes {flags.nnodes}: --job places its workers on this machine unless --nodes names "
                "the nodes (--nodes NODE,NODE...: the names their `felactl agent`s join with, each its "
                "hostname unless --node-name; inside a Slurm allocation, its nodes)"
            )
    if sum(x is not None for x in (flags.plan, flags.resume, flags.job)) != 1:
        raise InputError(
            "give a PLAN to launch, --job SOURCE to train on local workers, or --resume RUN "
            "to continue a run (one of them)"
        )


def plan_options(flags: LaunchFlags, plan: Path | None) -> LaunchOptions:
    """The options of a plan's launch of ``plan`` (None: the ``--resume``'d run's); the counts a
    ``--resume`` does not restate are the run's own (:func:`~felactl.launcher.resume.run_counts`).
    In a Slurm allocation the run is named after the job unless ``--run-id`` says otherwise, and a
    requeued job resumes it (:func:`~felactl.launcher.slurm.requeued_run`)."""
    min_nodes, max_nodes = parse_count_range("--nnodes", flags.nnodes)
    slurm = allocation(flags)
    if slurm is not None and flags.resume is None:
        run_id, resume = requeued_run(slurm, flags.run_id, flags.runs_root)
        flags = replace(flags, run_id=run_id, resume=resume)
        plan = None if resume is not None else plan
    counts = run_counts(
        flags.resume,
        flags.runs_root,
        steps=flags.steps,
        checkpoint_every=flags.checkpoint_every,
        keep_checkpoints=flags.keep_checkpoints,
        slowdown=flags.slowdown,
        straggler=flags.straggler,
    )
    return LaunchOptions(
        plan_path=plan,
        run_id=flags.run_id,
        runs_root=flags.runs_root,
        sync=flags.sync,
        **counts,
        rdzv_endpoint=flags.rdzv_endpoint,
        nnodes=max_nodes,
        min_nodes=min_nodes,
        hostfile=flags.hostfile,
        node_name=flags.node_name,
        testbed=flags.testbed,
        slurm=slurm,
        resume=flags.resume,
        max_nproc_per_node=flags.max_nproc_per_node,
        scaling_policy=flags.scaling_policy,
        max_batch=flags.max_batch,
        heartbeat_timeout_s=flags.heartbeat_timeout_s,
        elastic=flags.elastic,
        collective_timeout_s=flags.collective_timeout_s,
        join_timeout_s=flags.join_timeout_s,
        max_restarts=flags.max_restarts,
        cluster_path=flags.cluster,
        model_path=flags.model,
    )
