"""This machine, as every room needs it: its short name, the cores this process may use, what an
agent tells the coordinator about its node, and stopping the processes felactl started on it.
(Measuring the machine's speed is :mod:`felactl.profiling`'s.)"""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path
from typing import NamedTuple

import psutil

GB = 1e9


def available_cores() -> list[int]:
    """The cores this process may run on (honours cgroups/taskset, unlike cpu_count)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:
        return list(range(psutil.cpu_count(logical=True) or 1))


CPU_QUOTA_ENV = "FELACTL_CPU_QUOTA_CORES"
"""Cores' worth of CPU time a process is held to, told by whoever put it in its cgroup, for where
the cgroup file system is not mounted: ``ip netns exec`` (a testbed node) mounts a fresh /sys."""


def cpu_quota_cores(proc: Path = Path("/proc/self")) -> float | None:
    """Cores' worth of CPU time this process's cgroups allow it (their CFS quota over its period,
    the smallest along the way to the root, and :data:`CPU_QUOTA_ENV`'s): a container's CPU
    limit, a testbed node's share. None where no quota is set (or none is readable). cgroup v2
    (``cpu.max``) and v1 (``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``).

    Whether or not it binds: a slot's name (``felactl.spec.cpu_slot_model``) must not depend on
    the cores a process is pinned to, since the cluster profile names a slot pinned to its cores
    and the model profile times it unpinned, and both must say the same."""
    quotas = []
    try:
        told = float(os.environ.get(CPU_QUOTA_ENV, "nan"))
    except ValueError:
        told = float("nan")
    if told > 0:
        quotas.append(told)
    try:
        memberships = (proc / "cgroup").read_text().splitlines()
    except OSError:
        memberships = []
    mounts = cgroup_mounts(proc)
    for line in memberships:
        if line.count(":") < 2:
            continue
        hierarchy, controllers, path = line.split(":", 2)
        v2 = hierarchy == "0" and controllers == ""
        if not v2 and "cpu" not in controllers.split(","):
            continue
        mount = _cpu_mount(mounts, v2)
        if mount is None:
            continue
        root, point = mount.root, mount.point
        relative = Path(path).relative_to(root) if Path(path).is_relative_to(root) else Path(path.lstrip("/"))
        directory = point / relative
        while directory.is_relative_to(point):
            quota = _read_quota(directory, v2)
            if quota is not None:
                quotas.append(quota)
            if directory == point:
                break
            directory = directory.parent
    return min(quotas) if quotas else None


class CgroupMount(NamedTuple):
    fstype: str
    """``cgroup2`` (the unified hierarchy) or ``cgroup`` (a v1 hierarchy)."""
    root: str
    """The cgroup path that is this mount's top (``/`` unless in a container)."""
    point: Path
    options: frozenset[str]
    """The file system's own options: a v1 hierarchy's controllers (``cpu``, ``cpuset``) among them."""


def cgroup_mounts(proc: Path = Path("/proc/self")) -> list[CgroupMount]:
    """The cgroup file systems mounted where this process sees them (``/proc/self/mountinfo``)."""
    try:
        lines = (proc / "mountinfo").read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        before, _, after = line.partition(" - ")
        fields, fs = before.split(), after.split()
        if len(fields) >= 5 and len(fs) >= 3 and fs[0] in ("cgroup", "cgroup2"):
            point = Path(fields[4].replace("\\040", " "))
            found.append(CgroupMount(fs[0], fields[3], point, frozenset(fs[2].split(","))))
    return found


def _cpu_mount(mounts: list[CgroupMount], v2: bool) -> CgroupMount | None:
    """The cgroup v2 tree, or v1's hierarchy with the cpu controller."""
    for mount in mounts:
        if (mount.fstype == "cgroup2") if v2 else (mount.fstype == "cgroup" and "cpu" in mount.options):
            return mount
    return None


def _read_quota(directory: Path, v2: bool) -> float | None:
    try:
        if v2:
            quota, period = (directory / "cpu.max").read_text().split()[:2]
        else:
            quota = (directory / "cpu.cfs_quota_us").read_text().strip()
            period = (directory / "cpu.cfs_period_us").read_text().strip()
        if quota in ("max", "-1"):
            return None
        quota_us, period_us = int(quota), int(period)
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def short_hostname() -> str:
    """This machine's hostname without its domain."""
    return socket.gethostname().split(".")[0] or "localhost"


def default_node_name() -> str:
    """This node's name where none is given: the testbed node it runs in, else the node Slurm
    runs it on (``SLURMD_NODENAME``: an emulated cluster's nodes share one hostname, and a real
    cluster's Slurm names may differ from it), else the short hostname."""
    return os.environ.get("FELACTL_TESTBED_NODE") or os.environ.get("SLURMD_NODENAME") or short_hostname()


def num_gpus() -> int:
    """The CUDA GPUs this process can use (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def memory_bytes() -> int:
    """This machine's memory (RAM), bytes."""
    return psutil.virtual_memory().total


def node_info() -> dict:
    """What an agent tells the coordinator about its machine."""
    return {
        "hostname": socket.gethostname(),
        "num_cpu_cores": len(available_cores()),
        "memory_gb": round(memory_bytes() / GB, 3),
        "num_gpus": num_gpus(),
    }


def stop_processes(procs: list[subprocess.Popen], grace_s: float = 3.0) -> None:
    """SIGTERM each process still running, SIGKILL those still there after ``grace_s``."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
