"""What a ring allreduce costs: over the best ring of a group's direct links, over the ring a
backend's rank order fixes, or over the rings NCCL lays on GPUs.

Pure: stdlib + networkx (via :mod:`felactl.optimizer.graph`), never torch. Bytes N; rates in GB/s
= 1e9 bytes/s; latencies in microseconds.

**Ring allreduce** (the baseline, as NCCL): ``2 (n - 1) / n * N / b + 2 (n - 1) * l``, with b the
best ring's bottleneck bandwidth and l its slowest link's latency (each of the 2 (n - 1) steps
waits for its slowest hop). Several rings at once (NCCL's) split the data by their bandwidth, so
b is their summed bottleneck. A group of one device moves nothing: its time is 0.
"""

from __future__ import annotations

from collections.abc import Sequence

from felactl.errors import PlanInfeasible
from felactl.optimizer.graph import (
    GBPS_TO_BYTES_PER_S,
    US_TO_S,
    best_ring,
    check_devices,
    nccl_rings,
    ring_hops,
    ring_width,
)
from felactl.spec.cluster import ClusterSpec, DeviceKind


def ring_allreduce_time_s(
    cluster: ClusterSpec, devices: Sequence[str], num_bytes: float, *, order: Sequence[str] | None = None
) -> float:
    """Seconds for a ring allreduce of ``num_bytes`` over the best ring (module docstring), or over
    the ring that sends along ``order`` (each device to the next) where the runtime fixes it
    (:func:`felactl.optimizer.collectives.gloo_ring`)."""
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


def ring_allreduce_gbps(bottleneck_gbps: float, count: int) -> float:
    """The rate a ring allreduce over ``count`` devices moves the data at: each sends 2 (n - 1) / n of it."""
    return bottleneck_gbps * count / (2 * (count - 1)) if count > 1 else 0.0


def on_nccl(cluster: ClusterSpec, devices: Sequence[str]) -> bool:
    """Whether a group syncs over NCCL's allreduce: a group of GPUs (a plan runs on GPUs with NCCL or
    on CPU slots with gloo, never both: :func:`~felactl.optimizer.planner.check_devices`). The
    runtime streams Blink trees over gloo only, so NCCL's own rings sum there (:func:`nccl_rings`)."""
    return all(cluster.device(d).kind is DeviceKind.CUDA for d in devices)
