"""The devices of a group as a directed capacity graph: min-cut bounds and the best ring.

Pure (stdlib + networkx). Capacities are GB/s in the edge attribute ``capacity``; latencies are
microseconds in ``latency_us``. A group's graph holds only the direct links among its devices
(``ClusterSpec.links_among``): a collective that routes through a device outside the group would
steal that device's links from whoever runs on it. Every link between servers leaves through its
server's one network interface (:func:`nic_gbps`).

The best ring is a directed Hamiltonian cycle whose narrowest link is as wide as possible (its
"bottleneck", the rate of a ring collective). Finding it is NP-hard in general; a depth-first
branch and bound that tries the widest links first and prunes every partial ring no wider than
the best found is exhaustive on the groups of one server (up to ~9-10 devices within the search
budget) and a good heuristic beyond (the budget stops it with the best ring found so far).
Groups spanning several servers chain each server's best Hamiltonian path, as NCCL does.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import networkx as nx

from felactl.errors import InputError, PlanInfeasible
from felactl.spec.cluster import ClusterSpec, LinkType

GBPS_TO_BYTES_PER_S = 1e9
"""Bytes per second of one GB/s, the unit of every capacity here."""
US_TO_S = 1e-6
"""Seconds of one microsecond, the unit of every latency here."""
RING_SEARCH_BUDGET = 200_000
"""Partial rings the search may extend before it settles for the best ring found so far."""

_VIRTUAL = object()
"""A node joined to every device by infinitely wide links: the best cycle through it is the best path."""


def abbreviate_names(names: Sequence[str], shown: int = 8) -> str:
    """The first few names for a message, so a 512-device cluster still makes a one-line error."""
    return ", ".join(names[:shown]) + (f", ... ({len(names)} in all)" if len(names) > shown else "")


def check_devices(cluster: ClusterSpec, devices: Sequence[str]) -> tuple[str, ...]:
    """The devices as a tuple, after checking each exists in the cluster and none repeats."""
    if not devices:
        raise InputError("a collective needs at least one device")
    for name in devices:
        if not cluster.has_device(name):
            known = abbreviate_names(cluster.device_names)
            raise InputError(f"unknown device {name!r} (cluster {cluster.name} has {known})")
    if len(set(devices)) != len(devices):
        raise InputError(f"a device is listed twice in {abbreviate_names(devices)}")
    return tuple(devices)


def group_links(
    cluster: ClusterSpec, devices: Sequence[str], *, trees: bool = True
) -> list[tuple[str, str, float, float]]:
    """(src, dst, GB/s, latency us) of every direct link among the devices, as the hardware lets a
    collective use it. A node with a switch (``Node.switch_gbps``, NVSwitch) gives each device one
    port: a ring sends to one peer at a time, so a link carries at most the port; trees may send to
    every peer at once, so each of the k - 1 links from one of the node's k devices in the group gets
    port / (k - 1) (a packing within those capacities never overloads a port, and the broadcast
    bound stays the port, not k - 1 ports). A node's shared NIC (``Node.nic_gbps``) caps each of its
    inter-node links (the collectives also count the NIC once per node: ``collectives``)."""
    devices = tuple(devices)
    per_node: dict[str, int] = {}
    for name in devices:
        node = cluster.node_of(name).name
        per_node[node] = per_node.get(node, 0) + 1
    found = []
    for link in cluster.links_among(devices):
        src, dst = cluster.node_of(link.src), cluster.node_of(link.dst)
        gbps = link.bandwidth_gbps
        if src.name == dst.name and src.switch_gbps:
            gbps = min(gbps, src.switch_gbps / (per_node[src.name] - 1) if trees else src.switch_gbps)
        elif src.name != dst.name:
            gbps = min([gbps] + [n.nic_gbps for n in (src, dst) if n.nic_gbps])
        found.append((link.src, link.dst, gbps, link.latency_us))
    return found


def capacity_graph(cluster: ClusterSpec, devices: Sequence[str], *, trees: bool = True) -> nx.DiGraph:
    """Every device of the group, and a directed edge for every direct link among them (its
    capacity as :func:`group_links` gives it: ``trees`` for packing, else for a ring)."""
    graph = nx.DiGraph()
    for name in devices:
        graph.add_node(name, server=cluster.node_of(name).name)
    for src, dst, gbps, latency_us in group_links(cluster, devices, trees=trees):
        graph.add_edge(src, dst, capacity=gbps, latency_us=latency_us)
    servers = {graph.nodes[d]["server"] for d in devices}
    graph.graph["nic_gbps"] = {n.name: n.nic_gbps for n in cluster.nodes if n.nic_gbps and n.name in servers}
    return graph


def min_cut_bound(graph: nx.DiGraph, root: str) -> tuple[float, str | None]:
    """The smallest root-to-device max-flow (Edmonds: the best broadcast rate), and that device.

    Returns ``(bound_gbps, narrowest_device)``; ``narrowest_device`` is None for a group of one.
    """
    bound, narrowest = float("inf"), None
    for node in graph.nodes:
        if node == root:
            continue
        flow = nx.maximum_flow_value(graph, root, node, capacity="capacity") if nx.has_path(graph, root, node) else 0.0
        if flow < bound:
            bound, narrowest = flow, node
    return (0.0 if narrowest is None else bound), narrowest


ALLREDUCE_BOUND_MAX_DEVICES = 9
"""Groups up to this size get :func:`allreduce_bound` (it enumerates partitions: 21,147 for 9)."""


def allreduce_bound(graph: nx.DiGraph) -> float | None:
    """The rate (GB/s) no allreduce over ``graph`` can beat, whatever its algorithm; None for a
    group too large to enumerate (``ALLREDUCE_BOUND_MAX_DEVICES``).

    Every element of the sum must reach every device from every other, and with sums formed on
    the way the fewest one-way transfers that do it are 2 (k - 1) among k parties (the one-way
    gossip bound; a ring and reduce-then-broadcast trees both meet it). Taking the parts of any
    partition P of the devices as the parties (transfers inside a part are free), the links
    crossing P must carry 2 (|P| - 1) times the data: rate <= (width crossing P, both ways) /
    (2 (|P| - 1)). Across a cut (A, B) the data must also cross each way: rate <= width A -> B.
    The bound is the least of these over all partitions. (A broadcast's min-cut bound is no
    bound of an allreduce: on four devices whose links give each 100 out and 100 in, a broadcast
    reaches 100 but no allreduce beats the 450 / 6 = 75 that the six transfers per element leave.)
    A server's network interface (``graph.graph["nic_gbps"]``, from :func:`capacity_graph`) is
    shared by all its links to other servers: what crosses a partition between servers is at most
    what their interfaces send, and at most what they receive (:func:`_crossing_gbps`).
    """
    nodes = list(graph.nodes)
    if len(nodes) < 2:
        return 0.0
    if len(nodes) > ALLREDUCE_BOUND_MAX_DEVICES:
        return None
    width = {(u, v): d["capacity"] for u, v, d in graph.edges(data=True)}
    best = float("inf")
    for parts in _partitions(nodes):
        if len(parts) < 2:
            continue
        side = {node: i for i, part in enumerate(parts) for node in part}
        crossing = [(u, v) for (u, v) in width if side[u] != side[v]]
        best = min(best, _crossing_gbps(graph, crossing) / (2 * (len(parts) - 1)))
        if len(parts) == 2:
            for direction in (0, 1):
                best = min(best, _crossing_gbps(graph, [(u, v) for u, v in crossing if side[u] == direction]))
    return best


def _crossing_gbps(graph: nx.DiGraph, links: list[tuple[str, str]]) -> float:
    """The most ``links`` of ``graph`` carry at once: their widths, where those between servers
    with a network interface (``graph.graph["nic_gbps"]``) count no more than each sending server's
    interface sends and each receiving server's receives."""
    nics = graph.graph.get("nic_gbps") or {}
    if not nics:
        return sum(graph.edges[e]["capacity"] for e in links)
    total, sent, received = 0.0, {}, {}
    for u, v in links:
        a, b = graph.nodes[u]["server"], graph.nodes[v]["server"]
        if a == b or (a not in nics and b not in nics):
            total += graph.edges[u, v]["capacity"]
        else:
            sent[a] = sent.get(a, 0.0) + graph.edges[u, v]["capacity"]
            received[b] = received.get(b, 0.0) + graph.edges[u, v]["capacity"]
    out = sum(min(gbps, nics.get(a, math.inf)) for a, gbps in sent.items())
    into = sum(min(gbps, nics.get(b, math.inf)) for b, gbps in received.items())
    return total + min(out, into)


def _partitions(items: list) -> Iterator[list[list]]:
    """Every partition of ``items`` into non-empty parts."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for smaller in _partitions(rest):
        for i in range(len(smaller)):
            yield [*smaller[:i], [first, *smaller[i]], *smaller[i + 1 :]]
        yield [[first], *smaller]


def roots_by_bound(graph: nx.DiGraph, candidates: Sequence[str]) -> list[tuple[str, float]]:
    """Every candidate root with its min-cut bound, largest bound first (ties in candidate order).

    Raises PlanInfeasible naming a device that the first candidate cannot reach when no
    candidate reaches every device.
    """
    ranked, narrowest = [], None
    for root in candidates:
        bound, worst = min_cut_bound(graph, root)
        ranked.append((root, bound))
        if root == candidates[0]:
            narrowest = worst
    ranked.sort(key=lambda item: -item[1])  # stable: ties keep the candidates' order
    if ranked[0][1] <= 0 and graph.number_of_nodes() > 1:
        raise PlanInfeasible(
            f"the group is disconnected: {narrowest} cannot be reached from {candidates[0]} "
            "over the links among the group's devices"
        )
    return ranked


def _bandwidth_map(graph: nx.DiGraph) -> dict:
    """src -> [(dst, capacity)] widest first: the order the ring search tries links in."""
    return {
        u: sorted(((v, d["capacity"]) for v, d in graph[u].items()), key=lambda item: -item[1]) for u in graph.nodes
    }


class _BudgetSpent(Exception):
    pass


def _widest_cycle(out_links: dict, nodes: list, budget: int) -> tuple[list, float]:
    """Branch and bound for the Hamiltonian cycle (from ``nodes[0]``) with the widest bottleneck."""
    start, total = nodes[0], len(nodes)
    best: list = [0.0, None]
    steps = [0]

    def extend(path: list, visited: set, bottleneck: float) -> None:
        steps[0] += 1
        if steps[0] > budget:
            raise _BudgetSpent
        if len(path) == total:
            closing = dict(out_links[path[-1]]).get(start, 0.0)
            if min(bottleneck, closing) > best[0]:
                best[0], best[1] = min(bottleneck, closing), list(path)
            return
        for nxt, capacity in out_links[path[-1]]:
            if capacity <= best[0]:
                break  # widest first: nothing further can beat the best ring
            if nxt not in visited:
                visited.add(nxt)
                path.append(nxt)
                extend(path, visited, min(bottleneck, capacity))
                path.pop()
                visited.discard(nxt)

    try:
        extend([start], {start}, float("inf"))
    except _BudgetSpent:
        pass
    return best[1] or [], best[0]


def best_ring_in_graph(graph: nx.DiGraph, budget: int = RING_SEARCH_BUDGET) -> tuple[tuple[str, ...], float]:
    """The widest directed Hamiltonian cycle of the graph: (device order, bottleneck GB/s); ((), 0) if none."""
    nodes = list(graph.nodes)
    if len(nodes) < 2:
        return tuple(nodes), 0.0
    order, bottleneck = _widest_cycle(_bandwidth_map(graph), nodes, budget)
    return tuple(order), bottleneck


def best_path_in_graph(graph: nx.DiGraph, budget: int = RING_SEARCH_BUDGET) -> tuple[tuple[str, ...], float]:
    """The widest Hamiltonian path (any ends): (device order, bottleneck GB/s; inf for one device)."""
    nodes = list(graph.nodes)
    if len(nodes) == 1:
        return tuple(nodes), float("inf")
    out_links = _bandwidth_map(graph)
    out_links[_VIRTUAL] = [(v, float("inf")) for v in nodes]
    for v in nodes:
        out_links[v] = out_links[v] + [(_VIRTUAL, float("inf"))]
    order, bottleneck = _widest_cycle(out_links, [_VIRTUAL, *nodes], budget)
    return tuple(order[1:]), bottleneck


def devices_by_node(cluster: ClusterSpec, devices: Sequence[str]) -> dict[str, list[str]]:
    """The group's devices per node, nodes in cluster order, devices in group order."""
    grouped: dict[str, list[str]] = {node.name: [] for node in cluster.nodes}
    for name in devices:
        grouped[cluster.node_of(name).name].append(name)
    return {node: names for node, names in grouped.items() if names}


def local_signature(cluster: ClusterSpec, names: Sequence[str], *, trees: bool = True) -> tuple:
    """The group's graph on one server with devices replaced by their position in ``names``
    (capacities as :func:`group_links` gives them).

    Two servers with the same signature (e.g. 64 identical DGX-1s) have the same trees and
    rings up to renaming, so the work is done once.
    """
    index = {name: i for i, name in enumerate(names)}
    edges = sorted(
        (index[src], index[dst], gbps, latency_us)
        for src, dst, gbps, latency_us in group_links(cluster, names, trees=trees)
    )
    return len(names), tuple(edges)


def signature_graph(signature: tuple) -> nx.DiGraph:
    """The graph a signature describes, over device positions 0..k-1."""
    count, edges = signature
    graph = nx.DiGraph()
    graph.add_nodes_from(range(count))
    for src, dst, capacity, latency_us in edges:
        graph.add_edge(src, dst, capacity=capacity, latency_us=latency_us)
    return graph


def best_ring(cluster: ClusterSpec, devices: Sequence[str]) -> tuple[tuple[str, ...], float]:
    """The best ring over the group's direct links: (order, bottleneck GB/s), ((), 0) if none exists.

    One server: the widest Hamiltonian cycle. Several: each server's widest Hamiltonian path,
    chained in node order (servers with the same local graph share one search).
    """
    per_node = devices_by_node(cluster, devices)
    if len(per_node) == 1:
        return best_ring_in_graph(capacity_graph(cluster, devices, trees=False))
    order: list[str] = []
    paths: dict[tuple, tuple] = {}
    for names in per_node.values():
        key = local_signature(cluster, names, trees=False)
        if key not in paths:
            paths[key] = best_path_in_graph(signature_graph(key))[0]
        order += [names[i] for i in paths[key]]
    if len(order) < len(devices):
        return (), 0.0
    bottleneck = ring_width(cluster, order)
    return (tuple(order), bottleneck) if bottleneck > 0 else ((), 0.0)


NCCL_MAX_RINGS = 16
"""The most rings :func:`nccl_rings` lays (NCCL caps its channels too): far past what an NVLink
mesh closes (the DGX-1V's eight GPUs: four)."""


def nccl_rings(cluster: ClusterSpec, devices: Sequence[str]) -> tuple[tuple[tuple[str, ...], float], ...]:
    """The rings NCCL's allreduce runs over a group of GPUs, as ``((order, GB/s), ...)``; () where
    no ring closes.

    NCCL lays several rings (channels) at once and splits the data over them. Where NVLink alone
    closes the widest ring on one server (NVLink meshes such as the DGX-1V's), modelled as NCCL
    searches: that ring, its bandwidth taken from every link it sends over, then the widest NVLink
    ring of what is left, and so on, at most :data:`NCCL_MAX_RINGS`. Elsewhere one ring
    (:func:`best_ring`): a ring with a PCIe hop (the cluster gives PCIe per pair, but the pairs
    share the GPUs' lanes and the switch, so more rings over them would not add up), behind a
    switch (each GPU one port), across servers (the network the bottleneck). A model of NCCL's
    search, not a measurement of it: the lent machines here have one GPU."""
    first = best_ring(cluster, devices)
    if first[1] <= 0:
        return ()
    if len(devices_by_node(cluster, devices)) > 1 or cluster.node_of(devices[0]).switch_gbps:
        return (first,)
    if any(cluster.link(a, b).type is not LinkType.NVLINK for a, b in ring_hops(first[0])):
        return (first,)
    residual = capacity_graph(cluster, devices, trees=False)
    residual.remove_edges_from([e for e in list(residual.edges) if cluster.link(*e).type is not LinkType.NVLINK])
    rings: list[tuple[tuple[str, ...], float]] = []
    order, gbps = first
    while gbps > 1e-9 and len(rings) < NCCL_MAX_RINGS:
        rings.append((order, gbps))
        for hop in ring_hops(order):
            residual.edges[hop]["capacity"] -= gbps
            if residual.edges[hop]["capacity"] <= 1e-9:
                residual.remove_edge(*hop)
        order, gbps = best_ring_in_graph(residual)
    return tuple(rings)


def ring_hops(order: Sequence[str]) -> list[tuple[str, str]]:
    """The links a ring along ``order`` sends over: each device to the next, the last to the first."""
    return list(zip(order, [*order[1:], *order[:1]]))


def ring_width(cluster: ClusterSpec, order: Sequence[str]) -> float:
    """The bottleneck GB/s of the ring that sends from each device of ``order`` to the next (the
    last to the first) over direct links, a server's network interface capping the links that
    leave or enter it; 0 where a link is missing."""
    nics = {node.name: node.nic_gbps for node in cluster.nodes if node.nic_gbps}

    def width(a: str, b: str) -> float:
        link = cluster.link(a, b)
        if link is None:
            return 0.0
        return min(
            [link.bandwidth_gbps]
            + [
                nics[n]
                for n in {cluster.node_of(a).name, cluster.node_of(b).name}
                if n in nics and cluster.node_of(a).name != cluster.node_of(b).name
            ]
        )

    return min(width(a, b) for a, b in ring_hops(order))


def nic_gbps(cluster: ClusterSpec, server: str) -> float:
    """A server's network interface: the spec's ``nic_gbps``, else the widest link between it and
    another server."""
    nic = next(node.nic_gbps for node in cluster.nodes if node.name == server)
    if nic:
        return nic
    widths = [cluster.inter_node_default.bandwidth_gbps] if cluster.inter_node_default else []
    widths += [
        l.bandwidth_gbps
        for l in cluster.links
        if (cluster.node_of(l.src).name == server) != (cluster.node_of(l.dst).name == server)
    ]
    return max(widths, default=math.inf)
