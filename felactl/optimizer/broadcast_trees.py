"""Blink's broadcast trees of a group of devices (SEEDS.md section 4): packed on one server, composed
across servers in three phases. :func:`felactl.optimizer.collectives.plan_collective` starts from
them and adds the trees of the reduce and of the allreduce.

Pure: stdlib + networkx + pulp (via :mod:`felactl.optimizer.packing`), never torch.

**One server.** The group's directed capacity graph holds its direct links, NVLink and PCIe alike
(a packing of the joint graph is at least as good as Blink's separate NVLink and PCIe packings,
whose union is one of its feasible packings). From a root r we pack spanning arborescences,
maximise sum_T w_T subject to sum_{T contains e} w_T <= c_e, keep the fewest trees that hold
``min_share`` of that rate (see ``packing``), and record the rate R = sum_T w_T beside the
min-cut bound B = min_v maxflow(r, v) (Edmonds: the packing optimum equals B) and
(``plan_collective``) the best ring's bottleneck. Without a root given, the root with the largest
B is taken (so the root choice costs max-flows, not packings); where that root needs more than n
trees, the other roots with the same B are packed too (up to ``MAX_ROOTS_TRIED``) and the one
needing the fewest trees is kept.

**Several servers** (Blink's three phases, composed into trees of the whole group): each server
packs its own devices from a local root; servers with the same local graph and local root share
one packing, which is how a 64 x 8 cluster plans in well under a second. The root's server is
first; every other server is reached over some link from a device of a server already reached
to one of its devices, which becomes its local root (any link, not only between local roots: two
servers joined by one device-to-device link are connected). Each step takes the widest such link,
counting a server's network interface as shared by the links it already sends on (a chain where
that is as wide, so each server sends once). All inter-server links of a server are assumed to
leave through one network interface (the spec's inter-node bandwidth, else its widest
inter-server link), so a server sends and receives at most that rate at once: under that
assumption a chain reaches the cross-server bound, while a star would overload the root's NIC.
Each piece of data crosses the server tree and then one tree of every server, so R = min(each
inter-server link, each sending NIC / its links, each server's rate); the trees of the group are
the server tree joined with each server's trees, the data split in the order of the servers' tree
weights (at most 1 + sum_s (k_s - 1) trees). The recorded bound is that of the three-phase
scheme: min(cross-server bound, each server's bound from its local root), the cross-server bound
being the root server's NIC and widest link out, and each other server's NIC and widest link in,
over all of their devices.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import networkx as nx

from felactl.errors import PlanInfeasible
from felactl.optimizer.graph import (
    capacity_graph,
    local_signature,
    min_cut_bound,
    nic_gbps,
    roots_by_bound,
    signature_graph,
)
from felactl.optimizer.packing import pack_arborescences
from felactl.spec.cluster import ClusterSpec

MAX_ROOTS_TRIED = 3
"""Roots with the best bound packed (in device order) when the first needs more than n trees."""


def _pack_group(graph: nx.DiGraph, root, min_share: float) -> tuple[object, dict, float]:
    """Pack one server's graph: (root, {edges: rate GB/s}, min-cut bound GB/s). ``root`` None: best root."""
    if graph.number_of_nodes() == 1:
        only = next(iter(graph.nodes))
        return only, {(): math.inf}, math.inf
    if root is not None:
        bound, narrowest = min_cut_bound(graph, root)
        if bound <= 0:
            raise PlanInfeasible(
                f"the group is disconnected: {narrowest} cannot be reached from {root} "
                "over the links among the group's devices"
            )
        return root, pack_arborescences(graph, root, bound, min_share)[0], bound
    ranked = roots_by_bound(graph, list(graph.nodes))
    best = None
    for candidate, bound in ranked[:MAX_ROOTS_TRIED]:
        if bound < ranked[0][1] * (1 - 1e-9):
            break
        kept = pack_arborescences(graph, candidate, bound, min_share)[0]
        if best is None or (len(kept), -sum(kept.values())) < (len(best[1]), -sum(best[1].values())):
            best = (candidate, kept, bound)
        if len(best[1]) <= graph.number_of_nodes():
            break  # the first root with the best bound usually needs <= n trees; else try its ties
    return best


@functools.lru_cache(maxsize=4096)
def _pack_signature(signature: tuple, root: int | None, min_share: float):
    """:func:`_pack_group` of a local signature's graph (positions for devices), remembered for the
    process: every group, stage and plan that holds a server part of the same shape packs it once.
    Returns the PlanInfeasible instead of raising it (remembered too)."""
    try:
        return _pack_group(signature_graph(signature), root, min_share)
    except PlanInfeasible as exc:
        return exc


def one_server_trees(
    cluster: ClusterSpec, devices: tuple[str, ...], root: str | None, min_share: float
) -> tuple[str, list[tuple[tuple, float]], float, float]:
    """The packed trees of a group on one server (module docstring): (root, [(edges, rate GB/s)],
    rate GB/s, bound GB/s)."""
    found = _pack_signature(local_signature(cluster, devices), None if root is None else devices.index(root), min_share)
    if isinstance(found, PlanInfeasible):
        _pack_group(capacity_graph(cluster, devices), root, min_share)  # raises it again, naming devices
        raise found
    root_index, kept, bound = found
    trees = [(tuple((devices[a], devices[b]) for a, b in edges), w) for edges, w in kept.items()]
    return devices[root_index], trees, sum(kept.values()), bound


def _compose(components: list[list[tuple[tuple, float]]], rate_gbps: float) -> list[tuple[tuple, float]]:
    """Join one tree of every component per slice of the data; fractions of each component sum to 1."""
    cuts = {0.0, 1.0}
    for trees in components:
        total = 0.0
        for _, fraction in trees:
            total += fraction
            cuts.add(min(total, 1.0))
    points = sorted(cuts)
    joined = []
    for low, high in zip(points, points[1:]):
        if high - low <= 1e-12:
            continue
        middle, edges = (low + high) / 2, []
        for trees in components:
            total, covering = 0.0, trees[-1][0]  # the last tree where rounding left a sliver
            for tree_edges, fraction in trees:
                total += fraction
                if middle < total:
                    covering = tree_edges
                    break
            edges += covering
        joined.append((tuple(edges), (high - low) * rate_gbps))
    return joined


def _cross_links(cluster: ClusterSpec, per_node: dict[str, list[str]]) -> dict[tuple[str, str], list]:
    """(server a, server b) -> [(GB/s, src device, dst device or None)]: every listed link from a
    device of a to one of b, and the inter-node default once (dst None: any pair not listed)."""
    server_of = {d: s for s, names in per_node.items() for d in names}
    found: dict[tuple[str, str], list] = {}
    listed: dict[tuple[str, str], int] = {}
    for link in cluster.links:
        a, b = server_of.get(link.src), server_of.get(link.dst)
        if a is None or b is None or a == b:
            continue
        found.setdefault((a, b), []).append((link.bandwidth_gbps, link.src, link.dst))
        listed[(a, b)] = listed.get((a, b), 0) + 1
    default = cluster.inter_node_default
    if default is not None:
        for a, src_names in per_node.items():
            for b, dst_names in per_node.items():
                if a != b and listed.get((a, b), 0) < len(src_names) * len(dst_names):
                    found.setdefault((a, b), []).append((default.bandwidth_gbps, None, None))
    return found


def three_phase_trees(
    cluster: ClusterSpec, per_node: dict[str, list[str]], root: str | None, min_share: float
) -> tuple[str, list[tuple[tuple, float]], float, float]:
    """Blink's three phases as trees of the whole group (module docstring): (root, [(edges, rate
    GB/s)], rate GB/s, bound GB/s)."""
    root_server = cluster.node_of(root).name if root else next(iter(per_node))
    cache: dict[tuple, tuple] = {}

    def pack(server: str, forced: int | None):
        names = per_node[server]
        key = (local_signature(cluster, names), forced)
        if key not in cache:
            found = _pack_signature(key[0], forced, min_share)
            if isinstance(found, PlanInfeasible):
                raise PlanInfeasible(
                    f"the group's devices on {server} ({', '.join(names)}) are not connected among "
                    "themselves; the three-phase collective needs each server's part "
                    "connected"
                )
            cache[key] = found
            if forced is None:  # the best root's packing is the packing from that root: not packed twice
                cache.setdefault((key[0], found[0]), found)
        return cache[key]

    def best_local(server: str) -> str:
        return per_node[server][pack(server, None)[0]]

    cross = _cross_links(cluster, per_node)
    nic = {server: nic_gbps(cluster, server) for server in per_node}
    first = root if root else best_local(root_server)
    local_roots, children, hops = _server_tree(cluster, per_node, root_server, first, cross, nic, best_local)
    local_trees, rates, bounds = {}, [], []
    for server, names in per_node.items():
        local_root, kept, bound = pack(server, names.index(local_roots[server]))
        rate = sum(kept.values())
        local_trees[server] = [
            (tuple((names[a], names[b]) for a, b in edges), w / rate if rate < math.inf else 1.0)
            for edges, w in kept.items()
        ]
        rates.append(rate)
        bounds.append(bound)
    nic_rates = [nic[a] / k for a, k in children.items()]
    rate = min([g for _, _, g in hops] + nic_rates + rates)
    bound = min(_cross_server_bound(cluster, per_node, cross, nic, root_server), *bounds)
    hop_edges = tuple((src, dst) for src, dst, _ in hops)
    components = [[(hop_edges, 1.0)]] + [local_trees[s] for s in per_node]
    return local_roots[root_server], _compose(components, rate), rate, bound


def _server_tree(
    cluster: ClusterSpec,
    per_node: dict[str, list[str]],
    root_server: str,
    root: str,
    cross: dict,
    nic: dict,
    best_local: Callable[[str], str],
) -> tuple[dict[str, str], dict[str, int], list[tuple[str, str, float]]]:
    """The tree that reaches every server from ``root``'s (module docstring, **Several servers**):
    (each server's local root, how many servers each one sends to, the hops (src device, dst device
    = that server's local root, GB/s)). ``best_local(server)``: the device a server's data lands on
    where a default link leaves the choice free."""
    listed = {(link.src, link.dst) for link in cluster.links}
    local_roots = {root_server: root}
    children: dict[str, int] = {}
    hops: list[tuple[str, str, float]] = []
    last = root_server
    while len(local_roots) < len(per_node):
        best = None
        for a in local_roots:
            for b in per_node:
                if b in local_roots:
                    continue
                for gbps, src, dst in cross.get((a, b), ()):
                    width = min(gbps, nic[a] / (children.get(a, 0) + 1), nic[b])
                    rank = (width, a == last, -list(per_node).index(b))
                    if best is None or rank > best[0]:
                        best = (rank, a, b, gbps, src, dst)
        if best is None:
            unreached = next(s for s in per_node if s not in local_roots)
            raise PlanInfeasible(
                f"the group is disconnected: {per_node[unreached][0]} cannot be reached from "
                f"{local_roots[root_server]} (no link into {unreached} from the servers reached "
                "before it)"
            )
        _, a, b, gbps, src, dst = best
        if dst is None:  # the default link: land on b's best local root, from a device of a not listed to it
            dst = best_local(b)
            src = next((d for d in [local_roots[a], *per_node[a]] if (d, dst) not in listed), None)
            if src is None:
                dst, src = next((y, x) for y in per_node[b] for x in per_node[a] if (x, y) not in listed)
        local_roots[b] = dst
        children[a] = children.get(a, 0) + 1
        hops.append((src, dst, min(gbps, nic[b])))  # b receives through its own NIC
        last = b
    return local_roots, children, hops


def _cross_server_bound(
    cluster: ClusterSpec, per_node: dict[str, list[str]], cross: dict, nic: dict, root_server: str
) -> float:
    """One NIC per server: the root's server sends, every other server receives, each at most its
    NIC and its widest link from any device to any device of another server."""

    def widest(pairs) -> float:
        return max((gbps for pair in pairs for gbps, _, _ in cross.get(pair, ())), default=0.0)

    others = [s for s in per_node if s != root_server]
    out = min(nic[root_server], widest((root_server, s) for s in others))
    return min([out] + [min(nic[s], widest((a, s) for a in per_node if a != s)) for s in others])
