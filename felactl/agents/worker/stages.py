"""Where this rank sits in the plan, and which samples it computes: pure functions over the plan.

A rank's device is ``plan.devices[rank]``. In data parallel (one stage) the replica index is the
device's position in the stage's worker list; with static pipelines (``1f1b``/``gpipe``) it is the
pipeline (``plan.pipelines[r]``) that holds the device. The samples of step ``k`` are
``k * global_batch + offset``; the offsets are split among replicas by their shares.
"""

from __future__ import annotations

from dataclasses import dataclass

from felactl.spec import Plan, Schedule
from felactl.spec.stages import split_by_shares


@dataclass(frozen=True, slots=True)
class Placement:
    rank: int
    stage: int
    replica: int
    offsets: range
    """This replica's sample offsets within each step's global batch (static split by shares)."""
    stage_ranks: tuple[int, ...]
    """Ranks that run this rank's stage (its sync group), in the stage's worker order."""
    prev_rank: int | None = None
    """Static pipelines: the rank of the previous stage in this rank's pipeline."""
    next_rank: int | None = None

    @property
    def is_first(self) -> bool:
        return self.prev_rank is None

    @property
    def is_last(self) -> bool:
        return self.next_rank is None


def micro_batches(offsets: range, micro_batch: int) -> list[range]:
    return [offsets[i : i + micro_batch] for i in range(0, len(offsets), micro_batch)]


def place(plan: Plan, rank: int) -> Placement:
    device = plan.devices[rank]
    if len(plan.stages) == 1:
        stage = plan.stages[0]
        replica = stage.devices.index(device)
        offsets = split_by_shares(plan.global_batch, [w.share for w in stage.workers])[replica]
        return Placement(rank, 0, replica, offsets, tuple(plan.rank_of(d) for d in stage.devices))
    if plan.schedule is Schedule.TOKENS:
        # Flexible hybrid: the rank may run several stages; its "home" is the first one it is in.
        s = next(i for i, stage in enumerate(plan.stages) if device in stage.devices)
        stage = plan.stages[s]
        return Placement(rank, s, stage.devices.index(device), range(0), tuple(plan.rank_of(d) for d in stage.devices))
    # One slot per device: felactl.spec.executable's rule 6, checked at the worker's start.
    replica, s = next((r, s) for r, pipe in enumerate(plan.pipelines) for s, d in enumerate(pipe) if d == device)
    pipe = plan.pipelines[replica]
    first = plan.stages[0]
    shares = [first.workers[first.devices.index(p[0])].share for p in plan.pipelines]
    offsets = split_by_shares(plan.global_batch, shares)[replica]
    stage_ranks = tuple(plan.rank_of(p[s]) for p in plan.pipelines)
    return Placement(
        rank,
        s,
        replica,
        offsets,
        stage_ranks,
        prev_rank=plan.rank_of(pipe[s - 1]) if s > 0 else None,
        next_rank=plan.rank_of(pipe[s + 1]) if s + 1 < len(pipe) else None,
    )


def held_stages(plan: Plan, rank: int) -> list[int]:
    """The stages whose layers ``rank`` holds: its placement's one, or under the flexible hybrid
    every sub-model its device may run."""
    if len(plan.stages) > 1 and plan.schedule is Schedule.TOKENS:
        device = plan.devices[rank]
        return [s for s, stage in enumerate(plan.stages) if device in stage.devices]
    return [place(plan, rank).stage]


def stage_rank_sets(plan: Plan) -> list[tuple[int, ...]]:
    """Every stage's ranks in plan order (static pipelines: in pipeline order), the same list on
    every rank: the stages' process groups are created from it, collectively."""
    if len(plan.stages) > 1 and plan.schedule is not Schedule.TOKENS:
        return [tuple(plan.rank_of(p[s]) for p in plan.pipelines) for s in range(len(plan.stages))]
    return [tuple(plan.rank_of(d) for d in stage.devices) for stage in plan.stages]
