"""Processes in a testbed's nodes: a command run inside a node, the node agents of a job, and
finding and killing what runs there.

A process is in a node when it is in the node's cgroups (its CPU share) and its network namespace
(its interface ``fl0``), from its first instruction: :func:`node_command` wraps a command so.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from felactl.machine import CPU_QUOTA_ENV
from felactl.testbed.cgroups import cgroup_procs
from felactl.testbed.host import require_root, run
from felactl.testbed.state import NodeInfo, TestbedState, read_state

_ENTER = 'n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1" || exit 125; shift; n=$((n-1)); done; exec "$@"'


def node_command(node: NodeInfo, argv: list[str]) -> list[str]:
    """``argv`` run inside ``node``: the shell joins the node's cgroups (so every process it starts
    is in them from its first instruction), then ``ip netns exec`` enters its namespace."""
    require_root()
    return _in_cgroups(node.cgroups, ["ip", "netns", "exec", node.netns, *argv])


def node_command_net(node: dict, argv: list[str]) -> list[str]:
    """``argv`` in the node a testbed's state document lists, entering only its network
    namespace (``nsenter --net``): ``/sys`` stays the host's, where a daemon such as ``slurmd``
    finds the cgroup file system (``ip netns exec`` mounts the namespace's ``/sys`` over it)."""
    require_root()
    return _in_cgroups(node["cgroups"], ["nsenter", f"--net=/run/netns/{node['netns']}", *argv])


def _in_cgroups(cgroups, argv: list[str]) -> list[str]:
    procs = [str(Path(d) / "cgroup.procs") for d in cgroups]
    return ["sh", "-c", _ENTER, "felactl-testbed-exec", str(len(procs)), *procs, *argv]


def node_env(state: TestbedState, node: NodeInfo, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a process in ``node``: gloo bound to its interface, and where it is."""
    env = dict(os.environ if base is None else base)
    env.update(
        GLOO_SOCKET_IFNAME=node.ifname,
        FELACTL_TESTBED=state.name,
        FELACTL_TESTBED_NODE=node.name,
        FELACTL_TESTBED_ADDR=node.address,
    )
    if node.cpus is not None:
        # its profiles name its devices by this share (felactl.spec.cpu_slot_model); inside the
        # namespace the cgroup file system that holds it is not mounted
        env[CPU_QUOTA_ENV] = f"{node.cpus:g}"
    else:
        env.pop(CPU_QUOTA_ENV, None)
    return env


def exec_in_node(name: str, node: str, argv: list[str]) -> int:
    """Run ``argv`` in ``node`` of testbed ``name`` (its namespace, cgroup and environment) and
    wait for it; its exit code."""
    import subprocess

    state = read_state(name)
    info = state.node(node)
    return subprocess.call(node_command(info, argv), env=node_env(state, info))


def start_node_agents(
    state: TestbedState, slots: dict[str, int], endpoint: str, secret: str, log_dir: Path, job: str
) -> list:
    """``felactl agent`` in each node of ``slots`` (node -> worker slots), in its namespace and cgroup,
    joining ``endpoint`` (the coordinator on the bridge's address); gloo binds the node's ``fl0``.
    The secret goes on stdin, as to an ssh agent; each agent's output is ``log_dir/testbed-<node>.log``."""
    from felactl.agents.agent import agent_argv, start_agent

    procs = []
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        for node, count in slots.items():
            info = state.node(node)
            argv = agent_argv(endpoint, nproc=count, node_name=node, job=job, log_dir=str(log_dir / node))
            procs.append(
                start_agent(node_command(info, argv), secret, log_dir / f"testbed-{node}.log", node_env(state, info))
            )
    except BaseException:
        from felactl.machine import stop_processes

        stop_processes(procs)
        raise
    return procs


def processes_in(namespaces, cgroups) -> set[int]:
    """The processes in these network namespaces and cgroups (not this one)."""
    pids: set[int] = set()
    for ns in namespaces:
        proc = run(["ip", "netns", "pids", ns], check=False)
        pids |= {int(p) for p in proc.stdout.split() if p.isdigit()}
    for cg in cgroups:
        pids |= set(cgroup_procs(cg))
    pids.discard(os.getpid())
    return pids


def kill(pids: set[int]) -> None:
    for pid in pids:
        if pid != os.getpid():
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
