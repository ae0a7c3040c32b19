"""A flexible plan that is one chain of devices runs as a static 1F1B pipeline.

The flexible hybrid's ILP (sync ``bsp`` and ``tokens``) may put each stage on one device and
every device in one stage: a chain, where no worker can take another's token. Run by the tokens
runtime, every forward and backward is still a request to rank 0's token server and its reply,
and every input a request to its producer: on the ``two-servers`` testbed (stages alternating over
a 2 ms link) that runtime measured 61 samples/s where the same stages as a static 1F1B pipeline
(point-to-point sends, no server) measured 99, 0.55 and 0.90 of the plan's prediction (BENCHMARKS.md,
"One chain as a static pipeline"). Such a plan is therefore written as one static pipeline, where
1F1B's in-flight micro-batches (``S - s`` at stage ``s``) fit every device's memory; else it stays a
flexible plan, whose in-flight limits the memory model set.

The ILP prices a stage's devices by their speed and memory, not the order the chain visits them
in: on two-servers it chained its four equal nodes across the thin link three times where once
would do. :func:`in_chain_order` deals a chain's devices again among the stages whose devices time
and hold them alike, for the fewest seconds on the links between neighbours.

A flexible plan whose every stage holds R >= 2 devices (R equal chains side by side) may run as R
static 1F1B pipelines instead, the stages' replicas summing their gradients once a step: the
token server's round trips go, and so does the tokens runtime's balancing between a stage's
devices (each pipeline takes an equal share). :func:`as_static_pipelines` writes one chain so
always, and R >= 2 where the simulator, which prices both runtimes, finds the pipelines no slower:
a tie goes to them (on two-servers two such chains ran 1.37x as pipelines; the tokens runtime
ran 0.70 of its price until each token's wait for the token server's answer was priced,
:meth:`~felactl.optimizer.cost.CostModel.claim_s`). Pure: stage arithmetic and the simulator.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import replace

from felactl.errors import InputError
from felactl.optimizer.cost import CostModel, boundary_bytes_per_sample, stage_memory_bytes
from felactl.optimizer.evaluate import StageChoice
from felactl.optimizer.simulator import simulate
from felactl.spec import Plan, Schedule, check_executable


def one_f_one_b_in_flight(num_stages: int, stage: int, global_batch: int, micro_batch: int) -> int:
    """Micro-batches 1F1B holds at ``stage``: its warm-up forwards and one more, at most all of them."""
    return min(num_stages - stage, math.ceil(global_batch / micro_batch))


def chain_devices(stages: Sequence) -> list[str] | None:
    """The devices of ``stages`` (a plan's or the ILP's) where they are a chain: two or more
    stages, none sharded, each on one device, each device in one stage; else None."""
    if len(stages) < 2 or any(len(st.devices) != 1 or st.shard for st in stages):
        return None
    devices = [st.devices[0] for st in stages]
    return devices if len(set(devices)) == len(devices) else None


MAX_ORDERS = 5040
"""Orders of a chain's devices :func:`in_chain_order` weighs at most (7!: seven alike devices);
a chain with more keeps the ILP's."""


ALIKE = 1.05
"""Devices of one kind and memory whose times for the chain's stages differ by at most this
factor are alike (the same GPU, or CPU share, measured a few percent apart)."""


def _alike(cost: CostModel, stages: Sequence[StageChoice], devices: Sequence[str]) -> list[list[int]]:
    """The chain's positions in classes whose devices could swap stages: one kind and memory, and
    times for the chain's stages within :data:`ALIKE` of each other; a kind whose devices differ
    more (one throttled, one straggling) is no class: each of its devices keeps its stage."""
    kinds: dict[tuple, list[int]] = {}
    for position, device in enumerate(devices):
        kinds.setdefault((cost.cluster.device(device).model, cost.usable_memory_bytes(device)), []).append(position)

    def total_s(device: str) -> float:
        return sum(sum(cost.stage_times_s(st.start, st.end, device, st.micro_batch)) for st in stages)

    classes = []
    for positions in kinds.values():
        times = [total_s(devices[p]) for p in positions]
        alike = max(times) <= ALIKE * min(times)
        classes += [positions] if alike else [[p] for p in positions]
    return classes


def in_chain_order(cost: CostModel, stages: Sequence[StageChoice]) -> tuple[StageChoice, ...]:
    """``stages`` (the ILP's) with a chain's devices re-dealt (module doc): each stage keeps a
    device that times its layers and holds as much as the one the ILP gave it, and the order chosen
    spends the fewest seconds sending each micro-batch's activations forward and its gradients
    back between neighbours; the ILP's order where no other is faster, or where it is no chain."""
    stages = tuple(stages)
    devices = chain_devices(stages)
    if devices is None:
        return stages

    classes = _alike(cost, stages, devices)
    if math.prod(math.factorial(len(p)) for p in classes) > MAX_ORDERS:
        return stages

    def hops_s(order: Sequence[str]) -> float:
        total = 0.0
        for s, (a, b) in enumerate(zip(order, order[1:])):
            nbytes = boundary_bytes_per_sample(cost.model, stages[s].end) * stages[s].micro_batch
            total += cost.link_time_s(a, b, nbytes) + cost.link_time_s(b, a, nbytes)
        return total

    best, best_s = devices, hops_s(devices)
    for dealt in itertools.product(*(itertools.permutations(p) for p in classes)):
        order = list(devices)
        for places, shuffled in zip(classes, dealt):
            for place, source in zip(places, shuffled):
                order[place] = devices[source]
        if (seconds := hops_s(order)) < best_s - 1e-12:
            best, best_s = order, seconds
    return tuple(replace(st, shares=((d, 1.0),)) for st, d in zip(stages, best))


def as_static_pipelines(plan: Plan, cost: CostModel) -> Plan:
    """``plan`` as R static 1F1B pipelines where it is a flexible plan of R equal chains (module
    doc): one chain always, R >= 2 where the simulator finds the pipelines no slower than the
    tokens runtime. Else ``plan`` itself."""
    static = _as_pipelines(plan, cost)
    if static is None:
        return plan
    if len(static.pipelines) == 1:
        return static
    ranked = replace(cost, ring_order=plan.devices)  # as the planner prices it: its rings in its rank order
    return static if simulate(static, ranked).iteration_s <= simulate(plan, ranked).iteration_s else plan


def _as_pipelines(plan: Plan, cost: CostModel) -> Plan | None:
    """``plan``'s stages as R static 1F1B pipelines, pipeline r the r-th device of each stage,
    each an equal share of the batch, each stage with 1F1B's in-flight count as its limit and
    memory. None where ``plan`` is no R equal chains (a static or sharded plan, stages of unlike
    widths or micro-batches, a device in two stages), or 1F1B's activations do not fit a device,
    or the shares do not split the batch into whole micro-batches."""
    stages = plan.stages
    widths = {len(st.workers) for st in stages}
    if (
        plan.schedule is not Schedule.TOKENS
        or len(stages) < 2
        or len(widths) != 1
        or any(st.shard for st in stages)
        or len({st.micro_batch for st in stages}) != 1
        or len({d for st in stages for d in st.devices}) != sum(len(st.devices) for st in stages)
    ):
        return None
    width = widths.pop()
    share = round(1 / width, 9)
    piped = []
    for s, stage in enumerate(stages):
        flight = one_f_one_b_in_flight(len(stages), s, plan.global_batch // width, stage.micro_batch)
        memory = stage_memory_bytes(cost.model, stage.layer_start, stage.layer_end, stage.micro_batch, flight)
        if any(memory > cost.usable_memory_bytes(d) for d in stage.devices):
            return None
        workers = [replace(w, share=share, predicted_memory_gb=round(memory / 1e9, 4)) for w in stage.workers]
        workers[0] = replace(workers[0], share=round(1.0 - share * (width - 1), 9))
        piped.append(replace(stage, workers=tuple(workers), max_in_flight=flight))
    static = replace(
        plan,
        stages=tuple(piped),
        schedule=Schedule.ONE_F_ONE_B,
        pipelines=tuple(tuple(st.devices[r] for st in stages) for r in range(width)),
    )
    try:
        check_executable(static)
    except InputError:
        return None
    return static
