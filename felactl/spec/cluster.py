"""The Cluster format: nodes, their devices, and the directed links between devices."""

from __future__ import annotations

import dataclasses
import enum
import math
import re
from dataclasses import dataclass, field

from felactl import limits
from felactl.spec.codec import SCHEMA_VERSION, FieldProblem, check_header, positive


class DeviceKind(str, enum.Enum):
    CPU = "cpu"
    CUDA = "cuda"


class LinkType(str, enum.Enum):
    NVLINK = "nvlink"
    PCIE = "pcie"
    NET = "net"
    LOOPBACK = "loopback"


_SHARE_SUFFIX = re.compile(r" @ ([0-9.]+) cores$")


def cpu_slot_model(cpu: str, quota_cores: float | None) -> str:
    """The hardware model of a CPU slot: the CPU's name, and where a cgroup quota holds the slot
    (a container's CPU limit, a testbed node's share), that quota (``Intel Xeon @ 0.1 cores``).
    A slot at a tenth of a core is not a tenth of a full one: a model's step ran 1.4x longer
    there than its full-core timings scaled by the matmul rates say (BENCHMARKS.md, issue 15
    item 4), so its timings are keyed apart, as another GPU's are."""
    return cpu if quota_cores is None else f"{cpu} @ {quota_cores:.3g} cores"


def cpu_of_slot_model(model: str) -> str:
    """The CPU's name in a :func:`cpu_slot_model` (the model itself where no quota is named)."""
    return _SHARE_SUFFIX.sub("", model)


def cpu_slot_quota(model: str) -> float | None:
    """The quota a :func:`cpu_slot_model` names, in cores (None where it names none)."""
    found = _SHARE_SUFFIX.search(model)
    try:
        quota = float(found.group(1))
    except (AttributeError, ValueError):  # no quota named, or not a number ("1.2.3")
        return None
    return quota if quota > 0 else None


def quota_slowdown(model: str) -> float | None:
    """How many times a full core's seconds one thread's work takes on a slot whose model names a
    quota (:func:`cpu_slot_model`): one over the quota, up to a core (None where none is named)."""
    quota = cpu_slot_quota(model)
    return 1.0 / min(1.0, quota) if quota is not None else None


QUOTA_PERIOD_US = 10_000
"""The CFS bandwidth period of a CPU slot held to a quota, as felactl's testbeds set it
(``testbed.cgroups``): a slot capped at 0.25 runs 2.5 ms in every 10 (the kernel's default of
100 ms would stall it 75 ms at a time, which a collective waiting on it would see). The cost model
prices a throttled slot's wake-ups by it (``CostModel.quota_wake_s``); a container's own period
(100 ms by default) is not in the cluster profile."""


def quota_period_us(quota_cores: float) -> int:
    """The period of a slot held to ``quota_cores``: :data:`QUOTA_PERIOD_US`, longer below a
    tenth of a core, where the kernel's least quota of 1 ms sets it."""
    return max(QUOTA_PERIOD_US, math.ceil(1000 / quota_cores))


@dataclass(frozen=True, kw_only=True, slots=True)
class Device:
    name: str
    """Unique in the cluster; links and plans refer to devices by this name."""
    kind: DeviceKind
    model: str
    """Hardware model, e.g. ``NVIDIA A100-SXM4-40GB`` or the CPU brand; model profiles are keyed by it."""
    tflops: float
    """Effective (measured or rated) dense matmul throughput in fp32, TFLOP/s."""
    memory_gb: float
    """Memory a worker on this device may use, GB."""
    bf16_tflops: float | None = None
    """Measured bf16 matmul throughput where the device has it."""
    cpu_cores: tuple[int, ...] | None = None
    """For CPU slots: the cores the worker process is pinned to."""
    local_index: int | None = None
    """Index of the device within its node (the worker's LOCAL_RANK, the CUDA ordinal)."""

    def __post_init__(self) -> None:
        if not self.name:
            raise FieldProblem("name", "must not be empty")
        positive("tflops", self.tflops, limits.TFLOPS)
        positive("memory_gb", self.memory_gb, limits.MEMORY_GB)
        if self.bf16_tflops is not None:
            positive("bf16_tflops", self.bf16_tflops, limits.TFLOPS)
        if self.local_index is not None:
            positive("local_index", self.local_index, limits.INDEX, allow_zero=True)
        if self.cpu_cores is not None:
            _check_cores(self.cpu_cores)


def _check_cores(cores: tuple[int, ...]) -> None:
    """A slot's cores are CPU numbers of one machine, each once: a slot pinned to a core no
    machine has (``[10**12]``) cannot start, and one listed twice is not two cores."""
    if not cores:
        raise FieldProblem("cpu_cores", "names no core (leave it out for a slot that is not pinned)")
    for i, core in enumerate(cores):
        positive(f"cpu_cores[{i}]", core, limits.CPU_CORE, allow_zero=True)
        if core in cores[:i]:
            raise FieldProblem(f"cpu_cores[{i}]", f"core {core} is listed twice")


@dataclass(frozen=True, kw_only=True, slots=True)
class Node:
    name: str
    """Unique in the cluster."""
    hostname: str | None = None
    """Where to reach the node (ssh, rendezvous); absent for clusters planned on paper."""
    num_cpu_cores: int | None = None
    memory_gb: float | None = None
    """Host memory."""
    devices: tuple[Device, ...]
    nic_gbps: float | None = None
    """The network interface the node's devices share for everything that leaves or enters the
    node, GB/s each way (e.g. one 12.5 GB/s NIC for 8 A10Gs): the planner divides it among the
    node's devices that send at once, however wide each device's own inter-node link is listed.
    Absent: each inter-node link stands alone (the collectives still assume one NIC per node, as
    wide as its widest inter-node link)."""
    switch_gbps: float | None = None
    """The devices of the node reach each other through a switch (NVSwitch) with one port of this
    many GB/s each way per device: a device sends (and receives) at most that in all, whatever
    its links to the other devices say. Absent: every intra-node link is its own wire."""

    def __post_init__(self) -> None:
        if not self.name:
            raise FieldProblem("name", "must not be empty")
        if self.nic_gbps is not None:
            positive("nic_gbps", self.nic_gbps, limits.BANDWIDTH_GBPS)
        if self.switch_gbps is not None:
            positive("switch_gbps", self.switch_gbps, limits.BANDWIDTH_GBPS)
        if self.num_cpu_cores is not None:
            positive("num_cpu_cores", self.num_cpu_cores, limits.COUNT)
        if self.memory_gb is not None:
            positive("memory_gb", self.memory_gb, limits.MEMORY_GB)
        if not self.devices:
            raise FieldProblem("devices", "a node needs at least one device")


@dataclass(frozen=True, kw_only=True, slots=True)
class Link:
    src: str
    """Device name the data leaves from."""
    dst: str
    """Device name the data arrives at."""
    bandwidth_gbps: float
    """Sustained bandwidth in GB/s (gigabytes, not gigabits) in the src -> dst direction."""
    latency_us: float
    """Time of a small message, microseconds."""
    type: LinkType
    num_links: int = 1
    """Physical links bundled here (e.g. 2 NVLinks between a pair); bandwidth_gbps is their sum."""

    def __post_init__(self) -> None:
        positive("bandwidth_gbps", self.bandwidth_gbps, limits.BANDWIDTH_GBPS)
        positive("latency_us", self.latency_us, limits.LATENCY_US, allow_zero=True)
        positive("num_links", self.num_links, limits.COUNT)
        if self.src == self.dst:
            raise FieldProblem("dst", f"a link must join two different devices, got {self.src} -> {self.dst}")


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkDefault:
    """A link for every ordered pair of devices not listed in ``links`` (compact big clusters)."""

    bandwidth_gbps: float
    latency_us: float
    type: LinkType

    def __post_init__(self) -> None:
        positive("bandwidth_gbps", self.bandwidth_gbps, limits.BANDWIDTH_GBPS)
        positive("latency_us", self.latency_us, limits.LATENCY_US, allow_zero=True)


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterSpec:
    kind: str = "Cluster"
    schema_version: int = SCHEMA_VERSION
    name: str
    nodes: tuple[Node, ...]
    links: tuple[Link, ...] = ()
    """Directed links. A pair with no link cannot talk directly (routes go through other devices)."""
    intra_node_default: LinkDefault | None = None
    """The link between two devices of one node that ``links`` does not list (e.g. PCIe)."""
    inter_node_default: LinkDefault | None = None
    """The link between devices of different nodes that ``links`` does not list (the network)."""
    description: str | None = None
    _by_name: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _links: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_header(self.kind, "Cluster", self.schema_version)
        if not self.nodes:
            raise FieldProblem("nodes", "a cluster needs at least one node")
        node_names: set[str] = set()
        for i, node in enumerate(self.nodes):
            if node.name in node_names:
                raise FieldProblem(f"nodes[{i}].name", f"duplicate node name {node.name!r}")
            node_names.add(node.name)
            for j, dev in enumerate(node.devices):
                if dev.name in self._by_name:
                    raise FieldProblem(f"nodes[{i}].devices[{j}].name", f"duplicate device name {dev.name!r}")
                self._by_name[dev.name] = (node, dev)
        for i, link in enumerate(self.links):
            for end in ("src", "dst"):
                if getattr(link, end) not in self._by_name:
                    raise FieldProblem(f"links[{i}].{end}", f"unknown device {getattr(link, end)!r}")
            if (link.src, link.dst) in self._links:
                raise FieldProblem(f"links[{i}]", f"duplicate link {link.src} -> {link.dst}")
            self._links[(link.src, link.dst)] = link

    # --- queries -------------------------------------------------------------------------
    @property
    def devices(self) -> tuple[Device, ...]:
        """Every device, in node order then device order (the order ranks are given in)."""
        return tuple(dev for node in self.nodes for dev in node.devices)

    @property
    def device_names(self) -> tuple[str, ...]:
        return tuple(dev.name for dev in self.devices)

    def device(self, name: str) -> Device:
        return self._by_name[name][1]

    def device_names_by_node(self) -> dict[str, tuple[str, ...]]:
        """Each node's devices, by name: where a rescale may put a newcomer the planner knows."""
        return {node.name: tuple(d.name for d in node.devices) for node in self.nodes}

    def node_of(self, device_name: str) -> Node:
        return self._by_name[device_name][0]

    def has_device(self, name: str) -> bool:
        return name in self._by_name

    def link(self, src: str, dst: str) -> Link | None:
        """The link src -> dst: listed, else the intra/inter-node default, else None (no direct link)."""
        listed = self._links.get((src, dst))
        if listed is not None or src == dst:
            return listed
        same_node = self.node_of(src).name == self.node_of(dst).name
        default = self.intra_node_default if same_node else self.inter_node_default
        if default is None:
            return None
        return Link(
            src=src, dst=dst, bandwidth_gbps=default.bandwidth_gbps, latency_us=default.latency_us, type=default.type
        )

    def links_among(self, device_names: list[str] | tuple[str, ...]) -> list[Link]:
        """Every direct link (listed or default) between two of these devices."""
        return [
            link
            for a in device_names
            for b in device_names
            if a != b
            for link in (self.link(a, b),)
            if link is not None
        ]

    def subset(self, device_names: list[str] | tuple[str, ...]) -> ClusterSpec:
        """The same cluster restricted to some devices (nodes left empty are dropped)."""
        keep = set(device_names)
        nodes = []
        for node in self.nodes:
            devs = tuple(d for d in node.devices if d.name in keep)
            if devs:
                nodes.append(dataclasses.replace(node, devices=devs))
        links = tuple(l for l in self.links if l.src in keep and l.dst in keep)
        return ClusterSpec(
            name=self.name,
            nodes=tuple(nodes),
            links=links,
            description=self.description,
            intra_node_default=self.intra_node_default,
            inter_node_default=self.inter_node_default,
        )
