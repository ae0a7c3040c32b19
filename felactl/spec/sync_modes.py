"""What each sync mode supports: one row per :class:`~felactl.spec.plan.SyncMode`.

The one table the planner (which shape it plans for a mode), ``felactl check`` and the worker's
start (:func:`felactl.spec.executable.check_executable`: which executions a mode runs, on which
backend), live rescaling (:func:`felactl.spec.executable.why_not_rescalable`), the worker's
strategy table (:mod:`felactl.agents.worker.strategies`, one class per execution a row allows) and
the CLI's ``--sync`` help read. A fifth mode is a ``SyncMode`` value, one row here and its
strategy classes; ``tests/test_sync_modes.py`` fails until the enum, this table, the worker's
table and the help agree. Pure: stdlib only, so the optimizer imports it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from felactl.spec.plan import SyncMode


class Execution(str, enum.Enum):
    """How a plan runs (:func:`felactl.spec.executable.execution` tells from its shape)."""

    DATA_PARALLEL = "data_parallel"
    """One stage: every worker holds the whole model."""
    FLEXIBLE = "flexible"
    """Fela's flexible hybrid: several stages, ``schedule: tokens``; a device may serve several."""
    PIPELINE = "pipeline"
    """Static pipelines: several stages, ``1f1b``/``gpipe``; each device holds one pipeline slot."""
    SHARDED = "sharded"
    """One stage whose workers split the model's parameters, gradients and optimizer state among
    them (``shard: true``; FSDP2), gathering each block's weights when it runs."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SyncModeSupport:
    """What one sync mode supports, for every part that must agree on it."""

    mode: SyncMode
    summary: str
    """What it does, in one line of ``--help``."""
    executions: frozenset[Execution]
    """The executions a plan under this mode may run (``felactl check`` refuses the others; the
    worker has a strategy class for each)."""
    planned_as: Execution
    """The shape the planner solves for: ``FLEXIBLE`` (one ILP; a device may serve several
    stages, schedule tokens), ``PIPELINE`` (static 1F1B pipelines, each device in one: one ILP per
    pipeline degree, and each stage holds the micro-batches 1F1B puts in flight, not a memory
    limit of its own) or ``DATA_PARALLEL`` (one stage)."""
    data_parallel_tokens: bool
    """Whether a data-parallel worker claims each micro-batch as a token through the store (the
    planner prices the claims); else it loops over its own share."""
    sums_over_trees: bool
    """Whether each stage's replicas sum their gradients along the plan's packed trees (Blink)
    where it has them (over gloo; on NCCL, NCCL's own allreduce sums)."""
    rescales_live: bool
    """Whether its data-parallel jobs grow, shrink and survive failures while they train."""
    at_own_pace: bool
    """Whether its workers go at their own pace: a rescale lets each settle wherever it stands
    (the mode's final merge), and a step is a fixed number of samples, so the job rescales with a
    fixed global batch. Else every member switches after the same step."""
    runs_on_gpus: bool
    """Whether it runs on GPUs (NCCL); else on CPU slots (gloo) only."""

    def __post_init__(self) -> None:
        if self.planned_as not in self.executions:
            raise ValueError(f"sync {self.mode.value}: planned as {self.planned_as.value}, which it does not run")


_ALL = frozenset(Execution)

SYNC_MODE_SUPPORT: Mapping[SyncMode, SyncModeSupport] = MappingProxyType(
    {
        row.mode: row
        for row in (
            SyncModeSupport(
                mode=SyncMode.BSP,
                summary="each stage sums its gradients every step, as DDP (the result equals one process's)",
                executions=_ALL,
                planned_as=Execution.FLEXIBLE,
                data_parallel_tokens=False,
                sums_over_trees=True,
                rescales_live=True,
                at_own_pace=False,
                runs_on_gpus=True,
            ),
            SyncModeSupport(
                mode=SyncMode.TOKENS,
                summary="Fela's token bucket, fast workers pull more micro-batches (the sum is still BSP's)",
                # a static pipeline's replicas sum as BSP; a sharded stage's workers gather every
                # block together, so none may take more micro-batches than another
                executions=_ALL - {Execution.SHARDED},
                planned_as=Execution.FLEXIBLE,
                data_parallel_tokens=True,
                sums_over_trees=True,
                rescales_live=True,
                at_own_pace=False,
                runs_on_gpus=True,
            ),
            SyncModeSupport(
                mode=SyncMode.WBSP,
                summary="no worker waits, each pushes its change after every local step (asynchronous)",
                executions=frozenset({Execution.DATA_PARALLEL}),
                planned_as=Execution.DATA_PARALLEL,
                data_parallel_tokens=False,
                sums_over_trees=False,
                rescales_live=True,
                at_own_pace=True,
                runs_on_gpus=True,
            ),
            SyncModeSupport(
                mode=SyncMode.SDPIPE,
                summary="ready workers form groups that average their weights (asynchronous)",
                executions=frozenset({Execution.DATA_PARALLEL, Execution.PIPELINE}),
                planned_as=Execution.PIPELINE,
                data_parallel_tokens=False,
                sums_over_trees=False,
                rescales_live=True,
                at_own_pace=True,
                runs_on_gpus=True,
            ),
        )
    }
)
"""Every sync mode's row, in ``SyncMode`` order."""


def sync_support(mode: SyncMode) -> SyncModeSupport:
    return SYNC_MODE_SUPPORT[mode]


def modes_where(predicate: Callable[[SyncModeSupport], bool]) -> tuple[SyncMode, ...]:
    """The modes whose rows satisfy ``predicate``, in table order."""
    return tuple(mode for mode, row in SYNC_MODE_SUPPORT.items() if predicate(row))


def mode_names(modes: Iterable[SyncMode]) -> str:
    """``bsp, tokens or sdpipe``: the modes as a message names them."""
    names = [m.value for m in modes]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def rescalable_mode_names() -> str:
    """``bsp, tokens, wbsp or sdpipe``: the modes whose data-parallel jobs rescale live, as the
    messages about rescaling name them."""
    return mode_names(modes_where(lambda row: row.rescales_live))


def sync_help() -> str:
    """The ``--sync`` help: every mode with its one line."""
    return "; ".join(f"{mode.value}: {row.summary}" for mode, row in SYNC_MODE_SUPPORT.items())
