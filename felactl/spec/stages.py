"""Where a plan's work goes: the stages (each a range of layers, the workers that run it and
their shares of its samples) and the node each device of the plan lives on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from felactl import limits
from felactl.spec.cluster import ClusterSpec, DeviceKind
from felactl.spec.codec import FieldProblem, positive

SHARE_TOLERANCE = 1e-6


def split_by_shares(total: int, shares: list[float]) -> list[range]:
    """Consecutive ranges whose sizes follow ``shares`` (rounded on the cumulative sum, so they
    always cover ``0..total`` exactly, whatever the rounding)."""
    whole = sum(shares)
    bounds, cumulative = [0], 0.0
    for share in shares:
        cumulative += share
        bounds.append(round(total * cumulative / whole))
    bounds[-1] = total
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def micro_batch_counts(total: int, shares: list[float], micro_batch: int) -> list[int]:
    """Micro-batches each worker runs of its share of ``total`` samples (:func:`split_by_shares`)."""
    return [math.ceil(len(r) / micro_batch) for r in split_by_shares(total, shares)]


@dataclass(frozen=True, kw_only=True, slots=True)
class Placement:
    """Where a device of the plan lives: the launcher gives each node's agent its devices' ranks."""

    device: str
    node: str
    kind: DeviceKind = DeviceKind.CPU
    local_index: int = 0
    """The device's index within its node (the worker's LOCAL_RANK; the CUDA ordinal)."""

    def __post_init__(self) -> None:
        positive("local_index", self.local_index, limits.INDEX, allow_zero=True)


def placements_from(cluster: ClusterSpec, devices: tuple[str, ...] | list[str]) -> tuple[Placement, ...]:
    """The placement of ``devices`` (rank order) in ``cluster``; the planner records it in the plan."""
    out = []
    for name in devices:
        node = cluster.node_of(name)
        index = next(i for i, d in enumerate(node.devices) if d.name == name)
        dev = cluster.device(name)
        out.append(
            Placement(
                device=name,
                node=node.name,
                kind=dev.kind,
                local_index=dev.local_index if dev.local_index is not None else index,
            )
        )
    return tuple(out)


@dataclass(frozen=True, kw_only=True, slots=True)
class StageWorker:
    device: str
    share: float
    """Fraction of the stage's samples of one iteration this worker computes."""
    predicted_memory_gb: float | None = None

    def __post_init__(self) -> None:
        positive("share", self.share)
        if self.share > 1 + SHARE_TOLERANCE:
            raise FieldProblem("share", f"must be <= 1, got {self.share:g}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Stage:
    layer_start: int
    """First layer of the stage (0-based)."""
    layer_end: int
    """One past the last layer of the stage."""
    micro_batch: int
    """Samples per micro-batch (Fela's per-sub-model batch size b_i)."""
    workers: tuple[StageWorker, ...]
    predicted_compute_s: float | None = None
    max_in_flight: int | None = None
    """Most micro-batches of this stage whose activations one worker holds at once (forward run,
    backward not yet): as many as the planner's memory model finds room for. The simulator holds
    every worker to it. None: no limit (memory holds every micro-batch of the stage, or a plan
    written before it)."""
    shard: bool = False
    """Whether the stage's workers hold its parameters, gradients and optimizer state split among
    them (torch FSDP2's ``fully_shard`` over the stage's group: each block's weights gathered for
    its forward and backward, the gradients reduce-scattered), rather than each holding all of
    them (replicated, the default)."""

    def __post_init__(self) -> None:
        positive("layer_start", self.layer_start, allow_zero=True)
        if self.layer_end <= self.layer_start:
            raise FieldProblem("layer_end", f"must be > layer_start ({self.layer_start}), got {self.layer_end}")
        positive("micro_batch", self.micro_batch, limits.BATCH)
        if self.max_in_flight is not None:
            positive("max_in_flight", self.max_in_flight, limits.COUNT)
        if not self.workers:
            raise FieldProblem("workers", "a stage needs at least one worker")
        seen = set()
        for i, w in enumerate(self.workers):
            if w.device in seen:
                raise FieldProblem(f"workers[{i}].device", f"device {w.device!r} listed twice in one stage")
            seen.add(w.device)
        total = sum(w.share for w in self.workers)
        if abs(total - 1.0) > 1e-3:
            raise FieldProblem("workers", f"shares must sum to 1, got {total:.4f}")

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(w.device for w in self.workers)
