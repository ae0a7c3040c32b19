"""Blink collective trees: validity of every packing, the DGX-1V numbers, errors, the time model."""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import random
import time
from pathlib import Path

import pulp
import pytest

from felactl.errors import InputError, PlanInfeasible
from felactl.optimizer.collectives import allreduce_rates, plan_collective
from felactl.optimizer.graph import allreduce_bound, best_ring, capacity_graph, min_cut_bound
from felactl.optimizer.packing import pack_up_and_down
from felactl.optimizer.ring_cost import ring_allreduce_time_s
from felactl.optimizer.tree_cost import allreduce_throughput_gbps, allreduce_time_s, tree_allreduce_cost
from felactl.spec import ClusterSpec, Collective, Device, DeviceKind, Link, LinkType, Node, Tree, load_cluster
from felactl.spec.plan import tree_root

REPO = Path(__file__).resolve().parent.parent
CLUSTERS = REPO / "plans" / "clusters"
DGX = load_cluster(CLUSTERS / "dgx1v.yaml")
NVLINK_ONLY = dataclasses.replace(DGX, intra_node_default=None)
EPS = 1e-6


def gpus(*indices: int) -> tuple[str, ...]:
    return tuple(f"gpu{i}" for i in indices)


def assert_valid(cluster: ClusterSpec, collective: Collective) -> None:
    """Every tree is a spanning arborescence from its root (the collective's, or, where links differ
    by direction, any device's that has trees both ways); no link carries more than it has."""
    members = set(collective.devices)
    load: dict[tuple[str, str], float] = {}
    if collective.reduce_trees:
        assert {t.root for t in collective.reduce_trees} == {t.root for t in collective.trees}
    else:
        assert {t.root for t in collective.trees} == {collective.root}
    # (the broadcast's load only: a reduce tree may equal a broadcast tree, so not `tree in trees`)
    for broadcast, tree in [(True, t) for t in collective.trees] + [(False, t) for t in collective.reduce_trees]:
        root = tree.root
        parent: dict[str, str] = {}
        for a, b in tree.edges:
            assert b not in parent, f"{b} has two parents"
            parent[b] = a
            if broadcast:
                load[(a, b)] = load.get((a, b), 0.0) + tree.weight
        assert set(parent) == members - {root}, "a tree must give every non-root device one parent"
        for device in parent:
            hops, here = 0, device
            while here != root:
                here, hops = parent[here], hops + 1
                assert hops <= len(members), f"{device} is on a cycle, not below the root"
    for (a, b), gbps in load.items():
        assert cluster.link(a, b) is not None, f"tree edge {a} -> {b} has no link"
        assert gbps <= cluster.link(a, b).bandwidth_gbps + EPS, f"{a} -> {b} carries {gbps} GB/s"
    assert sum(t.weight for t in collective.trees) == pytest.approx(collective.rate_gbps)
    assert collective.rate_gbps <= collective.bound_gbps + EPS


GROUPS = [
    (NVLINK_ONLY, NVLINK_ONLY.device_names),
    (DGX, gpus(0, 1, 5)),
    (NVLINK_ONLY, gpus(0, 1, 2, 4, 5)),
    (DGX, gpus(0, 1, 2, 4, 5)),
    (DGX, gpus(1, 2, 3, 4, 6, 7)),
    (NVLINK_ONLY, gpus(2, 3, 6, 7)),
]


@pytest.mark.parametrize("cluster,devices", GROUPS, ids=lambda x: ",".join(x) if isinstance(x, tuple) else x.name)
def test_trees_are_arborescences_within_capacity(cluster, devices):
    collective = plan_collective(cluster, devices, for_allreduce=False)  # Blink's broadcast packing
    assert_valid(cluster, collective)
    assert collective.rate_gbps >= 0.99 * collective.bound_gbps - EPS


def test_full_dgx1v_from_gpu0_reaches_the_min_cut():
    # gpu0 has 6 NVLinks (0-1, 0-2, 2x 0-3, 2x 0-4) of 25 GB/s: 150 GB/s; PCIe adds 3 x 10 GB/s.
    nvlink = plan_collective(NVLINK_ONLY, NVLINK_ONLY.device_names, root="gpu0", min_share=1.0, for_allreduce=False)
    assert nvlink.bound_gbps == pytest.approx(150.0)
    assert nvlink.rate_gbps == pytest.approx(150.0)
    assert len(nvlink.trees) <= 8
    both = plan_collective(DGX, DGX.device_names, root="gpu0", min_share=1.0, for_allreduce=False)
    assert_valid(DGX, both)
    assert both.bound_gbps == pytest.approx(180.0) and both.rate_gbps == pytest.approx(180.0)
    assert both.ring_gbps == pytest.approx(50.0)  # the widest Hamiltonian cycle uses only 2-link pairs


def test_three_gpus_without_nvlink_ring_trees_beat_the_ring():
    # 0-1 (1 link), 1-5 (2 links), no 0-5 NVLink: no NVLink ring; NCCL would fall back to PCIe.
    devices = gpus(0, 1, 5)
    assert best_ring(NVLINK_ONLY, devices) == ((), 0.0)
    collective = plan_collective(DGX, devices)
    assert collective.ring_gbps == pytest.approx(10.0)  # the ring must take a PCIe hop
    assert collective.rate_gbps == pytest.approx(35.0)  # 25 over NVLink + 10 over PCIe
    num_bytes = 100e6
    assert allreduce_time_s(DGX, collective, num_bytes) * 3 < ring_allreduce_time_s(DGX, devices, num_bytes)


@pytest.mark.parametrize("devices", [NVLINK_ONLY.device_names, *itertools.combinations(NVLINK_ONLY.device_names, 7)])
def test_at_most_n_trees_on_the_nvlink_graph(devices):
    collective = plan_collective(NVLINK_ONLY, devices, for_allreduce=False)
    assert 1 <= len(collective.trees) <= len(devices)
    assert collective.rate_gbps >= 0.99 * collective.bound_gbps - EPS


def _random_cluster(seed: int, size: int) -> ClusterSpec:
    rng = random.Random(seed)
    devices = tuple(
        Device(name=f"d{i}", kind=DeviceKind.CUDA, model="x", tflops=1.0, memory_gb=1.0) for i in range(size)
    )
    links = tuple(
        Link(
            src=f"d{a}",
            dst=f"d{b}",
            bandwidth_gbps=float(rng.choice([5, 10, 25, 50])),
            latency_us=1.0,
            type=LinkType.NVLINK,
        )
        for a in range(size)
        for b in range(size)
        if a != b and (rng.random() < 0.6 or b == (a + 1) % size)
    )
    return ClusterSpec(name=f"random{seed}", nodes=(Node(name="n", devices=devices),), links=links)


def _all_arborescences(devices: tuple[str, ...], root: str, edges: set) -> list[tuple]:
    others = [d for d in devices if d != root]
    trees = []
    for parents in itertools.product(devices, repeat=len(others)):
        tree = tuple(zip(parents, others))
        if all(e in edges for e in tree):
            parent = dict((b, a) for a, b in tree)

            def reaches(d, seen=(), parent=parent):
                return d == root or (d not in seen and reaches(parent[d], seen + (d,)))

            if all(reaches(d) for d in others):
                trees.append(tree)
    return trees


@pytest.mark.parametrize("seed", range(6))
def test_packing_matches_an_lp_over_every_arborescence(seed):
    """A second implementation: enumerate every spanning arborescence, solve the full LP."""
    cluster = _random_cluster(seed, 5)
    devices = cluster.device_names
    collective = plan_collective(cluster, devices, root="d0", min_share=1.0, for_allreduce=False)
    assert_valid(cluster, collective)
    capacity = {(l.src, l.dst): l.bandwidth_gbps for l in cluster.links}
    trees = _all_arborescences(devices, "d0", set(capacity))
    problem = pulp.LpProblem("all_trees", pulp.LpMaximize)
    w = [pulp.LpVariable(f"w{i}", lowBound=0) for i in range(len(trees))]
    problem += pulp.lpSum(w)
    for e, cap in capacity.items():
        users = [w[i] for i, t in enumerate(trees) if e in t]
        if users:
            problem += pulp.lpSum(users) <= cap
    problem.solve(pulp.PULP_CBC_CMD(msg=False))
    assert pulp.LpStatus[problem.status] == "Optimal"
    optimum = pulp.value(problem.objective)
    assert collective.rate_gbps == pytest.approx(optimum, rel=1e-6)
    assert min_cut_bound(capacity_graph(cluster, devices), "d0")[0] == pytest.approx(optimum, rel=1e-6)  # Edmonds


def test_unknown_device_and_foreign_root_are_input_errors():
    with pytest.raises(InputError, match="unknown device 'gpu9'"):
        plan_collective(DGX, ["gpu0", "gpu9"])
    with pytest.raises(InputError, match="root 'gpu3'"):
        plan_collective(DGX, gpus(0, 1), root="gpu3")
    with pytest.raises(InputError, match="listed twice"):
        plan_collective(DGX, ["gpu0", "gpu0"])


def test_disconnected_group_names_the_unreachable_device():
    # NVLink only: gpu0 has no NVLink to gpu5 or gpu6 (they are linked to each other).
    with pytest.raises(PlanInfeasible, match="gpu0 cannot be reached from gpu5"):
        plan_collective(NVLINK_ONLY, gpus(0, 5, 6), root="gpu5")
    with pytest.raises(PlanInfeasible, match="disconnected"):
        plan_collective(NVLINK_ONLY, gpus(0, 5, 6))
    no_network = dataclasses.replace(load_cluster(CLUSTERS / "dgx1v-x2.yaml"), inter_node_default=None)
    with pytest.raises(PlanInfeasible, match="dgx1.gpu0 cannot be reached"):
        plan_collective(no_network, ["dgx0.gpu0", "dgx1.gpu0"])


def test_a_group_of_one_needs_no_collective():
    collective = plan_collective(DGX, ["gpu3"])
    assert collective.trees == () and collective.root == "gpu3" and collective.rate_gbps == 0
    assert allreduce_time_s(DGX, collective, 1e9) == 0.0
    assert ring_allreduce_time_s(DGX, ["gpu3"], 1e9) == 0.0


def _pair_cluster(
    *links: tuple[str, str, float, float],
    kind: DeviceKind = DeviceKind.CUDA,
    model: str = "x",
    models: dict[str, str] | None = None,
) -> ClusterSpec:
    """Devices joined by ``(a, b, GB/s, latency us)`` both ways: GPUs by default, whose links alone
    price a tree allreduce (on CPU slots its messages' CPU may outlast them); each of ``model``,
    or of its own in ``models``."""
    names = sorted({x for link in links for x in link[:2]})
    devices = tuple(
        Device(name=n, kind=kind, model=(models or {}).get(n, model), tflops=1.0, memory_gb=1.0) for n in names
    )
    return ClusterSpec(
        name="hand",
        nodes=(Node(name="n", devices=devices),),
        links=tuple(
            Link(src=s, dst=d, bandwidth_gbps=gbps, latency_us=lat, type=LinkType.PCIE)
            for a, b, gbps, lat in links
            for s, d in ((a, b), (b, a))
        ),
    )


def test_time_formulas_on_hand_computed_groups():
    pair = _pair_cluster(("a", "b", 10.0, 5.0))
    collective = plan_collective(pair, ["a", "b"])
    # n = 2: ring 2(n-1)/n * N / 10 GB/s + 2(n-1) * 5 us; trees: reduce and broadcast overlap on the two directions.
    # Pieces of 1 MiB: the last one climbs 0 hops after the leaf's last send and comes down 1.
    piece = 2**20
    assert ring_allreduce_time_s(pair, ["a", "b"], 1e9) == pytest.approx(0.1 + 10e-6)
    assert allreduce_time_s(pair, collective, 1e9) == pytest.approx(0.1 + 10e-6 + 1 * piece / 10e9)
    chain = _pair_cluster(("a", "b", 20.0, 2.0), ("b", "c", 20.0, 3.0))
    collective = plan_collective(chain, ["a", "b", "c"], root="a")
    assert collective.rate_gbps == pytest.approx(20.0) and collective.ring_gbps == 0.0
    # Two hops deep: the last piece waits one hop up and two down.
    assert allreduce_time_s(chain, collective, 1e9) == pytest.approx(
        1e9 / 20e9 + 2 * (2 + 3) * 1e-6 + (1 + 2) * piece / 20e9
    )
    with pytest.raises(PlanInfeasible, match="no ring"):
        ring_allreduce_time_s(chain, ["a", "b", "c"], 1e9)


def test_two_dgx1v_three_phase_trees():
    cluster = load_cluster(CLUSTERS / "dgx1v-x2.yaml")
    rooted = plan_collective(
        dataclasses.replace(cluster, intra_node_default=None), cluster.device_names, root="dgx1.gpu2"
    )
    assert rooted.root == "dgx1.gpu2" and rooted.rate_gbps == pytest.approx(12.5)
    assert rooted.trees[0].edges[0][0] == "dgx1.gpu2"
    collective = plan_collective(cluster, cluster.device_names)  # identical servers: one packing serves both
    assert_valid(cluster, collective)
    assert collective.rate_gbps == pytest.approx(12.5) and collective.bound_gbps == pytest.approx(12.5)
    assert len(collective.trees) <= 16
    # two servers: the broadcast crosses one way and the reduce the other, each NIC busy once per direction
    # plus the pipeline's fill: twice the deepest latency (<= 7 PCIe-or-NVLink hops per server + the network)
    # and the pieces' (of 1 MiB: a light tree moves its pieces slowly, so its depth costs many)
    pieces_s = tree_allreduce_cost(cluster, collective).piece_hops * 2**20 / 12.5e9
    assert pieces_s > 0
    assert (
        1e9 / 12.5e9 < allreduce_time_s(cluster, collective, 1e9) <= 1e9 / 12.5e9 + 2 * (14 * 8 + 5) * 1e-6 + pieces_s
    )
    assert ring_allreduce_time_s(cluster, cluster.device_names, 1e9) == pytest.approx(
        2 * 15 / 16 * 1e9 / 12.5e9 + 2 * 15 * 5e-6
    )


def test_64_servers_of_8_gpus_plan_in_seconds():
    spec = importlib.util.spec_from_file_location("generate", CLUSTERS / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    cluster = dataclasses.replace(generate.dgx1v(64), intra_node_default=None)
    started = time.perf_counter()
    collective = plan_collective(cluster, cluster.device_names)
    elapsed = time.perf_counter() - started
    assert elapsed < 5.0
    assert len(collective.devices) == 512 and len(collective.trees) <= 8
    assert all(len(tree.edges) == 511 for tree in collective.trees)
    assert collective.rate_gbps == pytest.approx(12.5)
    assert allreduce_time_s(cluster, collective, 1e9) > 0


def test_mixed_cluster_loads_and_plans():
    cluster = load_cluster(CLUSTERS / "mixed.yaml")
    assert len(cluster.devices) == 24
    a100 = [d.name for d in cluster.nodes[0].devices]
    local = plan_collective(cluster, a100, min_share=1.0, for_allreduce=False)
    assert local.rate_gbps == pytest.approx(300.0)  # 3 peers x 4 NVLinks x 25 GB/s
    everything = plan_collective(cluster, cluster.device_names)
    assert_valid(cluster, everything)
    assert everything.rate_gbps == pytest.approx(3.125)  # 25 Gb/s Ethernet between nodes


def test_a_server_whose_part_is_disconnected_is_named():
    cluster = dataclasses.replace(load_cluster(CLUSTERS / "dgx1v-x2.yaml"), intra_node_default=None)
    with pytest.raises(PlanInfeasible, match=r"on dgx1 \(dgx1.gpu0, dgx1.gpu5\) are not connected"):
        plan_collective(cluster, ["dgx0.gpu0", "dgx0.gpu1", "dgx1.gpu0", "dgx1.gpu5"])


def test_a_server_behind_a_narrow_nic_bounds_the_three_phase_rate():
    """The L4 server of h100-a10g-l4.yaml receives through a 3.125 GB/s NIC: the trees cannot
    broadcast faster than that. The chain's hop into it was priced at the link's 12.5 GB/s, so
    `plan collectives` printed a rate of 12.5 over a min-cut bound of 3.125 ("4x the ring")."""
    cluster = load_cluster(CLUSTERS / "h100-a10g-l4.yaml")
    collective = plan_collective(cluster, cluster.device_names)
    assert collective.rate_gbps <= collective.bound_gbps * (1 + 1e-9)
    assert collective.rate_gbps == pytest.approx(3.125)


# --- trees packed for the allreduce itself (two-way) ------------------------------------------
FRAGMENT = _pair_cluster(  # plans/testbeds/dgx1v-fragment.yaml: 100 out and 100 in at gpu0 and gpu1
    ("g0", "g1", 25.0, 10.0),
    ("g0", "g2", 25.0, 10.0),
    ("g0", "g3", 50.0, 10.0),
    ("g1", "g2", 50.0, 10.0),
    ("g1", "g3", 25.0, 10.0),
    ("g2", "g3", 50.0, 10.0),
)


def _pair(there: float, back: float) -> ClusterSpec:
    """Two of the fragment's GPUs joined by ``there`` GB/s g0 -> g1 and ``back`` g1 -> g0."""
    return ClusterSpec(
        name="hand",
        nodes=(Node(name="n", devices=FRAGMENT.nodes[0].devices[:2]),),
        links=(
            Link(src="g0", dst="g1", bandwidth_gbps=there, latency_us=1.0, type=LinkType.PCIE),
            Link(src="g1", dst="g0", bandwidth_gbps=back, latency_us=1.0, type=LinkType.PCIE),
        ),
    )


def test_the_bound_of_any_allreduce_counts_every_transfer_not_the_broadcasts_cut():
    names = list(FRAGMENT.device_names)
    graph = capacity_graph(FRAGMENT, names)
    assert min_cut_bound(graph, "g0")[0] == pytest.approx(100.0)  # a broadcast from g0 reaches 100
    # four parties need six transfers per element over 2 x 225 GB/s of links: 75
    assert allreduce_bound(graph) == pytest.approx(75.0)
    one_way_narrow = _pair(10.0, 4.0)
    assert allreduce_bound(capacity_graph(one_way_narrow, ["g0", "g1"])) == pytest.approx(4.0)  # each way


def test_trees_packed_for_the_allreduce_reach_its_bound_where_the_broadcasts_reach_two_thirds():
    broadcast = plan_collective(FRAGMENT, FRAGMENT.device_names, for_allreduce=False)
    assert broadcast.rate_gbps == pytest.approx(100.0)
    assert allreduce_throughput_gbps(FRAGMENT, broadcast) == pytest.approx(50.0)
    collective = plan_collective(FRAGMENT, FRAGMENT.device_names)
    assert_valid(FRAGMENT, collective)
    assert not collective.reduce_trees  # the reduce runs up the same trees
    assert allreduce_throughput_gbps(FRAGMENT, collective) == pytest.approx(75.0)
    assert len(collective.trees) <= 4
    assert allreduce_time_s(FRAGMENT, collective, 1e9) < allreduce_time_s(FRAGMENT, broadcast, 1e9) / 1.4


@pytest.mark.parametrize("cluster,devices", GROUPS, ids=lambda x: ",".join(x) if isinstance(x, tuple) else x.name)
def test_the_allreduce_trees_are_never_slower_than_the_broadcasts_nor_beat_the_bound(cluster, devices):
    collective = plan_collective(cluster, devices)
    assert_valid(cluster, collective)
    x = allreduce_throughput_gbps(cluster, collective)
    assert x >= allreduce_throughput_gbps(cluster, plan_collective(cluster, devices, for_allreduce=False)) * (1 - EPS)
    assert x <= allreduce_bound(capacity_graph(cluster, devices)) * (1 + EPS)


def _ring_of_three(fast: float, slow: float) -> ClusterSpec:
    """plans/testbeds/asymmetric.yaml's shape: ``fast`` round the ring a -> b -> c -> a, ``slow`` back."""
    devices = tuple(Device(name=n, kind=DeviceKind.CPU, model="x", tflops=1.0, memory_gb=1.0) for n in ("a", "b", "c"))
    links = [("a", "b", fast), ("b", "c", fast), ("c", "a", fast), ("b", "a", slow), ("c", "b", slow), ("a", "c", slow)]
    return ClusterSpec(
        name="hand",
        nodes=(Node(name="n", devices=devices),),
        links=tuple(Link(src=s, dst=d, bandwidth_gbps=g, latency_us=1.0, type=LinkType.PCIE) for s, d, g in links),
    )


def test_where_links_differ_by_direction_the_reduce_and_broadcast_trees_are_packed_together():
    # 80 round the ring one way, 10 back. Each family packed alone reaches 90, and together they
    # moved the allreduce at 45; packed together for it from one root, at 50.
    ring = _ring_of_three(80.0, 10.0)
    graph = capacity_graph(ring, ["a", "b", "c"])
    down, up, rates = pack_up_and_down(graph, ["a"])
    assert sum(rates.values()) == pytest.approx(50.0)  # from one root: a's links in and out bound it
    assert allreduce_bound(graph) == pytest.approx(67.5)
    # A root per part of the sum, as a ring's reduce-scatter and all-gather: at the bound.
    down, up, rates = pack_up_and_down(graph, ["a", "b", "c"])
    assert sum(rates.values()) == pytest.approx(67.5) and len(rates) == 3
    for family in (down, up):  # each root's trees carry its rate
        for root, rate in rates.items():
            assert sum(w for t, w in family.items() if tree_root(t) == root) == pytest.approx(rate)
    # The thin ways are left to the acknowledgements of the wide ones (measured: trees loading
    # them ran at 0.59 of the bound, without them as priced): the three chains of the fast ring.
    collective = plan_collective(ring, ["a", "b", "c"], root="a")
    assert_valid(ring, collective)
    assert collective.root == "a" and len({t.root for t in collective.trees}) == 3
    assert allreduce_throughput_gbps(ring, collective) == pytest.approx(60.0)
    loaded = {edge for t in collective.trees for edge in t.edges}
    loaded |= {(child, parent) for t in collective.reduce_trees for parent, child in t.edges}
    assert loaded == {("a", "b"), ("b", "c"), ("c", "a")}


def test_links_thinner_back_but_not_by_much_are_all_loaded():
    ring = _ring_of_three(80.0, 40.0)
    collective = plan_collective(ring, ["a", "b", "c"])
    assert_valid(ring, collective)
    bound = allreduce_bound(capacity_graph(ring, ["a", "b", "c"]))
    assert allreduce_throughput_gbps(ring, collective) == pytest.approx(bound)


def test_a_small_buffer_pays_the_pieces_fill_the_runtime_cuts_it_into():
    """256 MiB over a 3-hop chain goes in the runtime's largest pieces, 1 MiB: the last piece
    reaches the root 2 pieces' time after the deepest leaf's last send and comes down 3 hops, so
    the allreduce takes 5 pieces' time beyond N / X; 16 MiB is cut into 128 pieces of 128 KiB, a
    buffer of 160 KiB into pieces of the smallest size, 64 KiB, and each pays 5 of its pieces.
    Before, all were priced N / X."""
    from felactl.spec.plan import tree_piece_bytes

    chain = _pair_cluster(("a", "b", 1.0, 0.0), ("b", "c", 1.0, 0.0), ("c", "d", 1.0, 0.0))
    collective = plan_collective(chain, ["a", "b", "c", "d"], root="a")
    assert len(collective.trees) == 1
    for num_bytes, piece in ((256 * 2**20, 2**20), (16 * 2**20, 128 * 2**10), (160 * 2**10, 64 * 2**10)):
        assert tree_piece_bytes(num_bytes, 1) == piece
        assert allreduce_time_s(chain, collective, num_bytes) == pytest.approx((num_bytes + 5 * piece) / 1e9)


def _shallow_and_deep_trees_cost():
    """Over a, b, c with links of 1 GB/s: a shallow tree (a -> b, a -> c) of weight 3 and a deep
    one (a -> b -> c) of weight 1."""
    chain = _pair_cluster(("a", "b", 1.0, 0.0), ("b", "c", 1.0, 0.0), ("a", "c", 1.0, 0.0))
    deep = Tree(edges=(("a", "b"), ("b", "c")), weight=1.0)
    shallow = Tree(edges=(("a", "b"), ("a", "c")), weight=3.0)
    collective = Collective(
        group="g",
        devices=("a", "b", "c"),
        root="a",
        trees=(shallow, deep),
        rate_gbps=4.0,
        bound_gbps=4.0,
        ring_gbps=0.0,
    )
    return tree_allreduce_cost(chain, collective)


def test_the_fill_of_unequal_trees_is_set_by_the_tree_slowest_for_its_depth():
    """Two trees of weights 3 and 1: the lighter carries a quarter of the data at a quarter of the
    rate, so each of its pieces takes 4 pieces' time at the whole rate; its depth is what counts."""
    cost = _shallow_and_deep_trees_cost()
    # up: the deep tree (2 - 1) hops at 4x; down: the deep tree 2 hops at 4x.
    assert cost.piece_hops == pytest.approx(1 * 4 + 2 * 4)
    assert cost.num_trees == 2


def test_a_buffer_of_few_pieces_pays_only_for_the_trees_it_is_dealt_to():
    """The runtime deals pieces by weight (``spec.plan.deal``): two pieces over trees of weights 3
    and 1 both go to the heavy, shallow tree, so the light tree's depth costs nothing and the
    heavy one moves all the bytes at its share of the rate. (Priced as if every tree had pieces,
    a 3-device plan of a small model took the ring over its trees: the rescale test's.)"""
    from felactl.spec.plan import deal, tree_piece_bytes

    cost = _shallow_and_deep_trees_cost()
    rate = cost.rate_gbps * 1e9
    small = 128 * 2**10
    piece = tree_piece_bytes(small, 2)
    assert piece == 64 * 2**10 and deal([3.0, 1.0], 2) == [0, 0]
    # the shallow tree alone: its 3/4 of the rate, reduce 0 hops beyond the first, broadcast 1
    assert cost.seconds(small) == pytest.approx((small / 0.75 + (0 + 1 / 0.75) * piece) / rate)
    # every tree dealt its share: the whole rate, and the deep tree's fill (1 and 2 hops at 4x)
    big = 64 * 2**20
    assert cost.seconds(big) == pytest.approx((big + (1 * 4 + 2 * 4) * tree_piece_bytes(big, 2)) / rate)


def test_each_root_s_reduce_trees_carry_its_share_of_the_pieces_whatever_their_weights_add_to():
    """The runtime deals a root the pieces its broadcast trees' rate gives it, then sends them up
    that root's reduce trees: a reduce tree's load is its root's share, not its weight over all
    reduce trees' (which would price this collective at 80 / 1.5 instead of 80 / 1.75)."""
    ring = _ring_of_three(80.0, 10.0)
    collective = Collective(
        group="g",
        devices=("a", "b", "c"),
        root="a",
        trees=(Tree(edges=(("a", "b"), ("b", "c")), weight=3.0), Tree(edges=(("b", "c"), ("c", "a")), weight=1.0)),
        reduce_trees=(  # data b -> c -> a into a, c -> a -> b into b: equal weights, unequal shares
            Tree(edges=(("a", "c"), ("c", "b")), weight=10.0),
            Tree(edges=(("b", "a"), ("a", "c")), weight=10.0),
        ),
        rate_gbps=4.0,
        bound_gbps=4.0,
        ring_gbps=80.0,
    )
    # b -> c carries a's broadcast (3/4), b's (1/4) and a's reduce (3/4)
    assert allreduce_throughput_gbps(ring, collective) == pytest.approx(80.0 / 1.75)


def test_a_thin_way_that_is_the_only_way_back_is_kept():
    pair = _pair(10.0, 1.0)
    collective = plan_collective(pair, ["g0", "g1"])
    assert_valid(pair, collective)
    assert allreduce_throughput_gbps(pair, collective) == pytest.approx(1.0)  # each byte crosses each way


def test_on_cpu_slots_a_tree_allreduce_takes_at_least_its_busiest_slot_s_messages_cpu():
    """16 MiB over the chain a -> b -> c -> d goes in 128 pieces of 128 KiB; per piece b sends or
    receives once over each of its 2 edges going up and again coming down (512 messages), a leaf 2
    (256). On GPUs the links alone price it. On CPU slots each message costs
    TREE_MESSAGE_CPU_S + piece * TREE_CPU_S_PER_BYTE of a core: a full core's b outlasts links of
    1 GB/s, and a slot held to a tenth of a core pays ten times its messages. (Priced by the links
    alone, 16 MiB over trees on the one-slow testbed measured 3x its price.)"""
    from felactl.optimizer.tree_cost import TREE_CPU_S_PER_BYTE, TREE_MESSAGE_CPU_S

    links = (("a", "b", 1.0, 0.0), ("b", "c", 1.0, 0.0), ("c", "d", 1.0, 0.0))
    gpus, cores = _pair_cluster(*links), _pair_cluster(*links, kind=DeviceKind.CPU)
    collective = plan_collective(gpus, ["a", "b", "c", "d"], root="a")
    num_bytes, piece = 16 * 2**20, 128 * 2**10
    per_message = TREE_MESSAGE_CPU_S + piece * TREE_CPU_S_PER_BYTE
    assert allreduce_time_s(gpus, collective, num_bytes) == pytest.approx((num_bytes + 5 * piece) / 1e9)
    assert allreduce_time_s(cores, collective, num_bytes) == pytest.approx(
        max((num_bytes + 5 * piece) / 1e9, 512 * per_message)
    )
    tenth = _pair_cluster(*links, kind=DeviceKind.CPU, model="Xeon @ 0.1 cores")
    assert allreduce_time_s(tenth, collective, num_bytes) == pytest.approx(10 * 512 * per_message)


def test_trees_whose_messages_outlast_a_slow_slot_s_ring_give_way_to_the_ring():
    """Four CPU slots joined evenly at 50 MB/s (the one-slow testbed), the last held to 0.12 of a
    core: trees and the ring are priced with the slots' CPU, and the cost model sums 16 MiB over
    the ring, as measured there (trees 0.54 s, gloo's ring 0.53 s; BENCHMARKS.md "Trees at run
    time"). Priced by links alone the trees looked 1.5x faster than the ring. The same four at a
    full core each keep the trees."""
    from felactl.optimizer.cost import CostModel
    from tests.planner_fixtures import model as model_profile

    names = ("fast0", "fast1", "fast2", "slow")
    links = tuple(
        Link(src=a, dst=b, bandwidth_gbps=0.05, latency_us=50.0, type=LinkType.NET)
        for a, b in itertools.permutations(names, 2)
    )

    def cluster(slow_model: str) -> ClusterSpec:
        devices = tuple(
            Device(name=n, kind=DeviceKind.CPU, model=slow_model if n == "slow" else "Xeon", tflops=0.1, memory_gb=1.0)
            for n in names
        )
        return ClusterSpec(name="one-slow", nodes=(Node(name="n", devices=devices),), links=links)

    model = model_profile([(4_000_000, 1000, 1e7)])
    num_bytes = 16 * 2**20
    even = CostModel(cluster("Xeon"), model)
    assert even.tree_sync_s(names, num_bytes) < even.ring_sync_s(names, num_bytes) / 1.3
    slow = CostModel(cluster("Xeon @ 0.12 cores"), model)
    assert slow.tree_sync_s(names, num_bytes) > slow.ring_sync_s(names, num_bytes)
    assert slow._link_sync_s(names, num_bytes) == pytest.approx(slow.ring_sync_s(names, num_bytes))


def _triangle(links: dict) -> ClusterSpec:
    devices = tuple(Device(name=n, kind=DeviceKind.CUDA, model="x", tflops=1.0, memory_gb=1.0) for n in "abc")
    return ClusterSpec(
        name="hand",
        nodes=(Node(name="n", devices=devices),),
        links=tuple(
            Link(src=s, dst=d, bandwidth_gbps=g, latency_us=1.0, type=LinkType.PCIE) for (s, d), g in links.items()
        ),
    )


def test_trees_over_a_link_left_to_acknowledgements_give_way_to_slower_trees_priced_above_what_such_trees_measured():
    """c -> b is 10x thinner than b -> c, so it carries b -> c's acknowledgements and trees that
    load it measured 0.6 of their price (ACKNOWLEDGED_RATE_MEASURED). Where trees avoiding it are
    priced at 10 against 12 for trees over it, they are taken: 10 beats 0.6 * 12. Where avoiding it
    leaves 3 against 13 (c's only other way out is 3 wide), the trees over it stay: 3 does not."""
    from felactl.optimizer.collectives import ACKNOWLEDGED_RATE_MEASURED

    def chosen(links: dict) -> tuple[float, bool]:
        cluster = _triangle(links)
        collective = plan_collective(cluster, ["a", "b", "c"])
        assert_valid(cluster, collective)
        loads_thin = any(("c", "b") in t.edges for t in collective.trees) or any(
            ("b", "c") in t.edges
            for t in collective.reduce_trees  # a reduce edge (b, c) sends c -> b
        )
        return allreduce_throughput_gbps(cluster, collective), loads_thin

    assert ACKNOWLEDGED_RATE_MEASURED * 12 < 10
    rate, loads_thin = chosen(
        {("a", "b"): 10, ("b", "a"): 10, ("a", "c"): 80, ("c", "a"): 20, ("b", "c"): 20, ("c", "b"): 2}
    )
    assert rate == pytest.approx(10.0) and not loads_thin
    rate, loads_thin = chosen(
        {("a", "b"): 10, ("b", "a"): 10, ("a", "c"): 10, ("c", "a"): 3, ("b", "c"): 100, ("c", "b"): 20}
    )
    assert rate == pytest.approx(13.0) and loads_thin


@pytest.mark.parametrize("count", [1, 2, 3, 7, 128])
def test_the_messages_priced_per_slot_are_those_the_runtime_sends_and_receives(count):
    """Two roots, reduce trees that differ from the broadcast trees and weights that leave a tree
    no piece of a short buffer: each slot's priced messages (its edges in each tree times the pieces
    dealt to that tree) equal what the runtime's walks (``agents.worker.sync.trees._walks``) send
    and receive on that rank: per piece, one receive per child and one send to the parent."""
    from felactl.agents.worker.sync.trees import _Tree, _walks
    from felactl.optimizer.tree_cost import TREE_CPU_S_PER_BYTE, TREE_MESSAGE_CPU_S, tree_allreduce_cost
    from felactl.spec.plan import root_rates, tree_piece_bytes

    names = ("a", "b", "c", "d")
    links = tuple((x, y, 1.0, 0.0) for x, y in itertools.combinations(names, 2))
    collective = Collective(
        group="g",
        devices=names,
        root="a",
        trees=(
            Tree(edges=(("a", "b"), ("b", "c"), ("c", "d")), weight=3.0),
            Tree(edges=(("a", "c"), ("a", "d"), ("d", "b")), weight=1.0),
            Tree(edges=(("b", "a"), ("a", "c"), ("a", "d")), weight=2.0),
        ),
        reduce_trees=(
            Tree(edges=(("a", "d"), ("d", "c"), ("c", "b")), weight=4.0),
            Tree(edges=(("b", "c"), ("c", "d"), ("d", "a")), weight=2.0),
        ),
        rate_gbps=6.0,
        bound_gbps=6.0,
        ring_gbps=0.0,
    )
    rank = {name: i for i, name in enumerate(names)}

    def runtime_trees(trees, me):
        return [
            _Tree(
                t.weight,
                next((rank[p] for p, c in t.edges if c == me), None),
                tuple(rank[c] for p, c in t.edges if p == me),
                rank[t.root],
            )
            for t in trees
        ]

    roots = [(rank[root], rate) for root, rate in root_rates([(t.root, t.weight) for t in collective.trees])]
    piece = 64 * 2**10
    num_bytes = count * piece
    assert tree_piece_bytes(num_bytes, 3) == piece
    for me in names:  # each slot in turn held to a hundredth of a core, so that its messages are the busiest
        sent_or_received = sum(
            len(order) * (len(tree.children) + (tree.parent is not None))
            for trees in (collective.reduce_trees, collective.trees)
            for tree, order in _walks(runtime_trees(trees, me), roots, count)
        )
        assert sent_or_received > 0
        slow = _pair_cluster(*links, kind=DeviceKind.CPU, models={me: "x @ 0.01 cores"})
        device, seconds = tree_allreduce_cost(slow, collective).busiest_cpu(num_bytes)
        assert device == me
        assert seconds == pytest.approx(100 * sent_or_received * (TREE_MESSAGE_CPU_S + piece * TREE_CPU_S_PER_BYTE))


def test_the_cost_model_stretches_the_trees_cpu_on_a_slot_slowed_without_a_quota():
    """A slot that timed its matmul at half the rate the model profile was timed at (a busy VM,
    no cgroup naming a quota) does its host work at half speed (``CostModel.host_slowdown``), its
    tree messages included: the cost model prices them so; the cluster alone cannot see it
    (``tree_cost.cpu_slowdown``: 1)."""
    from felactl.optimizer.cost import CostModel
    from felactl.optimizer.tree_cost import tree_allreduce_cost
    from tests.planner_fixtures import model as model_profile

    links = (("a", "b", 1.0, 0.0), ("b", "c", 1.0, 0.0), ("c", "d", 1.0, 0.0))
    cluster = _pair_cluster(*links, kind=DeviceKind.CPU)  # every slot timed at 1 TFLOP/s
    group, num_bytes = ("a", "b", "c", "d"), 16 * 2**20
    timed_at_two = dataclasses.replace(model_profile([(4_000_000, 1000, 1e7)]), timed_tflops={"x": 2.0})
    cost = CostModel(cluster, timed_at_two)
    alone = tree_allreduce_cost(cluster, cost.collective(group))
    assert alone.busiest_cpu(num_bytes)[1] > alone.links_seconds(num_bytes)  # the CPU decides
    assert cost.tree_sync_s(group, num_bytes) == pytest.approx(
        alone.latency_s + 2 * alone.busiest_cpu(num_bytes)[1], rel=1e-6
    )


def test_the_recorded_bound_is_that_of_the_trees_own_root():
    # One-way links of several widths: the trees packed for the allreduce grow from g2, whose
    # broadcast reaches at most 12.5 GB/s; the bound recorded was the first packing root's, 25.
    from tests.graph_fixtures import random_strong_graph

    cluster = random_strong_graph(30)
    devices = list(cluster.device_names)
    collective = plan_collective(cluster, devices)
    graph = capacity_graph(cluster, devices)
    assert collective.bound_gbps == pytest.approx(min_cut_bound(graph, collective.root)[0])
    assert collective.rate_gbps <= collective.bound_gbps * (1 + EPS)


def _two_servers_behind_nics(nic_gbps: float) -> ClusterSpec:
    """Two servers of two devices, every device linked to every device of the other server at
    10 GB/s, each server behind one network interface of ``nic_gbps``."""
    from tests.planner_fixtures import cluster

    spec = cluster([[("g", 10.0, 16.0)] * 2] * 2, intra_gbps=50.0, inter_gbps=10.0)
    return dataclasses.replace(spec, nodes=tuple(dataclasses.replace(n, nic_gbps=nic_gbps) for n in spec.nodes))


def test_no_allreduce_beats_what_the_servers_network_interfaces_carry():
    # Four 10 GB/s links each way between the servers, but each server sends and receives 10
    # through its one NIC: across the two servers an allreduce moves 2 x 10 / 2 = 10, not 40.
    spec = _two_servers_behind_nics(10.0)
    devices = list(spec.device_names)
    bound = allreduce_bound(capacity_graph(spec, devices))
    assert bound == pytest.approx(10.0)
    rates = allreduce_rates(spec, plan_collective(spec, devices))
    assert rates["allreduce_bound_gbps"] == pytest.approx(10.0)
    assert rates["allreduce_gbps"] <= rates["allreduce_bound_gbps"] * (1 + EPS)
    # without interfaces the four links each way do carry 40
    free = dataclasses.replace(spec, nodes=tuple(dataclasses.replace(n, nic_gbps=None) for n in spec.nodes))
    assert allreduce_bound(capacity_graph(free, devices)) == pytest.approx(40.0)


def test_eight_dgx1v_gpus_pack_for_the_allreduce_with_one_ilp_each_way(monkeypatch):
    """Packing all 8 DGX-1V GPUs took 14 s once the two-way trees were added (2 s before): the
    two-way packing ran the fewest-trees ILP (21 trees, thrown away: more than 8) and then the
    most-rate ILP. Now the most rate of 8 trees says first whether 8 can carry the share, and the
    trees are as good as before: 95 GB/s of allreduce over 8 trees."""
    from felactl.optimizer import broadcast_trees, collectives, packing

    solved = []
    real = packing._solve
    monkeypatch.setattr(
        packing, "_solve", lambda problem, what, *a, **k: solved.append(what) or real(problem, what, *a, **k)
    )
    broadcast_trees._pack_signature.cache_clear()
    collectives._pack_two_way_signature.cache_clear()
    collective = plan_collective(DGX, DGX.device_names)
    assert_valid(DGX, collective)
    assert len(collective.trees) <= 8
    assert allreduce_throughput_gbps(DGX, collective) == pytest.approx(95.0)
    ilps = [what for what in solved if "ILP" in what]
    assert ilps == ["fewest-trees ILP", "most-rate ILP"]  # the broadcast's, the allreduce's


def test_the_pricing_arborescence_is_the_cheapest():
    """The column generation's own Chu-Liu/Edmonds gives arborescences as cheap as networkx's."""
    import networkx as nx

    from felactl.optimizer.arborescences import min_cost_arborescence

    rng = random.Random(7)
    for _ in range(200):
        n = rng.randint(2, 9)
        graph = nx.DiGraph()
        graph.add_nodes_from(range(n))
        for v in range(1, n):
            graph.add_edge(rng.randrange(v), v)  # every node reachable from 0
        for _ in range(rng.randint(0, n * n)):
            a, b = rng.sample(range(n), 2)
            graph.add_edge(a, b)
        cost = {e: rng.choice([0.0, 0.5, 1.0, rng.random() * 10]) for e in graph.edges}
        tree = min_cost_arborescence(graph, 0, cost)
        assert len(tree) == n - 1 and {v for _, v in tree} == set(range(1, n))
        assert all(graph.has_edge(*e) for e in tree) and nx.is_arborescence(nx.DiGraph(list(tree)))
        weighted = nx.DiGraph()
        weighted.add_weighted_edges_from((u, v, cost[(u, v)]) for u, v in graph.edges if v != 0)
        best = nx.minimum_spanning_arborescence(weighted)
        assert sum(cost[e] for e in tree) == pytest.approx(sum(d["weight"] for _, _, d in best.edges(data=True)))
