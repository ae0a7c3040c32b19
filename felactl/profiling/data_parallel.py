"""What gradient sync adds to a data-parallel step, measured on a group of this machine's slots.

The cost model prices a group's allreduce from the link profile: latency plus bytes over the
bandwidth a ping-pong measured. On CPU slots that misses most of what sync costs a step. On the
project's 2-core box, gpt-mini {depth 2, width 128} (1.7 MB of gradients) on two single-core
slots over gloo: the link model says ~0.7 ms; gloo's allreduce of those 1.7 MB alone takes
~3.5 ms (gloo changes algorithm near that size: 1 MiB takes 0.6 ms); and inside DDP, where it
overlaps the backward on the same core, the step grows by ~7 ms. The demo's plan predicted a
third too little because of it.

So where a group is this machine's slots, felactl times the step as training will run it: one
process per slot, pinned to the slot's cores with as many threads, the whole model wrapped in
DDP over the backend, and pairs of blocks of steps with and without gradient sync (``no_sync``),
each step counted as its slowest rank; the median over pairs of the difference of the blocks'
medians is the sync the step pays. Pairs are added until that difference's noise is small next
to the step, or up to ``max_pairs``; a difference not above its noise is recorded without
``sync_ms`` (not measured), never as 0 (``felactl.profiling.timing.difference``). The cost
model turns it into a calibration (measured / its link-based estimate of the group, at least 1)
for that group and every group inside it (``CostModel.sync_factor``). Both steps include the optimizer step, which the cost model charges apart:
the difference is what sync adds, to the backward and to the step after it.
"""

from __future__ import annotations

import math
import multiprocessing
import queue
import tempfile
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from felactl.errors import ProfilingError
from felactl.profiling.devices import pin_to_cores
from felactl.profiling.timing import SYNC_NOISE_LIMIT, difference, repeat_until
from felactl.spec import SyncTiming

MIN_PAIRS = 4
"""Pairs of blocks (synced, then local) at least; more while the difference is noisy."""
MAX_PAIRS = 10
STEPS_PER_BLOCK = 10
WARMUP_PER_BLOCK = 2
START_TIMEOUT_S = 120.0
"""Spawning, importing torch and building the model in every slot: seconds on a busy machine."""


@dataclass(frozen=True)
class Slot:
    """One process of the measured group: the device it stands for and the cores it is pinned to."""

    device: str
    cores: tuple[int, ...] = ()


def measure_data_parallel_sync(
    model: str,
    config: dict[str, Any],
    micro_batch: int,
    slots: Sequence[Slot],
    *,
    cluster: str,
    min_pairs: int = MIN_PAIRS,
    max_pairs: int = MAX_PAIRS,
    per_block: int = STEPS_PER_BLOCK,
    warmup: int = WARMUP_PER_BLOCK,
    backend: str = "gloo",
    timeout_s: float = START_TIMEOUT_S,
) -> SyncTiming:
    """Time ``model`` in DDP on ``slots`` (one process each) with and without sync; see module doc.
    ``cluster``: the name of the cluster profile the slots' devices belong to."""
    if len(slots) < 2:
        raise ProfilingError("a data-parallel sync needs two or more slots")
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="felactl-dp-sync.") as tmp:
        store_path = str(Path(tmp) / "store")
        procs = [
            ctx.Process(
                target=_slot_main,
                daemon=True,
                args=(
                    results,
                    rank,
                    len(slots),
                    store_path,
                    backend,
                    model,
                    config,
                    micro_batch,
                    list(slot.cores),
                    (min_pairs, max_pairs),
                    per_block,
                    warmup,
                ),
            )
            for rank, slot in enumerate(slots)
        ]
        try:
            for proc in procs:
                proc.start()
            pairs = _collect(results, procs, timeout_s + 2 * max_pairs * (per_block + warmup))[0]
        finally:
            reap(procs, grace_s=5.0)
    return sync_timing(
        pairs, cluster=cluster, devices=tuple(slot.device for slot in slots), backend=backend, micro_batch=micro_batch
    )


def sync_timing(pairs: Sequence[tuple[Sequence[float], Sequence[float]]], **fields: Any) -> SyncTiming:
    """The timing of ``pairs`` of blocks (seconds per step, synced and local): see module doc."""
    diff = difference(pairs)
    sync_ms = None if diff.estimate is None else round(diff.estimate * 1e3, 3)
    noise_ms = round(diff.noise * 1e3, 3) if math.isfinite(diff.noise) else None
    return SyncTiming(sync_ms=sync_ms or None, noise_ms=noise_ms, noisy=not diff.settled(SYNC_NOISE_LIMIT), **fields)


def sync_settled(pairs: Sequence[tuple[Sequence[float], Sequence[float]]]) -> bool:
    """Whether the difference of ``pairs`` is known well enough to stop adding pairs."""
    return difference(pairs).settled(SYNC_NOISE_LIMIT)


def reap(procs, grace_s: float) -> None:
    """Wait up to ``grace_s`` in all for ``multiprocessing`` processes to end, then kill the rest:
    a slot stuck in a collective with a peer that failed never ends by itself. A process that
    never started (its start failed, or one before it) is passed over."""
    deadline = time.monotonic() + grace_s
    procs = [proc for proc in procs if proc.pid is not None]
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()


def _collect(results, procs, timeout_s: float) -> list[Any]:
    """Every rank's result, or a ProfilingError naming what went wrong."""
    deadline = time.monotonic() + timeout_s
    got: dict[int, Any] = {}
    while len(got) < len(procs):
        try:
            rank, outcome = results.get(timeout=1.0)
        except queue.Empty:
            dead = [i for i, p in enumerate(procs) if i not in got and p.exitcode is not None]
            if dead and not _settled(results, got):
                raise ProfilingError(
                    f"data-parallel sync: slot process {dead[0]} exited with code "
                    f"{procs[dead[0]].exitcode} before reporting"
                ) from None
            if time.monotonic() > deadline:
                raise ProfilingError(f"data-parallel sync: no result within {timeout_s:.0f} s") from None
            continue
        if isinstance(outcome, str):
            raise ProfilingError(f"data-parallel sync: slot {rank} failed: {outcome}")
        got[rank] = outcome
    return [got[rank] for rank in range(len(procs))]


def _settled(results, got: dict) -> bool:
    """One more look at the queue: a slot that reported just before it exited is not a failure.
    True when a result or an error came (stored in ``got`` or raised)."""
    try:
        rank, outcome = results.get(timeout=0.5)
    except queue.Empty:
        return False
    if isinstance(outcome, str):
        raise ProfilingError(f"data-parallel sync: slot {rank} failed: {outcome}")
    got[rank] = outcome
    return True


def _slot_main(results, rank: int, *args) -> None:
    """One slot's process: :func:`_time_steps` ``(rank, *args)``, its result or its failure put on
    ``results`` with its rank."""
    try:
        results.put((rank, _time_steps(rank, *args)))
    except Exception as exc:  # reported to the parent, which raises it with the slot's rank
        results.put((rank, f"{type(exc).__name__}: {exc}"))


def _time_steps(
    rank: int,
    world_size: int,
    store_path: str,
    backend: str,
    model: str,
    config: dict[str, Any],
    micro_batch: int,
    cores: list[int],
    pairs: tuple[int, int],
    per_block: int,
    warmup: int,
) -> list[tuple[list[float], list[float]]]:
    """Pairs of blocks (synced, local) of step times, each step its slowest rank's: the same on
    every rank, so every rank decides alike when the pairs are enough."""
    import torch.distributed as dist

    from felactl.models import build

    pin_to_cores(cores, strict=True)
    # The model is built before the rendezvous: a slot whose model fails says so alone, and its
    # peers are stopped while they wait there (built after it, a peer's 'connection closed by
    # peer' could reach the parent first and hide the cause).
    bundle = build(model, config, seed=0)
    dist.init_process_group(backend, store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size)
    try:
        return _timed_pairs(bundle, rank, micro_batch, pairs, per_block, warmup)
    finally:
        # After _timed_pairs returned, its DDP is gone: freed by then (on a failure its traceback
        # may keep it, and the parent reaps the slot). A DDP freed after this would drop the
        # group's last reference in its own dealloc, holding the GIL while the group's destructor
        # joins a gloo thread that may need the GIL (torch issue 56297): 1 slot in 15 hung so,
        # right after the last barrier.
        dist.destroy_process_group()


def _timed_pairs(bundle, rank: int, micro_batch: int, pairs: tuple[int, int], per_block: int, warmup: int):
    """:func:`_time_steps` in the formed group, with the DDP replica living only in this frame."""
    import torch
    import torch.distributed as dist

    from felactl.parallel.ddp import wrap_replica

    replica = wrap_replica(bundle.model)  # as the runtime wraps a one-stage plan's: the user's module whole
    # Training steps the optimizer after the sync, and a step after DDP's sync was measured
    # slower (~4 ms vs ~2 ms here): time it in both, so the difference holds what sync costs
    # it too. lr 0 keeps the replicas equal while no_sync steps skip the allreduce.
    optimizer = torch.optim.AdamW(replica.parameters(), lr=0.0)
    inputs, targets = bundle.data.batch(range(rank * micro_batch, (rank + 1) * micro_batch))

    def block(context) -> list[float]:
        # each block of one kind, like training, and its first steps not counted
        times = []
        for i in range(warmup + per_block):
            dist.barrier()
            started = time.perf_counter()
            replica.zero_grad(set_to_none=True)
            with context():
                bundle.loss(replica(inputs), targets).backward()
            optimizer.step()
            if i >= warmup:
                times.append(time.perf_counter() - started)
        return times

    def pair() -> tuple[list[float], list[float]]:
        # adjacent blocks of both kinds, so drift of a shared machine falls on both alike
        steps = torch.tensor(block(nullcontext) + block(replica.no_sync), dtype=torch.float64)
        dist.all_reduce(steps, op=dist.ReduceOp.MAX)
        return steps[:per_block].tolist(), steps[per_block:].tolist()

    timed, _settled = repeat_until(pair, sync_settled, min_blocks=pairs[0], max_blocks=pairs[1])
    dist.barrier()
    return timed


__all__ = ["Slot", "measure_data_parallel_sync", "reap", "sync_settled", "sync_timing"]
