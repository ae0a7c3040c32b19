"""BSP: every iteration each replica computes its share, then one sum-allreduce per stage group.

Gradients are flattened into one buffer so a step costs one collective (not one per tensor).
Before it, a one-element allreduce measures how long this worker waited for the others
(``wait_s``); the gradient allreduce itself is ``comm_s``.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from felactl.agents.worker.engine import Trainer


def arrive(group, device: torch.device) -> float:
    """Block until every member of ``group`` arrived; returns the seconds waited."""
    start = time.perf_counter()
    dist.all_reduce(torch.zeros(1, device=device), group=group)
    return time.perf_counter() - start


def allreduce_grads(trainer: Trainer, group) -> float:
    """Sum the stage's gradients over ``group`` in one collective; returns its seconds."""
    start = time.perf_counter()
    flat = trainer.flat_grads()
    dist.all_reduce(flat, group=group)
    trainer.set_flat_grads(flat)
    return time.perf_counter() - start


def run(trainer: Trainer) -> None:
    placement = trainer.placement
    group = trainer.runtime.group(placement.stage_ranks)
    device = trainer.runtime.device
    for step in range(trainer.runtime.cfg.steps):
        start = time.perf_counter()
        pattern_s = trainer.straggler.at_iteration(step)
        result = trainer.compute(trainer.step_indices(step, placement.offsets), weight_by=trainer.global_batch)
        wait_s = arrive(group, device)
        comm_s = allreduce_grads(trainer, group)
        trainer.optimizer_step()
        trainer.record(step=step, samples=result.samples, loss_sum=result.loss_sum,
                       compute_s=result.compute_s + pattern_s, comm_s=comm_s, wait_s=wait_s,
                       duration_s=time.perf_counter() - start)
        trainer.maybe_checkpoint(step, (step + 1) * trainer.global_batch)
