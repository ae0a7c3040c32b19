"""Stragglers on purpose: sleeps injected after compute, so straggler handling shows on any machine.

Three kinds, which may be combined:

- ``--slowdown RANK=FACTOR`` (several, comma separated): after each compute the worker sleeps
  ``(factor - 1) x`` that compute's time, so it behaves like a device ``factor`` times slower.
- ``roundrobin:SECONDS`` (Fela): in iteration ``i`` the worker ``i mod N`` sleeps ``SECONDS``.
- ``prob:P:SECONDS`` (Fela, SDPipe): every worker sleeps ``SECONDS`` with probability ``P`` per
  iteration, drawn from a generator seeded by the training seed and the rank (reproducible).

The launcher checks the flags and hands them to the workers as text (``FELACTL_SLOWDOWN``,
``FELACTL_STRAGGLER``); each worker parses them again and injects the sleeps
(:class:`felactl.agents.worker.stragglers.Straggler`). The parsers live here, below both: pure,
raising :class:`InputError` with one line.
"""

from __future__ import annotations

import math
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
