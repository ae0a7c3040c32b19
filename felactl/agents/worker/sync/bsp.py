"""BSP: every iteration each replica computes its share, then the stage's gradients are summed.

Data parallel runs through torch's ``DistributedDataParallel`` on the stage's group: its bucketed
allreduce overlaps the last micro-batch's backward (only the last one synchronises), so the
communication is hidden inside ``compute_s`` and ``comm_s`` is 0. Just before that micro-batch a
one-element allreduce measures how long this worker waited for the others (``wait_s``).
Where the plan packed trees for the stage's group, DDP's buckets are summed along them
(felactl.agents.worker.sync.trees, a DDP communication hook), else by the backend's allreduce.
Where DDP does not fit (a replica with no samples this step) and for the pipelines,
:func:`allreduce_grads` sums one flat buffer in one collective (its time is ``comm_s``).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from felactl.agents.worker.engine import Trainer
from felactl.agents.worker.membership_view import MembershipView
from felactl.agents.worker.stages import split_by_shares
from felactl.agents.worker.strategy import Lockstep, StepResult, Work
from felactl.agents.worker.sync.trees import TreeAllreduce, ddp_hook, stage_trees
from felactl.parallel.ddp import wrap_replica


def arrive(group, device: torch.device, proposal: float = 0.0) -> tuple[float, float]:
    """Block until every member of ``group`` arrived; returns the seconds waited and the largest
    ``proposal`` of any member: the one-element all-reduce carries it at no extra cost."""
    start = time.perf_counter()
    values = torch.tensor([proposal], device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    return time.perf_counter() - start, float(values.item())


def allreduce_grads(trainer: Trainer, group, trees: TreeAllreduce | None = None) -> float:
    """Sum the stage's gradients over ``group`` (along ``trees`` where given); returns its seconds."""
    start = time.perf_counter()
    flat = trainer.flat_grads()
    if trees is not None:
        trees(flat)
    else:
        dist.all_reduce(flat, group=group)
    trainer.set_flat_grads(flat)
    return time.perf_counter() - start


def data_parallel(trainer: Trainer, group, init_sync: bool = True) -> DistributedDataParallel | None:
    """DDP over the stage's replicas, where every replica computes samples each step
    (``init_sync=False``: the replicas already hold the same parameters; skip DDP's broadcast)."""
    plan = trainer.plan
    shares = split_by_shares(plan.global_batch, [w.share for w in plan.stages[0].workers])
    if len(trainer.placement.stage_ranks) < 2 or min(len(s) for s in shares) == 0:
        return None
    device_ids = [trainer.runtime.device.index] if trainer.runtime.device.type == "cuda" else None
    ddp = wrap_replica(trainer.model, group, device_ids=device_ids, init_sync=init_sync)
    trees = stage_trees(plan, trainer.placement.stage, trainer.runtime.rank, group)
    if trees is not None:
        ddp.register_comm_hook(trees, ddp_hook)
    return ddp


def settle_buckets(ddp: DistributedDataParallel) -> None:
    """Rebuild DDP's gradient buckets now, after the first synchronised step, on every rank at once.

    DDP otherwise rebuilds them inside the next forward, with a broadcast: replicas that run a
    different number of micro-batches (uneven shares) would reach that broadcast and the arrival
    all-reduce in different orders and deadlock. ``_has_rebuilt_buckets`` is DDP's own flag for
    that rebuild: setting it is how DDP is told it has happened."""
    ddp.reducer._rebuild_buckets()
    ddp._has_rebuilt_buckets = True


class BSP(Lockstep):
    """Every replica computes its share of each step; the stage's gradients are summed (inside
    DDP's backward where it fits, else in one flat allreduce) before the optimizer step.

    In an elastic job, each step's arrival also carries the newest generation each member has
    seen, so the members agree to switch after the same step at no extra cost."""

    def __init__(self, trainer: Trainer):
        super().__init__(trainer)
        self.group = trainer.runtime.group(trainer.placement.stage_ranks)
        self.ddp = data_parallel(trainer, self.group, init_sync=False)  # begin() or replication made them agree
        self.buckets_settled = self.ddp is None
        """Whether :func:`settle_buckets` has run on this strategy's DDP (once, after the first step)."""
        self.trees = stage_trees(trainer.plan, trainer.placement.stage, trainer.runtime.rank, self.group)
        self.seen_generation = trainer.membership.generation
        """The newest generation any member had seen at the last step's arrival."""

    def step(self, work: Work) -> StepResult:
        t = self.trainer
        if self.ddp is not None:
            result = t.compute(work.indices, weight_by=t.global_batch, ddp=self.ddp, before_last=self._arrive)
            wait_s, comm_s = result.waited_s, 0.0
        else:
            result = t.compute(work.indices, weight_by=t.global_batch)
            wait_s = self._arrive()
            comm_s = allreduce_grads(t, self.group, self.trees)
        t.optimizer_step()
        if not self.buckets_settled:
            settle_buckets(self.ddp)
            self.buckets_settled = True
        return StepResult(result.samples, result.loss_sum, result.compute_s, comm_s, wait_s)

    def close(self) -> None:
        # A DDP that outlives its gloo group frees the group's last reference in its own dealloc,
        # which holds the GIL while the group's destructor joins a gloo thread that may need the
        # GIL to free the last collective's tensors (torch issue 56297): a hang, 1 process in 15
        # right after a collective in the profiler's sync timing. Dropped while the group lives.
        self.ddp = None

    def _arrive(self) -> float:
        """The arrival before the step's gradients are summed, proposing the newest generation
        this member has seen; returns the seconds waited."""
        membership = self.trainer.membership
        wait_s, seen = arrive(self.group, self.trainer.runtime.device, float(membership.newest_generation()))
        self.seen_generation = int(seen)
        return wait_s

    def generation_to_switch_to(self, membership: MembershipView) -> int | None:
        """The newest generation any member had seen at this step's arrival, if newer."""
        return self.seen_generation if self.seen_generation > membership.generation else None
