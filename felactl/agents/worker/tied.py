"""Weights that two stages of a pipeline hold (GPT-2's ``lm_head`` is its ``wte``): each stage
steps its own copy, so their gradients are summed over the stages that hold them before the step
(as Megatron sums the embedding's over the first and last stage), and counted once in the norm
that clipping reads. The copies start equal (every worker builds the model from one seed) and
stay equal: the same gradients through the same optimizer."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from felactl import models
from felactl.errors import InputError
from felactl.models import split
from felactl.parallel.fsdp import local
from felactl.spec import Plan, Schedule
from felactl.spec.checks import sharded_unlike


@dataclass(frozen=True, slots=True)
class Tied:
    name: str
    """The weight's name in the model (any of its names: a stage holds it under all of them)."""
    stages: tuple[int, ...]
    """The stages that hold it, in order."""


def tied_weights(plan: Plan, bundle: models.ModelBundle) -> list[Tied]:
    """The weights several of ``plan``'s stages hold (none for one stage or an unsplit model)."""
    if len(plan.stages) < 2 or not bundle.split_points:
        return []
    ranges = [(s.layer_start, s.layer_end) for s in plan.stages]
    return [Tied(name, stages) for name, stages in split.tied_weights(bundle.split_graph, bundle.model, ranges)]


def check_sharded_ties(plan: Plan, tied: list[Tied]) -> None:
    """A tied weight's copies sum shard by shard only where every stage holding it is sharded the
    same way (or none is); refuse (InputError) a plan that shards some of them."""
    for t in tied:
        if sharded_unlike(plan, t.stages):
            held = ", ".join(f"stage {s} ({'sharded' if plan.stages[s].shard else 'replicated'})" for s in t.stages)
            raise InputError(
                f"the tied weight {t.name!r} is on {held}: shard all of these stages over as many workers, or none"
            )


def holders(plan: Plan, t: Tied) -> tuple[int, ...]:
    """Under the flexible hybrid: every rank that holds a stage holding ``t`` (a rank that runs
    two of them holds one copy: its stages share the tensor)."""
    return tuple(sorted({plan.rank_of(d) for s in t.stages for d in plan.stages[s].devices}))


def tied_rank_sets(plan: Plan, tied: list[Tied]) -> list[tuple[int, ...]]:
    """The ranks that sum each tied weight (the same list on every rank: the groups are created
    from it collectively): in each static pipeline, its stages that hold it; under the flexible
    hybrid, every holder."""
    if plan.schedule is Schedule.TOKENS:
        return [holders(plan, t) for t in tied]
    return [tuple(plan.rank_of(pipe[s]) for s in t.stages) for t in tied for pipe in plan.pipelines]


def tied_ids(trainer, tied: list[Tied]) -> set[int]:
    """The ids of the tied weights this rank holds (in any of its stages)."""
    held = [(part, t) for part in trainer.parts for t in tied if part.stage in t.stages]
    return {id(part.module.get_parameter(t.name)) for part, t in held}


def sum_tied_over_holders(trainer, tied: list[Tied]) -> None:
    """Under the flexible hybrid: sum each tied weight's gradient over every rank that holds it
    (its stages' sums leave it out: those would count a replica's part twice)."""
    plan, rank = trainer.plan, trainer.runtime.rank
    for t in tied:
        ranks = holders(plan, t)
        if rank not in ranks:
            continue
        part = next(part for part in trainer.parts if part.stage in t.stages)
        param = part.module.get_parameter(t.name)
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        if len(ranks) > 1:
            dist.all_reduce(param.grad, group=trainer.runtime.group(ranks))


def sum_tied_grads(trainer, tied: list[Tied]) -> float:
    """Sum each tied weight's gradient over the stages of this rank's pipeline that hold it (after
    each stage's replicas summed theirs); the seconds it took."""
    start = time.perf_counter()
    placement, plan = trainer.placement, trainer.plan
    pipe = plan.pipelines[placement.replica]
    for t in tied:
        if placement.stage not in t.stages:
            continue
        # sharded stages (each over one worker per pipeline) hold the same rows of the weight on
        # one pipeline's workers: the shards sum as the whole weights would
        grad = local(trainer.model.get_parameter(t.name).grad)
        ranks = tuple(plan.rank_of(pipe[s]) for s in t.stages)
        dist.all_reduce(grad, group=trainer.runtime.group(ranks))
    return time.perf_counter() - start


def counted_elsewhere(part, tied: list[Tied]) -> set[int]:
    """The ids of the tied weights ``part`` holds that an earlier stage counts in the norm."""
    return {id(part.module.get_parameter(t.name)) for t in tied if part.stage in t.stages and part.stage != t.stages[0]}
