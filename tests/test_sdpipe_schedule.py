"""SDPipe's group schedulers, one per stage, driven by pipelines that couple their stages.

A pipeline's step ends in no stage before every stage of it has left the sync of the step before
(1F1B sends activations down and gradients up), so a worker the scheduler holds for a connection
holds its whole pipeline. The schedulers of two stages must never hold two pipelines each waiting
for the other: this simulates S stages x N pipelines in event time, with the real
:class:`GroupScheduler`, and fails on a state where nothing can move before every step is done.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass

import pytest

from felactl.agents.worker.sync.groups import GroupScheduler


@dataclass
class Simulated:
    steps_done: list[int]
    """Each pipeline's steps when nothing could move any more (all ``steps`` unless deadlocked)."""
    connections: list[int]
    """How often each stage's groups connected every replica."""
    released_unconnected: int = 0
    """Workers held for a connection that went on without one."""


def simulate(pipelines: int, stages: int, steps: int, connect_every: int, seed: int) -> Simulated:
    """Run every pipeline up to ``steps`` local steps, until nothing can move any more."""
    rng = random.Random(seed)
    rank = {(p, s): p * stages + s for p in range(pipelines) for s in range(stages)}
    schedulers = [
        GroupScheduler([rank[p, s] for p in range(pipelines)], 2, 0.001, connect_every) for s in range(stages)
    ]
    pace = [rng.uniform(0.5, 3.0) for _ in range(pipelines)]
    left = {(p, s): 0.0 for p in range(pipelines) for s in range(stages)}  # when each left its last sync
    done_steps = [0] * pipelines
    leaving = {key: 0 for key in left}  # steps each worker finished its sync of
    events: list[tuple[float, int, int]] = []
    unconnected = 0

    def start_step(p: int) -> None:
        """Step ``done_steps[p]`` of pipeline p starts once every stage of it left its last sync; the
        last stage finishes it first (its backward starts the gradients' way up)."""
        begin = max(left[p, s] for s in range(stages))
        length = pace[p] * rng.uniform(0.8, 1.6)
        for s in range(stages):
            heapq.heappush(events, (begin + length * (1 + 0.05 * (stages - 1 - s)), p, s))

    def release(s: int, members: list[int], now: float) -> None:
        held = set(getattr(schedulers[s], "held", ()))
        for member in members:
            if member in held:
                continue
            p = member // stages
            left[p, s] = now
            leaving[p, s] += 1
            if all(leaving[p, t] == done_steps[p] + 1 for t in range(stages)):
                done_steps[p] += 1
                if done_steps[p] < steps:
                    start_step(p)
                else:
                    for t in range(stages):
                        schedulers[t].leave(rank[p, t])

    for p in range(pipelines):
        start_step(p)
    now = 0.0
    while True:
        for s, scheduler in enumerate(schedulers):
            held, connections = set(getattr(scheduler, "held", ())), getattr(scheduler, "connections", 0)
            for group in scheduler.poll(now):
                released = held - set(getattr(scheduler, "held", ()))
                unconnected += len(released) if getattr(scheduler, "connections", 0) == connections else 0
                release(s, group, now)
        deadlines = [d for d in (sched.deadline() for sched in schedulers) if d is not None]
        if not events and not deadlines:
            break
        upcoming = min(([events[0][0]] if events else []) + deadlines)
        if deadlines and min(deadlines) <= upcoming:
            now = max(now, min(deadlines))
            continue
        now, p, s = heapq.heappop(events)
        schedulers[s].arrive(rank[p, s], now)
    return Simulated(done_steps, [getattr(sched, "connections", 0) for sched in schedulers], unconnected)


@pytest.mark.parametrize("pipelines,stages", [(2, 2), (3, 2), (2, 3), (4, 3)])
def test_no_two_stage_schedulers_hold_pipelines_that_wait_on_each_other(pipelines, stages):
    """Every pipeline finishes its steps (the old scheduler deadlocked here in every shape); each
    held worker goes on only at a connection, and every stage's replicas connect at least once
    every ``connect_every`` steps of a pipeline."""
    steps, connect_every = 40, 2
    for seed in range(60):
        run = simulate(pipelines, stages, steps, connect_every, seed)
        assert run.steps_done == [steps] * pipelines, f"seed {seed}: deadlocked at steps {run.steps_done}"
        assert run.released_unconnected == 0, f"seed {seed}: a held worker went on unconnected"
        assert min(run.connections) >= steps // connect_every, f"seed {seed}: connections {run.connections}"
