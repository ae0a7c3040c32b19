"""One worker's life: connect, build, train with the plan's sync mode, write its summary."""

from __future__ import annotations

import importlib
import time

import torch.distributed as dist

from felactl.agents.worker.config import WorkerConfig
from felactl.agents.worker.engine import Trainer
from felactl.agents.worker import runtime as runtime_mod
from felactl.errors import InputError
from felactl.spec import Plan, Schedule, SyncMode

SYNC_MODULES = {"bsp": "bsp", "tokens": "tokens", "wbsp": "wbsp", "sdpipe": "sdpipe"}


def strategy(plan: Plan):
    """The module whose ``run(trainer)`` trains under this plan."""
    if len(plan.stages) > 1 and plan.schedule is Schedule.TOKENS:
        return importlib.import_module("felactl.agents.worker.flexible")
    if len(plan.stages) > 1:
        if plan.sync.mode not in (SyncMode.BSP, SyncMode.TOKENS):
            raise InputError(f"sync {plan.sync.mode.value} runs on data-parallel plans (one stage); static pipelines "
                             f"synchronise each stage's replicas with bsp")
        return importlib.import_module("felactl.agents.worker.pipeline")
    return importlib.import_module(f"felactl.agents.worker.sync.{SYNC_MODULES[plan.sync.mode.value]}")


def stage_groups(plan: Plan) -> list[tuple[int, ...]]:
    """Every stage's rank set, in plan order (the same list on every rank: ``new_group`` is collective)."""
    if len(plan.stages) > 1 and plan.schedule is not Schedule.TOKENS:
        return [tuple(plan.rank_of(p[s]) for p in plan.pipelines) for s in range(len(plan.stages))]
    return [tuple(plan.rank_of(d) for d in stage.devices) for stage in plan.stages]


def run_worker(cfg: WorkerConfig) -> dict:
    plan = cfg.load_plan()
    module = strategy(plan)
    runtime = runtime_mod.start(cfg)
    try:
        runtime.make_groups(stage_groups(plan))
        trainer = Trainer(runtime, plan)
        dist.barrier()
        start = time.perf_counter()
        module.run(trainer)
        wall_s = time.perf_counter() - start
        trainer.finish(wall_s)
        dist.barrier()
        return dict(trainer.totals, wall_s=wall_s)
    finally:
        runtime.close()
