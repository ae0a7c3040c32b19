"""One worker's life: connect, build, train with the plan's sync mode, write its summary."""

from __future__ import annotations

import time

import torch.distributed as dist

from felactl import models
from felactl.agents.worker import runtime as runtime_mod
from felactl.agents.worker.config import WorkerConfig
from felactl.agents.worker.engine import Trainer
from felactl.agents.worker.loop import train
from felactl.agents.worker.stages import stage_rank_sets
from felactl.agents.worker.strategies import strategy_for
from felactl.spec import Plan
from felactl.spec.executable import check_executable


def load_checked(cfg: WorkerConfig) -> tuple[Plan, models.ModelBundle]:
    """The plan (with the environment's overrides) and its model, refused (InputError) before
    this worker connects to anyone unless the runtime can execute the one on the other."""
    plan = cfg.load_plan()
    bundle = models.build(plan.model.source, plan.model.config, seed=plan.training.seed)
    bundle.check_global_batch(plan.global_batch)
    check_executable(plan, bundle.layer_params(), where=str(cfg.plan_path))
    return plan, bundle


def run_worker(cfg: WorkerConfig) -> dict:
    if cfg.elastic:
        from felactl.agents.worker.elastic import run_elastic

        return run_elastic(cfg)
    plan, bundle = load_checked(cfg)
    runtime = runtime_mod.start(cfg)
    try:
        runtime.make_groups(stage_rank_sets(plan))
        trainer = Trainer(runtime, plan, bundle)
        trainer.begin()
        dist.barrier()
        start = time.perf_counter()
        train(trainer, strategy_for(plan)(trainer))
        wall_s = time.perf_counter() - start
        trainer.final_checkpoint()
        trainer.finish(wall_s)
        dist.barrier()
        return dict(trainer.totals, wall_s=wall_s)
    finally:
        runtime.close()
