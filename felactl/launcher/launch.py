"""``felactl launch``: run a plan — the coordinator here, one agent per node, workers per device.

The launch process hosts the control plane (:class:`Coordinator`), starts this machine's agent in a
thread (and, with a hostfile, the other nodes' agents over ssh), waits until every node of the
plan has joined and proved the job secret, hands each agent the ranks of its node's devices, then
watches: agents' states on the store, workers' records in ``metrics.jsonl``. It ends by writing
``summary.json``. Whatever happens, every process it started is stopped before it returns.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from felactl import limits, models
from felactl.agents.agent import WorkerState
from felactl.agents.local_node import AgentThread, local_agent_config
from felactl.control import EventKind
from felactl.control.documents import Assignment
from felactl.control.events import record
from felactl.control.metrics import summarize
from felactl.control.store import parse_endpoint
from felactl.control.stragglers import parse_pattern, parse_slowdown
from felactl.errors import ControlPlaneError, InputError, Stopped, WorkerFailed
from felactl.fsutil import JsonlTail, atomic_write_text, check_directory
from felactl.launcher import hosts as hostfile
from felactl.launcher.controlplane import Coordinator, Member, read_secret_file, write_secret_file
from felactl.launcher.elastic import ElasticController, ElasticSettings
from felactl.launcher.liveness import Heartbeat, LaunchIdentity
from felactl.launcher.resume import ResumePoint, find_resume_point, pick_checkpoint, prune_checkpoints
from felactl.launcher.rundir import RunDir, read_jsonl
from felactl.launcher.scale_plan import ScalingPolicy
from felactl.launcher.scale_requests import refuse_requests
from felactl.limits import check_flag
from felactl.machine import num_gpus, short_hostname, stop_processes
from felactl.spec import (
    DeviceKind,
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
from felactl.spec.executable import FIXED_BATCH_SYNC, RESCALABLE_SYNC, rescalable

log = logging.getLogger(__name__)
PRUNE_EVERY_S = 2.0
"""How often the launch deletes checkpoints beyond --keep-checkpoints (a glob of a few dirs)."""
WORKER_MODULE = "felactl.agents.worker"
POLL_S = 0.2


@dataclass(frozen=True, kw_only=True)
class LaunchOptions:
    plan_path: Path
    run_id: str | None = None
    runs_root: Path = Path("runs")
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
    join_timeout_s: float = 60.0
    timeout_s: float = 120.0
    """Collective and store timeout inside the workers."""
    resume: str | None = None
    """A run to continue from its newest complete checkpoint (its directory is reused)."""
    elastic: bool = True
    """Data-parallel bsp and tokens plans run under live rescaling (``felactl scale``) and survive failures."""
    max_nproc_per_node: int | None = None
    scaling_policy: str = "fixed-batch"
    max_batch: int | None = None
    heartbeat_timeout_s: float = 5.0
    collective_timeout_s: float = 10.0
    """Elastic jobs: the data-parallel group's collective timeout (a survivor blocked with a dead
    peer fails after at most this; usually at once, when the dead peer's sockets close)."""
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
        if self.nnodes > 1 and not (self.rdzv_endpoint or self.hostfile):
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

    def elastic_settings(self) -> ElasticSettings:
        return ElasticSettings(
            policy=ScalingPolicy(self.scaling_policy, self.max_batch),
            heartbeat_timeout_s=self.heartbeat_timeout_s,
            max_nproc_per_node=self.max_nproc_per_node,
            ready_timeout_s=self.join_timeout_s,
            min_nodes=self.min_nodes,
        )


@dataclass
class LaunchState:
    """What the live view shows: the run, its members, the records so far."""

    run: RunDir
    plan: Plan
    sync: SyncMode
    members: list[Member] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    not_elastic: str = ""
    """Why ``felactl scale`` is refused (a job that is not elastic)."""
    _metrics: JsonlTail | None = field(default=None, repr=False)

    def read_new(self) -> None:
        """Take in the records the workers appended to metrics.jsonl since the last look."""
        if self._metrics is None:
            self._metrics = JsonlTail(self.run.metrics)
        self.records.extend(self._metrics.read_new())

    def summary_so_far(self) -> dict[str, Any] | None:
        """The summary of every step recorded by now (what felactl status would read: a view
        drawn after a graceful stop's drain shows the steps it trained), None before the first;
        with the run's events, so a resumed run counts neither its redone steps nor the time it
        lay stopped."""
        self.read_new()
        return summarize(self.records, read_jsonl(self.run.events)) if self.records else None


def node_devices(plan: Plan, local_node: str) -> dict[str, tuple[str, ...]]:
    """Node -> its devices in rank order; a plan without placement runs wholly on ``local_node``."""
    nodes = plan.nodes()
    return {local_node: nodes[""]} if "" in nodes else nodes


def assign_ranks(
    plan: Plan, members: list[Member], nodes: dict[str, tuple[str, ...]], env: dict[str, str]
) -> dict[str, Assignment]:
    """Give each member the ranks of its node's devices (pure; every mismatch is an InputError)."""
    by_node = {m.node_name: m for m in members}
    missing = [n for n in nodes if n not in by_node]
    if missing:
        raise InputError(f"no agent joined for node {missing[0]!r} of the plan (joined: {', '.join(by_node)})")
    assignments = {}
    for node, devices in nodes.items():
        member = by_node[node]
        if member.num_slots != len(devices):
            raise InputError(
                f"node {node!r} offers {member.num_slots} worker slot(s) but the plan puts "
                f"{len(devices)} device(s) there"
            )
        ranks = [plan.rank_of(d) for d in devices]
        if ranks != list(range(ranks[0], ranks[0] + len(ranks))):
            raise InputError(f"the devices of node {node!r} must have consecutive ranks in plan.devices, got {ranks}")
        placed = {p.device: p.local_index for p in plan.placement}
        local_indices = tuple(placed[d] for d in devices) if all(d in placed for d in devices) else ()
        assignments[member.agent_id] = Assignment(
            rank_offset=ranks[0],
            world_size=len(plan.devices),
            module=WORKER_MODULE,
            env=dict(env),
            local_indices=local_indices,
        )
    return assignments


def worker_env(
    options: LaunchOptions,
    run: RunDir,
    plan: Plan,
    store_endpoint: str,
    *,
    elastic: bool = False,
    resume: ResumePoint | None = None,
) -> dict[str, str]:
    """The FELACTL_* variables every worker reads (see felactl.agents.worker.config)."""
    env = {
        "FELACTL_PLAN": str(run.plan.resolve()),
        "FELACTL_RUN_DIR": str(run.path.resolve()),
        "FELACTL_STORE": store_endpoint,
        "FELACTL_STEPS": str(options.steps),
        "FELACTL_CHECKPOINT_EVERY": str(options.checkpoint_every),
        "FELACTL_TIMEOUT_S": str(int(options.timeout_s)),
        # A user's own script calling init_process_group("env://") connects to our store as a
        # client instead of trying to host one on MASTER_PORT (torchrun's agent does the same).
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }
    env["FELACTL_BACKEND"] = plan_backend(plan)
    if options.sync is not None:
        env["FELACTL_SYNC"] = options.sync.value
    if options.slowdown:
        env["FELACTL_SLOWDOWN"] = options.slowdown
    if options.straggler:
        env["FELACTL_STRAGGLER"] = options.straggler
    if resume is not None:
        env.update(
            FELACTL_PLAN=str(resume.plan_path.resolve()),
            FELACTL_RESUME_FROM=str(resume.checkpoint.resolve()),
            FELACTL_GENERATION=str(resume.generation),
        )
    if elastic:
        env.update(
            FELACTL_ELASTIC="1",
            FELACTL_COLLECTIVE_TIMEOUT_S=str(options.collective_timeout_s),
            FELACTL_HEARTBEAT_S=str(min(0.5, options.heartbeat_timeout_s / 4)),
        )
    return env


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


def plan_backend(plan: Plan) -> str:
    """NCCL when the plan places every device on a GPU, else gloo: one process group has one
    backend, and a CPU plan (or one that places nothing) stays on the CPU on a machine with a GPU."""
    on_gpus = plan.placement and all(p.kind == DeviceKind.CUDA for p in plan.placement)
    return "nccl" if on_gpus else "gloo"


def runnable_plan(options: LaunchOptions, resume: ResumePoint | None) -> tuple[Plan, ResumePoint | None]:
    """The plan this launch runs (a resume: its generation's, kept as its own copy so that a later
    resume finds it), with ``--sync`` applied once, refused (InputError) unless it can run."""
    plan_path = resume.plan_path if resume else options.plan_path
    plan = load_plan(plan_path)
    if options.sync is not None:  # the run's plan says the mode it runs with, so a resume runs it too
        plan = dataclasses.replace(plan, sync=dataclasses.replace(plan.sync, mode=options.sync))
    check_runnable(plan, where=str(plan_path))
    if options.elastic and options.scaling_policy != "fixed-batch" and plan.sync.mode in FIXED_BATCH_SYNC:
        raise InputError(
            f"--scaling-policy {options.scaling_policy}: sync {plan.sync.mode.value} rescales with a fixed "
            f"global batch; use --scaling-policy fixed-batch"
        )
    if resume is not None:  # the resumed generation's own copy of its plan, so a later resume finds it
        resume = dataclasses.replace(resume, plan_path=save(plan, resume.run.path / f"plan.{resume.generation}.yaml"))
    return plan, resume


def prepare_run(options: LaunchOptions, plan: Plan, resume: ResumePoint | None = None) -> tuple[RunDir, str]:
    """Make the run directory, its secret and its copy of ``plan`` (checked against the profiles
    it was made from, where given). A resumed run keeps its directory and secret."""
    if resume is not None:
        return resume.run, read_secret_file(resume.run.secret)
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
    return run, secret


def job_plan(source: str, config: dict, nproc: int | None, global_batch: int | None, micro_batch: int | None) -> Plan:
    """``felactl launch --job``: a data-parallel plan of the job on ``nproc`` local CPU slots
    (micro-batch: the global batch split evenly, unless given)."""
    if nproc is None or global_batch is None:
        raise InputError("--job needs --nproc-per-node and --global-batch")
    check_flag("--nproc-per-node", nproc, limits.COUNT)
    check_flag("--global-batch", global_batch, limits.BATCH)
    if global_batch < nproc:
        raise InputError(f"--global-batch ({global_batch}) must be >= --nproc-per-node ({nproc})")
    largest_share = -(-global_batch // nproc)
    if micro_batch is not None:
        check_flag("--micro-batch", micro_batch, limits.BATCH)
        if micro_batch > largest_share:  # never used: a worker runs at most its share at once
            raise InputError(
                f"--micro-batch {micro_batch} is larger than a worker's share of --global-batch {global_batch} "
                f"over {nproc} workers (at most {largest_share} samples): use --micro-batch {largest_share} or "
                "less, or leave it out"
            )
    micro = micro_batch or largest_share
    return models.local_data_parallel_plan(source, config, nproc, global_batch=global_batch, micro_batch=micro)


def launch(options: LaunchOptions, on_update: Callable[[LaunchState], None] = lambda state: None) -> dict[str, Any]:
    """Run the plan to the end; return the summary (also written to ``summary.json``)."""
    local_node = options.node_name or short_hostname()
    resume = find_resume_point(options.resume, options.runs_root) if options.resume else None
    if resume is not None and options.steps <= resume.step:
        raise InputError(
            f"--steps {options.steps}: run {options.resume} is already at step {resume.step} (steps "
            f"count the whole run, as at its launch); give more than {resume.step}"
        )
    plan, resume = runnable_plan(options, resume)
    sync = plan.sync.mode
    nodes = node_devices(plan, local_node)
    endpoint = options.rdzv_endpoint
    if options.testbed is not None:
        bed = testbed_for(options.testbed, nodes, options.plan_path)
        endpoint = f"{bed.host_address}:0"
    else:
        check_nodes(options, nodes, local_node)
        _check_this_machine(options, plan, local_node)
    elastic = options.elastic and rescalable(plan, sync)
    _check_min_nodes(options, plan, sync, elastic)
    run, secret = prepare_run(options, plan, resume)
    if (warning := idle_gpus_warning(plan, local_node)) is not None:
        log.warning(warning)
    # Live rescaling covers data-parallel plans of the rescalable sync modes, on CPUs (gloo) and GPUs (NCCL): a
    # newcomer builds its model on its own device before it joins (felactl.agents.worker.elastic).
    state = LaunchState(run=run, plan=plan, sync=sync)
    try:
        coordinator = Coordinator(secret, endpoint=endpoint, job=run.run_id, events=run.events)
    except BaseException:
        if resume is None:  # nothing ran: leave no run directory behind for `felactl status` to list
            shutil.rmtree(run.path, ignore_errors=True)
        raise
    heartbeat = Heartbeat(run.heartbeat)  # with the identity below, how felactl status tells a lost launch
    record(
        run.events,
        EventKind.RESUME if resume else EventKind.LAUNCH,
        run=run.run_id,
        steps=options.steps,  # what felactl status counts an ETA to
        endpoint=coordinator.endpoint,
        session=coordinator.session,
        devices=list(plan.devices),
        launcher=LaunchIdentity.of_this_process().to_dict(),
        **({"from_step": resume.step, "checkpoint": str(resume.checkpoint)} if resume else {}),
    )
    agents = Agents(
        coordinator,
        secret,
        local_slots=0 if options.testbed else len(nodes.get(local_node, ())),
        local_node=local_node,
        logs=run.logs,
        job=run.run_id,
        hostfile=options.hostfile,
        join_timeout_s=options.join_timeout_s,
        testbed=options.testbed,
        testbed_slots={node: len(devs) for node, devs in nodes.items()},
    )
    with supervised(coordinator, agents, run, heartbeat, drain_s=options.drain_s):
        agents.start()
        state.members = coordinator.wait_members(len(nodes), options.join_timeout_s, alive=agents.check)
        env = worker_env(options, run, plan, coordinator.endpoint, elastic=elastic, resume=resume)
        controller = None
        if elastic:
            controller = ElasticController(
                coordinator,
                run,
                plan,
                state.members,
                nodes,
                options.elastic_settings(),
                start_generation=resume.generation if resume else 0,
                plan_path=resume.plan_path if resume else run.plan,
                worker=(WORKER_MODULE, env),
            )
        coordinator.publish_assignments(assign_ranks(plan, state.members, nodes, env))
        record(
            run.events,
            EventKind.START,
            members=[m.node_name for m in state.members],
            agents=[m.agent_id for m in state.members],
        )
        if controller is None:
            state.not_elastic = (
                f"this job cannot be rescaled: live rescaling covers data-parallel plans (one stage) "
                f"with sync {' or '.join(m.value for m in RESCALABLE_SYNC)}; it runs {len(plan.stages)} stage(s) "
                f"with sync {sync.value}" + ("" if options.elastic else " and was launched --no-elastic")
            )
        _watch(coordinator, state, agents, on_update, controller, options.keep_checkpoints)
        prune_checkpoints(run.checkpoints, len(plan.stages), options.keep_checkpoints)  # the last ones too
        summary = _summary(state)  # here, so that a run without a step is recorded as failed
        coordinator.stop("finished")
    run.write_summary(summary)
    record(run.events, EventKind.FINISHED, steps=summary["steps"])
    return summary


@contextlib.contextmanager
def supervised(
    coordinator: Coordinator,
    agents: Agents,
    run: RunDir,
    heartbeat: Heartbeat,
    *,
    drain_s: float,
    late_requests: str | None = None,
) -> Iterator[None]:
    """The life of a started job (a plan's or a script's) around its body. Ctrl-C or SIGTERM
    drains it (the workers checkpoint a step they agree on) and raises :class:`Stopped`, saying
    where the run stands; any other exception stops the job and records it as failed. Whatever
    happened, :func:`close_job` then answers late ``felactl scale`` requests with
    ``late_requests``, or else with how the job ended."""
    ending = "the job finished its last step; nothing changed"
    try:
        yield
    except KeyboardInterrupt:
        ending = "the job was stopped; nothing changed"
        raise drain_job(coordinator, agents, run, drain_s) from None
    except BaseException as exc:
        ending = "the job failed; nothing changed"
        coordinator.stop(f"launch ended: {type(exc).__name__}")
        record(run.events, EventKind.FAILED, reason=str(exc) or type(exc).__name__)
        raise
    finally:
        close_job(agents, coordinator, run, heartbeat, late_requests or ending)


def close_job(agents: Agents, coordinator: Coordinator, run: RunDir, heartbeat: Heartbeat, ending: str) -> None:
    """Whatever happened: stop the agents, answer late scale requests, close the store, stop the heartbeat."""
    agents.stop()
    # A felactl scale request that came after the last look must not just find the store
    # gone: answer it. (One sent after this sweep still may; felactl scale then reads how
    # the run ended.)
    with contextlib.suppress(RuntimeError):
        refuse_requests(coordinator, run, ending)
    coordinator.close()
    heartbeat.stop()


def drain_job(coordinator: Coordinator, agents: Agents, run: RunDir, drain_s: float) -> Stopped:
    """A graceful stop: the workers end after an agreed step and checkpoint it (within
    ``drain_s``, else they are killed); the ``stopped`` event says which step a resume starts at.
    Returns what the launch raises then: where the run stands, for the user."""
    coordinator.stop("interrupted", drain_s=drain_s)
    agents.stop(timeout_s=drain_s + 10, let_remote_drain=True)
    try:
        step = pick_checkpoint(run).step
    except InputError:
        step = None
    record(run.events, EventKind.STOPPED, checkpoint_step=step)
    if step is None:
        return Stopped(f"run {run.run_id} stopped before its first checkpoint (in {run.path})")
    return Stopped(f"run {run.run_id} stopped at step {step}; continue with `felactl launch --resume {run.run_id}`")


def check_runnable(plan: Plan, where: str = "plan") -> None:
    """Refuse (exit 2) before anything starts a plan the workers would refuse: one the runtime
    cannot execute, or whose model source cannot be imported."""
    check_executable(plan, where=where)
    models.check_source(plan.model.source, plan.model.config)


def _check_this_machine(options: LaunchOptions, plan: Plan, local_node: str) -> None:
    """What this machine can tell before anything starts: the GPUs the plan puts on it exist, and
    every rank ``--slowdown`` names is one of the plan's."""
    wanted = [p for p in plan.placement if p.node == local_node and p.kind == DeviceKind.CUDA]
    if wanted:
        have = num_gpus()
        needed = max(p.local_index for p in wanted) + 1
        if have < needed:
            raise InputError(
                f"{options.plan_path}: placement: the plan puts {len(wanted)} GPU worker(s) on node "
                f"{local_node!r} (GPU indices up to {needed - 1}), but this machine has {have} GPU(s)"
            )
    for rank in parse_slowdown(options.slowdown):
        if rank >= len(plan.devices):
            raise InputError(f"--slowdown: rank {rank} does not exist; the plan has ranks 0..{len(plan.devices) - 1}")


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


def _check_min_nodes(options: LaunchOptions, plan: Plan, sync: SyncMode, elastic: bool) -> None:
    """``--nnodes MIN:MAX`` with MIN < MAX: only a job that survives losing workers goes on without a node."""
    if options.min_nodes is None or options.min_nodes == options.nnodes or elastic:
        return
    raise InputError(
        f"--nnodes {options.min_nodes}:{options.nnodes}: going on without a node needs live rescaling (a "
        f"data-parallel plan with sync {' or '.join(m.value for m in RESCALABLE_SYNC)}, not --no-elastic); this "
        f"job runs {len(plan.stages)} stage(s) with sync {sync.value}"
    )


def check_nodes(options: LaunchOptions, nodes: dict[str, tuple[str, ...]], local_node: str) -> None:
    if options.nnodes > 1 and options.nnodes != len(nodes):
        raise InputError(
            f"--nnodes {options.nnodes}, but the plan places its workers on {len(nodes)} node(s): "
            f"{', '.join(sorted(nodes))}"
        )
    if options.rdzv_endpoint is None and options.hostfile is None and local_node not in nodes:
        names = ", ".join(sorted(nodes))
        raise InputError(
            f"{options.plan_path}: placement: the plan runs on node(s) {names} but this machine is "
            f"{local_node!r} (plan for a cluster profiled here, or pass --node-name)"
        )
    if options.rdzv_endpoint is None and options.hostfile is None and len(nodes) > 1:
        raise InputError(
            f"{options.plan_path}: the plan spans {len(nodes)} nodes; start their agents with "
            "--hostfile, or with --rdzv-endpoint and `felactl agent` on each node"
        )


class Agents:
    """The agents a job starts itself: this machine's (a thread, with ``local_slots`` workers) and,
    with a hostfile, one ``felactl agent`` over ssh per host. (Agents started by hand join too.)"""

    def __init__(
        self,
        coordinator: Coordinator,
        secret: str,
        *,
        local_slots: int,
        local_node: str,
        logs: Path,
        job: str,
        hostfile: Path | None = None,
        join_timeout_s: float = 60.0,
        testbed: str | None = None,
        testbed_slots: dict[str, int] | None = None,
    ):
        """``testbed``: a testbed that is up; one agent runs in each of its nodes (namespace and
        cgroup) with ``testbed_slots[node]`` workers."""
        self.coordinator, self.secret = coordinator, secret
        self.local_slots, self.local_node, self.logs, self.job = local_slots, local_node, logs, job
        self.hostfile, self.join_timeout_s = hostfile, join_timeout_s
        self.testbed, self.testbed_slots = testbed, testbed_slots or {}
        self.thread: AgentThread | None = None
        self.ssh: list = []
        self.lost: set = set()
        """Remote agents whose end an elastic job survived (said once)."""

    def start(self) -> None:
        if self.hostfile is not None:
            hosts = hostfile.read_hostfile(self.hostfile)
            self.ssh += hostfile.start_ssh_agents(
                hosts, self.coordinator.endpoint, self.secret, self.logs, job=self.job
            )
        if self.testbed is not None:
            from felactl.testbed import read_state, start_node_agents

            self.ssh += start_node_agents(
                read_state(self.testbed),
                self.testbed_slots,
                self.coordinator.endpoint,
                self.secret,
                self.logs,
                self.job,
            )
        if self.local_slots:
            config = local_agent_config(
                self.coordinator.endpoint,
                self.secret,
                nproc=self.local_slots,
                node_name=self.local_node,
                log_dir=self.logs,
                join_timeout_s=self.join_timeout_s,
                job=self.job,
            )
            self.thread = AgentThread(config)
            self.thread.start()

    def check(self, *, node_loss_is_fatal: bool = True) -> None:
        """Raise when an agent has failed. An elastic job survives losing a remote node's agent (a
        lost machine): its controller drops the node's workers once their heartbeats stop, so the
        agent's end is only logged here."""
        if self.thread is not None:
            self.thread.check()
        for proc in self.ssh:
            if proc.poll() in (None, 0) or proc in self.lost:
                continue
            where = f"{self.logs}/ssh-*.log or testbed-*.log"
            if node_loss_is_fatal:
                raise ControlPlaneError(
                    f"an agent started over ssh or in a testbed node exited with code {proc.returncode} (see {where})"
                )
            self.lost.add(proc)
            log.warning(
                "an agent started over ssh or in a testbed node exited with code %s (see %s); its workers "
                "are dropped once their heartbeats stop",
                proc.returncode,
                where,
            )

    def stop(self, timeout_s: float = 30, *, let_remote_drain: bool = False) -> None:
        """Stop the agents. ``let_remote_drain``: a graceful stop, where the agents over ssh or in a
        testbed nodes end by themselves once their workers have checkpointed the agreed last step
        (the coordinator's stop order): wait for them up to ``timeout_s`` before they are
        terminated (terminating them at once killed their workers before the checkpoint)."""
        deadline = time.monotonic() + timeout_s
        if self.thread is not None:
            self.thread.join(timeout=timeout_s)
        if let_remote_drain:
            for proc in self.ssh:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        stop_processes(self.ssh)


def _watch(
    coordinator: Coordinator,
    state: LaunchState,
    agents: Agents,
    on_update: Callable[[LaunchState], None],
    controller: ElasticController | None = None,
    keep_checkpoints: int = 0,
) -> None:
    """Until every agent reports its workers done: follow metrics, and fail fast on a failure
    (an elastic job instead re-forms without the failed worker; its controller says when it is done)."""
    events = JsonlTail(state.run.events)
    pruned_at = 0.0
    while True:
        agents.check(node_loss_is_fatal=controller is None)
        _say_storage_trouble(events)
        on_update(state)
        if keep_checkpoints and time.monotonic() - pruned_at > PRUNE_EVERY_S:
            prune_checkpoints(state.run.checkpoints, len(state.plan.stages), keep_checkpoints)
            pruned_at = time.monotonic()
        if controller is not None:
            if controller.poll():
                _say_storage_trouble(events)
                on_update(state)
                return
            time.sleep(POLL_S)
            continue
        refuse_requests(coordinator, state.run, state.not_elastic)
        coordinator.audit()
        states = {m.agent_id: coordinator.agent_state(m.agent_id) for m in state.members}
        failed = {aid: s for aid, s in states.items() if s and s.get("state") == WorkerState.FAILED.value}
        if failed:
            raise WorkerFailed(_failure_line(failed, state))
        if all(s and s.get("state") == WorkerState.SUCCEEDED.value for s in states.values()):
            _say_storage_trouble(events)
            on_update(state)
            return
        time.sleep(POLL_S)


def _failure_line(failed: dict[str, dict], state: LaunchState) -> str:
    node_of = {m.agent_id: m.node_name for m in state.members}
    parts = []
    for agent_id, s in failed.items():
        for rank, line in sorted(s.get("failures", {}).items()):
            parts.append(f"node {node_of.get(agent_id, agent_id)!r} rank {rank}: {line}")
    return f"worker failed ({'; '.join(parts) or 'no message'}); logs in {state.run.logs}"


def _say_storage_trouble(events: JsonlTail) -> None:
    """What the workers could not write (events.jsonl says it where it can be written; else each
    worker's log does): a warning on the console, the job goes on."""
    for e in events.read_new():
        if e.get("kind") == EventKind.CHECKPOINT_FAILED.value:
            log.warning(
                "worker %s: the checkpoint of step %s was not written (%s); training goes on",
                e.get("worker"),
                e.get("step"),
                e.get("reason"),
            )


def _summary(state: LaunchState) -> dict[str, Any]:
    summary = state.summary_so_far()
    if summary is None:
        raise WorkerFailed(f"the workers ended without recording a step; logs in {state.run.logs}")
    predicted = state.plan.predicted
    measured_iteration_s = summary["wall_s"] / max(summary["steps"], 1)
    summary.update(
        run=state.run.run_id,
        run_dir=str(state.run.path),
        iteration_s=measured_iteration_s,
        sync=state.sync.value,
    )
    if predicted is not None:
        summary["predicted_iteration_s"] = predicted.iteration_s
        summary["predicted_ratio"] = measured_iteration_s / predicted.iteration_s
    return summary
