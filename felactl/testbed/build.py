"""Make and remove a testbed: namespaces, veth pairs, a bridge, tc shaping, cgroups.

Every node is a network namespace ``felactl-<name>-<node>`` holding one end (``fl0``) of a veth
pair; the other end (``flv-<name>-<i>``) is a port of the bridge ``flbr-<name>``. Each testbed
takes one /24 of 198.18.0.0/15 (reserved for benchmarking networks): node ``i`` is ``.<i+1>``, the
bridge itself ``.254`` (where nodes reach the host: a coordinator listens there). A node has no
route beyond its /24, so its traffic never leaves the namespaces, the bridge and the host.

Shaping, per directed pair ``a -> b``, all inside the nodes' namespaces:
- bandwidth: an htb class per destination on ``a``'s ``fl0`` (a u32 filter on ``b``'s address),
  its rate raised by the header overhead of a 1500-byte frame so that a TCP stream's payload gets
  ``bandwidth_gbps``;
- latency: a netem qdisc under that class (kernels without netem cannot add latency);
- loss: a classic-BPF filter on ``b``'s ingress that drops that fraction of ``a``'s packets (at
  the receiver, so the sender's TCP sees a real loss, not a local drop it silently retries).

Each node's processes share a cgroup (``felactl-<name>/<node>`` under the cpu and cpuset
controllers): ``cpus`` caps their CPU time, ``cores`` pins them.

Crash safety: before each step that makes something, the state file
(``/run/felactl/testbeds/<name>.json``, written atomically) records it; :func:`down` removes
what the state file lists and anything else named with this testbed's prefix, so a testbed whose
``up`` was killed half-way is removed as completely as a finished one. ``down`` is idempotent.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from felactl.errors import InputError, SpecError
from felactl.fsutil import atomic_write_text
from felactl.machine import CPU_QUOTA_ENV
from felactl.spec.codec import FieldProblem, encode
from felactl.spec.io import from_dict
from felactl.testbed.host import CgroupLayout, Host, TestbedError, probe_host, require_root, run
from felactl.testbed.spec import TestbedLink, TestbedSpec

PREFIX = "felactl"
NAME = re.compile(r"^[a-z][a-z0-9]{0,7}$")
"""A testbed's name: short, because interface names have at most 15 characters."""
DEFAULT_NAME = "tb"
IFNAME = "fl0"
"""The node's interface inside its namespace (what GLOO_SOCKET_IFNAME names)."""
PREFIX_LEN = 24
MAX_TESTBEDS = 512
"""Testbeds up at once: each takes one /24 of 198.18.0.0/15."""
HOST_OCTET = 254
"""The bridge's own address in each testbed's /24: where a node reaches the host (the control plane)."""
MTU = 1500
FRAME_OVERHEAD = (MTU + 14) / (MTU - 20 - 20 - 12)
"""An Ethernet frame of a TCP segment (with timestamps) over its payload: the htb rate is raised
by this so that ``bandwidth_gbps`` is what an application's stream gets."""
CPU_PERIOD_US = 10_000
"""The CFS bandwidth period: a node capped at 0.25 runs 2.5 ms in every 10 (the kernel's default
period of 100 ms would stall it 75 ms at a time, which a collective waiting on it would see).
The kernel's smallest quota is 1 ms, so a share below 0.1 gets a longer period.

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
    return max(CPU_PERIOD_US, math.ceil(1000 / cpus))


STATE_VERSION = 1


def state_dir() -> Path:
    return Path(os.environ.get("FELACTL_TESTBED_DIR", "/run/felactl/testbeds"))


def check_name(name: str) -> str:
    if not NAME.match(name):
        raise InputError(
            f"--name {name!r}: must be a lower-case letter then up to 7 letters or digits "
            "(it is part of interface names, which have at most 15 characters)"
        )
    return name


def netns_name(name: str, node: str) -> str:
    return f"{PREFIX}-{name}-{node}"


def bridge_name(name: str) -> str:
    return f"flbr-{name}"


def veth_name(name: str, index: int) -> str:
    return f"flv-{name}-{index}"


def cgroup_name(name: str) -> str:
    return f"{PREFIX}-{name}"


def subnet(k: int) -> str:
    """The k-th /24 of 198.18.0.0/15, without its last octet."""
    return f"198.{18 + k // 256}.{k % 256}"


def node_address(k: int, index: int) -> str:
    return f"{subnet(k)}.{index + 1}"


@contextlib.contextmanager
def _state_lock():
    state_dir().mkdir(parents=True, exist_ok=True)
    fd = os.open(state_dir() / ".lock", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _free_subnet(name: str) -> int:
    """The first /24 that no other testbed's state file holds and no interface here has."""
    taken: set[str] = set()
    if state_dir().is_dir():
        for path in state_dir().glob("*.json"):
            doc = _read_state_doc(path.stem) if NAME.match(path.stem) and path.stem != name else None
            if doc and isinstance(doc.get("subnet"), str):
                taken.add(doc["subnet"])
    addrs = run(["ip", "-o", "-4", "addr", "show"], check=False).stdout
    for k in range(MAX_TESTBEDS):
        if subnet(k) not in taken and f" {subnet(k)}." not in addrs:
            return k
    raise InputError(f"all {MAX_TESTBEDS} subnets of 198.18.0.0/15 are taken: felactl testbed down --all")


@dataclass(frozen=True)
class NodeInfo:
    """Where one node of a testbed that is up lives: what ``exec`` and the launcher need."""

    name: str
    index: int
    netns: str
    address: str
    ifname: str
    cgroups: tuple[str, ...]
    """The node's cgroup directories (one on cgroup v2, cpu and cpuset on v1)."""
    cpus: float | None
    cores: tuple[int, ...]


@dataclass(frozen=True)
class TestbedState:
    __test__ = False  # not a pytest class, whatever its name

    name: str
    spec_path: str
    spec: dict
    complete: bool
    netem: bool
    cgroup_version: int
    host_address: str
    """The bridge's address: the host as the nodes reach it (a coordinator listens here)."""
    nodes: dict[str, NodeInfo]
    made: tuple[dict, ...]

    def node(self, node: str) -> NodeInfo:
        if node not in self.nodes:
            raise InputError(f"testbed {self.name!r} has no node {node!r} (it has: {', '.join(self.nodes)})")
        return self.nodes[node]


# --- the state file ----------------------------------------------------------------------


def state_path(name: str) -> Path:
    return state_dir() / f"{name}.json"


def _write_state(doc: dict) -> None:
    atomic_write_text(state_path(doc["name"]), json.dumps(doc, indent=1) + "\n", mode=0o600)


def _read_state_doc(name: str) -> dict | None:
    try:
        doc = json.loads(state_path(name).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return None  # damaged: down still finds everything by its prefix
    return doc if isinstance(doc, dict) else None


def read_state(name: str = DEFAULT_NAME) -> TestbedState:
    """The testbed ``name`` that is up, or :class:`InputError` when there is none."""
    check_name(name)
    doc = _read_state_doc(name)
    if doc is None:
        raise InputError(f"no testbed {name!r} is up (felactl testbed up SPEC --name {name})")
    if not doc.get("complete"):
        raise InputError(f"testbed {name!r} was left half-made; remove it with: felactl testbed down --name {name}")
    nodes = {
        n["name"]: NodeInfo(
            name=n["name"],
            index=n["index"],
            netns=n["netns"],
            address=n["address"],
            ifname=n["ifname"],
            cgroups=tuple(n["cgroups"]),
            cpus=n["cpus"],
            cores=tuple(n["cores"]),
        )
        for n in doc["nodes"]
    }
    return TestbedState(
        name=doc["name"],
        spec_path=doc["spec_path"],
        spec=doc["spec"],
        complete=True,
        netem=doc["netem"],
        cgroup_version=doc["cgroup_version"],
        host_address=doc["host_address"],
        nodes=nodes,
        made=tuple(doc["made"]),
    )


def list_testbeds() -> list[str]:
    """Names of the testbeds that have a state file or leave anything behind."""
    names = {p.stem for p in state_dir().glob("*.json") if NAME.match(p.stem)} if state_dir().is_dir() else set()
    for ns in _netns_list():
        m = re.match(rf"^{PREFIX}-([a-z][a-z0-9]{{0,7}})-", ns)
        if m:
            names.add(m.group(1))
    for link in _link_list():
        m = re.match(r"^fl(?:v|br)-([a-z][a-z0-9]{0,7})(?:-\d+)?$", link)
        if m:
            names.add(m.group(1))
    try:
        from felactl.testbed.host import find_cgroups

        for root in find_cgroups().roots():
            for d in root.glob(f"{PREFIX}-*"):
                m = re.match(rf"^{PREFIX}-([a-z][a-z0-9]{{0,7}})$", d.name)
                if m and d.is_dir():
                    names.add(m.group(1))
    except InputError:
        pass
    return sorted(names)


# --- up ----------------------------------------------------------------------------------


def _check_fits_host(spec: TestbedSpec, where: str, host: Host, allow_no_latency: bool) -> None:
    for i, node in enumerate(spec.nodes):
        for j, core in enumerate(node.cores or ()):
            if core not in host.cores:
                raise SpecError(
                    where,
                    f"nodes[{i}].cores[{j}]",
                    f"core {core} is not one this machine lets felactl use ({', '.join(map(str, host.cores))})",
                )
        usable = len(node.cores) if node.cores else len(host.cores)
        if node.cpus is not None and node.cpus > usable:
            raise SpecError(
                where,
                f"nodes[{i}].cpus",
                f"{node.cpus:g} cores' worth of CPU time is more than the {usable} core(s) this machine gives it",
            )
    if not host.netem and not allow_no_latency:
        for link in spec.all_links():
            if link.latency_us > 0:
                raise SpecError(
                    where,
                    "links",
                    f"{link.src} -> {link.dst} has latency_us {link.latency_us:g}, but "
                    "this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM) to add "
                    "latency; give --no-latency to build it without latency",
                )


def _bits(gbps: float) -> str:
    return f"{max(8, round(gbps * 1e9 * 8 * FRAME_OVERHEAD))}bit"


def _burst(gbps: float) -> str:
    """htb's bucket: a millisecond of the rate (tc's default, rate/HZ + a frame, is a frame or two
    and loses 10-15% at a few hundred MB/s to timer slack), and at least two frames."""
    return f"{max(2 * (MTU + 14), round(gbps * 1e9 * FRAME_OVERHEAD * 1e-3))}b"


def _loss_bytecode(src_address: str, loss: float) -> str:
    """Classic BPF for a direct-action ingress filter: drop ``loss`` of the IPv4 packets from
    ``src_address`` (TC_ACT_SHOT), pass everything else on (TC_ACT_UNSPEC)."""
    src = int.from_bytes(bytes(int(p) for p in src_address.split(".")), "big")
    prog: list[tuple[int, int, int, int]] = [
        (0x28, 0, 0, 12),
        (0x15, 0, -1, 0x0800),  # ldh [12]; jeq IPv4
        (0x20, 0, 0, 26),
        (0x15, 0, -1, src),
    ]  # ld [26]; jeq src
    if loss < 1.0:
        threshold = min(2**32 - 1, round(loss * 2**32))
        prog += [(0x20, 0, 0, (2**32 - 0x1000 + 56)), (0x35, 1, 0, threshold)]  # ld rand; jge -> pass
    prog += [(0x06, 0, 0, 2), (0x06, 0, 0, 2**32 - 1)]  # ret SHOT; pass: ret UNSPEC
    last = len(prog) - 1
    fixed = [(op, jt, (last - k - 1) if jf == -1 else jf, v) for k, (op, jt, jf, v) in enumerate(prog)]
    return f"{len(fixed)}," + ",".join(f"{op} {jt} {jf} {v}" for op, jt, jf, v in fixed)


def _cgroup_dirs(layout: CgroupLayout, name: str, node: str | None = None) -> list[Path]:
    rel = Path(cgroup_name(name)) if node is None else Path(cgroup_name(name), node)
    return [root / rel for root in layout.roots()]


def _write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError as exc:
        raise TestbedError(f"testbed: cannot write {value!r} to {path}: {exc.strerror}") from None


def _make_cgroup_parent(layout: CgroupLayout, name: str) -> None:
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


def _make_node_cgroup(layout: CgroupLayout, name: str, node: str, cpus: float | None, cores: tuple[int, ...]) -> None:
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


def up(
    spec: TestbedSpec,
    spec_path: str,
    *,
    name: str = DEFAULT_NAME,
    allow_no_latency: bool = False,
    host: Host | None = None,
) -> TestbedState:
    """Build testbed ``name`` from ``spec``. On a failure, what was made is removed again."""
    check_name(name)
    host = host or probe_host()
    _check_fits_host(spec, spec_path, host, allow_no_latency)
    with _state_lock():  # two ups at once: one name, one subnet each
        if _read_state_doc(name) is not None or name in list_testbeds():
            raise InputError(
                f"testbed {name!r} is up already (or was left half-made): "
                f"felactl testbed down --name {name} first, or give another --name"
            )
        layout = host.cgroup
        k = _free_subnet(name)
        host_address = f"{subnet(k)}.{HOST_OCTET}"
        nodes = []
        for i, node in enumerate(spec.nodes):
            nodes.append(
                {
                    "name": node.name,
                    "index": i,
                    "netns": netns_name(name, node.name),
                    "address": node_address(k, i),
                    "ifname": IFNAME,
                    "cgroups": [str(p) for p in _cgroup_dirs(layout, name, node.name)],
                    "cpus": node.cpus,
                    "cores": list(node.cores or host.cores),
                }
            )
        doc: dict[str, Any] = {
            "version": STATE_VERSION,
            "name": name,
            "spec_path": str(spec_path),
            "spec": encode(spec),
            "complete": False,
            "pid": os.getpid(),
            "subnet": subnet(k),
            "host_address": host_address,
            "netem": host.netem,
            "latency_emulated": host.netem,
            "cgroup_version": layout.version,
            "cgroup_roots": [str(r) for r in layout.roots()],
            "nodes": nodes,
            "made": [],
        }
        _write_state(doc)

    def step(kind: str, what: str) -> None:
        doc["made"].append({"kind": kind, "name": what})
        _write_state(doc)

    try:
        step("cgroup", cgroup_name(name))
        _make_cgroup_parent(layout, name)
        bridge = bridge_name(name)
        step("link", bridge)
        run(["ip", "link", "add", bridge, "type", "bridge"])
        run(["ip", "link", "set", bridge, "addrgenmode", "none"])
        run(["ip", "addr", "add", f"{host_address}/{PREFIX_LEN}", "dev", bridge])
        run(["ip", "link", "set", bridge, "up"])
        for info in nodes:
            ns, veth = info["netns"], veth_name(name, info["index"])
            step("netns", ns)
            run(["ip", "netns", "add", ns])
            run(["ip", "-n", ns, "link", "set", "lo", "up"])
            step("link", veth)
            run(
                [
                    "ip",
                    "link",
                    "add",
                    veth,
                    "mtu",
                    str(MTU),
                    "type",
                    "veth",
                    "peer",
                    "name",
                    IFNAME,
                    "mtu",
                    str(MTU),
                    "netns",
                    ns,
                ]
            )
            run(["ip", "link", "set", veth, "addrgenmode", "none"])
            run(["ip", "link", "set", veth, "master", bridge, "up"])
            run(["ip", "-n", ns, "link", "set", IFNAME, "addrgenmode", "none"])
            run(["ip", "-n", ns, "addr", "add", f"{info['address']}/{PREFIX_LEN}", "dev", IFNAME])
            run(["ip", "-n", ns, "link", "set", IFNAME, "up"])
        by_name = {info["name"]: info for info in nodes}
        for info in nodes:
            _shape_node(spec, info, by_name, host.netem)
        for info in nodes:
            step("cgroup", f"{cgroup_name(name)}/{info['name']}")
            _make_node_cgroup(layout, name, info["name"], info["cpus"], tuple(info["cores"]))
        doc["complete"] = True
        _write_state(doc)
    except BaseException:
        try:
            down(name)
        except Exception:  # the first error is the news; the state file still lets down finish later
            pass
        raise
    return read_state(name)


def _class_id(dst_index: int) -> str:
    return f"1:{dst_index + 16:x}"


def _rate_args(link: TestbedLink) -> list[str]:
    rate, burst = _bits(link.bandwidth_gbps), _burst(link.bandwidth_gbps)
    return ["htb", "rate", rate, "ceil", rate, "burst", burst, "cburst", burst, "quantum", str(MTU + 14)]


def _netem_args(link: TestbedLink) -> list[str]:
    # room for a bandwidth-delay product of packets, and then some
    bdp_packets = link.bandwidth_gbps * 1e9 * link.latency_us * 1e-6 / MTU
    return ["netem", "delay", f"{link.latency_us:g}us", "limit", str(max(1000, int(4 * bdp_packets)))]


def _loss_args(src_index: int, src_address: str, loss: float) -> list[str]:
    """The receiver's ingress filter that drops ``loss`` of what comes from node ``src_index``."""
    return [
        "parent",
        "ffff:",
        "protocol",
        "ip",
        "prio",
        str(src_index + 1),
        "handle",
        "1",
        "bpf",
        "da",
        "bytecode",
        _loss_bytecode(src_address, loss),
    ]


def _shape_node(spec: TestbedSpec, info: dict, by_name: dict, netem: bool) -> None:
    """htb per destination on the node's egress (+ netem for latency), loss filters on its ingress."""
    tc = ["tc", "-n", info["netns"]]
    run([*tc, "qdisc", "add", "dev", IFNAME, "root", "handle", "1:", "htb", "default", "1"])
    run(
        [
            *tc,
            "class",
            "add",
            "dev",
            IFNAME,
            "parent",
            "1:",
            "classid",
            "1:1",
            "htb",
            "rate",
            "10gbit",
            "quantum",
            "60000",
        ]
    )
    for other in spec.node_names:
        if other == info["name"]:
            continue
        link = spec.link(info["name"], other)
        dst = by_name[other]
        classid = _class_id(dst["index"])
        run([*tc, "class", "add", "dev", IFNAME, "parent", "1:", "classid", classid, *_rate_args(link)])
        if netem and link.latency_us > 0:
            run(
                [
                    *tc,
                    "qdisc",
                    "add",
                    "dev",
                    IFNAME,
                    "parent",
                    classid,
                    "handle",
                    f"{dst['index'] + 16:x}:",
                    *_netem_args(link),
                ]
            )
        run(
            [
                *tc,
                "filter",
                "add",
                "dev",
                IFNAME,
                "parent",
                "1:",
                "protocol",
                "ip",
                "prio",
                "1",
                "u32",
                "match",
                "ip",
                "dst",
                f"{dst['address']}/32",
                "flowid",
                classid,
            ]
        )
    run([*tc, "qdisc", "add", "dev", IFNAME, "handle", "ffff:", "ingress"])
    for src in spec.node_names:
        loss = spec.link(src, info["name"]).loss if src != info["name"] else 0.0
        if loss > 0:
            run(
                [*tc, "filter", "add", "dev", IFNAME, *_loss_args(by_name[src]["index"], by_name[src]["address"], loss)]
            )


def set_link(
    name: str,
    src: str,
    dst: str,
    *,
    bandwidth_gbps: float | None = None,
    latency_us: float | None = None,
    loss: float | None = None,
) -> TestbedLink:
    """Change the link ``src -> dst`` of a testbed that is up, while it carries traffic (``loss=1``
    cuts it, the old loss heals it); the state file, and so ``status``, follows. Returns the new link."""
    state = read_state(name)
    a, b = state.node(src), state.node(dst)
    if src == dst:
        raise InputError(f"a link joins two different nodes, got {src} -> {dst}")
    spec = from_dict(TestbedSpec, state.spec, state.spec_path)
    old = spec.link(src, dst)
    try:
        new = TestbedLink(
            src=src,
            dst=dst,
            bandwidth_gbps=old.bandwidth_gbps if bandwidth_gbps is None else bandwidth_gbps,
            latency_us=old.latency_us if latency_us is None else latency_us,
            loss=old.loss if loss is None else loss,
        )
    except FieldProblem as exc:
        raise InputError(f"--{exc.key.replace('_', '-')} {exc.problem}") from None
    if new.latency_us > 0 and new.latency_us != old.latency_us and not state.netem:
        raise InputError("--latency-us: this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM) to add latency")
    classid = _class_id(b.index)
    if new.bandwidth_gbps != old.bandwidth_gbps:
        run(
            [
                "tc",
                "-n",
                a.netns,
                "class",
                "change",
                "dev",
                IFNAME,
                "parent",
                "1:",
                "classid",
                classid,
                *_rate_args(new),
            ]
        )
    if new.latency_us != old.latency_us and state.netem:
        if new.latency_us > 0:
            run(
                [
                    "tc",
                    "-n",
                    a.netns,
                    "qdisc",
                    "replace",
                    "dev",
                    IFNAME,
                    "parent",
                    classid,
                    "handle",
                    f"{b.index + 16:x}:",
                    *_netem_args(new),
                ]
            )
        else:
            run(["tc", "-n", a.netns, "qdisc", "del", "dev", IFNAME, "parent", classid])
    if new.loss != old.loss:
        if new.loss > 0:
            run(["tc", "-n", b.netns, "filter", "replace", "dev", IFNAME, *_loss_args(a.index, a.address, new.loss)])
        else:
            run(["tc", "-n", b.netns, "filter", "del", "dev", IFNAME, "parent", "ffff:", "prio", str(a.index + 1)])
    with _state_lock():
        doc = _read_state_doc(name)
        if doc is not None:
            links = [l for l in doc["spec"].get("links", []) if (l["src"], l["dst"]) != (src, dst)]
            doc["spec"]["links"] = [*links, encode(new)]
            _write_state(doc)
    return new


def cut_node(name: str, node: str, *, cut: bool = True) -> None:
    """Cut ``node`` off the testbed (``cut=False``: connect it again), as a lost machine or a pulled
    cable: the host's end of its veth goes down, so every packet to and from it is dropped (its
    peers and the control plane alike) and open connections hang rather than close."""
    state = read_state(name)
    info = state.node(node)
    run(["ip", "link", "set", veth_name(name, info.index), "down" if cut else "up"])
    with _state_lock():
        doc = _read_state_doc(name)
        if doc is not None:
            others = [n for n in doc.get("cut", []) if n != node]
            doc["cut"] = sorted([*others, node]) if cut else others
            _write_state(doc)


def partition_nodes(name: str, side: list[str], *, apart: bool = True) -> list[str]:
    """Partition testbed ``name`` in two: every link between ``side`` and the other nodes drops
    every packet, both ways (as a failed switch between two racks), while every node still reaches
    the host's bridge (the control plane). ``apart=False`` heals it, each link back to the loss it
    had; ``side`` is then ignored. Returns the side cut apart (or healed)."""
    state = read_state(name)
    with _state_lock():
        saved = (_read_state_doc(name) or {}).get("partition")
    if not apart:
        if not saved:
            raise InputError(f"testbed {name!r} is not partitioned")
        for pair, loss in saved["loss"].items():
            src, dst = pair.split(">")
            set_link(name, src, dst, loss=loss)
        _save_partition(name, None)
        return list(saved["side"])
    if saved:
        raise InputError(
            f"testbed {name!r} is already partitioned ({', '.join(saved['side'])} apart from the rest); "
            f"heal it first: felactl testbed partition --heal --name {name}"
        )
    for node in side:
        state.node(node)
    others = [n for n in state.nodes if n not in side]
    if not side or not others:
        raise InputError(f"a partition needs nodes on both sides: give some of {', '.join(state.nodes)}, not all")
    spec = from_dict(TestbedSpec, state.spec, state.spec_path)
    pairs = [(a, b) for a in side for b in others] + [(b, a) for a in side for b in others]
    # recorded before the first link is cut, so that a heal after a crash half-way restores them all
    _save_partition(name, {"side": list(side), "loss": {f"{a}>{b}": spec.link(a, b).loss for a, b in pairs}})
    for a, b in pairs:
        set_link(name, a, b, loss=1.0)
    return list(side)


def _save_partition(name: str, partition: dict | None) -> None:
    with _state_lock():
        doc = _read_state_doc(name)
        if doc is not None:
            doc.pop("partition", None)
            if partition is not None:
                doc["partition"] = partition
            _write_state(doc)


def partitioned(name: str = DEFAULT_NAME) -> list[str]:
    """The side of testbed ``name`` that :func:`partition_nodes` cut apart, or [] when none is."""
    doc = _read_state_doc(name)
    return list((doc or {}).get("partition", {}).get("side", []))


def crash_node(name: str, node: str) -> list[int]:
    """SIGKILL every process in ``node`` (its namespace and its cgroups), as a machine that loses
    power: its agent and workers end without a word, their connections close. Returns the pids."""
    info = read_state(name).node(node)
    pids = _processes_in([info.netns], [Path(c) for c in info.cgroups])
    _kill(pids)
    return sorted(pids)


def cut_nodes(name: str = DEFAULT_NAME) -> list[str]:
    """The nodes of testbed ``name`` that are cut off (:func:`cut_node`)."""
    doc = _read_state_doc(name)
    return list(doc.get("cut", [])) if doc else []


# --- down --------------------------------------------------------------------------------


def _netns_list() -> list[str]:
    proc = run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def _link_list() -> list[str]:
    proc = run(["ip", "-o", "link", "show"], check=False)
    names = []
    for line in proc.stdout.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            names.append(parts[1].strip().split("@")[0])
    return names


def _cgroup_procs(directory: Path) -> list[int]:
    pids = []
    for procs in directory.rglob("cgroup.procs"):
        try:
            pids += [int(p) for p in procs.read_text().split()]
        except (OSError, ValueError):
            pass
    return pids


def _processes_in(namespaces, cgroups) -> set[int]:
    """The processes in these network namespaces and cgroups (not this one)."""
    pids: set[int] = set()
    for ns in namespaces:
        proc = run(["ip", "netns", "pids", ns], check=False)
        pids |= {int(p) for p in proc.stdout.split() if p.isdigit()}
    for cg in cgroups:
        pids |= set(_cgroup_procs(cg))
    pids.discard(os.getpid())
    return pids


def _kill(pids: set[int]) -> None:
    for pid in pids:
        if pid != os.getpid():
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _rmdir_tree(directory: Path) -> None:
    if not directory.is_dir():
        return
    for child in sorted((d for d in directory.rglob("*") if d.is_dir()), key=lambda d: -len(d.parts)):
        child.rmdir()
    directory.rmdir()


def down(name: str = DEFAULT_NAME) -> dict[str, list[str]]:
    """Remove testbed ``name``: kill the processes in its namespaces and cgroups, delete its veth
    pairs, bridge, namespaces and cgroups, and its state file. Nothing there: nothing to do.
    Returns what was removed, by kind."""
    check_name(name)
    if leftovers(name):
        require_root()
    doc = _read_state_doc(name) or {}
    ns_prefix = f"{PREFIX}-{name}-"
    namespaces = sorted(
        {m["name"] for m in doc.get("made", []) if m.get("kind") == "netns"}
        | {ns for ns in _netns_list() if ns.startswith(ns_prefix)}
    )
    existing = set(_netns_list())
    namespaces = [ns for ns in namespaces if ns in existing]
    links = [link for link in _link_list() if link == bridge_name(name) or link.startswith(f"flv-{name}-")]
    from felactl.testbed.host import find_cgroups

    try:
        roots = find_cgroups().roots()
    except InputError:
        roots = [Path(r) for r in doc.get("cgroup_roots", [])]
    cgroups = [root / cgroup_name(name) for root in roots if (root / cgroup_name(name)).is_dir()]
    removed: dict[str, list[str]] = {"processes": [], "links": [], "netns": [], "cgroups": []}

    # processes first: a process inside a namespace keeps it (and its veth) alive
    deadline = time.monotonic() + 10.0
    while True:
        pids = _processes_in(namespaces, cgroups)
        if not pids:
            break
        removed["processes"] += [str(p) for p in sorted(pids) if str(p) not in removed["processes"]]
        if time.monotonic() > deadline:
            raise TestbedError(
                f"testbed {name!r}: processes {sorted(pids)} do not die; remove them and run "
                f"felactl testbed down --name {name} again"
            )
        _kill(pids)
        time.sleep(0.05)
    for link in sorted(links, key=lambda link: link.startswith("flbr-")):  # ports before the bridge
        proc = run(["ip", "link", "del", link], check=False)
        if proc.returncode == 0:
            removed["links"].append(link)
    for ns in namespaces:
        run(["ip", "netns", "del", ns])
        removed["netns"].append(ns)
    for cg in cgroups:
        for attempt in range(50):
            try:
                _rmdir_tree(cg)
                break
            except OSError as exc:  # a just-killed task can take a moment to leave its cgroup
                if attempt == 49:
                    raise TestbedError(f"testbed {name!r}: cannot remove cgroup {cg}: {exc.strerror}") from None
                time.sleep(0.05)
        removed["cgroups"].append(str(cg))
    try:
        state_path(name).unlink()
    except FileNotFoundError:
        pass
    left = leftovers(name)
    if left:
        raise TestbedError(f"testbed {name!r}: still there after down: {', '.join(left)}")
    return removed


def leftovers(name: str) -> list[str]:
    """Everything of testbed ``name`` that exists now (empty after a complete ``down``)."""
    out = [f"netns {ns}" for ns in _netns_list() if ns.startswith(f"{PREFIX}-{name}-")]
    out += [f"link {link}" for link in _link_list() if link == bridge_name(name) or link.startswith(f"flv-{name}-")]
    try:
        from felactl.testbed.host import find_cgroups

        out += [
            f"cgroup {root / cgroup_name(name)}"
            for root in find_cgroups().roots()
            if (root / cgroup_name(name)).exists()
        ]
    except InputError:
        pass
    if state_path(name).exists():
        out.append(f"state file {state_path(name)}")
    return out


# --- running a command in a node ---------------------------------------------------------

_ENTER = 'n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1" || exit 125; shift; n=$((n-1)); done; exec "$@"'


def node_command(node: NodeInfo, argv: list[str]) -> list[str]:
    """``argv`` run inside ``node``: the shell joins the node's cgroups (so every process it starts
    is in them from its first instruction), then ``ip netns exec`` enters its namespace."""
    require_root()
    procs = [str(Path(d) / "cgroup.procs") for d in node.cgroups]
    return [
        "sh",
        "-c",
        _ENTER,
        "felactl-testbed-exec",
        str(len(procs)),
        *procs,
        "ip",
        "netns",
        "exec",
        node.netns,
        *argv,
    ]


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
