"""Exhaustive enumeration over the ILP's space: the oracle the ILP is tested against.

It walks every way to cut the model at the space's cut points into at most ``max_stages``
stages, every option for each stage, keeps the combinations that fit every slot's memory (and
use each slot once, when exclusive) and that the runtime can execute, and scores each with :func:`evaluate.predict` — the
definition of the iteration time, not the ILP's coefficients. Exponential: tiny instances only.
"""

from __future__ import annotations

import math
from itertools import pairwise, product

from felactl.optimizer.evaluate import chain_follows, predict
from felactl.optimizer.space import SearchSpace, StageOption
from felactl.spec.executable import tokens_hold_samples


def _paths(cuts: tuple[int, ...], max_stages: int):
    """Every increasing sequence of cut points from the first to the last, <= max_stages steps."""

    def walk(prefix: list[int]):
        if prefix[-1] == cuts[-1]:
            yield tuple(prefix)
            return
        if len(prefix) > max_stages:
            return
        for c in cuts:
            if c > prefix[-1]:
                yield from walk(prefix + [c])

    yield from walk([cuts[0]])


def _fits(space: SearchSpace, combo: tuple[StageOption, ...], exclusive: bool) -> bool:
    for u, slot in enumerate(space.slots):
        held = [o.memory_bytes[u] for o in combo if u in o.memory_bytes]
        if sum(held) > slot.memory_bytes or (exclusive and len(held) > 1):
            return False
    return True


def _executable(space: SearchSpace, combo: tuple[StageOption, ...], exclusive: bool) -> bool:
    """The runtime's rules on micro-batches (:mod:`felactl.spec.executable`) for these stages."""
    mbs = [o.choice.micro_batch for o in combo]
    if any(not chain_follows(a, b, space.max_stages, space.global_batch, static=exclusive) for a, b in pairwise(mbs)):
        return False
    return (
        exclusive
        or len(combo) == 1
        or tokens_hold_samples(space.global_batch, mbs[0], len(combo[0].choice.devices), mbs[-1])
    )


def best_by_enumeration(space: SearchSpace, *, exclusive: bool = False) -> tuple[float, tuple[StageOption, ...]]:
    """The least predicted iteration time over the space, and the stages that reach it."""
    by_range: dict[tuple[int, int], list[StageOption]] = {}
    for opt in space.options:
        by_range.setdefault((opt.choice.start, opt.choice.end), []).append(opt)
    best_s, best = math.inf, ()
    for path in _paths(space.boundaries, space.max_stages):
        ranges = list(zip(path, path[1:]))
        if len(ranges) > space.max_stages:
            continue
        for combo in product(*(by_range.get(r, []) for r in ranges)):
            if not _fits(space, combo, exclusive) or not _executable(space, combo, exclusive):
                continue
            stages = tuple(o.choice for o in combo)
            t = predict(space.cost, stages, space.global_batch, space.max_stages).iteration_s
            if t < best_s:
                best_s, best = t, combo
    return best_s, best
