"""The plans felactl is compared against, each a candidate scored by the same cost model.

* ``dp``: data parallel on every device, equal shares of the batch, ring allreduce.
* ``mp``: model parallel, one device per stage (fastest devices first), layers balanced by time,
  micro-batches pipelined through the chain.
* ``fsdp``: the whole model sharded over every device (torch FSDP2; ZeRO-3), equal shares:
  priced by :mod:`felactl.optimizer.sharding`. What the planner falls back on where nothing
  replicated fits, and picks where it is faster.
* ``hp``: Fela's hybrid: the leading layers data parallel on every device (ring), the trailing
  fully connected layers (low arithmetic intensity, see :func:`compute_cost.b_half`) on the fastest device.
  Its plan runs on token scheduling, where a free worker takes the leading layers' next token, so
  their shares are those that make every device finish together (the fastest, which carries the
  tail, takes fewer): with equal shares it was priced up to a quarter slower than it ran.

Each baseline takes the best micro-batch for itself; one that fits no device's memory is left out,
and :func:`baselines_and_missing` says why (``felactl plan --compare`` shows it).
(``no_trees``, the plan's own stages synced over rings only, is priced by the planner.)
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import NamedTuple

from felactl.optimizer.compute_cost import b_half
from felactl.optimizer.cost import CostModel, micro_batch_options
from felactl.optimizer.evaluate import StageChoice, memory_fits, memory_limits, predict, token_samples
from felactl.optimizer.sharding import best_sharded

FC_B_HALF = 16.0
"""Layers that need this many samples to reach half speed count as fully connected for ``hp``."""


class Missing(Exception):
    """Why a baseline has no plan here (its message is shown by ``felactl plan --compare``)."""


class Baseline(NamedTuple):
    """A baseline's best candidate: its predicted iteration time, micro-batch and stages (which
    :func:`felactl.optimizer.planner.make_baseline_plan` turns into a runnable plan)."""

    iteration_s: float
    micro_batch: int
    stages: tuple[StageChoice, ...]


def _best(cost: CostModel, global_batch: int, build) -> Baseline:
    """The least iteration time of ``build(micro_batch)`` over micro-batches that fit memory,
    with that micro-batch and its stages; raises Missing saying why none does."""
    best = Baseline(math.inf, 0, ())
    overflow = None  # (GB over, device, GB needed) at the micro-batch that came closest
    tried = 0
    for b in micro_batch_options(global_batch):
        stages = build(b)
        if stages is None:
            continue
        stages = memory_limits(cost, stages, global_batch, max_stages=len(stages))
        tried += 1
        prediction = predict(cost, stages, global_batch, max_stages=len(stages))
        device = memory_fits(cost, prediction)
        if device is None:
            if prediction.iteration_s < best.iteration_s:
                best = Baseline(prediction.iteration_s, b, stages)
            continue
        need_gb = prediction.memory_bytes[device] / 1e9
        over = need_gb - cost.usable_memory_bytes(device) / 1e9
        if overflow is None or over < overflow[0]:
            overflow = (over, device, need_gb, b)
    if best.iteration_s < math.inf:
        return best
    if overflow is not None:
        _, device, need_gb, b = overflow
        raise Missing(
            f"does not fit: needs {need_gb:.3g} GB on {device} ({cost.usable_memory_bytes(device) / 1e9:.3g} "
            f"of its {cost.cluster.device(device).memory_gb:g} GB usable) even at micro-batch {b}"
        )
    if tried:
        raise Missing("its groups cannot sync (no trees, no ring even over routes)")
    raise Missing(f"the global batch {global_batch} gives some device no micro-batch")


def _equal(devices: tuple[str, ...]) -> tuple[tuple[str, float], ...]:
    return tuple((d, 1.0 / len(devices)) for d in devices)


def _fastest_first(cost: CostModel) -> list[str]:
    return sorted(cost.cluster.device_names, key=lambda d: -cost.cluster.device(d).tflops)


def data_parallel(cost: CostModel, global_batch: int) -> Baseline:
    devices = cost.cluster.device_names
    num_layers = cost.model.num_layers
    return _best(
        cost,
        global_batch,
        lambda b: (StageChoice(0, num_layers, b, _equal(devices)),) if b * len(devices) <= global_batch else None,
    )


def sharded_data_parallel(cost: CostModel, global_batch: int) -> Baseline:
    """FSDP as its users run it: over every device."""
    found = best_sharded(cost, global_batch)
    if isinstance(found, str):
        raise Missing(found)
    return sharded_baseline(cost, *found, tuple(cost.cluster.device_names))


def sharded_baseline(cost: CostModel, seconds: float, micro_batch: int, devices: tuple[str, ...]) -> Baseline:
    """The whole model as one stage sharded over ``devices`` in equal shares."""
    stage = StageChoice(0, cost.model.num_layers, micro_batch, _equal(devices), in_flight=1, shard=True)
    return Baseline(seconds, micro_batch, (stage,))


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


def model_parallel(cost: CostModel, global_batch: int) -> Baseline:
    devices = _fastest_first(cost)[: cost.model.num_layers]

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


def hybrid_parallel(cost: CostModel, global_batch: int) -> Baseline:
    devices = cost.cluster.device_names
    tail = fc_tail_start(cost)
    fastest = _fastest_first(cost)[0]
    if len(devices) < 2:
        raise Missing("needs two devices or more")
    if tail == 0:
        raise Missing("the model has no leading layers before its fully connected tail")

    def build(b: int):
        if b * len(devices) > global_batch:
            return None
        # The fastest device carries the whole tail; the leading layers' tokens go to whoever is
        # free, so each device's share of them is what makes every device finish together.
        carried = {fastest: global_batch * cost.per_sample_s(tail, cost.model.num_layers, fastest, b)}
        return (
            StageChoice(0, tail, b, finishing_together(cost, 0, tail, b, devices, global_batch, carried)),
            StageChoice(tail, cost.model.num_layers, b, ((fastest, 1.0),)),
        )

    return _best(cost, global_batch, build)


def finishing_together(
    cost: CostModel,
    start: int,
    end: int,
    micro_batch: int,
    devices: tuple[str, ...],
    global_batch: int,
    carried: dict[str, float],
) -> tuple[tuple[str, float], ...]:
    """Shares of a stage's samples under token scheduling, where a free worker takes the next
    token: each device computes until the time T at which, with the ``carried`` seconds it spends
    on other stages, all have finished the batch together (water-filling); a device whose share
    deals it no token is left out of the stage."""
    rate = {d: 1.0 / max(cost.per_sample_s(start, end, d, micro_batch), 1e-15) for d in devices}

    def done(t: float) -> float:
        return sum(max(0.0, t - carried.get(d, 0.0)) * rate[d] for d in devices)

    lo, hi = 0.0, max(carried.values(), default=0.0) + global_batch / min(rate.values())
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if done(mid) < global_batch else (lo, mid)
    samples = {d: max(0.0, hi - carried.get(d, 0.0)) * rate[d] for d in devices}
    shares = tuple((d, samples[d] / sum(samples.values())) for d in devices if samples[d] > 0)
    dealt = token_samples(shares, global_batch, micro_batch)
    kept = tuple((d, share) for d, share in shares if dealt[d] > 0)
    total = sum(share for _, share in kept)
    return tuple((d, share / total) for d, share in kept)


def rings_only(cost: CostModel) -> CostModel:
    """The cost model the baselines are priced with: ``cost`` with trees off, the backend's rings
    in cluster order, the ranks torchrun would give (and their plans keep), and data parallelism
    as DDP runs it, each worker over its own share, asking for no token (their plans sync
    ``bsp``; ``felactl plan --baseline`` writes them)."""
    order = tuple(cost.cluster.device_names)
    if not cost.use_trees and cost.ring_order == order and not cost.data_parallel_tokens:
        return cost
    return replace(cost, use_trees=False, ring_order=order, data_parallel_tokens=False)


def baselines(cost: CostModel, global_batch: int) -> dict[str, Baseline]:
    """Each baseline that fits (predicted iteration time, micro-batch, stages), with rings only as
    their systems do."""
    return baselines_and_missing(cost, global_batch)[0]


def baselines_and_missing(cost: CostModel, global_batch: int) -> tuple[dict[str, Baseline], dict[str, str]]:
    """The baselines that fit (as :func:`baselines`), and why each other one is missing."""
    rings = rings_only(cost)
    makers = {"dp": data_parallel, "fsdp": sharded_data_parallel}
    missing = {}
    if cost.model.splittable:
        makers |= {"mp": model_parallel, "hp": hybrid_parallel}
    else:
        missing = {name: "the model cannot be cut into stages (splittable: false)" for name in ("mp", "hp")}
    found = {}
    for name, make in makers.items():
        try:
            found[name] = make(rings, global_batch)
        except Missing as why:
            missing[name] = str(why)
    return found, missing
