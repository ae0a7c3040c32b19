"""The predicted iteration time of any candidate plan, in the shared cost model.

A candidate is a list of stages, each a layer range, a micro-batch and the share of the stage's
samples each device computes. Under token scheduling every device pulls work from every stage it
serves, so over one iteration of global batch ``B``:

* ``load(d)  = sum_s samples(s, d) * (compute_per_sample(s, d, b_s) + exchange_per_sample(s, d))
  + tokens(s, d) * token_overhead(d)``
  where ``samples`` apportions whole tokens by share (:func:`token_samples`), the exchange is
  what the device fetches per micro-batch: its input activation from the stage before, its
  output's gradient from the stage after (:meth:`CostModel.mean_fetch_s`), and each token the
  device runs (:func:`stage_tokens`) costs the runtime's work around it
  (:meth:`CostModel.token_overhead_s`);
* ``sync(d)  = sum_{s served by d} exposed_s(d)``: what the allreduce of the stage's gradients
  over its group adds after ``d``'s last backward (the buckets that backward completes early run
  under it, :meth:`CostModel.exposed_sync_s`);
* ``fill     = sum_s fill_s`` (:func:`stage_fill_s`): the pipeline's bubble, one micro-batch's
  forward + backward of each later stage on its slowest member and the first stage's backward,
  and each cut's first activation and last gradient on their way (nothing else is in flight
  then to hide them);
* ``iteration = max_d (load(d) + sync(d)) + fill``.

The ILP minimises exactly this expression (its coefficients come from :func:`stage_device_cost`),
the exhaustive oracle enumerates it, and the baselines are candidates evaluated by it.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from felactl.optimizer.cost import CostModel, boundary_bytes_per_sample, stage_memory_bytes
from felactl.spec.executable import micro_batch_follows


@dataclass(frozen=True)
class StageChoice:
    start: int
    end: int
    micro_batch: int
    shares: tuple[tuple[str, float], ...]
    """(device, fraction of the stage's samples), fractions summing to 1."""

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(d for d, _ in self.shares)


@dataclass(frozen=True)
class Prediction:
    iteration_s: float
    load_s: dict[str, float]
    """Compute + boundary exchange per device."""
    sync_s: dict[str, float]
    fill_s: float
    memory_bytes: dict[str, float]


def in_flight(max_stages: int, global_batch: int, micro_batch: int, whole_model: bool) -> int:
    """Micro-batches of one stage whose activations a device holds at once: one where the stage is
    the whole model (forward, then its backward at once), else the 1F1B bound of ``max_stages``."""
    if whole_model:
        return 1
    return max(1, min(max_stages, math.ceil(global_batch / micro_batch)))


def chain_follows(before: int, after: int, max_stages: int, global_batch: int, *, static: bool) -> bool:
    """Whether a stage of micro-batch ``after`` may follow one of ``before`` in a plan: the
    runtime's rule (:func:`felactl.spec.executable.micro_batch_follows`), and ``after / before``
    at most the earlier stage's in-flight limit (:func:`in_flight`): a worker of the earlier stage
    may have to hold every one of the ``after / before`` micro-batches a next-stage token takes
    before that token can run, and the memory model gives it room for no more than the limit."""
    if not micro_batch_follows(before, after, static=static):
        return False
    return after // before <= in_flight(max_stages, global_batch, before, whole_model=False)


def token_samples(shares: tuple[tuple[str, float], ...], global_batch: int, micro_batch: int) -> dict[str, int]:
    """Samples each worker computes: the stage's ceil(B / b) tokens dealt one at a time to the
    worker that would finish its next token first at a speed proportional to its share (a divisor
    apportionment: ties go to the earlier worker), each worker then taking a contiguous run of
    tokens in worker order; the last token holds what is left of the batch.

    Tokens are indivisible, so this, not ``share * B``, is a worker's load: with few tokens per
    worker the split is coarse, and the planner sees it (and picks a smaller micro-batch)."""
    num_tokens = math.ceil(global_batch / micro_batch)
    counts = [0] * len(shares)
    rates = [max(share, 1e-12) for _, share in shares]
    finish = [(1.0 / rate, k) for k, rate in enumerate(rates)]
    heapq.heapify(finish)
    for _ in range(num_tokens):
        _, k = heapq.heappop(finish)
        counts[k] += 1
        heapq.heappush(finish, ((counts[k] + 1) / rates[k], k))
    samples, first = {}, 0
    for (device, _), count in zip(shares, counts):
        last = min(first + count * micro_batch, global_batch)
        samples[device] = last - first
        first = last
    return samples


def exchange_per_sample_s(cost: CostModel, start: int, end: int, micro_batch: int, device: str) -> float:
    """What a stage's worker on ``device`` fetches, per sample: the activation crossing the cut
    before the stage (its forward's input) and the gradient crossing the cut after it (its
    backward's), one fetch per micro-batch each."""
    total = 0.0
    for boundary in (start, end):
        total += _boundary_fetch_s(cost, boundary, micro_batch, device)
    return total / micro_batch


def _boundary_fetch_s(cost: CostModel, boundary: int, micro_batch: int, device: str) -> float:
    """One micro-batch's tensor at cut ``boundary`` fetched into ``device`` (0 at the model's ends)."""
    return cost.mean_fetch_s(device, boundary_bytes_per_sample(cost.model, boundary) * micro_batch)


def stage_device_cost(cost: CostModel, stage: StageChoice, device: str, samples: int) -> float:
    """Seconds ``device`` spends on ``stage`` in one iteration: compute, exchange, its tokens'
    overhead, the optimizer step and the sync."""
    per_sample = cost.per_sample_s(stage.start, stage.end, device, stage.micro_batch)
    exchange = exchange_per_sample_s(cost, stage.start, stage.end, stage.micro_batch, device)
    tokens = stage_tokens(cost, stage, samples)
    sync = stage_sync_s(cost, stage, device)
    step = cost.optimizer_step_s(stage.start, stage.end, device)
    return samples * (per_sample + exchange) + tokens * cost.token_overhead_s(device) + step + sync


def stage_tokens(cost: CostModel, stage: StageChoice, samples: int) -> int:
    """Tokens a worker claims to run ``samples`` of a stage (:meth:`CostModel.tokens_per_micro_batch`)."""
    return math.ceil(samples / stage.micro_batch) * cost.tokens_per_micro_batch(stage.start, stage.end)


def stage_sync_s(cost: CostModel, stage: StageChoice, device: str) -> float:
    """What the stage's gradient sum adds to ``device``'s iteration after its last backward."""
    return cost.exposed_sync_s(stage.devices, stage.start, stage.end, device, stage.micro_batch)


def stage_fill_s(cost: CostModel, stage: StageChoice) -> float:
    """The pipeline's fill and drain a stage adds: one micro-batch's forward + backward on its
    slowest member, except for a first stage, which adds only its backward (the drain: after the
    last gradient comes back, its micro-batch still has to go through it); and the fetches no
    other work hides, on the member slowest to fetch: a later stage waits for its first input
    activation (the fill), an earlier one for its last output gradient (the drain). Nothing for a
    stage that is the whole model."""
    if cost.whole_model(stage.start, stage.end):
        return 0.0
    times = [cost.stage_times_s(stage.start, stage.end, d, stage.micro_batch) for d in stage.devices]
    compute = max(bwd for _, bwd in times) if stage.start == 0 else max(fwd + bwd for fwd, bwd in times)
    first_input = max(_boundary_fetch_s(cost, stage.start, stage.micro_batch, d) for d in stage.devices)
    last_gradient = max(_boundary_fetch_s(cost, stage.end, stage.micro_batch, d) for d in stage.devices)
    return compute + first_input + last_gradient


def predict(cost: CostModel, stages: tuple[StageChoice, ...], global_batch: int, max_stages: int) -> Prediction:
    """The iteration time of a candidate (see module doc), with its per-device parts."""
    load: dict[str, float] = {}
    sync: dict[str, float] = {}
    memory: dict[str, float] = {}
    for stage in stages:
        held = stage_memory_bytes(
            cost.model,
            stage.start,
            stage.end,
            stage.micro_batch,
            in_flight(
                max_stages,
                global_batch,
                stage.micro_batch,
                whole_model=cost.whole_model(stage.start, stage.end),
            ),
        )
        samples = token_samples(stage.shares, global_batch, stage.micro_batch)
        for device, _ in stage.shares:
            total = stage_device_cost(cost, stage, device, samples[device])
            exposed = stage_sync_s(cost, stage, device)
            load[device] = load.get(device, 0.0) + total - exposed
            sync[device] = sync.get(device, 0.0) + exposed
            memory[device] = memory.get(device, 0.0) + held
    fill = sum(stage_fill_s(cost, stage) for stage in stages)
    busiest = max(load[d] + sync[d] for d in load)
    return Prediction(
        iteration_s=busiest + fill,
        load_s=load,
        sync_s=sync,
        fill_s=fill,
        memory_bytes=memory,
    )


def memory_fits(cost: CostModel, prediction: Prediction) -> str | None:
    """The first device whose predicted memory exceeds what it may fill (its memory less the
    headroom), or None."""
    for device, used in prediction.memory_bytes.items():
        if used > cost.usable_memory_bytes(device):
            return device
    return None
