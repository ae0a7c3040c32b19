"""``felactl profile``: a launcher job whose workers measure the cluster.

The profile runs the way ``felactl launch`` runs a plan: a :class:`Coordinator` hosts the store,
one agent per node proves the job secret and joins (on this machine, an in-process agent; with a
hostfile, ``felactl agent`` over ssh; elsewhere one started by hand), the coordinator hands out
ranks, and each agent starts ``python -m felactl.profiling.worker`` per slot. The workers form one
global process group over all slots of all nodes, so links between nodes are measured like links
inside one; :func:`felactl.profiling.cluster.assemble_cluster` turns their results into a
ClusterSpec. What is measured, and how, lives in :mod:`felactl.profiling`; this module only runs it.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from felactl import limits
from felactl.control import keys as store_keys
from felactl.control.documents import Assignment, WorkerState
from felactl.control.store import parse_endpoint
from felactl.errors import InputError, ProfilingError
from felactl.launcher import hosts as hostfile
from felactl.launcher.controlplane import Coordinator, Member, read_secret_file, write_secret_file
from felactl.launcher.node_agents import Agents, removed_if_it_fails
from felactl.launcher.slurm import Allocation
from felactl.limits import check_flag
from felactl.machine import available_cores, default_node_name, num_gpus
from felactl.profiling.cluster import assemble_cluster, peer_copies
from felactl.profiling.links import LinkProbe, ordered_pairs
from felactl.spec import ClusterSpec

WORKER_MODULE = "felactl.profiling.worker"
JOB = "profile"
Progress = Callable[[str, int, int], None]


@dataclass(frozen=True, kw_only=True)
class ProfileOptions:
    """Measurement sizes and patience. Defaults give steady numbers; tests shrink them."""

    cpu_matmul_size: int = 512
    gpu_matmul_size: int = 4096
    probe: LinkProbe = field(default_factory=LinkProbe)
    device: str = "auto"
    """cpu, cuda, or auto (cuda when every node has a GPU per slot)."""
    join_timeout_s: float = 60.0
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        probe = self.probe
        for flag, value, bound in (
            ("--matmul-size", self.cpu_matmul_size, limits.MATMUL_SIZE),
            ("--gpu-matmul-size", self.gpu_matmul_size, limits.MATMUL_SIZE),
            ("--repetitions", probe.repetitions, limits.COUNT),
            ("--repetitions (latency)", probe.latency_repetitions, limits.COUNT),
            ("--message-bytes", probe.message_bytes, limits.MESSAGE_BYTES),
            ("--small-message-bytes", probe.small_message_bytes, limits.MESSAGE_BYTES),
        ):
            check_flag(flag, value, bound)
        for flag, seconds in (("--join-timeout", self.join_timeout_s), ("--timeout", self.timeout_s)):
            check_flag(flag, seconds, limits.SECONDS, above=0)
        if self.device not in ("auto", "cpu", "cuda"):
            raise InputError(f"--device must be auto, cpu or cuda, got {self.device!r}")


@dataclass(frozen=True, kw_only=True)
class ProfileResult:
    cluster: ClusterSpec
    profile_s: float
    log_dir: Path | None
    """The workers' logs; None when they went to a temp dir, removed once the profile succeeded."""
    peer_copy_gbps: dict[str, float] = field(default_factory=dict)
    """``<src device> -> <dst device>`` -> GB/s of direct GPU peer copies (CUDA nodes only)."""


def default_nproc_per_node() -> int:
    """Number of GPUs with CUDA, else 2 CPU slots (capped by the cores we may use, at least 1)."""
    return num_gpus() or max(1, min(2, len(available_cores())))


def profile_cluster(
    *,
    nproc_per_node: int | None = None,
    nnodes: int = 1,
    endpoint: str | None = None,
    hostfile_path: str | None = None,
    secret_file: str | None = None,
    node_name: str | None = None,
    name: str | None = None,
    log_dir: str | Path | None = None,
    options: ProfileOptions = ProfileOptions(),
    on_progress: Progress = lambda *a: None,
    testbed: str | None = None,
    slurm: Allocation | None = None,
) -> ProfileResult:
    """Profile this machine (no endpoint/hostfile), the agents that join ``endpoint``, the nodes
    of ``testbed`` (an agent in each node's namespace and cgroup, ``nproc_per_node`` slots each,
    default 1), or the nodes of the Slurm allocation ``slurm`` (an agent per node as a job step,
    ``nproc_per_node`` slots each, default the node's own)."""
    started = time.perf_counter()
    hosts = check_profile_flags(nproc_per_node, nnodes, endpoint, hostfile_path, testbed)
    endpoint, nnodes, name, placed = _where_agents_run(testbed, slurm, nproc_per_node, endpoint, nnodes, name)
    logs, secret_path, secret, coordinator = _start_coordinator(log_dir, secret_file, endpoint)
    agents = Agents(
        coordinator,
        secret,
        local_slots=0 if endpoint else nproc_per_node or default_nproc_per_node(),
        local_node=node_name or default_node_name(),
        logs=logs,
        job=JOB,
        hostfile=Path(hostfile_path) if hosts is not None else None,
        join_timeout_s=options.join_timeout_s,
        testbed=testbed,
        slurm=slurm,
        node_slots=placed,
    )
    cluster, copies = _measure_cluster(
        coordinator,
        agents,
        nnodes=len(hosts) if hosts is not None else nnodes,
        endpoint=endpoint,
        secret_path=secret_path,
        name=name,
        options=options,
        on_progress=on_progress,
    )
    if not log_dir:  # nobody asked for them and nothing failed: no temp dir left behind per profile
        shutil.rmtree(logs, ignore_errors=True)
    return ProfileResult(
        cluster=cluster,
        profile_s=time.perf_counter() - started,
        log_dir=Path(log_dir) if log_dir else None,
        peer_copy_gbps=copies,
    )


def _where_agents_run(
    testbed: str | None,
    slurm: Allocation | None,
    nproc_per_node: int | None,
    endpoint: str | None,
    nnodes: int,
    name: str | None,
) -> tuple[str | None, int, str | None, dict[str, int | None] | None]:
    """Where the coordinator listens, how many agents join, the cluster's name and the agents
    felactl starts itself (node -> slots): a testbed's nodes (default 1 slot each) or a Slurm
    allocation's (default: each node's own); else as given, no agent placed."""
    if testbed is not None:
        from felactl.testbed import read_state

        bed = read_state(testbed)
        return (
            f"{bed.host_address}:0",
            len(bed.nodes),
            name or bed.spec.get("name"),
            dict.fromkeys(bed.nodes, nproc_per_node or 1),
        )
    if slurm is not None:
        return (
            slurm.coordinator_endpoint(),
            len(slurm.nodes),
            name or slurm.cluster_name,
            dict.fromkeys(slurm.nodes, nproc_per_node),
        )
    return endpoint, nnodes, name, None


def _measure_cluster(
    coordinator: Coordinator,
    agents: Agents,
    *,
    nnodes: int,
    endpoint: str | None,
    secret_path: Path,
    name: str | None,
    options: ProfileOptions,
    on_progress: Progress,
) -> tuple[ClusterSpec, dict[str, float]]:
    """Start the agents, wait for ``nnodes`` of them, run the measuring workers and assemble the
    cluster (named ``name``, else after its one node); returns it with the peer-copy rates. The
    coordinator and the agents are shut down on the way out, whatever happened."""
    reason = "the profile is over"
    try:
        agents.start()
        alive = agents.check
        waiting = (
            "waiting for agents"
            if endpoint is None
            else f"waiting for agents: felactl agent --rdzv-endpoint {coordinator.endpoint} --secret-file {secret_path}"
        )
        on_progress(waiting, 0, nnodes)
        members = coordinator.wait_members(nnodes, options.join_timeout_s, alive)
        members.sort(key=lambda m: m.node_name)
        results = _run_workers(coordinator, members, options, alive, on_progress)
        cluster = assemble_cluster(name or (members[0].node_name if len(members) == 1 else "cluster"), members, results)
        _wait_agents_done(coordinator, members, alive)
        copies = peer_copies(results)
    except BaseException as exc:
        reason = f"the coordinator gave up: {exc or type(exc).__name__}"
        raise
    finally:
        _shutdown(coordinator, agents, reason)
    return cluster, copies


def _start_coordinator(
    log_dir: str | Path | None, secret_file: str | None, endpoint: str | None
) -> tuple[Path, Path, str, Coordinator]:
    """The profile's log directory (a new temp dir without ``log_dir``), its secret's file, the
    secret, and the coordinator listening on ``endpoint`` (any free port on loopback without)."""
    logs = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="felactl-profile-"))
    secret_path = Path(secret_file) if secret_file else logs / "secret"
    with removed_if_it_fails(None if log_dir else logs):
        secret = _job_secret(secret_path)
        coordinator = Coordinator(secret, endpoint=endpoint, job=JOB)
    return logs, secret_path, secret, coordinator


def check_profile_flags(
    nproc_per_node: int | None,
    nnodes: int,
    endpoint: str | None,
    hostfile_path: str | Path | None,
    testbed: str | None = None,
) -> list[hostfile.Host] | None:
    """The flags of a local profile and of a multi-node one do not mix; say so instead of ignoring
    one. Returns the hostfile's hosts (None without one). The CLI calls it before its progress bar
    opens, so bad input is one line, not a line under a half-drawn bar."""
    if testbed is not None:
        given = [
            flag
            for flag, value in (
                ("--rdzv-endpoint", endpoint),
                ("--hostfile", hostfile_path),
                ("--nnodes", nnodes if nnodes != 1 else None),
            )
            if value is not None
        ]
        if given:
            raise InputError(
                f"{given[0]}: not with --testbed (its nodes are the agents; the coordinator "
                "listens on the testbed's bridge)"
            )
        check_flag("--nproc-per-node", nproc_per_node, limits.COUNT)
        return None
    hosts = hostfile.read_hostfile(hostfile_path) if hostfile_path else None
    with_hostfile = hosts is not None
    if with_hostfile and endpoint is None:
        raise InputError("--hostfile needs --rdzv-endpoint HOST:PORT, an address the hosts can reach")
    if endpoint is not None:
        parse_endpoint(endpoint)
    check_flag("--nproc-per-node", nproc_per_node, limits.COUNT)
    check_flag("--nnodes", nnodes, limits.COUNT)
    if endpoint is None and nnodes != 1:
        raise InputError("--nnodes needs --rdzv-endpoint HOST:PORT for the agents to join")
    if endpoint is not None and nproc_per_node is not None:
        raise InputError(
            "--nproc-per-node is each agent's option when agents join --rdzv-endpoint "
            "(felactl agent --nproc-per-node N, or slots=N in the hostfile)"
        )
    if with_hostfile and nnodes != 1:
        raise InputError("--nnodes comes from the hostfile (one node per line); leave it out")
    return hosts


def _job_secret(path: Path) -> str:
    """The job's secret: read from ``path`` when it exists (agents were given it), else made there."""
    return read_secret_file(path) if path.exists() else write_secret_file(path)


def _device_kind(members: list[Member], choice: str) -> str:
    """cuda only when every node has a GPU per slot: one process group needs one backend."""
    short = [m for m in members if m.info.get("num_gpus", 0) < m.num_slots]
    if choice == "cuda" and short:
        raise InputError(
            f"--device cuda: node {short[0].node_name} has {short[0].info.get('num_gpus', 0)} GPU(s) "
            f"for {short[0].num_slots} slot(s)"
        )
    if choice != "auto":
        return choice
    return "cpu" if short else "cuda"


def _run_workers(
    coordinator: Coordinator, members: list[Member], options: ProfileOptions, alive, on_progress: Progress
) -> dict[int, dict]:
    """Assign ranks, publish the job, and collect one result per rank, failing fast if a worker dies."""
    world_size = sum(m.num_slots for m in members)
    config = {
        "device": _device_kind(members, options.device),
        "cpu_matmul_size": options.cpu_matmul_size,
        "gpu_matmul_size": options.gpu_matmul_size,
        "timeout_s": options.timeout_s,
        **asdict(options.probe),
    }
    assignments, offset = {}, 0
    for member in members:
        assignments[member.agent_id] = Assignment(
            rank_offset=offset,
            world_size=world_size,
            module=WORKER_MODULE,
            env={"FELACTL_PROFILE_CONFIG": json.dumps(config), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"},
        )
        offset += member.num_slots
    coordinator.publish_assignments(assignments)
    store, prefix = coordinator.store, coordinator.prefix
    keys = [prefix + store_keys.profile_result(rank) for rank in range(world_size)]
    total = world_size + len(ordered_pairs(world_size))
    deadline = time.monotonic() + options.timeout_s
    while not store.check(keys):
        on_progress("measuring", int(store.add(prefix + store_keys.PROFILE_PROGRESS, 0)), total)
        alive()
        _raise_on_failed_agent(coordinator, members)
        if time.monotonic() > deadline:
            raise ProfilingError(f"the profile did not finish within {options.timeout_s:g} s")
        time.sleep(0.1)
    on_progress("measuring", total, total)
    return {rank: json.loads(raw) for rank, raw in enumerate(store.multi_get(keys))}


def _raise_on_failed_agent(coordinator: Coordinator, members: list[Member]) -> None:
    for member in members:
        state = coordinator.agent_state(member.agent_id)
        if state and state["state"] in (WorkerState.FAILED.value, WorkerState.STOPPED.value):
            failures = "; ".join(f"rank {rank}: {line}" for rank, line in state.get("failures", {}).items())
            raise ProfilingError(
                f"a profiling worker on {member.node_name} failed ({failures or state['state']}); "
                f"logs in {state.get('log_dir', '?')}"
            )


def _wait_agents_done(coordinator: Coordinator, members: list[Member], alive, timeout_s: float = 30.0) -> None:
    """Let every agent see its workers exit and report, so none is cut off mid-report."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = [coordinator.agent_state(m.agent_id) for m in members]
        if all(s and s["state"] != WorkerState.HEALTHY.value for s in states):
            return  # a worker that failed after leaving its result does not spoil the measurement
        alive()
        time.sleep(0.05)


def _shutdown(coordinator: Coordinator, agents: Agents, reason: str) -> None:
    try:
        coordinator.stop(reason)
        _wait_agents_done(coordinator, list(coordinator.members.values()), alive=lambda: None, timeout_s=10)
    except RuntimeError:
        pass
    agents.stop()
    coordinator.close()
