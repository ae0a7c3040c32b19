"""Fela's tokens for a data-parallel stage, with the token bucket kept in the control-plane store.

Each iteration has ``n1 = max(global_batch / micro_batch, N)`` tokens (a token is one of the
plan's micro-batches). The store's atomic ``add`` makes the bucket: one ``add`` claims a token,
so two workers can never get the same one and nobody hands tokens out by message. Workers pull
until nothing is left, so fast workers simply pull more.

- ``hf`` / ``ads+hf``: one sub-bucket per worker (split by the plan's shares), one store counter
  each. The owner takes tokens from the front (``add 1``), helpers from the back (``add
  STEAL``): the counter's value holds both counts, so a claim is valid exactly when the two
  together do not exceed the sub-bucket. A worker drains its own, then helps the owner chosen by
  :func:`felactl.launcher.tokens.choose_victim` (reading one counter per other worker).
- ``ads``: one shared bucket. With a single level, ADS has one depth to choose from, so it
  hands tokens out in id order; the multi-level policy lives in :class:`TokenServer`.

Gradients are weighted by samples and summed in place (:class:`GradBuckets`): BSP semantics
whoever did the work. When a worker knows the token it starts is its last, it arms the buckets
and their allreduce overlaps that token's backward. It knows when no token is left, and it may
*retire* early: when the others (all started, speeds known from the last iteration) would drain
what is left before its own token ends. A store counter keeps at least one worker from retiring,
so every token is still claimed; a wrong guess only costs time, never correctness.

Who did what is recorded once per iteration (``by/<rank>`` = token ids, then the worker's
seconds per token, which the others read as its speed).
"""

from __future__ import annotations

import time

import torch.distributed as dist

from felactl.agents.worker.engine import Trainer
from felactl.agents.worker.stages import split_by_shares
from felactl.agents.worker.sync.buckets import GradBuckets
from felactl.launcher.tokens import SubBucketView, choose_victim, num_first_level_tokens, token_samples

STEAL = 1 << 20
"""A helper's claim adds this to the owner's counter: owner count in the low bits, helpers' above."""
RETIRE_SLACK = 1.2
"""Retire when the others' drain time is at most this many of one's own token times."""


class StoreTokenBucket:
    """One stage's tokens of one iteration, claimed through store counters."""

    def __init__(self, store: dist.Store, rank: int, workers: tuple[int, ...], shares: list[float],
                 num_tokens: int, policy: str):
        if num_tokens >= STEAL:
            raise ValueError(f"{num_tokens} tokens per iteration is too many (at most {STEAL - 1})")
        self.store = store
        self.rank = rank
        self.workers = workers
        self.num_tokens = num_tokens
        self.hf = "hf" in policy
        self.ranges = dict(zip(workers, split_by_shares(num_tokens, shares))) if self.hf else {}
        self.step = -1
        self.helping: set[int] = set()
        self.claimed: list[int] = []
        self.token_s: float | None = None
        """This worker's seconds per token (moving average, injected slowness included)."""
        self.others_token_s: dict[int, float] = {}

    def _key(self, name: str, step: int | None = None) -> str:
        return f"tok/{self.step if step is None else step}/{name}"

    def begin(self, step: int) -> None:
        """Open iteration ``step``: read the others' speeds of the last one, drop this worker's
        keys of two iterations ago (everyone finished that one: each ends with an allreduce)."""
        if step >= 2:
            for name in (f"b/{self.rank}", f"helpers/{self.rank}", f"by/{self.rank}"):
                self.store.delete_key(self._key(name, step - 2))
            if self.rank == self.workers[0]:
                for name in ("all", "retired"):
                    self.store.delete_key(self._key(name, step - 2))
        if step >= 1 and self.hf:
            for w in self.workers:
                if w != self.rank:
                    record = self.store.get(self._key(f"by/{w}", step - 1)).decode()
                    seconds = float(record.rpartition(";")[2])
                    if seconds > 0:
                        self.others_token_s[w] = seconds
        self.step = step
        self.claimed = []
        self.helping = set()

    def next_token(self) -> tuple[int, bool] | None:
        """``(token, last)``: the claimed token and whether this worker will claim no more this
        iteration; None when nothing is left."""
        if not self.hf:
            position = self.store.add(self._key("all"), 1) - 1
            if position >= self.num_tokens:
                return None
            return self._took(position, position == self.num_tokens - 1)
        own, steals = self._split(self.store.add(self._key(f"b/{self.rank}"), 1))
        mine = self.ranges[self.rank]
        if own + steals <= len(mine):
            return self._took(mine[own - 1], self._last(len(mine) - own - steals))
        while (victim := choose_victim(self._views())) is not None:
            if victim not in self.helping and len(self.workers) > 2:
                self.helping.add(victim)
                self.store.add(self._key(f"helpers/{victim}"), 1)
            own, steals = self._split(self.store.add(self._key(f"b/{victim}"), STEAL))
            theirs = self.ranges[victim]
            if own + steals <= len(theirs):
                return self._took(theirs[len(theirs) - steals], self._last(len(theirs) - own - steals, skip=victim))
        return None

    def _took(self, token: int, last: bool) -> tuple[int, bool]:
        self.claimed.append(token)
        return token, last

    @staticmethod
    def _split(value: int) -> tuple[int, int]:
        return value % STEAL, value // STEAL

    def _views(self) -> list[SubBucketView]:
        views = []
        for w in self.workers:
            if w == self.rank:
                continue
            own, steals = self._split(self.store.add(self._key(f"b/{w}"), 0))
            backlog = max(0, len(self.ranges[w]) - own - steals)
            if backlog:
                views.append(SubBucketView(w, backlog, 0, max(own - 1, 0)))
        if len(views) > 1:  # whom to help depends on who helps already
            views = [SubBucketView(v.owner, v.backlog, self._count(f"helpers/{v.owner}") - (v.owner in self.helping),
                                   v.completed) for v in views]
        return views

    def _count(self, name: str) -> int:
        return self.store.add(self._key(name), 0)

    def _last(self, left_here: int, skip: int | None = None) -> bool:
        """HF: is the token just claimed this worker's last? Yes when nothing is left anywhere;
        or retire when the others, all started, would drain what is left before this worker's
        token ends (at least one worker never retires, so every token is still claimed)."""
        others = [w for w in self.workers if w != self.rank]
        if not others:  # a group of one: nobody to leave tokens to
            return left_here == 0
        if self.token_s is None or any(w not in self.others_token_s for w in others):
            unknown = True
        else:
            unknown = False
            drain_rate = sum(1 / self.others_token_s[w] for w in others)
            if left_here / drain_rate > RETIRE_SLACK * self.token_s:
                return False  # what is left here alone keeps the others busy longer: no need to look
        left, started = left_here, True
        for w in others:
            if w == skip:
                continue
            own, steals = self._split(self.store.add(self._key(f"b/{w}"), 0))
            left += max(0, len(self.ranges[w]) - own - steals)
            started = started and own > 0
        if left == 0:
            return True
        if unknown or not started or left / drain_rate > RETIRE_SLACK * self.token_s:
            return False
        if self.store.add(self._key("retired"), 1) < len(self.workers):
            return True
        self.store.add(self._key("retired"), -1)
        return False

    def done(self, token_s: float) -> None:
        """Close the iteration for this worker: record its tokens and its seconds per token."""
        if self.claimed:
            self.token_s = token_s if self.token_s is None else 0.5 * self.token_s + 0.5 * token_s
        tokens = ",".join(map(str, self.claimed))
        self.store.set(self._key(f"by/{self.rank}"), f"{tokens};{self.token_s or 0.0:.6f}")


def run(trainer: Trainer) -> None:
    placement, plan = trainer.placement, trainer.plan
    stage = plan.stages[placement.stage]
    group = trainer.runtime.group(placement.stage_ranks)
    num_tokens = num_first_level_tokens(plan.global_batch, stage.micro_batch, len(stage.workers))
    bucket = StoreTokenBucket(trainer.runtime.store, trainer.runtime.rank, placement.stage_ranks,
                              [w.share for w in stage.workers], num_tokens, plan.sync.token_policy)
    grads = GradBuckets(trainer.params, group)
    for step in range(trainer.runtime.cfg.steps):
        start = time.perf_counter()
        pattern_s = trainer.straggler.at_iteration(step)
        bucket.begin(step)
        grads.begin()
        loss_sum, samples, tokens, token_s = 0.0, 0, 0, 0.0
        while (claim := bucket.next_token()) is not None:
            token, last = claim
            if last:
                grads.arm()
            offsets = token_samples(plan.global_batch, num_tokens, token)
            result = trainer.compute(trainer.step_indices(step, offsets), weight_by=plan.global_batch)
            loss_sum, samples, tokens = loss_sum + result.loss_sum, samples + result.samples, tokens + 1
            token_s += result.compute_s
            if last:
                break
        bucket.done(token_s / tokens if tokens else 0.0)
        wait_s, comm_s = grads.finish()
        trainer.optimizer_step()
        trainer.record(step=step, samples=samples, loss_sum=loss_sum, compute_s=token_s + pattern_s, comm_s=comm_s,
                       wait_s=wait_s, duration_s=time.perf_counter() - start, tokens=tokens)
        trainer.maybe_checkpoint(step, (step + 1) * trainer.global_batch)
