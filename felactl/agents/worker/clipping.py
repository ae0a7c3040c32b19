"""Clipping the gradients of the whole model, wherever its stages are (a worker holds some)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from felactl.agents.worker.tied import counted_elsewhere
from felactl.parallel.fsdp import is_dtensor, is_sharded, local


def grad_sq_norm(params) -> torch.Tensor:
    """The squared L2 norm of these parameters' gradients (of a sharded one, the shard this worker
    holds), in float32 (0 where none has one)."""
    norms = [
        torch.linalg.vector_norm(local(p.grad.detach()), dtype=torch.float32) for p in params if p.grad is not None
    ]
    return torch.stack(norms).square().sum() if norms else torch.zeros(())


def clip_gradients(trainer, max_norm: float, across_stages: bool = True) -> float:
    """Scale the gradients so that the whole model's L2 norm is at most ``max_norm``, as
    ``torch.nn.utils.clip_grad_norm_`` does; returns the norm before clipping.

    One stage: this worker's gradients are the model's. Several stages under ``bsp`` or
    ``tokens`` (every rank steps together, its stages' gradients already summed, so each
    replica of a stage holds the same): every rank adds its stages' squared norms, each
    divided by the stage's replicas (a sharded stage's workers hold disjoint shards: each adds
    its own), in one allreduce over all ranks: the global norm.
    Under ``wbsp`` and ``sdpipe`` pipelines, whose stages step at their own pace
    (``across_stages=False``), each stage clips its own norm."""
    # two stages this worker holds may share a tied weight: each tensor once
    params = list({id(p): p for part in trainer.parts for p in part.module.parameters()}.values())
    global_norm = len(trainer.plan.stages) > 1 and across_stages
    if global_norm:
        sq = sum(
            (
                # a tied weight counts once, in the first stage that holds it, as in one model
                grad_sq_norm(p for p in part.module.parameters() if id(p) not in counted_elsewhere(part, trainer.tied))
                / (1 if is_sharded(part.module) else len(part.ranks))
                for part in trainer.parts
            ),
            torch.zeros(()),
        ).to(trainer.runtime.device)
        dist.all_reduce(sq)
        total = math.sqrt(float(sq))
    elif any(is_sharded(part.module) for part in trainer.parts):
        # each worker holds a shard of every gradient: torch's clipping sums their norms over the stage
        total = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return float(total.full_tensor() if is_dtensor(total) else total)
    else:
        total = float(torch.sqrt(grad_sq_norm(params)))
    coef = max_norm / (total + 1e-6)
    if coef < 1:
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(coef)
    return total
