"""What the asynchronous modes (WBSP, SDPipe) share: local steps on samples claimed from a store
counter, so workers advance at their own pace and still never see the same sample twice.

The data position is one store counter (``data/next``): a worker takes its next
``len(placement.offsets)`` samples with one atomic ``add``; the run ends when ``steps *
global_batch`` samples have been handed out, the same amount of data a BSP run of ``steps``
iterations trains on.
"""

from __future__ import annotations

import time
from typing import Callable

from felactl.agents.worker.engine import Trainer


def claim_samples(trainer: Trainer) -> list[int]:
    total = trainer.runtime.cfg.steps * trainer.global_batch
    size = len(trainer.placement.offsets)
    end = trainer.runtime.store.add("data/next", size)
    start = end - size
    return list(range(start, min(end, total))) if start < total else []


def local_steps(trainer: Trainer, sync: Callable[[int], tuple[float, float]]) -> int:
    """Loop: claim samples, local step, then ``sync(step) -> (comm_s, wait_s)``. Returns steps done."""
    step = 0
    while indices := claim_samples(trainer):
        start = time.perf_counter()
        pattern_s = trainer.straggler.at_iteration(step)
        result = trainer.compute(indices)
        trainer.optimizer_step()
        comm_s, wait_s = sync(step)
        trainer.record(step=step, samples=result.samples, loss_sum=result.loss_sum,
                       compute_s=result.compute_s + pattern_s, comm_s=comm_s, wait_s=wait_s,
                       duration_s=time.perf_counter() - start)
        trainer.maybe_checkpoint(step, indices[-1] + 1)
        step += 1
    return step
