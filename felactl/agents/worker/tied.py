"""Weights that two stages of a pipeline hold (GPT-2's ``lm_head`` is its ``wte``): each stage
steps its own copy, so their gradients are summed over the stages that hold them before the step
(as Megatron sums the embedding's over the first and last stage), and counted once in the norm
that clipping reads. The copies start equal (every worker builds the model from one seed) and
stay equal: the same gradients through the same optimizer."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch.distributed as dist

from felactl import models
from felactl.errors import InputError
from felactl.models import split
from felactl.spec import Plan, Schedule


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
    tied = [Tied(name, stages) for name, stages in split.tied_weights(bundle.split_graph, bundle.model, ranges)]
    if tied and plan.schedule is Schedule.TOKENS:
        raise InputError(
            f"model {plan.model.source!r}: weight {tied[0].name} is read by stages {tied[0].stages}; "
            "tied weights across stages run in static pipelines (--schedule 1f1b or gpipe), not under tokens"
        )
    return tied


def tied_rank_sets(plan: Plan, tied: list[Tied]) -> list[tuple[int, ...]]:
    """The ranks that sum each tied weight, in every pipeline (the same list on every rank: the
    groups are created from it collectively)."""
    return [tuple(plan.rank_of(pipe[s]) for s in t.stages) for t in tied for pipe in plan.pipelines]


def sum_tied_grads(trainer, tied: list[Tied]) -> float:
    """Sum each tied weight's gradient over the stages of this rank's pipeline that hold it (after
    each stage's replicas summed theirs); the seconds it took."""
    start = time.perf_counter()
    placement, plan = trainer.placement, trainer.plan
    pipe = plan.pipelines[placement.replica]
    for t in tied:
        if placement.stage not in t.stages:
            continue
        grad = trainer.model.get_parameter(t.name).grad
        ranks = tuple(plan.rank_of(pipe[s]) for s in t.stages)
        dist.all_reduce(grad, group=trainer.runtime.group(ranks))
    return time.perf_counter() - start


def counted_elsewhere(trainer, tied: list[Tied]) -> set[int]:
    """The ids of the tied weights this rank holds that an earlier stage counts in the norm."""
    stage = trainer.placement.stage
    return {id(trainer.model.get_parameter(t.name)) for t in tied if stage in t.stages and stage != t.stages[0]}
