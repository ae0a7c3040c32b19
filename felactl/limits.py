"""What a flag or a file may claim, in one place, and the one check of a number flag.

A number felactl is given either comes from a person (a flag) or from a file; both can be wrong
in ways Python accepts: ``nan`` and ``inf`` parse as floats (a timeout of nan is never reached),
and an integer has no size limit (a global batch of 10**40 is a loop that never ends). The
bounds below are far beyond any real machine or job, so they refuse only what cannot be meant,
and each names why, so the one-line error says it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from felactl.errors import InputError


@dataclass(frozen=True, slots=True)
class Bound:
    """The range a quantity may take, and why its ends are where they are."""

    least: float
    most: float
    why: str

    def problem(self, value: float, *, above: float | None = None) -> str | None:
        """What is wrong with ``value`` (None when nothing is), the text after ``key: ``; with
        ``above``, the value must also be > it (a timeout: > 0)."""
        if isinstance(value, float) and not math.isfinite(value):
            return f"must be a finite number, got {value}"
        if above is not None and not value > above:
            return f"must be > {above:g}, got {show(value)}"
        if value < self.least:
            return f"must be >= {self.least:g}, got {show(value)}"
        if value > self.most:
            return f"must be at most {self.most:g} ({self.why}), got {show(value)}"
        return None


def show(value: float | int) -> str:
    """A number for a one-line message: ``1e+40`` for a float, an integer of any size kept short."""
    if isinstance(value, int) and not isinstance(value, bool):
        text = str(value)
        return text if len(text) <= 16 else f"{text[:6]}... ({len(text)} digits)"
    return f"{value:g}"


MAX_GLOBAL_BATCH = 2**17
"""Samples per iteration: twice the largest batches published (LAMB's 65,536). The planner's
token accounting and the workers' data order are linear in the batch, so a batch beyond this is a
plan that never finishes, not a plan."""

MAX_COUNT = 2**16
"""Workers, nodes, devices or repetitions a flag may ask for: more than any cluster has."""

# What a cluster or model file may claim (lower ends > 0 where the value divides: a time).
SHARE = Bound(0.0, 1.0, "the whole")
MEGABYTES = Bound(0.0, 1e12, "an exabyte")
MEMORY_GB = Bound(0.0, 1e5, "100 TB: no device or host has more")
TFLOPS = Bound(1e-6, 1e5, "100 PFLOP/s: no device is faster")
BANDWIDTH_GBPS = Bound(1e-6, 1e5, "100 TB/s: no link is faster")
LATENCY_US = Bound(0.0, 1e7, "10 s: no link is slower to answer")
SECONDS = Bound(0.0, 1e7, "about 4 months")
MILLISECONDS = Bound(0.0, 1e10, "about 4 months")
BYTES = Bound(0.0, 1e18, "an exabyte")
PARAMS = Bound(0.0, 1e15, "a quadrillion parameters")
FLOPS = Bound(0.0, 1e21, "a zettaflop per sample")
BATCH = Bound(1, MAX_GLOBAL_BATCH, "the most samples an iteration may hold")
COUNT = Bound(1, MAX_COUNT, "more than any cluster has")
INDEX = Bound(0, MAX_COUNT - 1, "more than any cluster has")
LAYERS = Bound(1, 4096, "four times the deepest transformer trained, DeepNet's 1,000 layers")
CPU_CORE = Bound(0, 8191, "Linux numbers at most 8192 CPUs in a machine: NR_CPUS")
SEED = Bound(0, 2**63 - 1, "torch's largest seed")
MATMUL_SIZE = Bound(1, 2**15, "a 4 GiB matrix")
MESSAGE_BYTES = Bound(4, 2**32, "4 GiB")


def check_flag(flag: str, value: float | int | None, bound: Bound, *, above: float | None = None) -> None:
    """The one check of a number flag: finite, inside ``bound`` and, with ``above``, > it.

    Raises :class:`InputError` naming the flag; None (a flag left out) passes."""
    if value is None:
        return
    problem = bound.problem(value, above=above)
    if problem is not None:
        raise InputError(f"{flag} {problem}")


def split_items(flag: str, text: str, expected: str) -> list[str]:
    """The comma-separated items of a flag's value, stripped. An empty item (``1,,2``, a
    trailing comma) is refused naming the flag: dropping it quietly ran something else than
    what was typed. ``expected`` says what the flag takes, for the message."""
    if not text.strip():
        raise InputError(f"{flag}: expected {expected}, got {text!r}")
    items = [part.strip() for part in text.split(",")]
    if not all(items):
        raise InputError(f"{flag}: an empty item in {text!r}; expected {expected}")
    return items


def parse_count_range(flag: str, text: str) -> tuple[int, int]:
    """``N`` or ``MIN:MAX`` (torchrun's ``--nnodes``) as (MIN, MAX), each a count (N: N, N).

    Raises :class:`InputError` naming the flag."""
    parts = text.split(":")
    if len(parts) > 2 or not all(p.strip().isdigit() for p in parts):
        raise InputError(f"{flag} must be a count N or a range MIN:MAX (e.g. 1:4), got {text!r}")
    counts = [int(p) for p in parts]
    for count in counts:
        check_flag(flag, count, COUNT)
    least, most = counts[0], counts[-1]
    if least > most:
        raise InputError(f"{flag} {text}: MIN must be <= MAX")
    return least, most
