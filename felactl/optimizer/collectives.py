"""Collectives over packed spanning trees (Blink, SEEDS.md section 4), and the ring they replace.

Pure: stdlib + networkx + pulp (via :mod:`felactl.optimizer.packing`), never torch.

**The broadcast** from a root, over one server or several (Blink's three phases): its trees, rate
R and min-cut bound B are packed in :mod:`felactl.optimizer.broadcast_trees`.

**The reduce direction.** The reduce runs up the broadcast trees reversed where every link is as
wide both ways (then X >= R / 2, below). Elsewhere (one-way or asymmetric links) trees are packed
for the reduce too, as arborescences out of the root on the reversed graph (``reduce_trees``),
and kept where they make the allreduce faster than the reversed trees (or where those need a
link that does not exist). A group whose devices cannot all reach the root has no reduce over
trees: its allreduce over trees is refused and the planner prices a ring.

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

**Times** (bytes N; rates in GB/s = 1e9 bytes/s; latencies in microseconds):

- Tree allreduce = reduce up the reduce trees (the broadcast trees reversed where there are none
  of its own), pipelined with the broadcast down the trees (chunks flow continuously, data split
  across trees by w_T / R; with several roots, first across the roots by their broadcast trees'
  rates, then each root's across its trees, ``spec.plan.deal_by_root``, whose long-run shares
  f_T, ``spec.plan.dealt_shares``, are w_T / R for the broadcast trees). Link (a, b) then carries
  the share f_T of every broadcast
  tree using (a, b) and the share of every reduce tree whose edge (b, a) sends child a to parent b:
  load(a, b) = sum_{T: (a,b) in T} f_T + sum_{T' reduce: (b,a) in T'} f_T'. The allreduce moves
  X = min( min_links c_ab / load(a, b), min_servers NIC / (cross-server load out or in) ) GB/s
  and takes ``N / X + deepest broadcast latency + deepest reduce latency`` (the largest sum of
  link latencies on a root-to-leaf path of any tree: the pipeline's fill, once up, once down)
  ``+ p / X * (max_T (up_T - 1) / f_T + max_T down_T / f_T)``: the pieces' fill, p being the bytes
  of one piece (``spec.plan.tree_piece_bytes``, the runtime's rule) and up_T, down_T a tree's
  depth in hops. A tree moves its pieces through its links at f_T X as a flow shop: the last piece
  reaches the root (up_T - 1) pieces' time after the reduce's last send from a deepest leaf, then
  takes down_T hops to the deepest leaf. The pieces are dealt to the trees as the runtime deals
  them (``spec.plan.deal_by_root``), and both maxima, and N / X, run over the trees dealt any: a buffer of
  a few pieces leaves light trees none, and its time is then the slowest dealt tree's bytes at
  f_T X (``TreeAllreduceCost.seconds``). (Measured on the fragment testbed: 16 MiB over 2 trees in
  1 MiB pieces took 0.41 s where N / X alone priced 0.22.)
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
- Ring allreduce (the baseline, as NCCL): ``2 (n - 1) / n * N / b + 2 (n - 1) * l``, with b the best
  ring's bottleneck bandwidth and l its slowest link's latency (each of the 2 (n - 1) steps waits
  for its slowest hop).
- A group of one device moves nothing: ``plan_collective`` returns it with no trees and rates 0,
  and both times are 0.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

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
    nic_gbps,
    ring_hops,
    ring_width,
    signature_graph,
)
from felactl.optimizer.packing import pack_arborescences, pack_up_and_down
from felactl.spec.cluster import ClusterSpec, DeviceKind, quota_slowdown
from felactl.spec.plan import Collective, Tree, deal_by_root, dealt_shares, root_rates, tree_piece_bytes, tree_root

GBPS_TO_BYTES_PER_S = 1e9
US_TO_S = 1e-6
TREE_MESSAGE_CPU_S = 70e-6
"""A full core's CPU seconds for each message a CPU slot sends or receives in a tree allreduce
(the walk's Python, gloo's work, the receive's buffer), beyond its bytes
(:data:`TREE_CPU_S_PER_BYTE`). Measured with the runtime's own allreduce, three local processes
over a chain, pieces of 64 KiB to 1 MiB (``benchmarks/bench_tree_cpu.py``, BENCHMARKS.md "Trees
at run time", thirteenth session): 70 us + 0.26 ns per byte of the piece."""
TREE_CPU_S_PER_BYTE = 0.26e-9
"""A full core's CPU seconds per byte of each piece a CPU slot sends or receives in a tree
allreduce, the reduce's add included (:data:`TREE_MESSAGE_CPU_S`)."""


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
        trees=tuple(Tree(edges=_root_first(edges), weight=w) for edges, w in trees if w > 0),
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
    trees = tuple(Tree(edges=_root_first(edges), weight=w) for edges, w in named if w > 0)
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
        reduce_trees=tuple(Tree(edges=_root_first(edges), weight=w) for edges, w in trees if w > 0),
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
            out += [Tree(edges=_root_first(edges), weight=w * rate / carried) for edges, w in family.items()]
    return trees, reduce_trees


def _loads_any(collective: Collective, links: set) -> bool:
    """Whether the collective's broadcast or reduce sends data over any of ``links``."""
    return any(link in links for link in _link_loads(collective))


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


def _root_first(edges: tuple) -> tuple[tuple[str, str], ...]:
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


def _reduce_trees(collective: Collective) -> tuple[Tree, ...]:
    """The trees the reduce runs up: its own, else the broadcast trees (reversed by the caller)."""
    return collective.reduce_trees or collective.trees


def _link_loads(collective: Collective) -> dict[tuple[str, str], float]:
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


def allreduce_throughput_gbps(cluster: ClusterSpec, collective: Collective) -> float:
    """X of the module docstring: the rate at which a pipelined reduce + broadcast moves the data."""
    throughput = math.inf
    egress: dict[str, float] = {}
    ingress: dict[str, float] = {}
    port_out: dict[str, float] = {}  # devices behind a switch: what their one port sends and receives
    port_in: dict[str, float] = {}
    for (src, dst), load in _link_loads(collective).items():
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


def _reach(tree: Tree, hop) -> float:
    """The largest sum of ``hop(parent, child)`` over a path from the root down ``tree``."""
    reach = {tree.root: 0.0}
    for parent, child in _root_first(tuple(tree.edges)):
        reach[child] = reach[parent] + hop(parent, child)
    return max(reach.values())


def _deepest_latency_us(cluster: ClusterSpec, collective: Collective, upward: bool = False) -> float:
    """The largest sum of link latencies from the root to a leaf of any tree (``upward``: of the
    reduce trees, over the links child -> parent)."""

    def latency_us(parent: str, child: str) -> float:
        return (cluster.link(child, parent) if upward else cluster.link(parent, child)).latency_us

    trees = _reduce_trees(collective) if upward else collective.trees
    return max(_reach(tree, latency_us) for tree in trees)


def allreduce_time_s(cluster: ClusterSpec, collective: Collective, num_bytes: float) -> float:
    """Seconds for an allreduce of ``num_bytes`` over the collective's trees (module docstring)."""
    if len(collective.devices) == 1 or num_bytes <= 0:
        return 0.0
    if not collective.trees:
        raise InputError(f"collective {collective.group!r} of {len(collective.devices)} devices has no trees")
    return tree_allreduce_cost(cluster, collective).seconds(num_bytes)


@dataclasses.dataclass(frozen=True)
class TreeAllreduceCost:
    """What a tree allreduce of N bytes costs (module docstring, "Times"): the links' latencies
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


def cpu_slowdown(cluster: ClusterSpec, device: str) -> float:
    """How many times a full core's seconds a CPU slot's own work takes, from the cluster alone:
    one over its quota where a cgroup holds it to a share of a core (``spec.cluster.quota_slowdown``),
    else 1. (GPU ranks of a gloo group pay their host's messages too; they are not priced.)"""
    return quota_slowdown(cluster.device(device).model) or 1.0


def _shares(trees: Sequence[Tree], roots: list) -> list[float]:
    """f_T of each of ``trees``: the share of the data it carries (the runtime deals pieces so)."""
    return dealt_shares([(tree.root, tree.weight) for tree in trees], roots)


def ring_allreduce_time_s(
    cluster: ClusterSpec, devices: Sequence[str], num_bytes: float, *, order: Sequence[str] | None = None
) -> float:
    """Seconds for a ring allreduce of ``num_bytes`` over the best ring (module docstring), or over
    the ring that sends along ``order`` (each device to the next) where the runtime fixes it
    (:func:`gloo_ring`)."""
    if len(devices) == 1 or num_bytes <= 0:
        check_devices(cluster, devices)
        return 0.0
    fixed_s, per_byte_s = ring_allreduce_line(cluster, devices, order=order)
    return fixed_s + num_bytes * per_byte_s


def ring_allreduce_line(
    cluster: ClusterSpec, devices: Sequence[str], *, order: Sequence[str] | None = None
) -> tuple[float, float]:
    """A ring allreduce's time as ``fixed_s + bytes * per_byte_s`` (:func:`ring_allreduce_time_s`
    for any size): finding the best ring is the costly part, so a caller pricing many sizes over
    one group (the cost model, a bucket at a time) finds it once."""
    devices = check_devices(cluster, devices)
    if order is None:
        order, bottleneck_gbps = best_ring(cluster, devices)
    else:
        bottleneck_gbps = ring_width(cluster, order)
    return _rings_line(cluster, devices, ((order, bottleneck_gbps),) if bottleneck_gbps > 0 else ())


def nccl_allreduce_line(cluster: ClusterSpec, devices: Sequence[str]) -> tuple[float, float]:
    """NCCL's allreduce over a group of GPUs as ``fixed_s + bytes * per_byte_s``: the data split
    over the rings it lays (:func:`~felactl.optimizer.graph.nccl_rings`) by their bandwidth, each a
    ring allreduce of its share, all at once. What the runtime runs on GPUs: Blink trees need
    gloo (:func:`felactl.agents.worker.sync.trees.stage_trees`)."""
    devices = check_devices(cluster, devices)
    return _rings_line(cluster, devices, nccl_rings(cluster, devices))


def _rings_line(cluster: ClusterSpec, devices: Sequence[str], rings) -> tuple[float, float]:
    """Ring allreduce over ``rings`` (``((order, GB/s), ...)``) at once, the data split by their
    bandwidth: 2 (n - 1) steps of the slowest hop's latency, and the data at the rings' summed rate."""
    if not rings:
        raise PlanInfeasible(
            f"no ring over {', '.join(devices)}: some device has no direct link in or out that closes a cycle"
        )
    slowest_us = max(cluster.link(a, b).latency_us for order, _ in rings for a, b in ring_hops(order))
    count = len(devices)
    rate_gbps = ring_allreduce_gbps(sum(gbps for _, gbps in rings), count)
    return 2 * (count - 1) * slowest_us * US_TO_S, 1.0 / (rate_gbps * GBPS_TO_BYTES_PER_S)


def gloo_ring(ranked: Sequence[str]) -> tuple[str, ...]:
    """The ring gloo's allreduce sends along over a group whose devices are ``ranked`` (ascending
    rank): each rank sends to the rank before it, so the data goes round the ranks backwards.
    Measured on the asymmetric testbed (links fast one way round, 8x slower the other): ranks
    n0, n1, n2 took 2.25 s for 16 MiB, the slow ring's time; ranks n0, n2, n1 took 0.29 s, the fast
    one's (BENCHMARKS.md, "Measured plan quality"). Rank order is felactl's to choose
    (:func:`felactl.optimizer.planner.rank_order`)."""
    return tuple(reversed(ranked))


def ring_allreduce_gbps(bottleneck_gbps: float, count: int) -> float:
    """The rate a ring allreduce over ``count`` devices moves the data at: each sends 2 (n - 1) / n of it."""
    return bottleneck_gbps * count / (2 * (count - 1)) if count > 1 else 0.0


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
    rate (what a job there runs, :func:`on_nccl`)."""
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


def on_nccl(cluster: ClusterSpec, devices: Sequence[str]) -> bool:
    """Whether a group syncs over NCCL's allreduce: a group of GPUs (a plan runs on GPUs with NCCL or
    on CPU slots with gloo, never both: :func:`~felactl.optimizer.planner.check_devices`). The
    runtime streams Blink trees over gloo only, so NCCL's own rings sum there (:func:`nccl_rings`)."""
    return all(cluster.device(d).kind is DeviceKind.CUDA for d in devices)
