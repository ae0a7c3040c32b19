"""Which strategy trains a plan: the one table of the runtime's sync modes.

A plan's shape (:func:`felactl.spec.executable.execution`) and its sync mode pick a
:class:`~felactl.agents.worker.strategy.Strategy`; :func:`felactl.agents.worker.loop.train` runs it.
Adding a mode is one class and one row here (and, for the planner, a ``SyncMode`` value). The
table holds only what :func:`felactl.spec.executable.check_executable` lets through.
"""

from __future__ import annotations

from felactl.agents.worker.flexible import Flexible
from felactl.agents.worker.pipeline import Pipeline, PipelineSDPipe
from felactl.agents.worker.strategy import Strategy
from felactl.agents.worker.sync.bsp import BSP
from felactl.agents.worker.sync.sdpipe import SDPipe
from felactl.agents.worker.sync.tokens import Tokens
from felactl.agents.worker.sync.wbsp import WBSP
from felactl.spec import Plan, SyncMode
from felactl.spec.executable import Execution, execution

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
}


def strategy_for(plan: Plan) -> type[Strategy]:
    """The strategy class of an executable plan."""
    return STRATEGIES[(execution(plan), plan.sync.mode)]
