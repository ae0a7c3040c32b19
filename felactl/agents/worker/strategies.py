"""Which strategy trains a plan: the runtime's one place that names a sync mode's classes.

A plan's shape (:func:`felactl.spec.executable.execution`) and its sync mode pick a
:class:`~felactl.agents.worker.strategy.Strategy`; :func:`felactl.agents.worker.loop.train` runs it.
What a mode supports is its row in :mod:`felactl.spec.sync_modes`; this table holds a class for
exactly the (execution, mode) pairs the rows allow, each going at its own pace
(:class:`~felactl.agents.worker.strategy.AtOwnPace`) where its row says so
(``tests/test_sync_modes.py``). Adding a mode is a ``SyncMode`` value, its row, and its class here.
"""

from __future__ import annotations

from felactl.agents.worker.flexible import Flexible
from felactl.agents.worker.pipeline import Pipeline, PipelineSDPipe
from felactl.agents.worker.strategy import Strategy
from felactl.agents.worker.sync.bsp import BSP
from felactl.agents.worker.sync.sdpipe import SDPipe
from felactl.agents.worker.sync.sharded import Sharded
from felactl.agents.worker.sync.tokens import Tokens
from felactl.agents.worker.sync.wbsp import WBSP
from felactl.spec import Plan, SyncMode
from felactl.spec.executable import execution
from felactl.spec.sync_modes import Execution

STRATEGIES: dict[tuple[Execution, SyncMode], type[Strategy]] = {
    (Execution.DATA_PARALLEL, SyncMode.BSP): BSP,
    (Execution.DATA_PARALLEL, SyncMode.TOKENS): Tokens,
    (Execution.DATA_PARALLEL, SyncMode.WBSP): WBSP,
    (Execution.DATA_PARALLEL, SyncMode.SDPIPE): SDPipe,
    (Execution.PIPELINE, SyncMode.BSP): Pipeline,
    (Execution.PIPELINE, SyncMode.TOKENS): Pipeline,  # a static schedule: the stages' replicas sum as BSP
    (Execution.PIPELINE, SyncMode.SDPIPE): PipelineSDPipe,
    (Execution.FLEXIBLE, SyncMode.BSP): Flexible,  # tokens schedule the sub-models; each stage sums
    (Execution.FLEXIBLE, SyncMode.TOKENS): Flexible,
    (Execution.SHARDED, SyncMode.BSP): Sharded,
}


def strategy_for(plan: Plan) -> type[Strategy]:
    """The strategy class of an executable plan."""
    return STRATEGIES[(execution(plan), plan.sync.mode)]
