"""What this machine offers a testbed, and the one way to run ``ip`` and ``tc``.

A testbed needs root, network namespaces, veth pairs, a bridge, htb, and a cgroup hierarchy with
the ``cpu`` and ``cpuset`` controllers: cgroup v2 (``cpu.max``) where its unified hierarchy has
them, else cgroup v1 (``cpu.cfs_quota_us``, ``cpuset.cpus``). netem (latency) is optional: a
kernel without it can still shape bandwidth and drop packets. :func:`probe_host` finds out which
with throw-away objects and says what is missing in one line.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from felactl.errors import FelactlError, InputError
from felactl.machine import available_cores, cgroup_mounts


class TestbedUnavailable(InputError):
    """This machine (or this user) cannot make a testbed: no root, no namespaces, no cgroups. Exit 2."""

    __test__ = False  # not a pytest class, whatever its name


class TestbedError(FelactlError):
    """Making or removing a testbed failed half-way (exit 1); the message names the step."""

    __test__ = False  # not a pytest class, whatever its name


COMMAND_TIMEOUT_S = 30.0


def run(argv: list[str], *, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``ip``/``tc``/``kill``-like tools; a failure is a :class:`TestbedError` naming the command."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise TestbedUnavailable(f"testbed: {argv[0]} is not installed (iproute2 is needed)") from None
    except subprocess.TimeoutExpired:
        raise TestbedError(f"testbed: '{' '.join(argv)}' did not finish in {COMMAND_TIMEOUT_S:g} s") from None
    if check and proc.returncode != 0:
        lines = [line for line in (proc.stderr or proc.stdout).splitlines() if line.strip()]
        why = lines[-1].strip() if lines else f"exit {proc.returncode}"
        raise TestbedError(f"testbed: '{' '.join(argv)}' failed: {why}")
    return proc


@dataclass(frozen=True)
class CgroupLayout:
    """Where the ``cpu`` and ``cpuset`` controllers are mounted: one directory on cgroup v2, two on v1."""

    version: int
    cpu_root: Path
    cpuset_root: Path

    def roots(self) -> list[Path]:
        return [self.cpu_root] if self.version == 2 else [self.cpu_root, self.cpuset_root]


@dataclass(frozen=True)
class Host:
    cgroup: CgroupLayout
    netem: bool
    """Whether the kernel has the netem qdisc (latency); without it only bandwidth and loss are emulated."""
    cores: tuple[int, ...]
    """The cores this process may run on (a node's pinned cores must be among them)."""


def find_cgroups() -> CgroupLayout:
    """The cgroup hierarchy a testbed's nodes go in, or :class:`TestbedUnavailable` saying why not."""
    mounts = cgroup_mounts()
    for mount in mounts:
        if mount.fstype == "cgroup2":
            try:
                have = set((mount.point / "cgroup.controllers").read_text().split())
            except OSError:
                continue
            if {"cpu", "cpuset"} <= have:
                return CgroupLayout(2, mount.point, mount.point)
    cpu = next((m.point for m in mounts if m.fstype == "cgroup" and "cpu" in m.options), None)
    cpuset = next((m.point for m in mounts if m.fstype == "cgroup" and "cpuset" in m.options), None)
    if cpu is not None and cpuset is not None and (cpu / "cpu.cfs_quota_us").exists():
        return CgroupLayout(1, cpu, cpuset)
    raise TestbedUnavailable(
        "testbed: no cgroup hierarchy with the cpu and cpuset controllers is mounted "
        "(cgroup v2 with cpu+cpuset, or v1 cpu and cpuset), so nodes cannot get CPU shares"
    )


def require_root() -> None:
    if os.geteuid() != 0:
        raise TestbedUnavailable("testbed: needs root (network namespaces, tc and cgroups); run it as root")


def probe_host() -> Host:
    """Check root, iproute2, network namespaces and cgroups; find netem. One-line
    :class:`TestbedUnavailable` for the first thing missing."""
    require_root()
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise TestbedUnavailable(f"testbed: {tool} is not installed (iproute2 is needed)")
    layout = find_cgroups()
    probe_cg = [root / f"felactlprobe-{os.getpid()}" for root in layout.roots()]
    try:
        for path in probe_cg:
            path.mkdir(exist_ok=True)
    except OSError as exc:
        raise TestbedUnavailable(f"testbed: cannot make cgroups under {layout.cpu_root}: {exc.strerror}") from None
    finally:
        for path in probe_cg:
            try:
                path.rmdir()
            except OSError:
                pass
    ns = f"felactlprobe-{os.getpid()}"
    made = run(["ip", "netns", "add", ns], check=False)
    if made.returncode != 0:
        why = (made.stderr.strip().splitlines() or ["unknown error"])[-1]
        raise TestbedUnavailable(f"testbed: cannot make network namespaces here: {why}")
    try:
        netem = (
            run(["tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"], check=False).returncode
            == 0
        )
        veth = run(["ip", "-n", ns, "link", "add", "p0", "type", "veth", "peer", "name", "p1"], check=False)
        if veth.returncode != 0:
            why = (veth.stderr.strip().splitlines() or ["unknown error"])[-1]
            raise TestbedUnavailable(f"testbed: cannot make veth pairs here: {why}")
        htb = run(["tc", "-n", ns, "qdisc", "add", "dev", "p0", "root", "handle", "1:", "htb"], check=False)
        if htb.returncode != 0:
            raise TestbedUnavailable(
                "testbed: this kernel has no htb qdisc (CONFIG_NET_SCH_HTB), so links cannot be shaped"
            )
    finally:
        run(["ip", "netns", "del", ns], check=False)
    return Host(cgroup=layout, netem=netem, cores=tuple(available_cores()))
