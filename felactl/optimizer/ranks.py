"""The rank order of a plan's devices: which device gets which rank decides gloo's rings."""

from __future__ import annotations

from collections.abc import Sequence

from felactl.optimizer.collectives import gloo_ring
from felactl.optimizer.cost import CostModel, stage_param_bytes
from felactl.optimizer.graph import best_ring, ring_width
from felactl.spec import Stage


def rank_order(cost: CostModel, stages: Sequence[Stage], over_trees: set[frozenset[str]]) -> tuple[str, ...]:
    """The plan's devices in the rank order that makes the backend's ring of each stage group the
    best ring the planner priced it with (``cost.ring_order`` None).

    gloo's allreduce runs round the ranks backwards (:func:`collectives.gloo_ring`), so where links
    differ by direction the rank order decides between a fast ring and a slow one (the asymmetric
    testbed: 8x). Groups of CPU devices that sync over the backend's ring (not over trees:
    ``over_trees``) are taken longest sync first; each places its devices not placed yet in the
    reverse of its best ring (in cluster order where that ring is as wide), so the first group's
    ring is its best, and so is a later one's where it shares no device with the earlier ones. The
    rest keep cluster order. The planner then prices the plan with these ranks
    (``CostModel.ring_order``)."""
    ranked: list[str] = []
    synced = {}
    for st in stages:
        if len(st.devices) > 1 and frozenset(st.devices) not in over_trees:
            nbytes = stage_param_bytes(cost.model, st.layer_start, st.layer_end)
            synced[st.devices] = max(synced.get(st.devices, 0.0), cost.sync_time_s(st.devices, nbytes))
    for group in sorted(synced, key=synced.get, reverse=True):
        if not cost.ranks_decide_ring(group):
            continue
        ring, width = best_ring(cost.cluster, group)
        in_cluster_order = [d for d in cost.cluster.device_names if d in group]
        if width > 0 and ring_width(cost.cluster, gloo_ring(in_cluster_order)) < width:
            ranked += [d for d in gloo_ring(ring) if d not in ranked]
        else:  # cluster order is as good: the ranks stay as a user would number them
            ranked += [d for d in in_cluster_order if d not in ranked]
    used = {d for st in stages for d in st.devices}
    return tuple(ranked) + tuple(d for d in cost.cluster.device_names if d in used and d not in ranked)
