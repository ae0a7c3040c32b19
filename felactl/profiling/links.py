"""Measuring the directed link between every ordered pair of worker slots with real send/recv.

Called in every worker of one process group (gloo on CPU, NCCL on CUDA). The pairs are measured
one at a time, in the same order on every rank, with a barrier between pairs, so no transfer
competes with another. For the pair ``src -> dst``:

- latency: ``src`` sends a small message and ``dst`` echoes it; half the median round trip. On
  CPU slots each round trip starts after a pause (:attr:`LinkProbe.latency_pause_s`): round trips
  back to back between two slots that share a core under a CPU cap read the cap's period (each
  end spends its quota waiting for the other, then both sit throttled), 4-5 ms one way on the
  testbeds, where a message takes 0.07 ms and a ring's steps or a tree's pieces pay nothing like
  it (BENCHMARKS.md, "Measured plan quality", tenth session).
- bandwidth: ``src`` sends a large message and ``dst`` answers with a small ack once it has it;
  the message took the median time minus one small one-way trip.

The times are taken on ``src`` only, so no two clocks are compared.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from felactl.spec.cluster import QUOTA_PERIOD_US

GB = 1e9


@dataclass(frozen=True, kw_only=True)
class LinkProbe:
    """Sizes of the probe; small ones keep tests fast, the CLI's defaults give steady numbers."""

    message_bytes: int = 16 * 2**20
    small_message_bytes: int = 8
    repetitions: int = 5
    """Timed large messages (median taken)."""
    latency_repetitions: int = 30
    """Timed small round trips: cheap, and scheduler noise on a busy host needs more of them."""
    latency_pause_s: float = QUOTA_PERIOD_US / 1e6
    """Idle time before each timed round trip on CPU slots: a testbed's CPU period (10 ms,
    :data:`felactl.spec.QUOTA_PERIOD_US`), after which a capped slot has its quota back (module
    doc). 0.3 s per ordered pair of CPU slots. (A testbed node under a tenth of a core has a longer
    period, :func:`felactl.spec.quota_period_us`.)"""


def ordered_pairs(world_size: int) -> list[tuple[int, int]]:
    return [(src, dst) for src in range(world_size) for dst in range(world_size) if src != dst]


def measure_links(
    rank: int,
    world_size: int,
    probe: LinkProbe,
    *,
    device=None,
    barrier: Callable[[], None] | None = None,
    on_pair: Callable[[int, int], None] = lambda src, dst: None,
) -> list[dict]:
    """Measure every ordered pair; return the links this rank measured (those it is the source of)."""
    import torch
    import torch.distributed as dist

    device = torch.device(device or "cpu")
    barrier = barrier or dist.barrier
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    pause_s = probe.latency_pause_s if device.type == "cpu" else 0.0  # a GPU slot does not wait on a core
    small = torch.zeros(max(1, probe.small_message_bytes // 4), device=device)
    large = torch.zeros(max(1, probe.message_bytes // 4), device=device)
    results = []
    for src, dst in ordered_pairs(world_size):
        barrier()
        if rank == src:
            results.append(_measure_as_source(dst, small, large, probe, sync, pause_s=pause_s))
            results[-1]["src_rank"] = src
            on_pair(src, dst)
        elif rank == dst:
            _serve_as_destination(src, small, large, probe, sync)
    barrier()
    return results


def _timed(fn: Callable[[], None], sync: Callable[[], None], repetitions: int, pause_s: float = 0.0) -> float:
    fn()  # warm-up: connection set-up, NCCL communicator creation
    sync()
    times_s = []
    for _ in range(repetitions):
        if pause_s:
            time.sleep(pause_s)
        start = time.perf_counter()
        fn()
        sync()
        times_s.append(time.perf_counter() - start)
    return statistics.median(times_s)


def _measure_as_source(dst: int, small, large, probe: LinkProbe, sync, *, pause_s: float = 0.0) -> dict:
    import torch.distributed as dist

    def ping() -> None:
        dist.send(small, dst)
        dist.recv(small, dst)

    def push() -> None:
        dist.send(large, dst)
        dist.recv(small, dst)

    round_trip_s = _timed(ping, sync, probe.latency_repetitions, pause_s)
    push_s = _timed(push, sync, probe.repetitions)
    one_way_s = round_trip_s / 2
    transfer_s = max(push_s - one_way_s, push_s * 0.01)
    message_bytes = large.numel() * large.element_size()
    return {
        "dst_rank": dst,
        "latency_us": one_way_s * 1e6,
        "bandwidth_gbps": message_bytes / transfer_s / GB,
        "message_bytes": message_bytes,
    }


def _serve_as_destination(src: int, small, large, probe: LinkProbe, sync) -> None:
    import torch.distributed as dist

    for _ in range(probe.latency_repetitions + 1):
        dist.recv(small, src)
        sync()
        dist.send(small, src)
    for _ in range(probe.repetitions + 1):
        dist.recv(large, src)
        sync()
        dist.send(small, src)
    sync()
