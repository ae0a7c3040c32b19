"""What a worker adds to its step's record for the user to see: the learning rate, and the
numbers of the job's own ``evaluate`` hook (:attr:`felactl.TrainJob.evaluate`), run on one worker
every ``evaluate_every`` steps."""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from felactl.agents.worker.engine import Trainer
from felactl.errors import InputError


def learning_rate(trainer: Trainer) -> dict[str, float]:
    """``{"lr": ...}``: the first parameter group's, after this step's scheduler step."""
    optimizer = trainer.optimizer
    groups = getattr(optimizer, "param_groups", None)
    return {"lr": float(groups[0]["lr"])} if groups else {}


def evaluation(trainer: Trainer, step: int) -> dict[str, Any]:
    """``{"eval": {name: number}, "eval_s": seconds}`` when ``step`` (0-based, completed) is an
    ``evaluate_every``-th and this worker is rank 0; else ``{}``. The hook's own error ends the
    worker as a step's would; what it returns must be names and finite numbers."""
    job = trainer.job
    if job.evaluate is None or trainer.runtime.rank != 0 or (step + 1) % job.evaluate_every:
        return {}
    check_evaluable(trainer)
    model = job.model
    was_training = model.training
    started = time.perf_counter()
    model.eval()
    try:
        with torch.no_grad():
            numbers = job.evaluate(model, step)
    finally:
        model.train(was_training)
    return {"eval": _checked(numbers), "eval_s": round(time.perf_counter() - started, 6)}


def check_evaluable(trainer: Trainer) -> None:
    """Refuse (one line) a job's evaluate hook on a plan that splits or shards the model: said
    when the worker starts, not ``evaluate_every`` steps into the run."""
    plan = trainer.plan
    if trainer.job.evaluate is not None and (len(plan.stages) > 1 or plan.stages[0].shard):
        raise InputError(
            "TrainJob.evaluate: runs on one worker that holds the whole model; this plan splits it "
            f"({len(plan.stages)} stage(s){', sharded' if plan.stages[0].shard else ''}): evaluate in "
            "your own process from `felactl export`, or plan one replicated stage"
        )


def _checked(numbers: Any) -> dict[str, float]:
    if numbers is None:
        return {}
    if not isinstance(numbers, dict):
        raise InputError(f"TrainJob.evaluate: must return {{name: number}} or None, got {type(numbers).__name__}")
    checked = {}
    for name, value in numbers.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if not isinstance(name, str) or isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InputError(f"TrainJob.evaluate: {name!r}: must be a name and a number, got {value!r}")
        if not math.isfinite(value):
            raise InputError(f"TrainJob.evaluate: {name!r} is {value}: a number must be finite")
        checked[name] = float(value)
    return checked
