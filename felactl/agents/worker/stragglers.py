"""Stragglers on purpose: sleeps injected after compute, so straggler handling shows on any machine.

Three kinds, which may be combined:

- ``--slowdown RANK=FACTOR`` (several, comma separated): after each compute the worker sleeps
  ``(factor - 1) x`` that compute's time, so it behaves like a device ``factor`` times slower.
- ``roundrobin:SECONDS`` (Fela): in iteration ``i`` the worker ``i mod N`` sleeps ``SECONDS``.
- ``prob:P:SECONDS`` (Fela, SDPipe): every worker sleeps ``SECONDS`` with probability ``P`` per
  iteration, drawn from a generator seeded by the training seed and the rank (reproducible).

The parsers are pure and raise :class:`InputError` with one line, so the CLI reuses them.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

from felactl import limits
from felactl.errors import InputError


@dataclass(frozen=True, slots=True)
class Pattern:
    kind: str
    """``roundrobin`` or ``prob``."""
    seconds: float
    probability: float = 1.0


def parse_slowdown(text: str | None) -> dict[int, float]:
    """``"1=3,2=1.5"`` -> ``{1: 3.0, 2: 1.5}``; empty or None -> ``{}``."""
    factors: dict[int, float] = {}
    for item in (text or "").replace(" ", "").split(","):
        if not item:
            continue
        rank_text, sep, factor_text = item.partition("=")
        if not sep:
            raise InputError(f"slowdown {item!r}: expected RANK=FACTOR, e.g. 1=3")
        try:
            rank, factor = int(rank_text), float(factor_text)
        except ValueError:
            raise InputError(f"slowdown {item!r}: RANK must be an integer and FACTOR a number") from None
        if rank < 0:
            raise InputError(f"slowdown {item!r}: RANK must be >= 0, got {rank}")
        if not 1.0 <= factor < math.inf:
            raise InputError(
                f"slowdown {item!r}: FACTOR must be a finite number >= 1 (1 = no slowdown), got {factor:g}"
            )
        if rank in factors:
            raise InputError(f"slowdown: rank {rank} given twice")
        factors[rank] = factor
    return factors


def parse_pattern(text: str | None) -> Pattern | None:
    """``roundrobin:SECONDS`` or ``prob:P:SECONDS``; empty or None -> no pattern."""
    if not text:
        return None
    parts = text.strip().split(":")
    try:
        if parts[0] == "roundrobin" and len(parts) == 2:
            pattern = Pattern("roundrobin", float(parts[1]))
        elif parts[0] == "prob" and len(parts) == 3:
            pattern = Pattern("prob", float(parts[2]), float(parts[1]))
        else:
            raise InputError(f"straggler pattern {text!r}: expected roundrobin:SECONDS or prob:P:SECONDS")
    except ValueError:
        numbers = "SECONDS must be a number" if parts[0] == "roundrobin" else "P and SECONDS must be numbers"
        raise InputError(f"straggler pattern {text!r}: {numbers}") from None
    problem = limits.SECONDS.problem(pattern.seconds)
    if problem is not None:
        raise InputError(f"straggler pattern {text!r}: SECONDS {problem}")
    if not 0.0 <= pattern.probability <= 1.0:
        raise InputError(f"straggler pattern {text!r}: P must be in [0, 1], got {pattern.probability:g}")
    return pattern


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
