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
DDP over the backend, and blocks of steps with and without gradient sync (``no_sync``) in turn; the
difference of the medians (the slowest rank of each step) is the sync the step pays. The cost
model turns it into a calibration (measured / its link-based estimate of the group, at least 1)
for that group and every group inside it (``CostModel.sync_factor``). Both steps include the optimizer step, which the cost model charges apart:
the difference is what sync adds, to the backward and to the step after it.
"""

from __future__ import annotations

import multiprocessing
import queue
import statistics
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from felactl.errors import ProfilingError
from felactl.profiling.devices import pin_to_cores
from felactl.spec import SyncTiming

BLOCKS = 4
"""Blocks of each kind, in turn: synced, local, synced, local, ..."""
STEPS_PER_BLOCK = 10
WARMUP_PER_BLOCK = 2
START_TIMEOUT_S = 120.0
"""Spawning, importing torch and building the model in every slot: seconds on a busy machine."""


@dataclass(frozen=True)
class Slot:
    """One process of the measured group: the device it stands for and the cores it is pinned to."""

    device: str
    cores: tuple[int, ...] = ()


def measure_data_parallel_sync(model: str, config: dict[str, Any], micro_batch: int, slots: Sequence[Slot], *,
                               cluster: str,
                               blocks: int = BLOCKS, per_block: int = STEPS_PER_BLOCK,
                               warmup: int = WARMUP_PER_BLOCK, backend: str = "gloo",
                               timeout_s: float = START_TIMEOUT_S) -> SyncTiming:
    """Time ``model`` in DDP on ``slots`` (one process each) with and without sync; see module doc.
    ``cluster``: the name of the cluster profile the slots' devices belong to."""
    if len(slots) < 2:
        raise ProfilingError("a data-parallel sync needs two or more slots")
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="felactl-dp-sync.") as tmp:
        store_path = str(Path(tmp) / "store")
        procs = [ctx.Process(target=_slot_main, daemon=True,
                             args=(rank, len(slots), store_path, backend, model, config, micro_batch,
                                   list(slot.cores), blocks, per_block, warmup, results))
                 for rank, slot in enumerate(slots)]
        try:
            for proc in procs:
                proc.start()
            per_rank = _collect(results, procs, timeout_s + 2 * blocks * (per_block + warmup))
        finally:
            reap(procs, grace_s=5.0)
    counted = blocks * per_block
    synced = [max(times[i] for times, _ in per_rank) for i in range(counted)]
    local = [max(times[i] for _, times in per_rank) for i in range(counted)]
    sync_ms = max(0.0, statistics.median(synced) - statistics.median(local)) * 1e3
    return SyncTiming(cluster=cluster, devices=tuple(slot.device for slot in slots), backend=backend,
                      micro_batch=micro_batch, sync_ms=round(sync_ms, 3))


def reap(procs, grace_s: float) -> None:
    """Wait up to ``grace_s`` in all for ``multiprocessing`` processes to end, then kill the rest:
    a slot stuck in a collective with a peer that failed never ends by itself."""
    deadline = time.monotonic() + grace_s
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()


def _collect(results, procs, timeout_s: float) -> list[tuple[list[float], list[float]]]:
    """Every rank's (synced, local) step times, or a ProfilingError naming what went wrong."""
    deadline = time.monotonic() + timeout_s
    got: dict[int, tuple[list[float], list[float]]] = {}
    while len(got) < len(procs):
        try:
            rank, outcome = results.get(timeout=1.0)
        except queue.Empty:
            dead = [i for i, p in enumerate(procs) if i not in got and p.exitcode is not None]
            if dead and not _settled(results, got):
                raise ProfilingError(f"data-parallel sync: slot process {dead[0]} exited with code "
                                     f"{procs[dead[0]].exitcode} before reporting") from None
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


def _slot_main(rank: int, world_size: int, store_path: str, backend: str, model: str, config: dict[str, Any],
               micro_batch: int, cores: list[int], blocks: int, per_block: int, warmup: int, results) -> None:
    try:
        results.put((rank, _time_steps(rank, world_size, store_path, backend, model, config, micro_batch, cores,
                                       blocks, per_block, warmup)))
    except Exception as exc:  # reported to the parent, which raises it with the slot's rank
        results.put((rank, f"{type(exc).__name__}: {exc}"))


def _time_steps(rank: int, world_size: int, store_path: str, backend: str, model: str, config: dict[str, Any],
                micro_batch: int, cores: list[int], blocks: int, per_block: int,
                warmup: int) -> tuple[list[float], list[float]]:
    import torch
    import torch.distributed as dist
    from felactl.agents.worker.ddp import wrap_replica
    from felactl.models import build

    pin_to_cores(cores, strict=True)
    dist.init_process_group(backend, store=dist.FileStore(store_path, world_size), rank=rank,
                            world_size=world_size)
    try:
        bundle = build(model, config, seed=0)
        replica = wrap_replica(bundle.layers)  # as the runtime wraps it
        # Training steps the optimizer after the sync, and a step after DDP's sync was measured
        # slower (~4 ms vs ~2 ms here): time it in both, so the difference holds what sync costs
        # it too. lr 0 keeps the replicas equal while no_sync steps skip the allreduce.
        optimizer = torch.optim.AdamW(replica.parameters(), lr=0.0)
        inputs, targets = bundle.data.batch(range(rank * micro_batch, (rank + 1) * micro_batch))
        synced: list[float] = []
        local: list[float] = []
        for block in range(2 * blocks):
            # Blocks in turn (ABAB...), so drift of a shared machine falls on both alike; each block
            # of one kind, like training, and its first steps not counted.
            times, context = ((synced, nullcontext), (local, replica.no_sync))[block % 2]
            for i in range(warmup + per_block):
                dist.barrier()
                started = time.perf_counter()
                replica.zero_grad(set_to_none=True)
                with context():
                    bundle.loss(replica(inputs), targets).backward()
                optimizer.step()
                if i >= warmup:
                    times.append(time.perf_counter() - started)
        dist.barrier()
        return synced, local
    finally:
        dist.destroy_process_group()


__all__ = ["Slot", "measure_data_parallel_sync", "reap"]
