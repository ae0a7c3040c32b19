"""The collective trees of a group of devices (Blink, SEEDS.md section 4): :func:`plan_collective`
packs its broadcast, reduce and allreduce trees; :func:`allreduce_rates` weighs them against rings
and the bound of any allreduce.

Pure: stdlib + networkx + pulp (via :mod:`felactl.optimizer.packing`), never torch.

**The broadcast** from a root, over one server or several (Blink's three phases): its trees, rate
R and min-cut bound B are packed in :mod:`felactl.optimizer.broadcast_trees`.

**The reduce direction.** The reduce runs up the broadcast trees reversed where every link is as
wide both ways (then X >= R / 2: :mod:`felactl.optimizer.tree_cost`). Elsewhere (one-way or
asymmetric links) trees are packed for the reduce too, as arborescences out of the root on the
reversed graph (``reduce_trees``), and kept where they make the allreduce faster than the
reversed trees (or where those need a link that does not exist). A group whose devices cannot
all reach the root has no reduce over trees: its allreduce over trees is refused and the planner
prices a ring.

**Trees for the allreduce itself.** Trees packed for a broadcast reach its bound R, but an
allreduce sends every byte up as well as down, so where a broadcast tree uses a link one way and
another tree the other way, the reduce and the broadcast meet on both: on four devices whose
links give each 100 in and 100 out, the broadcast's trees move an allreduce at 50 where 75 is
possible. So one server's group is also packed *two-way* (``packing``: each tree loads its links
both ways, the reduce running up it reversed), and those trees are kept where their allreduce
is faster (then ``rate_gbps``, their broadcast rate, is below ``bound_gbps``, the broadcast's).
Where links are as wide both ways, the two-way LP optimum is Nash-Williams' bound of spanning
tree packing, which equals the bound of any allreduce (``graph.allreduce_bound``). Where links
differ by direction, broadcast and reduce trees are packed together instead, in one LP whose
objective is the allreduce's rate (``packing.pack_up_and_down``), kept where faster. There every
device sums a part of the data, as a ring's reduce-scatter and all-gather do: from one root every
byte arrives at and leaves from the root, whose links then bound the allreduce (three devices
ringed 80 one way and 10 back: 50 from one root, 67.5 with a root per part, the bound), so each
device roots trees of both kinds, with its own rate. That LP leaves out link directions much
thinner than their way back (``_without_acknowledgement_links``): they carry the wide way's
acknowledgements, which bulk data on them delays. Both are tried for one server's groups of up
to ``ALLREDUCE_BOUND_MAX_DEVICES``; ``for_allreduce=False`` keeps the broadcast's packing.

**Times**: a tree allreduce's in :mod:`felactl.optimizer.tree_cost`, a ring allreduce's (the
baseline, as NCCL) in :mod:`felactl.optimizer.ring_cost`; :func:`allreduce_rates` sets their rates
side by side with the bound of any allreduce. A group of one device moves nothing:
``plan_collective`` returns it with no trees and rates 0, and both times are 0.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import networkx as nx

from felactl.errors import InputError, PlanInfeasible
from felactl.optimizer.broadcast_trees import one_server_trees, three_phase_trees
from felactl.optimizer.graph import (
    ALLREDUCE_BOUND_MAX_DEVICES,
    allreduce_bound,
    best_ring,
    capacity_graph,
    check_devices,
    devices_by_node,
    local_signature,
    min_cut_bound,
    nccl_rings,
    signature_graph,
)
from felactl.optimizer.packing import pack_arborescences, pack_up_and_down
from felactl.optimizer.ring_cost import on_nccl, ring_allreduce_gbps
from felactl.optimizer.tree_cost import allreduce_throughput_gbps, link_loads, root_first
from felactl.spec.cluster import ClusterSpec
from felactl.spec.plan import Collective, Tree, tree_root


def plan_collective(
    cluster: ClusterSpec,
    devices: Sequence[str],
    *,
    group: str = "group",
    root: str | None = None,
    min_share: float = 0.99,
    for_allreduce: bool = True,
) -> Collective:
    """The allreduce trees of a group of devices (module docstring), with rate, bound and ring rate.
    ``for_allreduce=False`` keeps the trees packed for a broadcast (Blink's packing, at the min-cut
    bound) and, where links differ by direction, the reduce's packed on their own."""
    devices = check_devices(cluster, devices)
    if root is not None and root not in devices:
        raise InputError(f"root {root!r} is not one of the group's devices ({', '.join(devices)})")
    if not 0 < min_share <= 1:
        raise InputError(f"min_share must be in (0, 1], got {min_share:g}")
    if len(devices) == 1:
        return Collective(group=group, devices=devices, root=devices[0], rate_gbps=0.0, bound_gbps=0.0, ring_gbps=0.0)
    per_node = devices_by_node(cluster, devices)

    def pack(spec: ClusterSpec, root: str | None):
        if len(per_node) == 1:
            return one_server_trees(spec, devices, root, min_share)
        return three_phase_trees(spec, per_node, root, min_share)

    root, trees, rate, bound = pack(cluster, root)
    collective = Collective(
        group=group,
        devices=devices,
        root=root,
        rate_gbps=rate,
        bound_gbps=bound,
        ring_gbps=best_ring(cluster, devices)[1],
        trees=tuple(Tree(edges=root_first(edges), weight=w) for edges, w in trees if w > 0),
    )
    collective = _with_reduce_trees(cluster, collective, lambda spec: pack(spec, root))
    if not for_allreduce or len(per_node) > 1:
        return collective
    if _symmetric(cluster, devices):
        found = _with_two_way_trees(cluster, collective, min_share)
    else:
        found = _with_trees_packed_up_and_down(cluster, collective)
    if found.root == collective.root:
        return found
    # Trees packed for the allreduce may grow from another root: the bound is of that root's broadcast.
    return dataclasses.replace(found, bound_gbps=min_cut_bound(capacity_graph(cluster, devices), found.root)[0])


def _with_two_way_trees(cluster: ClusterSpec, collective: Collective, min_share: float) -> Collective:
    """The trees packed two-way for the allreduce (module docstring), where they move it faster.
    Tried where the bound of any allreduce is known (up to ``ALLREDUCE_BOUND_MAX_DEVICES``) and the
    trees in hand stay below it; packings of the same local shape are remembered."""
    bound = allreduce_bound(capacity_graph(cluster, collective.devices))
    if bound is None or _x_or_zero(cluster, collective) >= bound * (1 - 1e-3):
        return collective
    signature = local_signature(cluster, collective.devices)
    kept = _pack_two_way_signature(signature, collective.devices.index(collective.root), min_share)
    if kept is None:  # some link has no way back: only the trees packed each way apply
        return collective
    named = [(tuple((collective.devices[a], collective.devices[b]) for a, b in edges), w) for edges, w in kept.items()]
    trees = tuple(Tree(edges=root_first(edges), weight=w) for edges, w in named if w > 0)
    candidate = dataclasses.replace(collective, trees=trees, reduce_trees=(), rate_gbps=sum(t.weight for t in trees))
    return _faster(cluster, candidate, collective)


def _x_or_zero(cluster: ClusterSpec, collective: Collective) -> float:
    """The allreduce rate of ``collective``'s trees; 0 where a reduce link is missing."""
    try:
        return allreduce_throughput_gbps(cluster, collective)
    except PlanInfeasible:
        return 0.0


def _faster(cluster: ClusterSpec, candidate: Collective, collective: Collective) -> Collective:
    """``candidate`` where its allreduce is faster than ``collective``'s, else ``collective``."""
    return candidate if _x_or_zero(cluster, candidate) > _x_or_zero(cluster, collective) * (1 + 1e-6) else collective


@functools.lru_cache(maxsize=4096)
def _pack_two_way_signature(signature: tuple, root: int, min_share: float):
    """The two-way packing of a local signature's graph from ``root`` (positions), or None."""
    try:
        return pack_arborescences(signature_graph(signature), root, math.inf, min_share, two_way=True)[0]
    except PlanInfeasible:
        return None


def _symmetric(cluster: ClusterSpec, devices: Sequence[str]) -> bool:
    """Whether every link among the devices has a reverse link of the same bandwidth. Only listed
    links can break it (a pair joined by defaults has the same default both ways): checking every
    pair instead took 8 s for 512 GPUs."""
    members = set(devices)
    return all(
        (back := cluster.link(link.dst, link.src)) is not None and back.bandwidth_gbps == link.bandwidth_gbps
        for link in cluster.links
        if link.src in members and link.dst in members
    )


def reversed_cluster(cluster: ClusterSpec) -> ClusterSpec:
    """The cluster with every listed link turned around (defaults join every pair both ways already):
    an arborescence into a root here is one out of it there."""
    turned = tuple(dataclasses.replace(link, src=link.dst, dst=link.src) for link in cluster.links)
    return dataclasses.replace(cluster, links=turned)


def _with_reduce_trees(cluster: ClusterSpec, collective: Collective, pack) -> Collective:
    """Add trees packed for the reduce direction (into the root: out of it on the reversed graph)
    where they make the allreduce faster than reducing up the broadcast trees reversed, or where
    those need a link the cluster lacks. Symmetric graphs keep the reversed trees: there each
    reversed tree is an in-tree as wide as the tree, and the allreduce is at least R / 2."""
    if not collective.trees or _symmetric(cluster, collective.devices):
        return collective
    try:
        _, trees, _, _ = pack(reversed_cluster(cluster))
    except PlanInfeasible:  # no path back to the root from some device: no reduce over trees
        return collective
    candidate = dataclasses.replace(
        collective,
        reduce_trees=tuple(Tree(edges=root_first(edges), weight=w) for edges, w in trees if w > 0),
    )
    return _faster(cluster, candidate, collective)


def _with_trees_packed_up_and_down(cluster: ClusterSpec, collective: Collective) -> Collective:
    """Where links differ by direction: broadcast and reduce trees packed together for the
    allreduce, with a part of the sum at each device (``packing.pack_up_and_down``), where they
    beat the trees in hand, or where those load a link left to acknowledgements
    (:func:`_without_acknowledgement_links`) and these do not, where they beat those at the rate
    such trees measured (:data:`ACKNOWLEDGED_RATE_MEASURED` of their links' rate). Groups up to
    ``ALLREDUCE_BOUND_MAX_DEVICES`` on one server."""
    devices = collective.devices
    if len(devices) > ALLREDUCE_BOUND_MAX_DEVICES or not collective.trees:
        return collective
    graph = capacity_graph(cluster, devices)
    packed_on = _without_acknowledgement_links(graph)
    try:
        down, up, rates = pack_up_and_down(packed_on, devices)
    except PlanInfeasible:
        return collective
    trees, reduce_trees = _fewest_per_kind(down, up, rates, TREES_PER_DEVICE * len(devices))
    if not trees:
        return collective
    roots = [t.root for t in trees]
    first = collective.root if collective.root in roots else roots[0]
    candidate = dataclasses.replace(
        collective,
        root=first,
        trees=tuple(sorted(trees, key=lambda t: t.root != first)),
        reduce_trees=tuple(reduce_trees),
        rate_gbps=sum(t.weight for t in trees),
    )
    if packed_on is not graph and _loads_any(collective, set(graph.edges) - set(packed_on.edges)):
        slowed = _x_or_zero(cluster, collective) * ACKNOWLEDGED_RATE_MEASURED
        return candidate if _x_or_zero(cluster, candidate) > slowed else collective
    return _faster(cluster, candidate, collective)


ACKNOWLEDGED_RATE_MEASURED = 0.6
"""What trees that load a link left to acknowledgements measured of their priced rate: 0.57-0.59
on the asymmetric testbed at 16-256 MiB (BENCHMARKS.md, "Trees at run time", twelfth session).
One testbed's number, used only to choose between such trees and trees that avoid those links."""

TREES_PER_DEVICE = 2
"""At most this many trees of each kind per device of the group with several roots (one root: n)."""

MIN_ROOT_SHARE = 1e-3
"""Roots whose part of the packed rate is below this are left out (the LP's crumbs)."""


def _fewest_per_kind(down: dict, up: dict, rates: dict, count: int) -> tuple[list[Tree], list[Tree]]:
    """At most ``count`` trees of each kind (the heaviest: each is a walk and a thread at run
    time, and more trees cut the pieces smaller), over the roots that keep trees of
    both kinds; each root's trees of each kind scaled to carry the same rate, the least of the
    two kinds' kept rates there (a root's pieces go up one kind and down the other)."""
    total = sum(rates.values())
    kept = {root for root, rate in rates.items() if rate >= MIN_ROOT_SHARE * total}

    def heaviest(family: dict) -> dict[object, dict]:
        by_root: dict[object, dict] = {}
        for edges, weight in sorted(family.items(), key=lambda item: -item[1])[:count]:
            if tree_root(edges) in kept:
                by_root.setdefault(tree_root(edges), {})[edges] = weight
        return by_root

    kept_down, kept_up = heaviest(down), heaviest(up)
    trees, reduce_trees = [], []
    for root in sorted(set(kept_down) & set(kept_up), key=lambda r: -rates[r]):
        rate = min(sum(kept_down[root].values()), sum(kept_up[root].values()))
        for family, out in ((kept_down[root], trees), (kept_up[root], reduce_trees)):
            carried = sum(family.values())
            out += [Tree(edges=root_first(edges), weight=w * rate / carried) for edges, w in family.items()]
    return trees, reduce_trees


def _loads_any(collective: Collective, links: set) -> bool:
    """Whether the collective's broadcast or reduce sends data over any of ``links``."""
    return any(link in links for link in link_loads(collective))


ACKNOWLEDGEMENT_LINK_RATIO = 4.0
"""A link direction this many times thinner than its way back is left to the acknowledgements of
the data coming the other way (below)."""


def _without_acknowledgement_links(graph: nx.DiGraph) -> nx.DiGraph:
    """``graph`` without the link directions :data:`ACKNOWLEDGEMENT_LINK_RATIO` times thinner than
    their reverse, where what is left still joins every device both ways.

    Why: a transfer over a link is acknowledged over its reverse (TCP's acknowledgements, gloo's
    ready-to-receive notes), behind whatever data that reverse has queued, and a thin link's queue
    is long in time. On the asymmetric testbed (80 one way round the ring, 10 back) the trees
    that also loaded the thin ways (67.5 priced, the bound) measured 0.59 of it; without them
    (60 priced) 0.78-0.88, as priced (BENCHMARKS.md, "Trees at run time", twelfth session). The
    classic lesson of asymmetric access links: a saturated uplink starves the downlink."""
    thin = [
        (a, b)
        for a, b, data in graph.edges(data=True)
        if graph.has_edge(b, a) and data["capacity"] * ACKNOWLEDGEMENT_LINK_RATIO < graph.edges[b, a]["capacity"]
    ]
    if not thin:
        return graph
    kept = graph.copy()
    kept.remove_edges_from(thin)
    return kept if nx.is_strongly_connected(kept) else graph


# A ring fact (ring_cost's room), kept here while planner.py imports it from this module.
def gloo_ring(ranked: Sequence[str]) -> tuple[str, ...]:
    """The ring gloo's allreduce sends along over a group whose devices are ``ranked`` (ascending
    rank): each rank sends to the rank before it, so the data goes round the ranks backwards.
    Measured on the asymmetric testbed (links fast one way round, 8x slower the other): ranks
    n0, n1, n2 took 2.25 s for 16 MiB, the slow ring's time; ranks n0, n2, n1 took 0.29 s, the fast
    one's (BENCHMARKS.md, "Measured plan quality"). Rank order is felactl's to choose
    (:func:`felactl.optimizer.ranks.rank_order`)."""
    return tuple(reversed(ranked))


def root_bounds_gbps(cluster: ClusterSpec, collective: Collective) -> dict[str, float]:
    """The min-cut bound of a broadcast from each of the trees' roots (``Collective.roots``), which
    bounds the part of the data that root sends: ``bound_gbps`` for the one root of a collective
    (the three-phase scheme's bound across servers), each root's own where there are several."""
    roots = collective.roots
    if len(roots) == 1:
        return {roots[0]: collective.bound_gbps}
    graph = capacity_graph(cluster, collective.devices)
    return {root: min_cut_bound(graph, root)[0] for root in roots}


def allreduce_rates(cluster: ClusterSpec, collective: Collective) -> dict[str, float | None]:
    """What a reader weighs the trees by: their allreduce rate (None without trees, or where a
    reduce link is missing), the bound of any allreduce over the group (None where too large to
    compute), and the best ring's allreduce rate; on GPUs also NCCL's rings and their allreduce
    rate (what a job there runs, :func:`~felactl.optimizer.ring_cost.on_nccl`)."""
    try:
        allreduce = allreduce_throughput_gbps(cluster, collective) if collective.trees else None
    except PlanInfeasible:
        allreduce = None
    rates = {
        "allreduce_gbps": allreduce,
        "allreduce_bound_gbps": allreduce_bound(capacity_graph(cluster, collective.devices)),
        "ring_allreduce_gbps": ring_allreduce_gbps(collective.ring_gbps, len(collective.devices)),
        "root_bounds_gbps": root_bounds_gbps(cluster, collective),
    }
    if on_nccl(cluster, collective.devices):  # what a felactl job on these GPUs runs instead of the trees
        rings = nccl_rings(cluster, collective.devices) if len(collective.devices) > 1 else ()
        rates["nccl_rings"] = [{"order": list(order), "gbps": gbps} for order, gbps in rings]
        rates["nccl_allreduce_gbps"] = (
            ring_allreduce_gbps(sum(gbps for _, gbps in rings), len(collective.devices)) or None
        )
    return rates
