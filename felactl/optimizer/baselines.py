"""The plans felactl is compared against, each a candidate scored by the same cost model.

* ``dp``: data parallel on every device, equal shares of the batch, ring allreduce.
* ``mp``: model parallel, one device per stage (fastest devices first), layers balanced by time,
  micro-batches pipelined through the chain.
* ``hp``: Fela's hybrid: the leading layers data parallel on every device (ring), the trailing
  fully connected layers (low arithmetic intensity, see :func:`cost.b_half`) on the fastest device.

Each baseline takes the best micro-batch for itself; one that fits no device's memory is left out.
(``no_trees``, the plan re-solved with rings only, is computed by the planner.)
"""

from __future__ import annotations

import math
from dataclasses import replace

from felactl.optimizer.cost import CostModel, b_half, micro_batch_options
from felactl.optimizer.evaluate import StageChoice, memory_fits, predict

FC_B_HALF = 16.0
"""Layers that need this many samples to reach half speed count as fully connected for ``hp``."""


def _best(cost: CostModel, global_batch: int, build) -> tuple[float, int] | None:
    """The least iteration time of ``build(micro_batch)`` over micro-batches that fit memory,
    and that micro-batch."""
    best = (math.inf, 0)
    for b in micro_batch_options(global_batch):
        stages = build(b)
        if stages is None:
            continue
        prediction = predict(cost, stages, global_batch, max_stages=len(stages))
        if memory_fits(cost, prediction) is None:
            best = min(best, (prediction.iteration_s, b))
    return None if best[0] == math.inf else best


def _equal(devices: tuple[str, ...]) -> tuple[tuple[str, float], ...]:
    return tuple((d, 1.0 / len(devices)) for d in devices)


def _fastest_first(cost: CostModel) -> list[str]:
    return sorted(cost.cluster.device_names, key=lambda d: -cost.cluster.device(d).tflops)


def data_parallel(cost: CostModel, global_batch: int) -> tuple[float, int] | None:
    devices = cost.cluster.device_names
    num_layers = cost.model.num_layers
    return _best(cost, global_batch, lambda b: (StageChoice(0, num_layers, b, _equal(devices)),)
                 if b * len(devices) <= global_batch else None)


def balanced_cuts(times: list[list[float]], num_stages: int) -> list[int]:
    """Cut points splitting layers into ``num_stages`` stages, stage s timed by ``times[s]``
    (per-layer seconds on its device), minimising the slowest stage (dynamic programming)."""
    num_layers = len(times[0])
    prefix = [[0.0] for _ in times]
    for s, row in enumerate(times):
        for t in row:
            prefix[s].append(prefix[s][-1] + t)
    best = {(0, 0): (0.0, [0])}
    for s in range(num_stages):
        for (k, done), (worst, cuts) in list(best.items()):
            if k != s:
                continue
            for end in range(done + 1, num_layers - (num_stages - s - 1) + 1):
                cand = max(worst, prefix[s][end] - prefix[s][done])
                key = (s + 1, end)
                if key not in best or cand < best[key][0]:
                    best[key] = (cand, cuts + [end])
    return best[(num_stages, num_layers)][1]


def model_parallel(cost: CostModel, global_batch: int) -> tuple[float, int] | None:
    devices = _fastest_first(cost)[:cost.model.num_layers]

    def build(b: int):
        times = [[cost.per_sample_s(l, l + 1, d, b) for l in range(cost.model.num_layers)] for d in devices]
        cuts = balanced_cuts(times, len(devices))
        return tuple(StageChoice(a, z, b, ((d, 1.0),)) for a, z, d in zip(cuts, cuts[1:], devices))
    return _best(cost, global_batch, build)


def fc_tail_start(cost: CostModel) -> int:
    """First layer of the trailing run of fully connected layers (at least the last layer)."""
    start = cost.model.num_layers - 1
    while start > 1 and b_half(cost.model.layers[start - 1]) >= FC_B_HALF:
        start -= 1
    return start


def hybrid_parallel(cost: CostModel, global_batch: int) -> tuple[float, int] | None:
    devices = cost.cluster.device_names
    tail = fc_tail_start(cost)
    fastest = _fastest_first(cost)[0]
    if tail == 0 or len(devices) < 2:
        return None

    def build(b: int):
        if b * len(devices) > global_batch:
            return None
        return (StageChoice(0, tail, b, _equal(devices)),
                StageChoice(tail, cost.model.num_layers, b, ((fastest, 1.0),)))
    return _best(cost, global_batch, build)


def baselines(cost: CostModel, global_batch: int) -> dict[str, tuple[float, int]]:
    """(predicted iteration time, micro-batch) of each baseline that fits, with rings only as
    their systems do."""
    rings = replace(cost, use_trees=False) if cost.use_trees else cost
    found = {"dp": data_parallel(rings, global_batch), "mp": model_parallel(rings, global_batch),
             "hp": hybrid_parallel(rings, global_batch)}
    return {name: best for name, best in found.items() if best is not None}
