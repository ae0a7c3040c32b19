"""Each node's CPU share: the cgroups that cap and pin a testbed's processes.

Each node's processes share a cgroup (``felactl-<name>/<node>`` under the cpu and cpuset
controllers): ``cpus`` caps their CPU time, ``cores`` pins them. Where the controllers are mounted
(cgroup v2, or v1's two hierarchies) is :func:`felactl.testbed.host.find_cgroups`'s to find.
"""

from __future__ import annotations

import time
from pathlib import Path

from felactl.spec.cluster import QUOTA_PERIOD_US, quota_period_us
from felactl.testbed.host import CgroupLayout, TestbedError
from felactl.testbed.state import PREFIX

CPU_PERIOD_US = QUOTA_PERIOD_US
"""The CFS bandwidth period a testbed's nodes run in (:data:`felactl.spec.QUOTA_PERIOD_US`, where
the cost model reads it too).

Short quotas cost something on a virtual machine whose core idles while the node is throttled:
every period the vCPU is woken again, and on this project's 2-core VM, idle otherwise, a node
capped at 0.25 (2.5 ms of every 10) ran matmuls at 0.19 of a core, one at 0.5 at 0.48. On a busy
host the loss vanishes (BENCHMARKS.md, "The profile sees the emulated cluster"). The profile
measures what a node really gets, and the planner plans with that."""


CPU_WEIGHT_V2, CPU_SHARES_V1 = 10_000, 262_144
"""The kernel's largest CFS weight, given to a testbed's cgroups: a node gets the share its spec
caps it at even while the host is busy with other work (its quota still caps it), so a node's speed
is the spec's, not the load's."""


def cpu_period_us(cpus: float) -> int:
    return quota_period_us(cpus)


def cgroup_name(name: str) -> str:
    return f"{PREFIX}-{name}"


def cgroup_dirs(layout: CgroupLayout, name: str, node: str | None = None) -> list[Path]:
    rel = Path(cgroup_name(name)) if node is None else Path(cgroup_name(name), node)
    return [root / rel for root in layout.roots()]


def _write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError as exc:
        raise TestbedError(f"testbed: cannot write {value!r} to {path}: {exc.strerror}") from None


def make_cgroup_parent(layout: CgroupLayout, name: str) -> None:
    if layout.version == 2:
        root = layout.cpu_root
        enabled = set((root / "cgroup.subtree_control").read_text().split())
        missing = [c for c in ("cpu", "cpuset") if c not in enabled]
        if missing:
            _write(root / "cgroup.subtree_control", " ".join(f"+{c}" for c in missing))
        parent = root / cgroup_name(name)
        parent.mkdir(exist_ok=True)
        _write(parent / "cgroup.subtree_control", "+cpu +cpuset")
        _write(parent / "cpu.weight", str(CPU_WEIGHT_V2))
        return
    (layout.cpu_root / cgroup_name(name)).mkdir(exist_ok=True)
    _write(layout.cpu_root / cgroup_name(name) / "cpu.shares", str(CPU_SHARES_V1))
    parent = layout.cpuset_root / cgroup_name(name)
    parent.mkdir(exist_ok=True)
    _write(parent / "cpuset.cpus", (layout.cpuset_root / "cpuset.cpus").read_text().strip())
    _write(parent / "cpuset.mems", (layout.cpuset_root / "cpuset.mems").read_text().strip())


def make_node_cgroup(layout: CgroupLayout, name: str, node: str, cpus: float | None, cores: tuple[int, ...]) -> None:
    period = CPU_PERIOD_US if cpus is None else cpu_period_us(cpus)
    quota = "max" if cpus is None else str(max(1000, round(cpus * period)))
    cores_text = ",".join(map(str, cores))
    if layout.version == 2:
        path = layout.cpu_root / cgroup_name(name) / node
        path.mkdir(exist_ok=True)
        _write(path / "cpu.max", f"{quota} {period}")
        _write(path / "cpu.weight", str(CPU_WEIGHT_V2))
        _write(path / "cpuset.cpus", cores_text)
        return
    cpu = layout.cpu_root / cgroup_name(name) / node
    cpu.mkdir(exist_ok=True)
    _write(cpu / "cpu.cfs_period_us", str(period))
    _write(cpu / "cpu.cfs_quota_us", "-1" if quota == "max" else quota)
    _write(cpu / "cpu.shares", str(CPU_SHARES_V1))
    cpuset = layout.cpuset_root / cgroup_name(name) / node
    cpuset.mkdir(exist_ok=True)
    _write(cpuset / "cpuset.cpus", cores_text)
    _write(cpuset / "cpuset.mems", (cpuset.parent / "cpuset.mems").read_text().strip())


def cgroup_procs(directory: Path) -> list[int]:
    pids = []
    for procs in directory.rglob("cgroup.procs"):
        try:
            pids += [int(p) for p in procs.read_text().split()]
        except (OSError, ValueError):
            pass
    return pids


def _rmdir_tree(directory: Path) -> None:
    if not directory.is_dir():
        return
    for child in sorted((d for d in directory.rglob("*") if d.is_dir()), key=lambda d: -len(d.parts)):
        child.rmdir()
    directory.rmdir()


def remove_cgroup(name: str, cg: Path) -> None:
    """Remove the cgroup tree ``cg`` of testbed ``name``, whose processes were killed."""
    for attempt in range(50):
        try:
            _rmdir_tree(cg)
            break
        except OSError as exc:  # a just-killed task can take a moment to leave its cgroup
            if attempt == 49:
                raise TestbedError(f"testbed {name!r}: cannot remove cgroup {cg}: {exc.strerror}") from None
            time.sleep(0.05)
