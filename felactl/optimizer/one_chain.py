"""A flexible plan that is one chain of devices runs as a static 1F1B pipeline.

The flexible hybrid's ILP (sync ``bsp`` and ``tokens``) may put each stage on one device and
every device in one stage: a chain, where no worker can take another's token. Run by the tokens
runtime, every forward and backward is still a request to rank 0's token server and its reply,
and every input a request to its producer: on the ``two-servers`` testbed (stages alternating over
a 2 ms link) that runtime measured 61 samples/s where the same stages as a static 1F1B pipeline
(point-to-point sends, no server) measured 99, 0.55 and 0.90 of the plan's prediction (BENCHMARKS.md,
"One chain as a static pipeline"). Such a plan is therefore written as one static pipeline, where
1F1B's in-flight micro-batches (``S - s`` at stage ``s``) fit every device's memory; else it stays a
flexible plan, whose in-flight limits the memory model set. Pure: stage arithmetic only.
"""

from __future__ import annotations

import math
from dataclasses import replace

from felactl.optimizer.cost import CostModel, stage_memory_bytes
from felactl.spec import Plan, Schedule


def one_f_one_b_in_flight(num_stages: int, stage: int, global_batch: int, micro_batch: int) -> int:
    """Micro-batches 1F1B holds at ``stage``: its warm-up forwards and one more, at most all of them."""
    return min(num_stages - stage, math.ceil(global_batch / micro_batch))


def as_one_pipeline(plan: Plan, cost: CostModel) -> Plan:
    """``plan`` as one static 1F1B pipeline where it is a flexible chain (module doc): each stage
    with 1F1B's in-flight count as its limit and memory. Else ``plan`` itself: several devices in
    a stage or one device in several, micro-batches that differ, a sharded stage, or 1F1B's
    activations more than a device's usable memory."""
    stages = plan.stages
    devices = [stage.devices for stage in stages]
    if plan.schedule is not Schedule.TOKENS or len(stages) < 2 or any(len(d) != 1 for d in devices):
        return plan
    if len({d[0] for d in devices}) != len(stages) or len({stage.micro_batch for stage in stages}) != 1:
        return plan
    if any(stage.shard for stage in stages):
        return plan
    piped = []
    for s, stage in enumerate(stages):
        flight = one_f_one_b_in_flight(len(stages), s, plan.global_batch, stage.micro_batch)
        memory = stage_memory_bytes(cost.model, stage.layer_start, stage.layer_end, stage.micro_batch, flight)
        if memory > cost.usable_memory_bytes(stage.devices[0]):
            return plan
        worker = replace(stage.workers[0], share=1.0, predicted_memory_gb=round(memory / 1e9, 4))
        piped.append(replace(stage, workers=(worker,), max_in_flight=flight))
    chain = (tuple(d[0] for d in devices),)
    return replace(plan, stages=tuple(piped), schedule=Schedule.ONE_F_ONE_B, pipelines=chain)
