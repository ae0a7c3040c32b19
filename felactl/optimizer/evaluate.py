"""The predicted iteration time of any candidate plan, in the shared cost model.

A candidate is a list of stages, each a layer range, a micro-batch and the share of the stage's
samples each device computes. Under token scheduling every device pulls work from every stage it
serves, so over one iteration of global batch ``B``:

* ``load(d)  = sum_s samples(s, d) * (compute_per_sample(s, d, b_s) + exchange_per_sample(s, d))
  + tokens(s, d) * claim(s, d)``
  where ``samples`` apportions whole tokens by share (:func:`token_samples`), the exchange is
  what the device fetches per micro-batch: its input activation from the stage before, its
  output's gradient from the stage after (:meth:`CostModel.mean_fetch_s`), and each token the
  device runs (:func:`stage_tokens`) costs the runtime's work around it
  (:meth:`CostModel.claim_s`);
* ``sync(d)  = sum_{s served by d} exposed_s(d)``: what the allreduce of the stage's gradients
  over its group adds after ``d``'s last backward (the buckets that backward completes early run
  under it, :meth:`CostModel.exposed_sync_s`);
* ``fill     = sum_s fill_s`` (:func:`stage_fill_s`): the pipeline's bubble, one micro-batch's
  forward + backward of each later stage on its slowest member and the first stage's backward,
  and each cut's first activation and last gradient on their way (nothing else is in flight
  then to hide them);
* ``held(s, d) = rounds * (r * fwd + after_s) + n * bwd + before_s + sync_s(d) + step_s(d)`` for
  a stage ``s`` whose in-flight limit ``k_s`` is below the ``n`` tokens worker ``d`` runs of it
  and which a stage of ``r`` times its micro-batch follows (:func:`held_terms`), ``fwd`` and
  ``bwd`` its forward and backward token on ``d`` (compute, the tensor it fetches, the runtime's
  work): a next-stage token takes ``r`` of its micro-batches at once, so ``k = r * (k_s // r)``
  of them are out at a time. In each of ``rounds = ceil(n / k)`` rounds, ``d`` runs a group of
  ``r`` forwards, which then go through the later stages and back (``after_s``, the sum of their
  :func:`stage_latency_s`) while ``d`` runs its other forwards; the later stage's workers run the
  round's micro-batches side by side, so their gradients come back together and ``d`` runs the
  backwards, deeper in the token DAG, before its next forward. ``before_s`` (the earlier stages'
  latencies) brings the first input and takes the last gradient away. Where the limit binds, the
  plan runs at this pace, not ``load``'s: a 36-GPU plan whose limit held each worker to 4
  micro-batches was priced 6.99 s without it and simulated 9.89 s. Where one worker of a later
  stage runs a round's micro-batches one after the other, their gradients come back apart and
  ``d`` overlaps more than this counts (a 2-device pipeline held to 2 in flight: 23% above the
  simulator);
* ``iteration = max(max_d (load(d) + sync(d)) + fill, max_{s, d} held(s, d))``.

The ILP minimises exactly this expression (its coefficients come from :func:`stage_device_cost`
and :func:`held_terms`), the exhaustive oracle enumerates it, and the baselines are candidates evaluated by it.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, replace

from felactl.optimizer.cost import CostModel, boundary_bytes_per_sample, stage_memory_bytes
from felactl.spec.executable import micro_batch_follows


@dataclass(frozen=True)
class StageChoice:
    start: int
    end: int
    micro_batch: int
    shares: tuple[tuple[str, float], ...]
    """(device, fraction of the stage's samples), fractions summing to 1."""
    in_flight: int | None = None
    """Micro-batches of the stage a worker may hold at once (the plan's ``Stage.max_in_flight``);
    None: the planner's default (:func:`in_flight`), what the search space prices. The planner
    raises it to what memory holds (:func:`memory_limits`)."""
    shard: bool = False
    """Whether its workers shard the stage (FSDP2; :mod:`felactl.optimizer.sharding` prices it)."""

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
    held_s: float = 0.0
    """The largest ``held(s, d)`` (module doc): the iteration where an in-flight limit sets the
    pace; 0 where no limit binds."""


def in_flight(max_stages: int, global_batch: int, micro_batch: int, whole_model: bool) -> int:
    """Micro-batches of one stage whose activations a device holds at once: one where the stage is
    the whole model (forward, then its backward at once), else the 1F1B bound of ``max_stages``."""
    if whole_model:
        return 1
    return max(1, min(max_stages, math.ceil(global_batch / micro_batch)))


def stage_in_flight(cost: CostModel, stage: StageChoice, global_batch: int, max_stages: int) -> int:
    """The in-flight limit of ``stage``: its own (:attr:`StageChoice.in_flight`), else the default."""
    if stage.in_flight is not None:
        return stage.in_flight
    return in_flight(max_stages, global_batch, stage.micro_batch, whole_model=cost.whole_model(stage.start, stage.end))


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
    return samples * (per_sample + exchange) + tokens * cost.claim_s(stage.start, stage.end, device) + step + sync


def held_terms(
    cost: CostModel, stage: StageChoice, device: str, samples: int, limit: int, next_micro_batch: int
) -> tuple[int, float] | None:
    """``(rounds, base_s)`` of ``held(s, d) = base_s + rounds * after_s + before_s`` (module doc)
    for ``device``'s ``samples`` of ``stage`` under in-flight limit ``limit``, followed by a stage
    of micro-batch ``next_micro_batch``; None where the limit does not bind: the device runs no
    more tokens than it may hold."""
    tokens = math.ceil(samples / stage.micro_batch)
    if tokens <= limit:
        return None
    group = max(1, next_micro_batch // stage.micro_batch)
    slots = group * max(1, limit // group)
    fwd_s, bwd_s = cost.stage_times_s(stage.start, stage.end, device, stage.micro_batch)
    overhead_s = cost.tokens_per_micro_batch(stage.start, stage.end) * cost.claim_s(stage.start, stage.end, device) / 2
    forward_s = fwd_s + _boundary_fetch_s(cost, stage.start, stage.micro_batch, device) + overhead_s
    backward_s = bwd_s + _boundary_fetch_s(cost, stage.end, stage.micro_batch, device) + overhead_s
    rounds = math.ceil(tokens / slots)
    after_work_s = stage_sync_s(cost, stage, device) + cost.optimizer_step_s(stage.start, stage.end, device)
    return rounds, rounds * group * forward_s + tokens * backward_s + after_work_s


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


def stage_latency_s(cost: CostModel, stage: StageChoice) -> float:
    """One micro-batch through ``stage`` on its slowest member: its input fetched, its forward,
    its output's gradient fetched, its backward, each with the runtime's work around its token."""
    fetch = max(exchange_per_sample_s(cost, stage.start, stage.end, stage.micro_batch, d) for d in stage.devices)
    token = max(
        sum(cost.stage_times_s(stage.start, stage.end, d, stage.micro_batch))
        + cost.tokens_per_micro_batch(stage.start, stage.end) * cost.claim_s(stage.start, stage.end, d)
        for d in stage.devices
    )
    return token + fetch * stage.micro_batch


def predict(cost: CostModel, stages: tuple[StageChoice, ...], global_batch: int, max_stages: int) -> Prediction:
    """The iteration time of a candidate (see module doc), with its per-device parts."""
    load: dict[str, float] = {}
    sync: dict[str, float] = {}
    memory: dict[str, float] = {}
    fills = [stage_fill_s(cost, stage) for stage in stages]
    latencies = [stage_latency_s(cost, stage) for stage in stages]
    held = 0.0
    for s, stage in enumerate(stages):
        limit = stage_in_flight(cost, stage, global_batch, max_stages)
        stage_bytes = stage_memory_bytes(cost.model, stage.start, stage.end, stage.micro_batch, limit)
        samples = token_samples(stage.shares, global_batch, stage.micro_batch)
        for device, _ in stage.shares:
            total = stage_device_cost(cost, stage, device, samples[device])
            exposed = stage_sync_s(cost, stage, device)
            load[device] = load.get(device, 0.0) + total - exposed
            sync[device] = sync.get(device, 0.0) + exposed
            memory[device] = memory.get(device, 0.0) + stage_bytes
            if s + 1 == len(stages):
                continue  # no later stage holds its micro-batches
            terms = held_terms(cost, stage, device, samples[device], limit, stages[s + 1].micro_batch)
            if terms is not None:
                rounds, base_s = terms
                held = max(held, base_s + rounds * sum(latencies[s + 1 :]) + sum(latencies[:s]))
    fill = sum(fills)
    busiest = max(load[d] + sync[d] for d in load)
    return Prediction(
        iteration_s=max(busiest + fill, held),
        load_s=load,
        sync_s=sync,
        fill_s=fill,
        memory_bytes=memory,
        held_s=held,
    )


def memory_limits(
    cost: CostModel, stages: tuple[StageChoice, ...], global_batch: int, max_stages: int
) -> tuple[StageChoice, ...]:
    """``stages`` with each pipeline stage's in-flight limit raised from the default the search
    priced to as many of its micro-batches as memory holds on every one of its workers, the other
    stages they serve held at their limits; earlier stages first, whose micro-batches are away the
    longest. A stage whose workers hold all its micro-batches gets them all: no limit (a limit
    memory does not need only slows a pipeline down: the default of 4 ran a 4-device plan 1.75x
    slower than it would without). Whole-model stages keep theirs (one micro-batch: forward, then
    its backward at once)."""
    limits = [stage_in_flight(cost, st, global_batch, max_stages) for st in stages]
    held: dict[str, float] = {}
    for st, limit in zip(stages, limits):
        for d in st.devices:
            held[d] = held.get(d, 0.0) + stage_memory_bytes(cost.model, st.start, st.end, st.micro_batch, limit)
    raised = []
    for st, limit in zip(stages, limits):
        if not cost.whole_model(st.start, st.end):
            weights = stage_memory_bytes(cost.model, st.start, st.end, st.micro_batch, 0)
            per_micro_batch = stage_memory_bytes(cost.model, st.start, st.end, st.micro_batch, 1) - weights
            room = min(cost.usable_memory_bytes(d) - held[d] for d in st.devices)
            more = math.ceil(global_batch / st.micro_batch) - limit
            if per_micro_batch > 0:
                more = min(more, max(0, math.floor(room / per_micro_batch)))
            for d in st.devices:
                held[d] += max(0, more) * per_micro_batch
            limit += max(0, more)
        raised.append(replace(st, in_flight=limit))
    return tuple(raised)


def memory_fits(cost: CostModel, prediction: Prediction) -> str | None:
    """The first device whose predicted memory exceeds what it may fill (its memory less the
    headroom), or None."""
    for device, used in prediction.memory_bytes.items():
        if used > cost.usable_memory_bytes(device):
            return device
    return None
