"""Sharded data parallel (``shard: true``, torch FSDP2): the stage's weights, gradients and AdamW
state split over its ``n`` workers, each layer's weights gathered when it runs.

Priced by the cost model's own parts, nothing overlapped (FSDP2 prefetches the next layer's
weights beside the current one's compute; not counting that keeps the price an upper bound):

* memory per worker: the state over ``n``, plus :data:`GATHERED_UNITS` of the largest layer's
  weights and gradients whole (the one running and the one prefetched; a pipeline's stage: all of
  its layers', gathered at once), plus the activations one micro-batch keeps for its backward;
* time per step: the slowest worker's micro-batches (each worker runs as many: the runtime's rule,
  :func:`felactl.spec.executable.problems`), then per micro-batch an all-gather of the weights for
  the forward and one for the backward, and once a reduce-scatter of the gradients, each half of a
  ring allreduce's traffic over the group plus each unit's host work (the slowest member's: a CPU
  slot under a quota takes many times a core's); then the optimizer step over ``1 / n`` of the state.
"""

from __future__ import annotations

import math

from felactl.optimizer.cost import ADAMW_STATE_BYTES_PER_PARAM, CostModel, micro_batch_options, saved_bytes_per_sample
from felactl.spec import ModelSpec, SyncMode
from felactl.spec.stages import micro_batch_counts
from felactl.spec.sync_modes import Execution, mode_names, modes_where

GATHERED_UNITS = 2
"""Layers whose weights (and, in the backward, gradients) a worker holds whole at once."""


def sharded_memory_bytes(model: ModelSpec, start: int, end: int, micro_batch: int, shards: int) -> float:
    """Bytes one of ``shards`` workers holds for layers ``[start, end)`` sharded among them."""
    layers = model.layers[start:end]
    state = sum(2 * l.param_bytes + ADAMW_STATE_BYTES_PER_PARAM * l.params for l in layers)
    whole = start == 0 and end == model.num_layers
    # the user's module is gathered block by block; a pipeline's stage of a split model runs its
    # traced graph, not its blocks' forwards, so FSDP gathers it whole (agents/worker/engine.py)
    largest = max((l.param_bytes for l in layers), default=0)
    gathered = 2 * (GATHERED_UNITS * largest if whole else sum(l.param_bytes for l in layers))
    activations = sum(saved_bytes_per_sample(model, i) for i in range(start, end)) * micro_batch
    return state / shards + gathered + activations


def shard_micro_batches(global_batch: int, workers: int) -> list[int]:
    """The micro-batches a sharded stage of ``workers`` can run: each gives every worker as many
    under the runtime's equal split (:func:`felactl.spec.executable.problems` refuses else), up to
    the first that holds a worker's whole share (past it, each is that one step again)."""
    per_worker = math.ceil(global_batch / workers)
    options = [b for b in micro_batch_options(global_batch, largest=2 * per_worker) if b < 2 * per_worker]
    return [b for b in options if len(set(micro_batch_counts(global_batch, [1.0] * workers, b))) == 1]


def micro_batches_each(global_batch: int, workers: int, micro_batch: int) -> int:
    """Micro-batches every worker of a sharded stage runs per step (equal shares)."""
    return math.ceil(math.ceil(global_batch / workers) / micro_batch)


def fsdp_units(model: ModelSpec, start: int, end: int) -> int:
    """The units gathered one at a time when layers ``[start, end)`` are sharded: the whole model's
    blocks and its root (which holds the embedding and the head); a pipeline's stage, one. (The
    profile does not say whether a model is an ``nn.Sequential``, which the runtime shards as one
    unit: its whole-model gathers are counted as a split model's, an upper bound.)"""
    whole = start == 0 and end == model.num_layers
    return max(1, model.num_layers - 1) if whole else 1


def sharded_comm_s(cost: CostModel, devices: tuple[str, ...], start: int, end: int, micro_batches: int) -> float:
    """Seconds of a step's gathers and its reduce-scatter over ``devices``: their bytes, and each
    unit's host work per gather (:meth:`CostModel.gather_overhead_s`)."""
    nbytes = sum(layer.param_bytes for layer in cost.model.layers[start:end])
    half_allreduce_s = cost.ring_sync_s(devices, nbytes) / 2
    collectives = 2 * micro_batches + 1
    return collectives * (half_allreduce_s + fsdp_units(cost.model, start, end) * cost.gather_overhead_s(devices))


def sharded_iteration_s(cost: CostModel, devices: tuple[str, ...], global_batch: int, micro_batch: int) -> float:
    """A step of the whole model sharded over ``devices`` at ``micro_batch``."""
    layers = cost.model.num_layers
    count = micro_batches_each(global_batch, len(devices), micro_batch)
    compute = max(count * sum(cost.stage_times_s(0, layers, d, micro_batch)) for d in devices)
    step = max(cost.optimizer_step_s(0, layers, d) for d in devices) / len(devices)
    return compute + sharded_comm_s(cost, devices, 0, layers, count) + step


def best_sharded(cost: CostModel, global_batch: int, devices: tuple[str, ...] | None = None) -> tuple[float, int] | str:
    """The fastest micro-batch at which the whole model sharded over ``devices`` (default: every
    device) fits each one's usable memory, and its iteration seconds; or why none does (one line)."""
    devices = devices or tuple(cost.cluster.device_names)
    if len(devices) < 2:
        return "needs two devices or more to shard over"
    usable = min(cost.usable_memory_bytes(d) for d in devices)
    best, closest = None, None
    for b in shard_micro_batches(global_batch, len(devices)):
        need = sharded_memory_bytes(cost.model, 0, cost.model.num_layers, b, len(devices))
        if need > usable:
            closest = need if closest is None else min(closest, need)
            continue
        seconds = sharded_iteration_s(cost, devices, global_batch, b)
        if best is None or seconds < best[0]:
            best = (seconds, b)
    if best is not None:
        return best
    if closest is not None:
        return (
            f"does not fit sharded either: needs {closest / 1e9:.3g} GB per device "
            f"({usable / 1e9:.3g} GB usable on the smallest)"
        )
    return f"the global batch {global_batch} gives {len(devices)} devices no micro-batch of which each runs as many"


def best_shard_group(cost: CostModel, global_batch: int) -> tuple[float, int, tuple[str, ...]] | str:
    """The planner's sharded candidate: the group of devices (two or more) whose step is shortest,
    with its seconds and micro-batch; or why even every device does not hold the model.

    A sharded stage's workers run equal shares in lockstep (every gather waits for all of them),
    so a slow device slows every step, and leaving it out can pay even though each of the others
    then holds more of the state. Groups are the k fastest of the devices with at least so much
    memory, for each memory size the cluster has: with equal shares, any other group of k of them
    is no faster, and a fast device with little memory (which keeps every group it is in from
    fitting) does not keep the larger ones from being tried without it."""
    names = cost.cluster.device_names
    by_speed = sorted(names, key=lambda d: cost.per_sample_s(0, cost.model.num_layers, d, 1))
    best, tried = None, set()
    for floor in sorted({cost.usable_memory_bytes(d) for d in names}):
        order = [d for d in by_speed if cost.usable_memory_bytes(d) >= floor]
        for k in range(2, len(order) + 1):
            group = tuple(d for d in names if d in order[:k])  # the cluster's rank order
            if group in tried:
                continue
            tried.add(group)
            found = best_sharded(cost, global_batch, group)
            if not isinstance(found, str) and (best is None or found[0] < best[0]):
                best = (*found, group)
    return best if best is not None else best_sharded(cost, global_batch)


def sharding_hint(found: dict, missing: dict[str, str], mode: SyncMode) -> str:
    """Where a sharded plan would fit but ``mode`` cannot run one: what to ask for instead; where
    it would not fit either, why (with the numbers)."""
    if "fsdp" not in found:
        return f"; sharded over every device: {missing['fsdp']}" if "fsdp" in missing else ""
    runs = mode_names(modes_where(lambda row: Execution.SHARDED in row.executions))
    return (
        f"; sharded over every device it fits ({found['fsdp'].iteration_s:.4g} s per step), which sync {runs} "
        f"runs, not sync {mode.value}: plan with --sync {runs.split(' ')[0].rstrip(',')}"
    )
