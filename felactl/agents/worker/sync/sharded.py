"""BSP over a sharded stage (``shard: true``, FSDP2): every worker computes its share of each
step, each block's weights gathered from the others for its forward and backward; the last
micro-batch's backward reduce-scatters the summed gradients, so each worker steps the shard it
holds, and the result equals one process's training (as DDP's)."""

from __future__ import annotations

from felactl.agents.worker.engine import Trainer
from felactl.agents.worker.strategy import Lockstep, StepResult, Work
from felactl.agents.worker.sync.bsp import arrive
from felactl.parallel.fsdp import ShardedReplica


class Sharded(Lockstep):
    def __init__(self, trainer: Trainer):
        super().__init__(trainer)
        self.group = trainer.runtime.group(trainer.placement.stage_ranks)
        self.replica = ShardedReplica(trainer.model, self.group)

    def step(self, work: Work) -> StepResult:
        t = self.trainer
        result = t.compute(work.indices, weight_by=t.global_batch, ddp=self.replica, before_last=self._arrive)
        t.optimizer_step()
        return StepResult(result.samples, result.loss_sum, result.compute_s, 0.0, result.waited_s)

    def _arrive(self) -> float:
        return arrive(self.group, self.trainer.runtime.device)[0]
