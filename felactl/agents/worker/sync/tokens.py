"""Fela's tokens for a data-parallel stage, with the token bucket kept in the control-plane store.

Each iteration has ``n1 = max(global_batch / micro_batch, N)`` tokens. The store's atomic ``add``
makes the bucket: a worker claims the next token of a sub-bucket by adding 1 to its counter, so
two workers can never get the same token and nobody hands tokens out by message. Workers pull
until nothing is left, so fast workers simply pull more.

- ``hf`` / ``ads+hf``: one sub-bucket per worker (split by the plan's shares). A worker drains its
  own, then helps the owner chosen by :func:`felactl.launcher.tokens.choose_victim` (slowest
  owner with the fewest helpers), reading the counters it needs from the store.
- ``ads``: one shared bucket. With a single level, ADS has one depth to choose from, so it
  hands tokens out in id order; the multi-level policy lives in :class:`TokenServer`.

Every claimed token is recorded (``by/<token>`` = rank): the server's map of who did what.
Gradients are weighted by samples, then one sum-allreduce: BSP semantics whoever did the work.
"""

from __future__ import annotations

import time

import torch.distributed as dist

from felactl.agents.worker.engine import Trainer
from felactl.agents.worker.stages import split_by_shares
from felactl.agents.worker.sync.bsp import allreduce_grads, arrive
from felactl.launcher.tokens import SubBucketView, choose_victim, num_first_level_tokens, token_samples


class StoreTokenBucket:
    """One stage's tokens of one iteration, claimed through store counters."""

    def __init__(self, store: dist.Store, rank: int, workers: tuple[int, ...], shares: list[float],
                 num_tokens: int, policy: str):
        self.store = store
        self.rank = rank
        self.workers = workers
        self.num_tokens = num_tokens
        self.hf = "hf" in policy
        self.ranges = dict(zip(workers, split_by_shares(num_tokens, shares))) if self.hf else {}
        self.prefix = ""
        self.helping: set[int] = set()
        self.claimed: dict[int, list[int]] = {}

    def begin(self, step: int) -> None:
        """Open iteration ``step``; drop this worker's keys of two iterations ago (everyone has
        finished that one: a step ends with an allreduce over all workers)."""
        old = self.claimed.pop(step - 2, None)
        if old is not None:
            keys = [f"tok/{step - 2}/by/{t}" for t in old]
            keys += [f"tok/{step - 2}/{k}/{self.rank}" for k in ("next", "helpers", "done")]
            for key in keys:
                self.store.delete_key(key)
        self.prefix = f"tok/{step}/"
        self.step = step
        self.claimed[step] = []
        self.helping = set()

    def _claim(self, bucket: str, tokens: range) -> int | None:
        position = self.store.add(f"{self.prefix}next/{bucket}", 1) - 1
        return tokens[position] if position < len(tokens) else None

    def _count(self, key: str) -> int:
        return self.store.add(f"{self.prefix}{key}", 0)

    def next_token(self) -> int | None:
        if not self.hf:
            return self._claim("all", range(self.num_tokens))
        token = self._claim(str(self.rank), self.ranges[self.rank])
        while token is None:
            victim = choose_victim(self._views())
            if victim is None:
                return None
            if victim not in self.helping:
                self.helping.add(victim)
                self.store.add(f"{self.prefix}helpers/{victim}", 1)
            token = self._claim(str(victim), self.ranges[victim])
        return token

    def _views(self) -> list[SubBucketView]:
        views = []
        for w in self.workers:
            if w == self.rank:
                continue
            backlog = max(0, len(self.ranges[w]) - self._count(f"next/{w}"))
            if backlog:
                views.append(SubBucketView(w, backlog, self._count(f"helpers/{w}") - (w in self.helping),
                                           self._count(f"done/{w}")))
        return views

    def done(self, token: int) -> None:
        self.claimed[self.step].append(token)
        self.store.set(f"{self.prefix}by/{token}", str(self.rank))
        if self.hf:
            self.store.add(f"{self.prefix}done/{self.rank}", 1)


def run(trainer: Trainer) -> None:
    placement, plan = trainer.placement, trainer.plan
    stage = plan.stages[placement.stage]
    group = trainer.runtime.group(placement.stage_ranks)
    device = trainer.runtime.device
    num_tokens = num_first_level_tokens(plan.global_batch, stage.micro_batch, len(stage.workers))
    bucket = StoreTokenBucket(trainer.runtime.store, trainer.runtime.rank, placement.stage_ranks,
                              [w.share for w in stage.workers], num_tokens, plan.sync.token_policy)
    for step in range(trainer.runtime.cfg.steps):
        start = time.perf_counter()
        pattern_s = trainer.straggler.at_iteration(step)
        bucket.begin(step)
        loss_sum, samples, tokens, compute_s = 0.0, 0, 0, pattern_s
        while (token := bucket.next_token()) is not None:
            offsets = token_samples(plan.global_batch, num_tokens, token)
            result = trainer.compute(trainer.step_indices(step, offsets), weight_by=plan.global_batch)
            bucket.done(token)
            loss_sum, samples, tokens = loss_sum + result.loss_sum, samples + result.samples, tokens + 1
            compute_s += result.compute_s
        wait_s = arrive(group, device)
        comm_s = allreduce_grads(trainer, group)
        trainer.optimizer_step()
        trainer.record(step=step, samples=samples, loss_sum=loss_sum, compute_s=compute_s, comm_s=comm_s,
                       wait_s=wait_s, duration_s=time.perf_counter() - start, tokens=tokens)
        trainer.maybe_checkpoint(step, (step + 1) * trainer.global_batch)
