"""Timings that say how far to trust them: repeat blocks until they agree, else record the spread.

One run of a small layer on a shared machine is sometimes preempted for a whole scheduler slice,
so a fixed handful of runs can put a spike in the median; a difference of two noisy medians (the
step with sync minus the step without) can come out at or below zero. So every profiler timing
runs in blocks: at least ``min_blocks``, then more while the blocks disagree (their spread is
above ``limit``), up to ``max_blocks`` or ``max_s``. A timing that hit the cap still disagreeing is
*noisy*: the profile records it (``ModelSpec.noisy``) and says so in one line on stderr.

Spread is the interquartile range of the block values over their median (``relative_spread``).
A difference is estimated per pair of adjacent blocks; its noise is the pairs' IQR over
sqrt(pairs) (about the standard error of the median difference): an estimate not above its noise
is not a measurement, and is recorded as unknown, never as 0 (``sync_difference``).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

SPREAD_LIMIT = 0.10
"""A timing's blocks agree when their IQR is at most this fraction of their median."""
SYNC_NOISE_LIMIT = 0.03
"""A sync difference is settled when its noise is at most this fraction of the step without sync."""
MIN_BLOCKS = 3

Block = TypeVar("Block")


def interquartile_range(values: Sequence[float]) -> float:
    """Q3 - Q1 (inclusive quartiles) of at least two values."""
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q3 - q1


def relative_spread(values: Sequence[float]) -> float:
    """Interquartile range over median; 0 for fewer than two values, inf for a median <= 0."""
    if len(values) < 2:
        return 0.0
    median = statistics.median(values)
    return interquartile_range(values) / median if median > 0 else math.inf


def repeat_until(
    run_block: Callable[[], Block],
    settled: Callable[[list[Block]], bool],
    *,
    min_blocks: int,
    max_blocks: int,
    max_s: float = math.inf,
    clock: Callable[[], float] = time.monotonic,
) -> tuple[list[Block], bool]:
    """Run blocks until ``settled(blocks)`` (checked from ``min_blocks`` on) or a cap is hit.

    Returns the blocks and whether they settled. ``max_s`` is wall time from the first block's
    start; the cap never cuts below ``min_blocks``."""
    if min_blocks < 1 or max_blocks < min_blocks:
        raise ValueError(f"need 1 <= min_blocks <= max_blocks, got {min_blocks} and {max_blocks}")
    start = clock()
    blocks: list[Block] = []
    while True:
        blocks.append(run_block())
        if len(blocks) < min_blocks:
            continue
        if settled(blocks):
            return blocks, True
        if len(blocks) >= max_blocks or clock() - start >= max_s:
            return blocks, False


@dataclass(frozen=True)
class Timed:
    """The block values of one timing and whether they agreed."""

    blocks: tuple[float, ...]
    noisy: bool

    @property
    def median(self) -> float:
        return statistics.median(self.blocks)

    @property
    def spread(self) -> float:
        return relative_spread(self.blocks)


def repeat_until_stable(
    run_block: Callable[[], float],
    *,
    limit: float = SPREAD_LIMIT,
    min_blocks: int = MIN_BLOCKS,
    max_blocks: int,
    max_s: float = math.inf,
    clock: Callable[[], float] = time.monotonic,
) -> Timed:
    """:func:`repeat_until` with blocks that are numbers (a block's median time), settled when
    their :func:`relative_spread` is at most ``limit``."""
    blocks, settled = repeat_until(
        run_block,
        lambda values: relative_spread(values) <= limit,
        min_blocks=min_blocks,
        max_blocks=max_blocks,
        max_s=max_s,
        clock=clock,
    )
    return Timed(tuple(blocks), noisy=not settled)


@dataclass(frozen=True)
class Difference:
    """``with - without`` from pairs of blocks: ``estimate`` None where it is not above ``noise``."""

    estimate: float | None
    noise: float
    baseline: float
    """Median of the blocks without: what the noise is judged against."""

    def settled(self, limit: float = SYNC_NOISE_LIMIT) -> bool:
        return self.noise <= limit * self.baseline


def difference(pairs: Sequence[tuple[Sequence[float], Sequence[float]]]) -> Difference:
    """Median over pairs of (median of the ``with`` block - median of the ``without`` block).

    Pairing adjacent blocks cancels the drift of a shared machine that falls on both alike; the
    pairs' IQR over sqrt(pairs) is the noise of the median difference (inf for one pair)."""
    if not pairs:
        raise ValueError("a difference needs at least one pair of blocks")
    diffs = [statistics.median(with_) - statistics.median(without) for with_, without in pairs]
    estimate = statistics.median(diffs)
    if len(diffs) < 2:
        noise = math.inf
    else:
        noise = interquartile_range(diffs) / math.sqrt(len(diffs))
    baseline = statistics.median(statistics.median(without) for _, without in pairs)
    return Difference(estimate=estimate if estimate > noise else None, noise=noise, baseline=baseline)


__all__ = [
    "Difference",
    "SPREAD_LIMIT",
    "SYNC_NOISE_LIMIT",
    "Timed",
    "difference",
    "relative_spread",
    "repeat_until",
    "repeat_until_stable",
]
