"""What an allreduce over a collective's trees costs: its rate X, its fill, and its CPU on CPU slots.

Pure: stdlib, never torch. Bytes N; rates in GB/s = 1e9 bytes/s; latencies in microseconds. The
trees are planned in :mod:`felactl.optimizer.collectives`; the ring they replace is priced in
:mod:`felactl.optimizer.ring_cost`.

**Tree allreduce** = reduce up the reduce trees (the broadcast trees reversed where there are none
of its own), pipelined with the broadcast down the trees (chunks flow continuously, data split
across trees by w_T / R; with several roots, first across the roots by their broadcast trees'
rates, then each root's across its trees, ``spec.plan.deal_by_root``, whose long-run shares
f_T, ``spec.plan.dealt_shares``, are w_T / R for the broadcast trees). Link (a, b) then carries
the share f_T of every broadcast tree using (a, b) and the share of every reduce tree whose edge
(b, a) sends child a to parent b:
load(a, b) = sum_{T: (a,b) in T} f_T + sum_{T' reduce: (b,a) in T'} f_T'. The allreduce moves
X = min( min_links c_ab / load(a, b), min_servers NIC / (cross-server load out or in) ) GB/s
and takes ``N / X + deepest broadcast latency + deepest reduce latency`` (the largest sum of
link latencies on a root-to-leaf path of any tree: the pipeline's fill, once up, once down)
``+ p / X * (max_T (up_T - 1) / f_T + max_T down_T / f_T)``: the pieces' fill, p being the bytes
of one piece (``spec.plan.tree_piece_bytes``, the runtime's rule) and up_T, down_T a tree's
depth in hops. A tree moves its pieces through its links at f_T X as a flow shop: the last piece
reaches the root (up_T - 1) pieces' time after the reduce's last send from a deepest leaf, then
takes down_T hops to the deepest leaf. The pieces are dealt to the trees as the runtime deals
them (``spec.plan.deal_by_root``), and both maxima, and N / X, run over the trees dealt any: a
buffer of a few pieces leaves light trees none, and its time is then the slowest dealt tree's
bytes at f_T X (``TreeAllreduceCost.seconds``). (Measured on the fragment testbed: 16 MiB over 2
trees in 1 MiB pieces took 0.41 s where N / X alone priced 0.22.)

On CPU slots (the runtime's trees run on gloo) the pieces also cost CPU: per piece a slot
sends or receives once over each of its edges in the trees the piece is dealt to, each message
:data:`TREE_MESSAGE_CPU_S` + p * :data:`TREE_CPU_S_PER_BYTE` of a full core, one over its quota
times that on a slot a cgroup holds to a share of a core (``cpu_slowdown``). The allreduce takes
at least its busiest slot's CPU, ``max_v slowdown_v * sum_T n_T deg_T(v) * (m + p b)`` over both
families (n_T the pieces dealt to tree T, deg_T(v) v's edges in it), and the time is the larger
of that and the links' time above (the two overlap: a slot's CPU works while its links carry).
Priced by the links alone, 16 MiB over trees on the one-slow testbed (a node at 0.12 of a core)
measured 3x its price, and no faster than gloo's ring.

X <= min(R, R') where R' is the reduce trees' rate (each direction alone moves at most that).
X >= min(R, R') / 2 where the reduce trees are packed (each family loads a link at most
c_ab / R, resp. c_ab / R'), and X >= R / 2 for reversed trees on links equally wide both ways
(load(a, b) <= (c_ab + c_ba) / R); the planner takes the ring instead where that is faster.
(An earlier version claimed "between R / 2 and R" for every graph: on asymmetric graphs the
reversed trees reached R / 3 and less.)

A group of one device moves nothing: its time is 0.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

from felactl.errors import InputError, PlanInfeasible
from felactl.optimizer.graph import GBPS_TO_BYTES_PER_S, US_TO_S, nic_gbps
from felactl.spec.cluster import ClusterSpec, DeviceKind, quota_slowdown
from felactl.spec.plan import Collective, Tree, deal_by_root, dealt_shares, root_rates, tree_piece_bytes, tree_root

TREE_MESSAGE_CPU_S = 70e-6
"""A full core's CPU seconds for each message a CPU slot sends or receives in a tree allreduce
(the walk's Python, gloo's work, the receive's buffer), beyond its bytes
(:data:`TREE_CPU_S_PER_BYTE`). Measured with the runtime's own allreduce, three local processes
over a chain, pieces of 64 KiB to 1 MiB (``benchmarks/bench_tree_cpu.py``, BENCHMARKS.md "Trees
at run time", thirteenth session): 70 us + 0.26 ns per byte of the piece."""


TREE_CPU_S_PER_BYTE = 0.26e-9
"""A full core's CPU seconds per byte of each piece a CPU slot sends or receives in a tree
allreduce, the reduce's add included (:data:`TREE_MESSAGE_CPU_S`)."""


def allreduce_time_s(cluster: ClusterSpec, collective: Collective, num_bytes: float) -> float:
    """Seconds for an allreduce of ``num_bytes`` over the collective's trees (module docstring)."""
    if len(collective.devices) == 1 or num_bytes <= 0:
        return 0.0
    if not collective.trees:
        raise InputError(f"collective {collective.group!r} of {len(collective.devices)} devices has no trees")
    return tree_allreduce_cost(cluster, collective).seconds(num_bytes)


def tree_allreduce_cost(
    cluster: ClusterSpec, collective: Collective, slowdown: Callable[[str], float] | None = None
) -> TreeAllreduceCost:
    """The rate X of the collective's allreduce and its pipeline's fill, worked out once per
    collective; :meth:`TreeAllreduceCost.seconds` prices N bytes. ``slowdown(device)``: how many
    times a full core's seconds a CPU slot's own work takes (the cost model's
    ``CostModel.host_slowdown``, which also reads a slot slowed without a quota from the model
    profile); :func:`cpu_slowdown` where not given."""
    throughput_gbps = allreduce_throughput_gbps(cluster, collective)  # raises where a link is missing
    fill_us = _deepest_latency_us(cluster, collective) + _deepest_latency_us(cluster, collective, upward=True)

    def hops(tree: Tree) -> float:
        return _reach(tree, lambda parent, child: 1.0)

    def edges_at(device: str, trees: Sequence[Tree]) -> tuple[int, ...]:
        return tuple(sum(device in edge for edge in tree.edges) for tree in trees)

    reduce_trees = _reduce_trees(collective)
    return TreeAllreduceCost(
        throughput_gbps,
        fill_us * US_TO_S,
        up=tuple((t.root, t.weight, hops(t) - 1) for t in reduce_trees),
        down=tuple((t.root, t.weight, hops(t)) for t in collective.trees),
        roots=tuple(root_rates([(t.root, t.weight) for t in collective.trees])),
        cpu=tuple(
            (
                d,
                (slowdown or functools.partial(cpu_slowdown, cluster))(d),
                edges_at(d, reduce_trees),
                edges_at(d, collective.trees),
            )
            for d in collective.devices
            if cluster.device(d).kind is DeviceKind.CPU
        ),
    )


@dataclasses.dataclass(frozen=True)
class TreeAllreduceCost:
    """What a tree allreduce of N bytes costs (module docstring): the links' latencies
    once up and once down, plus the larger of the links' time (over the trees the runtime deals
    pieces to, the slowest tree's transfer of its pieces at its share of the rate and the deepest
    fill in pieces' time) and the busiest CPU slot's messages."""

    rate_gbps: float
    latency_s: float
    up: tuple[tuple[str, float, float], ...]
    """(root, weight, up_T - 1) of each reduce tree."""
    down: tuple[tuple[str, float, float], ...]
    """(root, weight, down_T) of each broadcast tree."""
    roots: tuple[tuple[str, float], ...]
    """Each root with its broadcast trees' rate: how the pieces are first dealt (``deal_by_root``)."""
    cpu: tuple[tuple[str, float, tuple[int, ...], tuple[int, ...]], ...] = ()
    """(device, slowdown, its edges in each reduce tree, in each broadcast tree) of each CPU slot:
    per piece a slot sends or receives once over each of its edges in the tree the piece is dealt
    to, at :data:`TREE_MESSAGE_CPU_S` + :data:`TREE_CPU_S_PER_BYTE` of a full core, ``slowdown``
    times that on a slot held to a share of a core."""

    @property
    def num_trees(self) -> int:
        """The more of the broadcast and reduce trees: the runtime cuts the pieces by it."""
        return max(len(self.up), len(self.down))

    @property
    def piece_hops(self) -> float:
        """max_T (up_T - 1) / f_T + max_T down_T / f_T: the fill in pieces' times at the rate when
        every tree is dealt pieces."""
        return sum(_fill(trees, _family_shares(trees, self.roots), range(len(trees))) for trees in (self.up, self.down))

    def seconds(self, num_bytes: float) -> float:
        """An allreduce of ``num_bytes``: the latencies plus max(links, busiest CPU slot)."""
        return self.latency_s + max(self.links_seconds(num_bytes), self.busiest_cpu(num_bytes)[1])

    def links_seconds(self, num_bytes: float) -> float:
        """The transfer of the slowest dealt tree's pieces at its share of the rate and the
        deepest fill (the latencies aside)."""
        rate = self.rate_gbps * GBPS_TO_BYTES_PER_S
        piece, count = self._pieces(num_bytes)
        transfer_up, fill_up = _dealt_family(self.up, self.roots, count, piece, num_bytes)
        transfer_down, fill_down = _dealt_family(self.down, self.roots, count, piece, num_bytes)
        return (max(transfer_up, transfer_down) + (fill_up + fill_down) * piece) / rate

    def busiest_cpu(self, num_bytes: float) -> tuple[str | None, float]:
        """The CPU slot whose messages take longest, and their seconds ((None, 0) without one).
        The short last piece is charged as a whole one (a message costs mostly its fixed part)."""
        piece, count = self._pieces(num_bytes)
        dealt_up = _deal_counts(tuple((root, weight) for root, weight, _ in self.up), self.roots, count)[0]
        dealt_down = _deal_counts(tuple((root, weight) for root, weight, _ in self.down), self.roots, count)[0]
        per_message_s = TREE_MESSAGE_CPU_S + piece * TREE_CPU_S_PER_BYTE
        return max(
            (
                (device, slowdown * (_dot(dealt_up, up) + _dot(dealt_down, down)) * per_message_s)
                for device, slowdown, up, down in self.cpu
            ),
            key=lambda found: found[1],
            default=(None, 0.0),
        )

    def _pieces(self, num_bytes: float) -> tuple[int, int]:
        piece = tree_piece_bytes(num_bytes, self.num_trees)
        return piece, math.ceil(num_bytes / piece)


def allreduce_throughput_gbps(cluster: ClusterSpec, collective: Collective) -> float:
    """X of the module docstring: the rate at which a pipelined reduce + broadcast moves the data."""
    throughput = math.inf
    egress: dict[str, float] = {}
    ingress: dict[str, float] = {}
    port_out: dict[str, float] = {}  # devices behind a switch: what their one port sends and receives
    port_in: dict[str, float] = {}
    for (src, dst), load in link_loads(collective).items():
        link = cluster.link(src, dst)
        if link is None:
            raise PlanInfeasible(
                f"the reduce needs the link {src} -> {dst} (the reverse of a tree edge), "
                "which the cluster does not have (and no trees lead back to the root)"
            )
        throughput = min(throughput, link.bandwidth_gbps / load)
        src_node, dst_node = cluster.node_of(src), cluster.node_of(dst)
        if src_node.name != dst_node.name:
            egress[src_node.name] = egress.get(src_node.name, 0.0) + load
            ingress[dst_node.name] = ingress.get(dst_node.name, 0.0) + load
        elif src_node.switch_gbps:
            port_out[src] = port_out.get(src, 0.0) + load
            port_in[dst] = port_in.get(dst, 0.0) + load
    for loads in (egress, ingress):
        for server, load in loads.items():
            throughput = min(throughput, nic_gbps(cluster, server) / load)
    for loads in (port_out, port_in):
        for device, load in loads.items():
            throughput = min(throughput, cluster.node_of(device).switch_gbps / load)
    return throughput


def link_loads(collective: Collective) -> dict[tuple[str, str], float]:
    """Share of the data each directed link carries: broadcast down every tree, reduce up the
    reduce trees (child -> parent)."""
    loads: dict[tuple[str, str], float] = {}
    roots = root_rates([(t.root, t.weight) for t in collective.trees])
    for trees, upward in ((collective.trees, False), (_reduce_trees(collective), True)):
        for tree, share in zip(trees, _shares(trees, roots)):
            for parent, child in tree.edges:
                link = (child, parent) if upward else (parent, child)
                loads[link] = loads.get(link, 0.0) + share
    return loads


def _reduce_trees(collective: Collective) -> tuple[Tree, ...]:
    """The trees the reduce runs up: its own, else the broadcast trees (reversed by the caller)."""
    return collective.reduce_trees or collective.trees


def _shares(trees: Sequence[Tree], roots: list) -> list[float]:
    """f_T of each of ``trees``: the share of the data it carries (the runtime deals pieces so)."""
    return dealt_shares([(tree.root, tree.weight) for tree in trees], roots)


def root_first(edges: tuple) -> tuple[tuple[str, str], ...]:
    """The tree's edges in breadth-first order from its root, so a reader sees it grow."""
    root = tree_root(edges)
    if root is None and edges:
        raise PlanInfeasible(f"not a tree grown from one root: {list(edges)}")
    children: dict[str, list[str]] = {}
    for parent, child in edges:
        children.setdefault(parent, []).append(child)
    ordered, frontier = [], [root]
    while frontier:
        parent = frontier.pop(0)
        for child in children.get(parent, []):
            ordered.append((parent, child))
            frontier.append(child)
    return tuple(ordered)


def _reach(tree: Tree, hop) -> float:
    """The largest sum of ``hop(parent, child)`` over a path from the root down ``tree``."""
    reach = {tree.root: 0.0}
    for parent, child in root_first(tuple(tree.edges)):
        reach[child] = reach[parent] + hop(parent, child)
    return max(reach.values())


def _deepest_latency_us(cluster: ClusterSpec, collective: Collective, upward: bool = False) -> float:
    """The largest sum of link latencies from the root to a leaf of any tree (``upward``: of the
    reduce trees, over the links child -> parent)."""

    def latency_us(parent: str, child: str) -> float:
        return (cluster.link(child, parent) if upward else cluster.link(parent, child)).latency_us

    trees = _reduce_trees(collective) if upward else collective.trees
    return max(_reach(tree, latency_us) for tree in trees)


def _dot(counts: tuple[int, ...], edges: tuple[int, ...]) -> int:
    return sum(n * e for n, e in zip(counts, edges))


Family = tuple[tuple[str, float, float], ...]
"""One family of trees, broadcast or reduce: (root, weight, hops) of each."""


def _dealt_family(trees: Family, roots: tuple, count: int, piece: int, num_bytes: float) -> tuple[float, float]:
    """For one family of trees and ``count`` pieces dealt to them as the runtime deals
    (``spec.plan.deal_by_root``): the bytes the slowest tree moves over its share f_T (bytes at the
    whole rate) and the deepest fill in pieces, over the trees dealt any."""
    shares = _family_shares(trees, roots)
    counts, last = _deal_counts(tuple((root, weight) for root, weight, _ in trees), roots, count)
    short = count * piece - num_bytes  # the last piece is the rest of the buffer
    dealt = [k for k, n in enumerate(counts) if n]
    transfer = max((counts[k] * piece - (short if k == last else 0)) / shares[k] for k in dealt)
    return transfer, _fill(trees, shares, dealt)


def _fill(trees: Family, shares: list[float], which) -> float:
    """max over the trees ``which`` of hops / f_T (``shares``): their fill in pieces' times at the whole rate."""
    return max(trees[k][2] / shares[k] for k in which)


def _family_shares(trees: Family, roots: tuple) -> list[float]:
    return dealt_shares([(root, weight) for root, weight, _ in trees], roots)


@functools.lru_cache(maxsize=4096)
def _deal_counts(trees: tuple, roots: tuple, count: int) -> tuple[tuple[int, ...], int]:
    """How many of ``count`` pieces each tree ((root, weight)) is dealt, and which tree the last goes to."""
    order = deal_by_root(trees, roots, count)
    return tuple(order.count(k) for k in range(len(trees))), order[-1]


def cpu_slowdown(cluster: ClusterSpec, device: str) -> float:
    """How many times a full core's seconds a CPU slot's own work takes, from the cluster alone:
    one over its quota where a cgroup holds it to a share of a core (``spec.cluster.quota_slowdown``),
    else 1. (GPU ranks of a gloo group pay their host's messages too; they are not priced.)"""
    return quota_slowdown(cluster.device(device).model) or 1.0
