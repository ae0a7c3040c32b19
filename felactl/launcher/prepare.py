"""Before anything starts: a launch's options, the plan it runs (``--sync`` applied, refused
unless the runtime can execute it), the checks of that plan against the flags, the testbed and
this machine, and the run directory (its secret, its copy of the plan and of the profiles)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from felactl import limits, models
from felactl.control.store import parse_endpoint
from felactl.control.stragglers import parse_pattern, parse_slowdown
from felactl.errors import InputError
from felactl.fsutil import atomic_write_text, check_directory
from felactl.launcher import hosts as hostfile
from felactl.launcher.controlplane import read_secret_file, write_secret_file
from felactl.launcher.elastic import ElasticSettings
from felactl.launcher.launch_defaults import (
    COLLECTIVE_TIMEOUT_S,
    HEARTBEAT_TIMEOUT_S,
    JOIN_TIMEOUT_S,
    PLAN_MAX_RESTARTS,
)
from felactl.launcher.resume import ResumePoint, find_resume_point
from felactl.launcher.rundir import DEFAULT_RUNS_ROOT, RunDir
from felactl.launcher.scale_plan import ScalingPolicy
from felactl.launcher.slurm import Allocation, requeued_onto
from felactl.limits import check_flag
from felactl.machine import num_gpus
from felactl.spec import (
    DeviceKind,
    Placement,
    Plan,
    SyncMode,
    check_executable,
    check_plan_against_cluster,
    check_plan_against_model,
    load_cluster,
    load_model,
    load_plan,
    save,
)
from felactl.spec.executable import plan_backend, why_not_rescalable
from felactl.spec.sync_modes import sync_support


@dataclass(frozen=True, kw_only=True)
class LaunchOptions:
    plan_path: Path | None
    """The plan to run; None for ``--resume``, which runs the run's own (:func:`runnable_plan`)."""
    run_id: str | None = None
    runs_root: Path = DEFAULT_RUNS_ROOT
    steps: int = 100
    sync: SyncMode | None = None
    slowdown: str | None = None
    """``RANK=FACTOR[,RANK=FACTOR]``: after each compute, sleep (factor - 1) x its compute time."""
    straggler: str | None = None
    """``roundrobin:SECONDS`` or ``prob:P:SECONDS``."""
    checkpoint_every: int = 0
    rdzv_endpoint: str | None = None
    nnodes: int = 1
    min_nodes: int | None = None
    """``--nnodes MIN:MAX``'s MIN: the nodes the job needs to start on; an elastic job goes on
    without nodes whose workers cannot start while this many are left. None: all ``nnodes``."""
    hostfile: Path | None = None
    testbed: str | None = None
    """A testbed that is up (``felactl testbed up``): the plan's nodes are its nodes, each agent runs
    in its node's namespace and cgroup, and the coordinator listens on the testbed's bridge."""
    node_name: str | None = None
    slurm: Allocation | None = None
    """The Slurm allocation this launch runs in (:mod:`~felactl.launcher.slurm`): the plan's nodes
    are its nodes, each agent a job step, the coordinator on this node's address."""
    join_timeout_s: float = JOIN_TIMEOUT_S
    timeout_s: float = 120.0
    """Collective and store timeout inside the workers."""
    resume: str | None = None
    """A run to continue from its newest complete checkpoint (its directory is reused)."""
    elastic: bool = True
    """Run under live rescaling (``felactl scale``) and survive failures, where the plan can: a
    data-parallel plan of a mode that rescales live (:func:`~felactl.spec.executable.why_not_rescalable`).
    False: ``--no-elastic``."""
    max_nproc_per_node: int | None = None
    scaling_policy: str = ScalingPolicy.name
    max_batch: int | None = None
    heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S
    collective_timeout_s: float = COLLECTIVE_TIMEOUT_S
    """Elastic jobs: the data-parallel group's collective timeout (a survivor blocked with a dead
    peer fails after at most this; usually at once, when the dead peer's sockets close)."""
    max_restarts: int | None = None
    """A job that does not rescale live: how many times a failed worker starts every worker again
    from the newest checkpoint (None: :data:`~felactl.launcher.launch_defaults.PLAN_MAX_RESTARTS`)."""
    keep_checkpoints: int = 3
    """The newest complete checkpoints kept; older ones are deleted as the run goes (0: keep all)."""
    cluster_path: Path | None = None
    model_path: Path | None = None
    """The profiles the plan was made from: kept in the run, so a rescale runs the planner again."""
    drain_s: float = 30.0
    """Interrupted (Ctrl-C, SIGTERM): how long the workers get to agree on a last step and
    checkpoint it before they are killed (torchelastic's workers get 30 s after SIGTERM too)."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise InputError(f"--steps must be >= 1, got {self.steps}")
        if self.checkpoint_every < 0:
            raise InputError(f"--checkpoint-every must be >= 0, got {self.checkpoint_every}")
        check_flag(
            "--max-restarts",
            self.max_restarts,
            limits.Bound(0, 1000, "a job that failed a thousand times fails for a reason of its own"),
        )
        if self.keep_checkpoints < 0:
            raise InputError(f"--keep-checkpoints must be >= 0, got {self.keep_checkpoints}")
        check_flag("--nnodes", self.nnodes, limits.COUNT)
        check_flag("--nnodes", self.min_nodes, limits.Bound(1, self.nnodes, "MIN is at most MAX"))
        if self.testbed is not None:
            given = [
                flag
                for flag, value in (
                    ("--rdzv-endpoint", self.rdzv_endpoint),
                    ("--hostfile", self.hostfile),
                    ("--nnodes", self.nnodes if self.nnodes != 1 else None),
                    ("--node-name", self.node_name),
                )
                if value is not None
            ]
            if given:
                raise InputError(
                    f"{given[0]}: not with --testbed (the plan's nodes are the testbed's; the "
                    "coordinator listens on its bridge)"
                )
        if self.nnodes > 1 and not (self.rdzv_endpoint or self.hostfile or self.slurm):
            raise InputError("--nnodes > 1 needs --rdzv-endpoint (agents join there) or --hostfile")
        if (self.cluster_path is None) != (self.model_path is None):
            raise InputError("--cluster and --model go together: the planner needs both profiles to re-plan")
        check_flag("--max-nproc-per-node", self.max_nproc_per_node, limits.COUNT)
        for flag, seconds in (
            ("--heartbeat-timeout", self.heartbeat_timeout_s),
            ("--collective-timeout", self.collective_timeout_s),
            ("--join-timeout", self.join_timeout_s),
            ("--timeout", self.timeout_s),
        ):
            check_flag(flag, seconds, limits.SECONDS, above=0)
        check_directory("--runs-root", self.runs_root)
        if self.rdzv_endpoint is not None:
            parse_endpoint(self.rdzv_endpoint)
        if self.hostfile is not None:
            hostfile.read_hostfile(self.hostfile)
        ScalingPolicy(self.scaling_policy, self.max_batch)
        parse_slowdown(self.slowdown)
        parse_pattern(self.straggler)

    @property
    def restarts_allowed(self) -> int:
        return PLAN_MAX_RESTARTS if self.max_restarts is None else self.max_restarts

    def elastic_settings(self) -> ElasticSettings:
        return ElasticSettings(
            policy=ScalingPolicy(self.scaling_policy, self.max_batch),
            heartbeat_timeout_s=self.heartbeat_timeout_s,
            max_nproc_per_node=self.max_nproc_per_node,
            ready_timeout_s=self.join_timeout_s,
            min_nodes=self.min_nodes,
        )


def resume_point(options: LaunchOptions) -> ResumePoint | None:
    """Where ``--resume`` continues from (None: a new run), refused unless ``--steps`` goes past it."""
    resume = find_resume_point(options.resume, options.runs_root) if options.resume else None
    if resume is not None and options.steps <= resume.step:
        raise InputError(
            f"--steps {options.steps}: run {options.resume} is already at step {resume.step} (steps "
            f"count the whole run, as at its launch); give more than {resume.step}"
        )
    return resume


def runnable_plan(options: LaunchOptions, resume: ResumePoint | None) -> Plan:
    """The plan this launch runs (a resume: its checkpoint's generation's), with ``--sync`` applied
    once, refused (InputError) unless it can run. Nothing is written: :func:`prepare_run` does,
    once every check has passed."""
    plan_path = resume.plan_path if resume else options.plan_path
    plan = load_plan(plan_path)
    if resume is not None and options.slurm is not None:
        plan = requeued_onto(options.slurm, plan)
    if options.sync is not None:  # the run's plan says the mode it runs with, so a resume runs it too
        plan = dataclasses.replace(plan, sync=dataclasses.replace(plan.sync, mode=options.sync))
    check_runnable(plan, where=str(plan_path))
    if options.elastic and options.scaling_policy != "fixed-batch" and sync_support(plan.sync.mode).at_own_pace:
        raise InputError(
            f"--scaling-policy {options.scaling_policy}: sync {plan.sync.mode.value} rescales with a fixed "
            f"global batch; use --scaling-policy fixed-batch"
        )
    return plan


def check_runnable(plan: Plan, where: str = "plan") -> None:
    """Refuse (exit 2) before anything starts a plan the workers would refuse: one the runtime
    cannot execute, or whose model source cannot be imported."""
    check_executable(plan, where=where)
    models.check_source(plan.model.source, plan.model.config)


def prepare_run(
    options: LaunchOptions, plan: Plan, resume: ResumePoint | None = None
) -> tuple[RunDir, str, ResumePoint | None]:
    """Make the run directory, its secret and its copy of ``plan`` (checked against the profiles
    it was made from, where given). A resumed run keeps its directory and secret; its new
    generation gets its own copy of the plan (``--sync`` applied), so a later resume runs the same,
    and the returned resume point names that copy."""
    if resume is not None:
        copy = save(plan, resume.run.plan_of(resume.generation))
        return resume.run, read_secret_file(resume.run.secret), dataclasses.replace(resume, plan_path=copy)
    profiles = None
    if options.cluster_path is not None:
        profiles = load_cluster(options.cluster_path), load_model(options.model_path)
        check_plan_against_cluster(plan, profiles[0], str(options.plan_path))
        check_plan_against_model(plan, profiles[1], str(options.plan_path))
    run = RunDir.create(options.run_id, root=options.runs_root)
    secret = write_secret_file(run.secret)
    save(plan, run.plan)
    if profiles is not None:  # what felactl scale re-plans with (felactl.launcher.elastic)
        save(profiles[0], run.cluster)
        save(profiles[1], run.model)
    atomic_write_text(
        run.launch_options,
        json.dumps(
            {k: (str(v) if isinstance(v, Path) else getattr(v, "value", v)) for k, v in asdict(options).items()},
            indent=2,
        )
        + "\n",
    )
    return run, secret, None


def job_plan(
    source: str,
    config: dict,
    nproc: int | None,
    global_batch: int | None,
    micro_batch: int | None,
    *,
    shard: bool = False,
    nodes: tuple[str, ...] = (),
) -> Plan:
    """``felactl launch --job``: a data-parallel plan of the job on ``nproc`` local CPU slots, or
    on ``nproc`` CPU slots of each of ``nodes`` (a Slurm allocation's); micro-batch: the global
    batch split evenly, unless given; with ``shard``, its one stage sharded among them under sync
    bsp."""
    if nproc is None or global_batch is None:
        raise InputError("--job needs --nproc-per-node and --global-batch")
    check_flag("--nproc-per-node", nproc, limits.COUNT)
    check_flag("--global-batch", global_batch, limits.BATCH)
    workers = nproc * max(1, len(nodes))
    if global_batch < workers:
        raise InputError(f"--global-batch ({global_batch}) must be >= the workers ({workers})")
    largest_share = -(-global_batch // workers)
    if micro_batch is not None:
        check_flag("--micro-batch", micro_batch, limits.BATCH)
        if micro_batch > largest_share:  # never used: a worker runs at most its share at once
            raise InputError(
                f"--micro-batch {micro_batch} is larger than a worker's share of --global-batch {global_batch} "
                f"over {workers} workers (at most {largest_share} samples): use --micro-batch {largest_share} or "
                "less, or leave it out"
            )
    micro = micro_batch or largest_share
    plan = models.local_data_parallel_plan(source, config, workers, global_batch=global_batch, micro_batch=micro)
    if nodes:
        placement = tuple(
            Placement(device=f"{node}-cpu{i}", node=node, local_index=i) for node in nodes for i in range(nproc)
        )
        stage = dataclasses.replace(
            plan.stages[0],
            workers=tuple(dataclasses.replace(w, device=p.device) for w, p in zip(plan.stages[0].workers, placement)),
        )
        plan = dataclasses.replace(
            plan, devices=tuple(p.device for p in placement), placement=placement, stages=(stage,)
        )
    if not shard:
        return plan
    stage = dataclasses.replace(plan.stages[0], shard=True)
    sharded = dataclasses.replace(plan, stages=(stage,), sync=dataclasses.replace(plan.sync, mode=SyncMode.BSP))
    # checked here, by the flags' name: the launch's own check would name the scratch plan it writes
    check_executable(sharded, where="--shard")
    return sharded


def node_devices(plan: Plan, local_node: str) -> dict[str, tuple[str, ...]]:
    """Node -> its devices in rank order; a plan without placement runs wholly on ``local_node``."""
    nodes = plan.nodes()
    return {local_node: nodes[""]} if "" in nodes else nodes


def idle_gpus_warning(plan: Plan, local_node: str) -> str | None:
    """A line for the user when this machine's workers of a CPU (gloo) plan leave GPUs idle:
    a plan made from a CPU profile, or one that places nothing, trains on the CPU even here."""
    if plan_backend(plan) != "gloo":
        return None
    if plan.placement and not any(p.node == local_node for p in plan.placement):
        return None  # no worker of this plan runs on this machine
    gpus = num_gpus()
    if not gpus:
        return None
    return (
        f"warning: this plan runs its workers on CPUs (gloo), and this machine's "
        f"{gpus} GPU(s) stay idle; to train on them, profile with "
        f"`felactl profile --device cuda` and plan again"
    )


def check_nodes(options: LaunchOptions, nodes: dict[str, tuple[str, ...]], local_node: str, plan_path: Path) -> None:
    """The plan's nodes (``nodes``, from ``plan_path``) against ``--nnodes``, this machine and how
    the other nodes' agents are started."""
    if options.nnodes > 1 and options.nnodes != len(nodes):
        raise InputError(
            f"--nnodes {options.nnodes}, but the plan places its workers on {len(nodes)} node(s): "
            f"{', '.join(sorted(nodes))}"
        )
    if options.rdzv_endpoint is None and options.hostfile is None and local_node not in nodes:
        names = ", ".join(sorted(nodes))
        raise InputError(
            f"{plan_path}: placement: the plan runs on node(s) {names} but this machine is "
            f"{local_node!r} (plan for a cluster profiled here, or pass --node-name)"
        )
    if options.rdzv_endpoint is None and options.hostfile is None and len(nodes) > 1:
        raise InputError(
            f"{plan_path}: the plan spans {len(nodes)} nodes; start their agents with "
            "--hostfile, or with --rdzv-endpoint and `felactl agent` on each node"
        )


def check_this_machine(options: LaunchOptions, plan: Plan, local_node: str, plan_path: Path) -> None:
    """What this machine can tell before anything starts: the GPUs the plan (read from
    ``plan_path``) puts on it exist, and every rank ``--slowdown`` names is one of the plan's."""
    wanted = [p for p in plan.placement if p.node == local_node and p.kind == DeviceKind.CUDA]
    if wanted:
        have = num_gpus()
        needed = max(p.local_index for p in wanted) + 1
        if have < needed:
            raise InputError(
                f"{plan_path}: placement: the plan puts {len(wanted)} GPU worker(s) on node "
                f"{local_node!r} (GPU indices up to {needed - 1}), but this machine has {have} GPU(s)"
            )
    for rank in parse_slowdown(options.slowdown):
        if rank >= len(plan.devices):
            raise InputError(f"--slowdown: rank {rank} does not exist; the plan has ranks 0..{len(plan.devices) - 1}")


def why_not_elastic(options: LaunchOptions, plan: Plan) -> str | None:
    """Why this launch of ``plan`` runs without live rescaling (None: it runs with it): the plan
    cannot be rescaled (:func:`~felactl.spec.executable.why_not_rescalable`), or ``--no-elastic``."""
    reasons = (why_not_rescalable(plan), None if options.elastic else "it was launched --no-elastic")
    return "; ".join(why for why in reasons if why) or None


def check_restarts(options: LaunchOptions, not_elastic: str | None) -> None:
    """``--max-restarts`` is for a job that cannot rescale live: an elastic one goes on without a
    failed worker instead of starting again."""
    if options.max_restarts is not None and not_elastic is None:
        raise InputError(
            "--max-restarts: this job rescales live and goes on without a failed worker instead of restarting; "
            "add --no-elastic to restart it from its checkpoints instead"
        )


def check_min_nodes(options: LaunchOptions, not_elastic: str | None) -> None:
    """``--nnodes MIN:MAX`` with MIN < MAX: only a job that survives losing workers goes on without
    a node (``not_elastic``: why this one does not, :func:`why_not_elastic`)."""
    if options.min_nodes is None or options.min_nodes == options.nnodes or not_elastic is None:
        return
    raise InputError(
        f"--nnodes {options.min_nodes}:{options.nnodes}: going on without a node needs live rescaling: {not_elastic}"
    )


def testbed_for(name: str, nodes: dict[str, tuple[str, ...]], plan_path: Path):
    """The testbed ``name`` that is up, checked to hold every node the plan places workers on."""
    from felactl.testbed import read_state

    bed = read_state(name)
    missing = sorted(set(nodes) - set(bed.nodes))
    if missing:
        raise InputError(
            f"{plan_path}: placement: the plan runs on node(s) {', '.join(missing)}, which testbed "
            f"{name!r} lacks (it has: {', '.join(bed.nodes)}); plan for a cluster profiled with "
            f"felactl profile --testbed {name}"
        )
    return bed
