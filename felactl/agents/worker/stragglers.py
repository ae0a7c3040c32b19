"""Stragglers on purpose: the sleeps a worker injects after compute, as ``--slowdown`` and
``--straggler`` ask (their patterns and parsers: :mod:`felactl.control.stragglers`)."""

from __future__ import annotations

import random
import time

from felactl.control.stragglers import Pattern


class Straggler:
    """One worker's injected slowness. ``after_compute`` sleeps and returns the seconds slept."""

    def __init__(self, rank: int, world_size: int, factor: float = 1.0, pattern: Pattern | None = None, seed: int = 0):
        self.rank = rank
        self.world_size = world_size
        self.factor = factor
        self.pattern = pattern
        self._rng = random.Random(f"{seed}:{rank}")

    @property
    def active(self) -> bool:
        return self.factor > 1.0 or self.pattern is not None

    def slowdown_s(self, compute_s: float) -> float:
        return (self.factor - 1.0) * compute_s

    def pattern_s(self, iteration: int) -> float:
        """The pattern's sleep for this iteration (call once per iteration: it draws for ``prob``)."""
        if self.pattern is None:
            return 0.0
        if self.pattern.kind == "roundrobin":
            return self.pattern.seconds if iteration % self.world_size == self.rank else 0.0
        return self.pattern.seconds if self._rng.random() < self.pattern.probability else 0.0

    def after_compute(self, compute_s: float) -> float:
        seconds = self.slowdown_s(compute_s)
        if seconds > 0:
            time.sleep(seconds)
        return seconds

    def at_iteration(self, iteration: int) -> float:
        seconds = self.pattern_s(iteration)
        if seconds > 0:
            time.sleep(seconds)
        return seconds
