"""Solve time (issue 14, item 4): one ILP solve per plan (the rings-only baseline is priced, not
solved again); a server part's trees are packed once per process, whatever group holds it."""

from __future__ import annotations

from pathlib import Path

import pytest

from felactl.optimizer import collectives, ilp
from felactl.optimizer.cost import CostModel
from felactl.optimizer.evaluate import predict
from felactl.optimizer.planner import make_plan
from felactl.spec import load_cluster, load_model

ROOT = Path(__file__).resolve().parents[1]


def test_the_rings_only_baseline_takes_no_second_solve(monkeypatch):
    cluster = load_cluster(ROOT / "plans" / "clusters" / "dgx1v.yaml")
    net = load_model(ROOT / "plans" / "models" / "vgg-mini.yaml")
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
    before = collectives._pack_signature.cache_info()
    # Another group of the same server shapes (the other A100 and V100 servers): nothing packed again.
    collectives.plan_collective(mixed, [d for d in mixed.device_names if d.startswith(("a100-1", "v100-1"))])
    after = collectives._pack_signature.cache_info()
    assert after.misses == before.misses and after.hits > before.hits
