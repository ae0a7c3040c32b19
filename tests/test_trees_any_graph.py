"""Trees on any graph (issue 14, item 3): one-way links, asymmetric links, servers joined by one
device-to-device link; the broadcast reaches the min-cut bound and the allreduce packs trees for
the reduce direction too."""

from __future__ import annotations

import dataclasses
import json
import math

import networkx as nx
import pytest
from typer.testing import CliRunner

from felactl.cli.main import app
from felactl.optimizer.collectives import plan_collective, reversed_cluster
from felactl.optimizer.cost import CostModel
from felactl.optimizer.graph import allreduce_bound, capacity_graph
from felactl.optimizer.planner import make_plan
from felactl.optimizer.tree_cost import allreduce_throughput_gbps, allreduce_time_s
from felactl.spec import save
from tests.graph_fixtures import graph_cluster, random_strong_graph
from tests.planner_fixtures import as_cpu_slots, model

SEEDS = range(38)  # one-way, asymmetric, two servers over one link, switched (graph_fixtures)


def _bound(cluster, root) -> float:
    """The broadcast min-cut bound from ``root`` over every link of the group (Edmonds)."""
    graph = capacity_graph(cluster, cluster.device_names)
    return min(nx.maximum_flow_value(graph, root, v) for v in graph if v != root)


@pytest.mark.parametrize("seed", SEEDS)
def test_random_strongly_connected_graphs_get_trees_at_the_bound(seed):
    cluster = random_strong_graph(seed)
    coll = plan_collective(cluster, cluster.device_names, for_allreduce=False)  # the broadcast's packing
    assert coll.rate_gbps >= 0.98 * _bound(cluster, coll.root)
    # The allreduce: between min(R, R_reduce) / 2 and min(R, R_reduce) (the module's claim).
    reduce_bound = _bound(reversed_cluster(cluster), coll.root)
    x = allreduce_throughput_gbps(cluster, coll)
    assert min(coll.rate_gbps, reduce_bound) / 2 * (1 - 1e-6) <= x <= min(coll.rate_gbps, reduce_bound) * (1 + 1e-6)
    assert math.isfinite(allreduce_time_s(cluster, coll, 1e8))
    # The trees plan_collective gives (two-way where faster): never slower, never past any allreduce's bound.
    best = allreduce_throughput_gbps(cluster, plan_collective(cluster, cluster.device_names))
    bound = allreduce_bound(capacity_graph(cluster, cluster.device_names))
    assert x * (1 - 1e-6) <= best and (bound is None or best <= bound * (1 + 1e-6))


@pytest.mark.parametrize("seed", SEEDS[::3])
def test_random_strongly_connected_graphs_get_a_plan(seed):
    plan = make_plan(random_strong_graph(seed), model([(1_000_000, 4096, 2e6)] * 3), 64)
    assert plan.predicted.iteration_s > 0


def _two_servers(one_node: bool):
    """Two 3-GPU servers, NVLink among each, joined by one 12.5 GB/s link each way: a2 <-> b1."""
    a = [(f"a{i}", "H", 30.0) for i in range(3)]
    b = [(f"b{i}", "H", 30.0) for i in range(3)]
    links = [(x, y, 50.0) for part in (a, b) for x, _, _ in part for y, _, _ in part if x != y]
    links += [("a2", "b1", 12.5), ("b1", "a2", 12.5)]
    return graph_cluster([a + b] if one_node else [a, b], links)


def test_two_servers_over_one_device_link_are_connected():
    split, joined = (
        plan_collective(_two_servers(False), [f"{s}{i}" for s in "ab" for i in range(3)]),
        plan_collective(_two_servers(True), [f"{s}{i}" for s in "ab" for i in range(3)]),
    )
    assert split.rate_gbps == pytest.approx(12.5) == pytest.approx(joined.rate_gbps)
    assert split.bound_gbps == pytest.approx(12.5)
    assert allreduce_throughput_gbps(_two_servers(False), split) == pytest.approx(12.5)


def test_asymmetric_links_pack_trees_for_the_reduce():
    """Wide links one way round a ring of 4, thin ones back: reducing up the broadcast trees would
    send everything over the thin links; trees packed for the reduce use the wide ones."""
    names = [f"g{i}" for i in range(4)]
    links = [(names[i], names[(i + 1) % 4], 50.0) for i in range(4)]
    links += [(names[(i + 1) % 4], names[i], 5.0) for i in range(4)]
    cluster = graph_cluster([[(n, "H", 30.0) for n in names]], links)
    coll = plan_collective(cluster, names)
    assert coll.reduce_trees
    reversed_only = allreduce_throughput_gbps(cluster, dataclasses.replace(coll, reduce_trees=()))
    assert allreduce_throughput_gbps(cluster, coll) >= 2 * reversed_only


def test_plan_collectives_size_mb_on_one_way_links(tmp_path):
    cluster = graph_cluster(
        [[(f"g{i}", "H", 30.0) for i in range(5)]], [(f"g{i}", f"g{(i + 1) % 5}", 25.0) for i in range(5)]
    )
    save(cluster, tmp_path / "c.yaml")
    result = CliRunner().invoke(
        app, ["plan", "collectives", "--cluster", str(tmp_path / "c.yaml"), "--size-mb", "100", "--json"]
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["allreduce_s"] > 0 and data["ring_allreduce_s"] > 0


def test_plan_collectives_size_mb_where_only_broadcast_trees_exist(tmp_path):
    """g0 reaches everyone, nobody reaches g0: broadcast trees, no reduce; the command still answers."""
    cluster = graph_cluster(
        [[(f"g{i}", "H", 30.0) for i in range(3)]], [("g0", "g1", 25.0), ("g1", "g2", 25.0), ("g2", "g1", 25.0)]
    )
    save(cluster, tmp_path / "c.yaml")
    result = CliRunner().invoke(
        app,
        ["plan", "collectives", "--cluster", str(tmp_path / "c.yaml"), "--root", "g0", "--size-mb", "100", "--json"],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["allreduce_s"] is None and data["ring_allreduce_s"] is None and data["trees"]
    assert "g0" in data["no_allreduce"]


def test_groups_of_one_shape_share_their_reduce_trees_renamed():
    """Two servers alike, each a ring wide one way and thin back: the second server's group reuses
    the first one's packing, reduce trees included, under its own device names."""
    links = []
    for s in "ab":
        names = [f"{s}{i}" for i in range(4)]
        links += [(names[i], names[(i + 1) % 4], 50.0) for i in range(4)]
        links += [(names[(i + 1) % 4], names[i], 5.0) for i in range(4)]
    cluster = as_cpu_slots(graph_cluster([[(f"{s}{i}", "H", 30.0) for i in range(4)] for s in "ab"], links))
    cost = CostModel(cluster, model([(1_000_000, 4096, 2e6)]))  # (CPU slots: where trees run)
    first, second = cost.collective(("a0", "a1", "a2", "a3")), cost.collective(("b0", "b1", "b2", "b3"))
    assert first.reduce_trees and second.reduce_trees
    assert {d for t in second.reduce_trees for e in t.edges for d in e} == {"b0", "b1", "b2", "b3"}
    assert cost.tree_sync_s(second.devices, 1e8) == pytest.approx(cost.tree_sync_s(first.devices, 1e8))
