"""Solve time (issue 14, item 4): one ILP solve per plan (the rings-only baseline is priced, not
solved again); a server part's trees are packed once per process, whatever group holds it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from felactl.optimizer import broadcast_trees, collectives, ilp
from felactl.optimizer.cost import CostModel
from felactl.optimizer.evaluate import predict
from felactl.optimizer.planner import make_plan
from felactl.spec import load_cluster, load_model
from tests.planner_fixtures import as_cpu_slots

ROOT = Path(__file__).resolve().parents[1]


def where_trees_beat_rings():
    """(cluster, model) where trees beat the rings under BSP. Trees run over gloo, on CPU slots: the
    DGX-1V's graph as CPU slots at a hundredth of its links' speed, and vgg-mini's layers ten times
    as wide, where they beat the ring despite their CPU."""
    dgx = as_cpu_slots(load_cluster(ROOT / "plans" / "clusters" / "dgx1v.yaml"))
    cluster = dataclasses.replace(
        dgx,
        links=tuple(dataclasses.replace(link, bandwidth_gbps=link.bandwidth_gbps / 100) for link in dgx.links),
        intra_node_default=dataclasses.replace(dgx.intra_node_default, bandwidth_gbps=0.1),
    )
    vgg = load_model(ROOT / "plans" / "models" / "vgg-mini.yaml")
    net = dataclasses.replace(
        vgg,
        layers=tuple(dataclasses.replace(x, params=10 * x.params, param_bytes=10 * x.param_bytes) for x in vgg.layers),
    )
    return cluster, net


def test_the_rings_only_baseline_takes_no_second_solve(monkeypatch):
    cluster, net = where_trees_beat_rings()
    calls = []
    real = ilp.solve
    monkeypatch.setattr(ilp, "solve", lambda *a, **k: calls.append(1) or real(*a, **k))
    plan = make_plan(cluster, net, 256)
    assert len(calls) == 1
    assert plan.collectives  # trees were faster somewhere: no_trees differs from the plan
    stages = tuple(plan_stage_choices(plan))
    rings = CostModel(cluster.subset(plan.devices), net, use_trees=False)
    assert plan.predicted.baselines["no_trees"] == pytest.approx(predict(rings, stages, 256, 4).iteration_s, rel=1e-6)


def plan_stage_choices(plan):
    from felactl.optimizer.evaluate import StageChoice

    for st in plan.stages:
        yield StageChoice(st.layer_start, st.layer_end, st.micro_batch, tuple((w.device, w.share) for w in st.workers))


def test_a_server_part_is_packed_once_per_process():
    mixed = load_cluster(ROOT / "plans" / "clusters" / "mixed.yaml")
    collectives.plan_collective(mixed, [d for d in mixed.device_names if d.startswith(("a100-0", "v100-0"))])
    before = broadcast_trees._pack_signature.cache_info()
    # Another group of the same server shapes (the other A100 and V100 servers): nothing packed again.
    collectives.plan_collective(mixed, [d for d in mixed.device_names if d.startswith(("a100-1", "v100-1"))])
    after = broadcast_trees._pack_signature.cache_info()
    assert after.misses == before.misses and after.hits > before.hits


@pytest.mark.parametrize("sync", ["wbsp", "sdpipe"])
def test_modes_that_run_no_trees_are_planned_without_them(sync):
    """WBSP and SDPipe merge through a parameter server or their groups, never along the plan's
    trees (spec.sync_modes: sums_over_trees): :func:`where_trees_beat_rings`, where trees beat the
    rings under BSP, gets none under them, and is priced with the rings they run."""
    cluster, net = where_trees_beat_rings()
    plan = make_plan(cluster, net, 256, sync=sync)
    assert plan.collectives == () and not plan.sync.use_trees
