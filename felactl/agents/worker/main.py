"""One worker's life: connect, build, train with the plan's sync mode, write its summary."""

from __future__ import annotations

import importlib
import time

import torch.distributed as dist

from felactl.agents.worker.config import WorkerConfig
from felactl.agents.worker.engine import Trainer
from felactl.agents.worker.stages import stage_rank_sets
from felactl.agents.worker import runtime as runtime_mod
from felactl.errors import InputError
from felactl.spec import Plan, Schedule, SyncMode

SYNC_MODULES = {"bsp": "bsp", "tokens": "tokens", "wbsp": "wbsp", "sdpipe": "sdpipe"}


def strategy(plan: Plan):
    """The module whose ``run(trainer)`` trains under this plan."""
    if len(plan.stages) > 1 and plan.schedule is Schedule.TOKENS:
        return importlib.import_module("felactl.agents.worker.flexible")
    if len(plan.stages) > 1:
        if plan.sync.mode is SyncMode.WBSP:
            raise InputError("sync wbsp runs on data-parallel plans (one stage); static pipelines synchronise "
                             "each stage's replicas with bsp or sdpipe")
        return importlib.import_module("felactl.agents.worker.pipeline")
    return importlib.import_module(f"felactl.agents.worker.sync.{SYNC_MODULES[plan.sync.mode.value]}")


def run_worker(cfg: WorkerConfig) -> dict:
    if cfg.elastic:
        from felactl.agents.worker.elastic import run_elastic

        return run_elastic(cfg)
    plan = cfg.load_plan()
    module = strategy(plan)
    runtime = runtime_mod.start(cfg)
    try:
        runtime.make_groups(stage_rank_sets(plan))
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
