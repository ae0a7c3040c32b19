"""The baselines' own stages, with made-up numbers."""

from __future__ import annotations

import pytest

from felactl.optimizer.baselines import finishing_together, hybrid_parallel
from felactl.optimizer.cost import CostModel
from felactl.optimizer.evaluate import token_samples
from tests.planner_fixtures import cluster, model


def test_tokens_of_a_stage_go_where_every_device_finishes_together():
    """Two devices at 10 and one at 5 TFLOP/s; the first carries 0.1 s (of per-sample time u) of
    another stage. Per sample u on the fast ones, 2u on the slow one: over 200 samples, T solves
    (T - 100u) + T + T / 2 = 200u, T = 120u: 20, 120 and 60 samples."""
    spec = cluster([[("g", 10.0, 8.0), ("g", 10.0, 8.0), ("s", 5.0, 8.0)]])
    net = model([(1000, 10, 1e10 / 3)])  # 1e10 FLOPs fwd + bwd per sample: 1 ms at 10 TFLOP/s
    cost = CostModel(spec, net, use_trees=False)
    u = cost.per_sample_s(0, 1, "n0.d0", 10)  # 1 ms at full speed, over eff(10) of a conv-like layer
    assert cost.per_sample_s(0, 1, "n0.d2", 10) == pytest.approx(2 * u)
    shares = dict(finishing_together(cost, 0, 1, 10, spec.device_names, 200, {"n0.d0": 100 * u}))
    assert shares == pytest.approx({"n0.d0": 0.1, "n0.d1": 0.6, "n0.d2": 0.3}, rel=1e-3)
    # a device that the carried work keeps busy past T gets no token and is left out
    assert [d for d, _ in finishing_together(cost, 0, 1, 10, spec.device_names, 200, {"n0.d0": 1000 * u})] == [
        "n0.d1",
        "n0.d2",
    ]


def test_the_hybrid_baseline_gives_the_device_with_the_tail_fewer_leading_tokens():
    spec = cluster([[("g", 10.0, 8.0), ("g", 5.0, 8.0), ("g", 5.0, 8.0)]])
    net = model([(10_000, 1000, 1e8), (1_000_000, 100, 2e6), (10_000, 10, 2e4)])
    # without the tokens' overhead the hybrid takes small micro-batches, fine enough to show the split
    found = hybrid_parallel(CostModel(spec, net, use_trees=False, token_cpu_s=0.0, token_server_cpu_s=0.0), 256)
    first, tail = found.stages
    assert tail.devices == ("n0.d0",) and (first.start, first.end) == (0, tail.start)
    dealt = token_samples(first.shares, 256, first.micro_batch)
    assert dealt["n0.d0"] < dealt["n0.d1"] + dealt["n0.d2"]  # not the half its speed alone would take
