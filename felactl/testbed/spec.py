"""The Testbed format: emulated nodes (a CPU share, pinned cores) and the directed links between
them (bandwidth, one-way latency, loss), as ``felactl testbed up`` builds them on one Linux box.

Validated like the other felactl files (:mod:`felactl.spec.codec`): unknown keys, wrong types,
negative or absurd numbers are one line naming the file and the key path. Whether this machine
can build it (cores that exist, netem for latency) is checked by ``up``, not here.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from felactl.limits import INDEX, LATENCY_US, SHARE, Bound
from felactl.spec.codec import SCHEMA_VERSION, FieldProblem, check_header, positive
from felactl.spec.io import load

MAX_NODES = 64
"""Nodes of one testbed: each is a namespace, a veth pair and a cgroup on one machine."""
BANDWIDTH_GBPS = Bound(1e-5, 100.0, "100 GB/s: more than a veth pair carries")
"""A link's rate in GB/s: from 10 KB/s (htb keeps time in microseconds) to more than one machine moves."""
CPUS = Bound(0.01, 4096.0, "more cores than a machine has")
"""CPU time in cores' worth (docker's --cpus): 0.25 is a quarter of one core."""

NODE_NAME = re.compile(r"^[a-z][a-z0-9-]{0,31}$")


@dataclass(frozen=True, kw_only=True, slots=True)
class TestbedNode:
    __test__ = False  # not a pytest class, whatever its name

    name: str
    """Unique in the testbed; lower-case letters, digits and '-', at most 32 characters (it is part
    of the node's network namespace name)."""
    cpus: float | None = None
    """CPU time the node's processes get together, in cores' worth (0.25 = a quarter of one core;
    cgroup ``cpu.max``); absent: no cap."""
    cores: tuple[int, ...] | None = None
    """The cores the node's processes are pinned to (cpuset); absent: every core."""

    def __post_init__(self) -> None:
        if not NODE_NAME.match(self.name):
            raise FieldProblem(
                "name",
                f"must be lower-case letters, digits and '-', starting with a letter, "
                f"at most 32 characters, got {self.name!r}",
            )
        if self.cpus is not None:
            positive("cpus", self.cpus, CPUS)
        if self.cores is not None:
            if not self.cores:
                raise FieldProblem("cores", "must list at least one core (leave it out for every core)")
            seen: set[int] = set()
            for i, core in enumerate(self.cores):
                positive(f"cores[{i}]", core, INDEX, allow_zero=True)
                if core in seen:
                    raise FieldProblem(f"cores[{i}]", f"core {core} is listed twice")
                seen.add(core)
            if self.cpus is not None and self.cpus > len(self.cores):
                raise FieldProblem(
                    "cpus",
                    f"{self.cpus:g} cores' worth of CPU time is more than the {len(self.cores)} pinned core(s) give",
                )


@dataclass(frozen=True, kw_only=True, slots=True)
class TestbedLinkDefault:
    """The link of every ordered pair of nodes that ``links`` does not list."""

    __test__ = False  # not a pytest class, whatever its name

    bandwidth_gbps: float
    """GB/s (gigabytes), as in the Cluster format."""
    latency_us: float = 0.0
    """One-way delay added to every packet, microseconds (netem)."""
    loss: float = 0.0
    """Fraction of packets lost on the way, 0..1 (1 cuts the link)."""

    def __post_init__(self) -> None:
        positive("bandwidth_gbps", self.bandwidth_gbps, BANDWIDTH_GBPS)
        positive("latency_us", self.latency_us, LATENCY_US, allow_zero=True)
        positive("loss", self.loss, SHARE, allow_zero=True)


@dataclass(frozen=True, kw_only=True, slots=True)
class TestbedLink:
    __test__ = False  # not a pytest class, whatever its name

    src: str
    """Node the data leaves from."""
    dst: str
    """Node the data arrives at."""
    bandwidth_gbps: float
    latency_us: float = 0.0
    loss: float = 0.0

    def __post_init__(self) -> None:
        positive("bandwidth_gbps", self.bandwidth_gbps, BANDWIDTH_GBPS)
        positive("latency_us", self.latency_us, LATENCY_US, allow_zero=True)
        positive("loss", self.loss, SHARE, allow_zero=True)
        if self.src == self.dst:
            raise FieldProblem("dst", f"a link must join two different nodes, got {self.src} -> {self.dst}")


@dataclass(frozen=True, kw_only=True, slots=True)
class TestbedSpec:
    __test__ = False  # not a pytest class, whatever its name

    kind: str = "Testbed"
    schema_version: int = SCHEMA_VERSION
    name: str
    nodes: tuple[TestbedNode, ...]
    links: tuple[TestbedLink, ...] = ()
    """Directed links; a pair not listed takes ``default_link``."""
    default_link: TestbedLinkDefault | None = None
    description: str | None = None
    _nodes: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _links: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_header(self.kind, "Testbed", self.schema_version)
        if not self.name:
            raise FieldProblem("name", "must not be empty")
        if not self.nodes:
            raise FieldProblem("nodes", "a testbed needs at least one node")
        if len(self.nodes) > MAX_NODES:
            raise FieldProblem("nodes", f"at most {MAX_NODES} nodes on one machine, got {len(self.nodes)}")
        for i, node in enumerate(self.nodes):
            if node.name in self._nodes:
                raise FieldProblem(f"nodes[{i}].name", f"duplicate node name {node.name!r}")
            self._nodes[node.name] = node
        for i, link in enumerate(self.links):
            for end in ("src", "dst"):
                if getattr(link, end) not in self._nodes:
                    raise FieldProblem(f"links[{i}].{end}", f"unknown node {getattr(link, end)!r}")
            if (link.src, link.dst) in self._links:
                raise FieldProblem(f"links[{i}]", f"duplicate link {link.src} -> {link.dst}")
            self._links[(link.src, link.dst)] = link
        if self.default_link is None:
            for a in self.nodes:
                for b in self.nodes:
                    if a.name != b.name and (a.name, b.name) not in self._links:
                        raise FieldProblem(
                            "links",
                            f"no link {a.name} -> {b.name} and no default_link: "
                            "list every ordered pair or give default_link",
                        )

    @property
    def node_names(self) -> tuple[str, ...]:
        return tuple(node.name for node in self.nodes)

    def node(self, name: str) -> TestbedNode:
        return self._nodes[name]

    def link(self, src: str, dst: str) -> TestbedLink:
        """The link src -> dst: listed, else the default."""
        listed = self._links.get((src, dst))
        if listed is not None:
            return listed
        d = self.default_link
        assert d is not None and src != dst and src in self._nodes and dst in self._nodes
        return TestbedLink(src=src, dst=dst, bandwidth_gbps=d.bandwidth_gbps, latency_us=d.latency_us, loss=d.loss)

    def all_links(self) -> list[TestbedLink]:
        """Every ordered pair of nodes, in node order."""
        return [self.link(a, b) for a in self.node_names for b in self.node_names if a != b]


def load_testbed(path: str | os.PathLike) -> TestbedSpec:
    """Load a Testbed file; every problem is one line naming the file and the key path."""
    return load(TestbedSpec, path)
