"""Collectives over packed spanning trees (Blink, SEEDS.md section 4), and the ring they replace.

Pure: stdlib + networkx + pulp (via :mod:`felactl.optimizer.packing`), never torch.

**One server.** The group's directed capacity graph holds its direct links, NVLink and PCIe alike
(a packing of the joint graph is at least as good as Blink's separate NVLink and PCIe packings,
whose union is one of its feasible packings). From a root r we pack spanning arborescences,
maximise sum_T w_T subject to sum_{T contains e} w_T <= c_e, keep the fewest trees that hold
``min_share`` of that rate (see ``packing``), and record the rate R = sum_T w_T beside the
min-cut bound B = min_v maxflow(r, v) (Edmonds: the packing optimum equals B) and the best
ring's bottleneck. Without a root given, the root with the largest B is taken (so the root
choice costs max-flows, not packings); where that root needs more than n trees, the other roots
with the same B are packed too (up to ``MAX_ROOTS_TRIED``) and the one needing the fewest trees
is kept.

**Several servers** (Blink's three phases, composed into trees of the whole group): each server
packs its own devices from a local root (the group's root on its server, elsewhere the device
with the best local bound; servers with the same local graph share one packing, which is how a
64 x 8 cluster plans in well under a second); the local roots form a chain across servers,
root's server first, each next server the one with the widest link from the current one. All
inter-server links of a server are assumed to leave through one network interface (the spec's
inter-node link bandwidth), so a server sends and receives at most that rate at once: under
that assumption a chain reaches the cross-server bound, while a star or a packing among roots
would overload the root's NIC. Each piece of data crosses the chain and then one tree of every
server, so R = min(chain rate, each server's rate); the trees of the group are the chain joined
with each server's trees, the data split in the order of the servers' tree weights (at most
1 + sum_s (k_s - 1) trees). The recorded bound is that of the three-phase scheme:
min(cross-server NIC bound, each server's bound from its local root).

**Times** (bytes N; rates in GB/s = 1e9 bytes/s; latencies in microseconds):

- Tree allreduce = reduce up the reversed trees, pipelined with the broadcast down the trees
  (chunks flow continuously, data split across trees by w_T / R). Link (a, b) then carries
  the share f_T = w_T / R of every tree using (a, b) to broadcast and of every tree using (b, a)
  to reduce: load(a, b) = sum_{T: (a,b) in T} f_T + sum_{T: (b,a) in T} f_T. The allreduce moves
  X = min( min_links c_ab / load(a, b), min_servers NIC / (cross-server load out or in) ) GB/s,
  between R / 2 and R, and takes ``N / X + 2 * deepest latency``, where the deepest latency is
  the largest sum of link latencies on a root-to-leaf path of any tree (the pipeline's fill,
  once up and once down).
- Ring allreduce (the baseline, as NCCL): ``2 (n - 1) / n * N / b + 2 (n - 1) * l``, with b the best
  ring's bottleneck bandwidth and l its slowest link's latency (each of the 2 (n - 1) steps waits
  for its slowest hop).
- A group of one device moves nothing: ``plan_collective`` returns it with no trees and rates 0,
  and both times are 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import networkx as nx

from felactl.errors import InputError, PlanInfeasible
from felactl.optimizer.graph import (best_ring, capacity_graph, check_devices, devices_by_node, local_signature,
                                     min_cut_bound, roots_by_bound, signature_graph)
from felactl.optimizer.packing import pack_arborescences
from felactl.spec.cluster import ClusterSpec
from felactl.spec.plan import Collective, Tree

GBPS_TO_BYTES_PER_S = 1e9
US_TO_S = 1e-6
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
            raise PlanInfeasible(f"the group is disconnected: {narrowest} cannot be reached from {root} "
                                 "over the links among the group's devices")
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
            break   # the first root with the best bound usually needs <= n trees; else try its ties
    return best


def _single_server(cluster: ClusterSpec, devices: tuple[str, ...], root: str | None,
                   min_share: float) -> tuple[str, list[tuple[tuple, float]], float, float]:
    root, kept, bound = _pack_group(capacity_graph(cluster, devices), root, min_share)
    return root, list(kept.items()), sum(kept.values()), bound


def _server_chain(cluster: ClusterSpec, local_roots: dict[str, str], first: str) -> list[str]:
    """Servers in chain order: ``first``, then always the one with the widest link from the last."""
    chain, remaining = [first], [s for s in local_roots if s != first]
    while remaining:
        here = local_roots[chain[-1]]
        widths = [(cluster.link(here, local_roots[s]), s) for s in remaining]
        reachable = [(link.bandwidth_gbps, -i, s) for i, (link, s) in enumerate(widths) if link is not None]
        if not reachable:
            raise PlanInfeasible(f"the group is disconnected: {local_roots[remaining[0]]} cannot be reached from "
                                 f"{here} (no link between their servers)")
        chain.append(max(reachable)[2])
        remaining.remove(chain[-1])
    return chain


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
            total = 0.0
            for tree_edges, fraction in trees:
                total += fraction
                if middle < total:
                    break
            edges += tree_edges   # the covering tree (the last one where rounding left a sliver)
        joined.append((tuple(edges), (high - low) * rate_gbps))
    return joined


def _multi_server(cluster: ClusterSpec, per_node: dict[str, list[str]], root: str | None,
                  min_share: float) -> tuple[str, list[tuple[tuple, float]], float, float]:
    """Blink's three phases as trees of the whole group (module docstring)."""
    root_server = cluster.node_of(root).name if root else next(iter(per_node))
    cache: dict[tuple, tuple] = {}
    local_roots, local_trees, rates, bounds = {}, {}, [], []
    for server, names in per_node.items():
        forced = names.index(root) if root and server == root_server else None
        key = (local_signature(cluster, names), forced)
        if key not in cache:
            try:
                cache[key] = _pack_group(signature_graph(key[0]), forced, min_share)
            except PlanInfeasible:
                raise PlanInfeasible(f"the group's devices on {server} ({', '.join(names)}) are not connected among "
                                     "themselves; the three-phase collective needs each server's part "
                                     "connected") from None
        local_root, kept, bound = cache[key]
        local_roots[server] = names[local_root]
        rate = sum(kept.values())
        local_trees[server] = [(tuple((names[a], names[b]) for a, b in edges), w / rate if rate < math.inf else 1.0)
                               for edges, w in kept.items()]
        rates.append(rate)
        bounds.append(bound)
    chain = _server_chain(cluster, local_roots, root_server)
    chain_edges = tuple((local_roots[a], local_roots[b]) for a, b in zip(chain, chain[1:]))
    chain_gbps = min(cluster.link(a, b).bandwidth_gbps for a, b in chain_edges)
    rate = min(chain_gbps, *rates)
    bound = min(_cross_server_bound(cluster, local_roots, root_server), *bounds)
    components = [[(chain_edges, 1.0)]] + [local_trees[s] for s in chain]
    return local_roots[root_server], _compose(components, rate), rate, bound


def _cross_server_bound(cluster: ClusterSpec, local_roots: dict[str, str], root_server: str) -> float:
    """One NIC per server: the root's server sends, every other server receives, at most its widest link."""
    def widest(src_servers, dst_servers) -> float:
        links = [cluster.link(local_roots[a], local_roots[b]) for a in src_servers for b in dst_servers if a != b]
        return max((l.bandwidth_gbps for l in links if l is not None), default=0.0)

    others = [s for s in local_roots if s != root_server]
    return min([widest([root_server], others)] + [widest(list(local_roots), [s]) for s in others])


def plan_collective(cluster: ClusterSpec, devices: Sequence[str], *, group: str = "group",
                    root: str | None = None, min_share: float = 0.99) -> Collective:
    """The allreduce trees of a group of devices (module docstring), with rate, bound and ring rate."""
    devices = check_devices(cluster, devices)
    if root is not None and root not in devices:
        raise InputError(f"root {root!r} is not one of the group's devices ({', '.join(devices)})")
    if not 0 < min_share <= 1:
        raise InputError(f"min_share must be in (0, 1], got {min_share:g}")
    if len(devices) == 1:
        return Collective(group=group, devices=devices, root=devices[0], rate_gbps=0.0, bound_gbps=0.0,
                          ring_gbps=0.0)
    per_node = devices_by_node(cluster, devices)
    if len(per_node) == 1:
        root, trees, rate, bound = _single_server(cluster, devices, root, min_share)
    else:
        root, trees, rate, bound = _multi_server(cluster, per_node, root, min_share)
    return Collective(group=group, devices=devices, root=root, rate_gbps=rate, bound_gbps=bound,
                      ring_gbps=best_ring(cluster, devices)[1],
                      trees=tuple(Tree(edges=_root_first(edges, root), weight=w) for edges, w in trees if w > 0))


def _root_first(edges: tuple, root: str) -> tuple[tuple[str, str], ...]:
    """The tree's edges in breadth-first order from the root, so a reader sees it grow."""
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


def _link_loads(collective: Collective) -> dict[tuple[str, str], float]:
    """Share of the data each directed link carries: broadcast down every tree, reduce up it."""
    total = sum(tree.weight for tree in collective.trees)
    loads: dict[tuple[str, str], float] = {}
    for tree in collective.trees:
        for parent, child in tree.edges:
            loads[(parent, child)] = loads.get((parent, child), 0.0) + tree.weight / total
            loads[(child, parent)] = loads.get((child, parent), 0.0) + tree.weight / total
    return loads


def _nic_gbps(cluster: ClusterSpec, server: str) -> float:
    """A server's network interface: the widest link between it and another server."""
    widths = [cluster.inter_node_default.bandwidth_gbps] if cluster.inter_node_default else []
    widths += [l.bandwidth_gbps for l in cluster.links
               if (cluster.node_of(l.src).name == server) != (cluster.node_of(l.dst).name == server)]
    return max(widths, default=math.inf)


def allreduce_throughput_gbps(cluster: ClusterSpec, collective: Collective) -> float:
    """X of the module docstring: the rate at which a pipelined reduce + broadcast moves the data."""
    throughput = math.inf
    egress: dict[str, float] = {}
    ingress: dict[str, float] = {}
    for (src, dst), load in _link_loads(collective).items():
        link = cluster.link(src, dst)
        if link is None:
            raise PlanInfeasible(f"the reduce needs the link {src} -> {dst} (the reverse of a tree edge), "
                                 "which the cluster does not have")
        throughput = min(throughput, link.bandwidth_gbps / load)
        src_server, dst_server = cluster.node_of(src).name, cluster.node_of(dst).name
        if src_server != dst_server:
            egress[src_server] = egress.get(src_server, 0.0) + load
            ingress[dst_server] = ingress.get(dst_server, 0.0) + load
    for loads in (egress, ingress):
        for server, load in loads.items():
            throughput = min(throughput, _nic_gbps(cluster, server) / load)
    return throughput


def _deepest_latency_us(cluster: ClusterSpec, collective: Collective) -> float:
    deepest = 0.0
    for tree in collective.trees:
        reach_us = {collective.root: 0.0}
        for parent, child in _root_first(tuple(tree.edges), collective.root):
            reach_us[child] = reach_us[parent] + cluster.link(parent, child).latency_us
        deepest = max(deepest, max(reach_us.values()))
    return deepest


def allreduce_time_s(cluster: ClusterSpec, collective: Collective, num_bytes: float) -> float:
    """Seconds for an allreduce of ``num_bytes`` over the collective's trees (module docstring)."""
    if len(collective.devices) == 1 or num_bytes <= 0:
        return 0.0
    if not collective.trees:
        raise InputError(f"collective {collective.group!r} of {len(collective.devices)} devices has no trees")
    throughput_gbps = allreduce_throughput_gbps(cluster, collective)
    return num_bytes / (throughput_gbps * GBPS_TO_BYTES_PER_S) + 2 * _deepest_latency_us(cluster, collective) * US_TO_S


def ring_allreduce_time_s(cluster: ClusterSpec, devices: Sequence[str], num_bytes: float) -> float:
    """Seconds for a ring allreduce of ``num_bytes`` over the best ring (module docstring)."""
    devices = check_devices(cluster, devices)
    count = len(devices)
    if count == 1 or num_bytes <= 0:
        return 0.0
    order, bottleneck_gbps = best_ring(cluster, devices)
    if bottleneck_gbps <= 0:
        raise PlanInfeasible(f"no ring over {', '.join(devices)}: some device has no direct link in or out "
                             "that closes a cycle")
    slowest_us = max(cluster.link(a, b).latency_us for a, b in zip(order, order[1:] + order[:1]))
    steps = 2 * (count - 1)
    return steps / count * num_bytes / (bottleneck_gbps * GBPS_TO_BYTES_PER_S) + steps * slowest_us * US_TO_S
