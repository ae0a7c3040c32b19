"""Profiling a cluster: run a profiling worker on every slot of every node, assemble a ClusterSpec.

This is the same path ``felactl launch`` takes: a :class:`Coordinator` hosts the store, one agent
per node proves the job secret and joins (on this machine, an in-process agent; elsewhere a
``felactl agent`` started by hand or over ssh), the coordinator hands out ranks, and each agent
starts ``python -m felactl.profiling.worker`` per slot. The workers form one global process
group over all slots of all nodes, so links between nodes are measured like links inside one.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from felactl.agents.agent import WorkerState
from felactl.agents.local_node import AgentThread, local_agent_config
from felactl.errors import ControlPlaneError, InputError, ProfilingError
from felactl.launcher import hosts as hostfile
from felactl.launcher.controlplane import (Assignment, Coordinator, Member, parse_endpoint, read_secret_file,
                                           write_secret_file)
from felactl.profiling.devices import available_cores, num_gpus
from felactl.profiling.links import LinkProbe, ordered_pairs
from felactl.spec import ClusterSpec, Device, DeviceKind, Link, LinkType, Node

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
        for flag, value, least in (("--matmul-size", self.cpu_matmul_size, 1),
                                   ("--gpu-matmul-size", self.gpu_matmul_size, 1),
                                   ("--repetitions", probe.repetitions, 1),
                                   ("--repetitions (latency)", probe.latency_repetitions, 1),
                                   ("--message-bytes", probe.message_bytes, 4),
                                   ("--small-message-bytes", probe.small_message_bytes, 4)):
            if value < least:
                raise InputError(f"{flag} must be >= {least}, got {value}")
        for flag, seconds in (("--join-timeout", self.join_timeout_s), ("--timeout", self.timeout_s)):
            if seconds <= 0:
                raise InputError(f"{flag} must be > 0, got {seconds:g}")
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


def profile_cluster(*, nproc_per_node: int | None = None, nnodes: int = 1, endpoint: str | None = None,
                    hostfile_path: str | None = None, secret_file: str | None = None, node_name: str | None = None,
                    name: str | None = None, log_dir: str | Path | None = None,
                    options: ProfileOptions = ProfileOptions(), on_progress: Progress = lambda *a: None
                    ) -> ProfileResult:
    """Profile this machine (no endpoint/hostfile) or the agents that join ``endpoint``."""
    started = time.perf_counter()
    hosts = check_profile_flags(nproc_per_node, nnodes, endpoint, hostfile_path)
    logs = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="felactl-profile-"))
    secret_path = Path(secret_file) if secret_file else logs / "secret"
    try:
        secret = _job_secret(secret_path)
        coordinator = Coordinator(secret, endpoint=endpoint, job=JOB)
    except BaseException:
        if not log_dir:  # nothing ran: nothing to read there
            shutil.rmtree(logs, ignore_errors=True)
        raise
    local_agent: AgentThread | None = None
    ssh_procs = []
    reason = "the profile is over"
    try:
        if endpoint is None:
            nproc = nproc_per_node or default_nproc_per_node()
            local_agent = AgentThread(local_agent_config(coordinator.endpoint, secret, nproc=nproc,
                                                          node_name=node_name, log_dir=logs,
                                                          join_timeout_s=options.join_timeout_s, job=JOB))
            local_agent.start()
        elif hosts is not None:
            nnodes = len(hosts)
            ssh_procs = hostfile.start_ssh_agents(hosts, coordinator.endpoint, secret, logs)

        def alive() -> None:
            if local_agent is not None:
                local_agent.check()
            _check_ssh(ssh_procs, logs)

        waiting = "waiting for agents" if endpoint is None else \
            f"waiting for agents: felactl agent --rdzv-endpoint {coordinator.endpoint} --secret-file {secret_path}"
        on_progress(waiting, 0, nnodes)
        members = coordinator.wait_members(nnodes, options.join_timeout_s, alive)
        members.sort(key=lambda m: m.node_name)
        _check_unique_node_names(members)
        results = _run_workers(coordinator, members, options, alive, on_progress)
        cluster = assemble_cluster(name or (members[0].node_name if len(members) == 1 else "cluster"),
                                   members, results)
        _wait_agents_done(coordinator, members, alive)
        peer_copies = _peer_copies(members, results)
    except BaseException as exc:
        reason = f"the coordinator gave up: {exc or type(exc).__name__}"
        raise
    finally:
        _shutdown(coordinator, local_agent, ssh_procs, reason)
    if not log_dir:  # nobody asked for them and nothing failed: no temp dir left behind per profile
        shutil.rmtree(logs, ignore_errors=True)
    return ProfileResult(cluster=cluster, profile_s=time.perf_counter() - started, log_dir=Path(log_dir) if log_dir
                         else None, peer_copy_gbps=peer_copies)


def check_profile_flags(nproc_per_node: int | None, nnodes: int, endpoint: str | None,
                        hostfile_path: str | Path | None) -> list[hostfile.Host] | None:
    """The flags of a local profile and of a multi-node one do not mix; say so instead of ignoring
    one. Returns the hostfile's hosts (None without one). The CLI calls it before its progress bar
    opens, so bad input is one line, not a line under a half-drawn bar."""
    hosts = hostfile.read_hostfile(hostfile_path) if hostfile_path else None
    with_hostfile = hosts is not None
    if with_hostfile and endpoint is None:
        raise InputError("--hostfile needs --rdzv-endpoint HOST:PORT, an address the hosts can reach")
    if endpoint is not None:
        parse_endpoint(endpoint)
    if nnodes < 1:
        raise InputError(f"--nnodes must be >= 1, got {nnodes}")
    if endpoint is None and nnodes != 1:
        raise InputError("--nnodes needs --rdzv-endpoint HOST:PORT for the agents to join")
    if endpoint is not None and nproc_per_node is not None:
        raise InputError("--nproc-per-node is each agent's option when agents join --rdzv-endpoint "
                         "(felactl agent --nproc-per-node N, or slots=N in the hostfile)")
    if with_hostfile and nnodes != 1:
        raise InputError("--nnodes comes from the hostfile (one node per line); leave it out")
    return hosts


def _check_unique_node_names(members: list[Member]) -> None:
    names = [m.node_name for m in members]
    for name in names:
        if names.count(name) > 1:
            raise InputError(f"{names.count(name)} agents call their node {name!r}; give each its own --node-name")


def _job_secret(path: Path) -> str:
    """The job's secret: read from ``path`` when it exists (agents were given it), else made there."""
    return read_secret_file(path) if path.exists() else write_secret_file(path)


def _check_ssh(procs, logs: Path) -> None:
    for proc in procs:
        if proc.poll() not in (None, 0):
            raise ControlPlaneError(f"an agent started over ssh exited with code {proc.returncode} "
                                    f"(see {logs}/ssh-*.log)")


def _device_kind(members: list[Member], choice: str) -> str:
    """cuda only when every node has a GPU per slot: one process group needs one backend."""
    short = [m for m in members if m.info.get("num_gpus", 0) < m.num_slots]
    if choice == "cuda" and short:
        raise InputError(f"--device cuda: node {short[0].node_name} has {short[0].info.get('num_gpus', 0)} GPU(s) "
                         f"for {short[0].num_slots} slot(s)")
    if choice != "auto":
        return choice
    return "cpu" if short else "cuda"


def _run_workers(coordinator: Coordinator, members: list[Member], options: ProfileOptions, alive,
                 on_progress: Progress) -> dict[int, dict]:
    """Assign ranks, publish the job, and collect one result per rank, failing fast if a worker dies."""
    world_size = sum(m.num_slots for m in members)
    config = {"device": _device_kind(members, options.device), "cpu_matmul_size": options.cpu_matmul_size,
              "gpu_matmul_size": options.gpu_matmul_size, "timeout_s": options.timeout_s, **asdict(options.probe)}
    assignments, offset = {}, 0
    for member in members:
        assignments[member.agent_id] = Assignment(rank_offset=offset, world_size=world_size, module=WORKER_MODULE,
                                                  env={"FELACTL_PROFILE_CONFIG": json.dumps(config),
                                                       "CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
        offset += member.num_slots
    coordinator.publish_assignments(assignments)
    store, prefix = coordinator.store, coordinator.prefix
    keys = [f"{prefix}profile/result/{rank}" for rank in range(world_size)]
    total = world_size + len(ordered_pairs(world_size))
    deadline = time.monotonic() + options.timeout_s
    while not store.check(keys):
        on_progress("measuring", int(store.add(prefix + "profile/progress", 0)), total)
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
            raise ProfilingError(f"a profiling worker on {member.node_name} failed ({failures or state['state']}); "
                                 f"logs in {state.get('log_dir', '?')}")


def _wait_agents_done(coordinator: Coordinator, members: list[Member], alive, timeout_s: float = 30.0) -> None:
    """Let every agent see its workers exit and report, so none is cut off mid-report."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = [coordinator.agent_state(m.agent_id) for m in members]
        if all(s and s["state"] != WorkerState.HEALTHY.value for s in states):
            return  # a worker that failed after leaving its result does not spoil the measurement
        alive()
        time.sleep(0.05)


def _shutdown(coordinator: Coordinator, local_agent: AgentThread | None, ssh_procs, reason: str) -> None:
    try:
        coordinator.stop(reason)
        _wait_agents_done(coordinator, list(coordinator.members.values()), alive=lambda: None, timeout_s=10)
    except RuntimeError:
        pass
    if local_agent is not None:
        local_agent.join(timeout=30)
    hostfile.stop_processes(ssh_procs)
    coordinator.close()


# --- assembling the cluster --------------------------------------------------------------------
def device_name(node_name: str, kind: str, local_rank: int) -> str:
    return f"{node_name}-{'gpu' if kind == 'cuda' else 'cpu'}{local_rank}"


def assemble_cluster(name: str, members: list[Member], results: dict[int, dict]) -> ClusterSpec:
    """Nodes in ``members`` order (ranks follow it), their devices from each rank's result, every link."""
    nodes, names, node_of_rank, rank = [], {}, {}, 0
    for member in members:
        devices = []
        for local_rank in range(member.num_slots):
            found = results[rank]["device"]
            names[rank] = device_name(member.node_name, found["kind"], local_rank)
            node_of_rank[rank] = member.node_name
            devices.append(Device(name=names[rank], kind=DeviceKind(found["kind"]), model=found["model"],
                                  tflops=_sig(found["tflops"]), memory_gb=found["memory_gb"],
                                  bf16_tflops=_sig(found.get("bf16_tflops")), local_index=local_rank,
                                  cpu_cores=tuple(found["cpu_cores"]) if found.get("cpu_cores") else None))
            rank += 1
        nodes.append(Node(name=member.node_name, hostname=member.info.get("hostname") or member.hostname or None,
                          num_cpu_cores=member.info.get("num_cpu_cores"), memory_gb=member.info.get("memory_gb"),
                          devices=tuple(devices)))
    topology = {node_of_rank[r]: res.get("topology", {}) for r, res in results.items() if res.get("topology")}
    links = []
    measured_links = sorted((m for res in results.values() for m in res["links"]),
                            key=lambda m: (m["src_rank"], m["dst_rank"]))
    for measured in measured_links:
        src, dst = measured["src_rank"], measured["dst_rank"]
        link_type, num_links = _link_type(src, dst, node_of_rank, results, topology)
        links.append(Link(src=names[src], dst=names[dst], bandwidth_gbps=_sig(measured["bandwidth_gbps"]),
                          latency_us=_sig(measured["latency_us"]), type=link_type, num_links=num_links))
    return ClusterSpec(name=name, nodes=tuple(nodes), links=tuple(links),
                       description=f"measured by felactl profile on {time.strftime('%Y-%m-%d %H:%M:%S %Z')}")


def _sig(value: float | None, digits: int = 4) -> float | None:
    """Round to significant digits: a measurement's noise is far above the 4th digit."""
    return None if value is None else float(f"{value:.{digits}g}")


def _link_type(src: int, dst: int, node_of_rank: dict, results: dict, topology: dict) -> tuple[LinkType, int]:
    if node_of_rank[src] != node_of_rank[dst]:
        return LinkType.NET, 1
    if results[src]["device"]["kind"] != "cuda":
        return LinkType.LOOPBACK, 1
    pair = f"{results[src]['local_rank']},{results[dst]['local_rank']}"
    found = topology.get(node_of_rank[src], {}).get(pair, {"type": "pcie", "num_links": 1})
    return LinkType(found["type"]), int(found["num_links"])


def _peer_copies(members: list[Member], results: dict[int, dict]) -> dict[str, float]:
    out = {}
    for result in results.values():
        node = result.get("node_name", "")
        for pair, gbps in result.get("peer_copy_gbps", {}).items():
            i, j = (int(x) for x in pair.split(","))
            out[f"{device_name(node, 'cuda', i)} -> {device_name(node, 'cuda', j)}"] = gbps
    return out
