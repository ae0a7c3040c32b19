"""Every valid cluster gets a plan (issue 14, item 2): a candidate group with no ring or no
reverse link is priced another way or left out, never refuses the whole cluster."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from felactl.cli.main import app
from felactl.optimizer.cost import CostModel
from felactl.optimizer.planner import make_plan
from felactl.spec import save
from tests.graph_fixtures import graph_cluster
from tests.planner_fixtures import model

SMALL = model([(1_000_000, 4096, 2e6), (2_000_000, 4096, 4e6), (1_000_000, 4096, 2e6)])


def _no_direct_ring() -> object:
    """Strongly connected NVLink graph in which g2 and g3 (a class of their own) share no link."""
    both = [("g0", "g1"), ("g0", "g2"), ("g1", "g3")]
    return graph_cluster(
        [[("g0", "A", 20.0), ("g1", "A", 20.0), ("g2", "B", 10.0), ("g3", "B", 10.0)]],
        [(a, b, 25.0) for x, y in both for a, b in ((x, y), (y, x))],
    )


def _one_way_ring() -> object:
    return graph_cluster(
        [[(f"g{i}", "A", 20.0) for i in range(5)]], [(f"g{i}", f"g{(i + 1) % 5}", 25.0) for i in range(5)]
    )


def test_group_without_a_direct_ring_is_priced_over_routes():
    cost = CostModel(_no_direct_ring(), SMALL)
    sync_s = cost.sync_time_s(("g2", "g3"), 4e6)
    # g2 -> g0 -> g1 -> g3: three 25 GB/s hops, each way: a two-device ring at 25/3 GB/s.
    assert sync_s == pytest.approx(2 / 2 * 4e6 / (25e9 / 3) + 2 * 6e-6)
    plan = make_plan(_no_direct_ring(), SMALL, 64)
    assert plan.predicted.iteration_s > 0


def test_one_way_links_get_a_plan():
    plan = make_plan(_one_way_ring(), SMALL, 64)
    assert plan.predicted.iteration_s > 0
    assert math.isfinite(CostModel(_one_way_ring(), SMALL).sync_time_s(tuple(f"g{i}" for i in range(5)), 4e6))


def test_a_group_nothing_joins_is_left_out():
    """g2 has no link at all: every group holding it is left out, and the plan runs without it."""
    cluster = graph_cluster(
        [[("g0", "A", 20.0), ("g1", "A", 20.0), ("g2", "A", 20.0)]], [("g0", "g1", 25.0), ("g1", "g0", 25.0)]
    )
    assert CostModel(cluster, SMALL).sync_time_s(("g0", "g2"), 4e6) == math.inf
    plan = make_plan(cluster, SMALL, 64)
    assert "g2" not in plan.devices


@pytest.mark.parametrize("make", [_no_direct_ring, _one_way_ring])
def test_plan_command_exits_0(tmp_path, make):
    save(make(), tmp_path / "cluster.yaml")
    save(SMALL, tmp_path / "model.yaml")
    result = CliRunner().invoke(
        app,
        [
            "plan",
            "--cluster",
            str(tmp_path / "cluster.yaml"),
            "--model",
            str(tmp_path / "model.yaml"),
            "--global-batch",
            "64",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["iteration_s"] > 0


def test_plan_records_trees_only_where_they_are_no_slower_than_the_ring():
    """On the one-way ring the broadcast tree is the ring's own path, and its reverse links are
    missing: a plan that syncs there runs the ring, so it must not hand the runtime trees."""
    plan = make_plan(_one_way_ring(), model([(50_000_000, 4096, 1e9)] * 3), 64)
    cost = CostModel(_one_way_ring(), SMALL)
    for coll in plan.collectives:
        assert cost.tree_sync_s(coll.devices, 1e8) <= cost.ring_sync_s(coll.devices, 1e8)
