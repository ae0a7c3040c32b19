"""Fela's tokens for a data-parallel stage, with the token bucket kept in the control-plane store.

Each iteration has ``n1 = max(global_batch / micro_batch, N)`` tokens (a token is one of the
plan's micro-batches). The store's atomic ``add`` makes the bucket: one ``add`` claims a token,
so two workers can never get the same one and nobody hands tokens out by message. Workers pull
until nothing is left, so fast workers simply pull more.

- ``hf`` / ``ads+hf``: one sub-bucket per worker (split by the plan's shares), one store counter
  each. The owner takes tokens from the front (``add 1``), helpers from the back (``add
  STEAL``): the counter's value holds both counts, so a claim is valid exactly when the two
  together do not exceed the sub-bucket. A worker drains its own, then helps the owner chosen by
  :func:`felactl.agents.worker.sync.token_policy.choose_victim` (reading one counter per other worker).
- ``ads``: one shared bucket. With a single level, ADS has one depth to choose from, so it
  hands tokens out in id order; the multi-level policy lives in :class:`TokenServer`.

Gradients are weighted by samples and summed in place (:class:`GradBuckets`): BSP semantics
whoever did the work. When a worker knows the token it starts is its last, it arms the buckets
and their allreduce overlaps that token's backward; when it cannot tell yet (another worker has
not claimed its own), it asks again once backward completes a bucket
(:meth:`GradBuckets.arm_if_last`). It knows when no token is left, and it may
*retire* early: when the others (all in, speeds known from the last iteration) would drain what
is left before its own token ends. A store counter keeps at least one worker from retiring, so
every token is still claimed; a wrong guess only costs time, never correctness.

**A stalled worker does not hold the others.** Under BSP a worker that stalls for longer than an
iteration (a pause, another job's burst: ``--straggler prob:P:S``) makes everyone wait at the
allreduce, although the others have already done all its tokens. So each iteration has a *gate*
(one store counter): a worker sets its bit before its first claim; every worker that finds the
bucket empty closes it (``add CLOSED``), and the bits set before the first close are the
iteration's members, which that first closer publishes. Only they sum gradients (in a group of
just them), and the first of them publishes the sum in the store, in pieces under the store's
largest value; a worker whose bit came after the close skipped the iteration: it reads that sum
and takes the same optimizer step, so every replica still applies exactly the single-process
update of every global batch.

Bounds. Members may run at most ``max_lag`` iterations ahead of the slowest worker (the sums wait
in the store until it has read them), so the store holds a bounded number of them; where even
one sum is over that budget there is no gate and every iteration waits for everyone, as plain
BSP does. A group of some of the workers costs sockets and threads in each member, so a job
forms at most ``MAX_MEMBER_GROUPS`` of them; a member set that would need one more is widened to
everyone (the late joiners read the published members and find themselves in), which again is
BSP's wait.

The last worker to finish an iteration deletes its keys; the seconds per token of each worker
(``speed/<rank>``, which the others read to decide retirements) are overwritten in place.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from felactl.agents.worker.engine import Trainer
from felactl.agents.worker.stages import split_by_shares
from felactl.agents.worker.strategy import Lockstep, StepResult, Work
from felactl.agents.worker.sync.buckets import GradBuckets
from felactl.agents.worker.sync.token_policy import SubBucketView, choose_victim, token_samples
from felactl.agents.worker.sync.trees import stage_trees
from felactl.control import keys
from felactl.errors import WorkerFailed
from felactl.spec.executable import num_first_level_tokens

STEAL = 1 << 20
"""A helper's claim adds this to the owner's counter: owner count in the low bits, helpers' above."""
RETIRE_SLACK = 1.2
"""Retire when the others' drain time is at most this many of one's own token times."""
CLOSED = 1 << 40
"""Closing an iteration's gate adds this; a worker's bit below it says it joined before."""
MAX_GATED_WORKERS = 40
"""One gate bit per worker; a larger stage has no gate (every iteration waits for everyone)."""
MAX_LAG = 8
"""Iterations the members may run ahead of a stalled worker."""
MAX_MEMBER_GROUPS = 8
"""Groups of some (two or more, not all) of the workers that one job may form."""
SUM_PIECE_BYTES = 4 << 20
"""A published sum goes to the store in pieces of at most this size (its values stop at 8 MiB)."""
LAG_BUDGET_BYTES = 512 << 20
"""At most this much of published sums waits in the store for a stalled worker."""
LAG_POLL_S = 0.002


def skip_ahead_limit(grad_bytes: int, num_workers: int, member_groups: bool = True) -> int:
    """How many iterations members may run ahead of a stalled worker (0: no gate): each one
    ahead may leave a published sum of ``grad_bytes`` in the store. Without ``member_groups``
    (groups of some workers formed mid-run) only two workers can have a gate: a member set short
    of everyone is then one worker, which needs no group."""
    if not 1 < num_workers <= MAX_GATED_WORKERS or (num_workers > 2 and not member_groups):
        return 0
    return min(MAX_LAG, LAG_BUDGET_BYTES // max(grad_bytes, 1))


class StoreTokenBucket:
    """One stage's tokens of one iteration, claimed through store counters.

    Per iteration: :meth:`begin`, :meth:`join` (False: this worker skipped it; take the members'
    sum), :meth:`next_token` until None or a last token, :meth:`close`, :meth:`record_speed`, and
    :meth:`finish_iteration` once this worker's update is applied. ``max_lag`` 0: no gate."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        workers: tuple[int, ...],
        shares: list[float],
        num_tokens: int,
        policy: str,
        max_lag: int = 0,
        timeout_s: float = 300.0,
        interrupted: Callable[[], bool] = lambda: False,
    ):
        """``interrupted()``: whether to give up a wait on the others (a member died: an elastic
        job re-forms without it, see :meth:`MembershipView.members_changed`)."""
        if num_tokens >= STEAL:
            raise ValueError(f"{num_tokens} tokens per iteration is too many (at most {STEAL - 1})")
        self.store = store
        self.rank = rank
        self.workers = workers
        self.num_tokens = num_tokens
        self.hf = "hf" in policy
        self.ranges = dict(zip(workers, split_by_shares(num_tokens, shares))) if self.hf else {}
        self.max_lag = max_lag
        self.bit = {w: 1 << i for i, w in enumerate(workers)}
        self.everyone = sum(self.bit.values())
        """The gate bits of all the workers."""
        self.timeout_s = timeout_s
        self.interrupted = interrupted
        self.step = -1
        self.helping: set[int] = set()
        self.claimed: list[int] = []
        self.retired = False
        self._members: tuple[int, ...] | None = None
        self.token_s: float | None = None
        """This worker's seconds per token (moving average, injected slowness included)."""
        self.others_token_s: dict[int, float] = {}

    @property
    def gated(self) -> bool:
        return self.max_lag > 0

    def _key(self, name: str, step: int | None = None) -> str:
        return keys.token(self.step if step is None else step, name)

    def begin(self, step: int) -> float:
        """Open iteration ``step``: wait until nobody is ``max_lag`` iterations behind, read the
        others' speeds. Returns the seconds waited."""
        waited_s = self._wait_for_laggards(step)
        if self.hf:
            for w in self.workers:
                key = keys.token_speed(w)
                if w != self.rank and self.store.check([key]):
                    seconds = float(self.store.get(key))
                    if seconds > 0:
                        self.others_token_s[w] = seconds
        self.step = step
        self.claimed = []
        self.helping = set()
        self.retired = False
        self._members = None
        return waited_s

    def _wait_for_laggards(self, step: int) -> float:
        """An iteration's ``done`` counter exists from its first finisher until its last one
        deletes it, so while that of ``step - max_lag`` exists someone is that far behind."""
        if not self.gated or step < self.max_lag:
            return 0.0
        key, start = self._key("done", step - self.max_lag), time.perf_counter()
        while self.store.check([key]):
            self._give_up_after(start, f"a peer has not finished iteration {step - self.max_lag}")
            time.sleep(LAG_POLL_S)
        return time.perf_counter() - start

    def _give_up_after(self, start: float, what: str) -> None:
        if self.interrupted():  # a RuntimeError, as a collective with a dead peer raises: the step failed
            raise RuntimeError(f"worker {self.rank}: {what}, and the job's members changed")
        if time.perf_counter() - start > self.timeout_s:
            raise WorkerFailed(f"worker {self.rank}: {what} after {self.timeout_s:g} s")

    def wait_get(self, key: str) -> bytes:
        """The value of ``key`` once another worker set it (polled, so a dead writer is noticed)."""
        start = time.perf_counter()
        while not self.store.check([key]):
            self._give_up_after(start, f"nobody wrote {key}")
            time.sleep(LAG_POLL_S)
        return self.store.get(key)

    def join(self) -> bool:
        """Enter the iteration before the first claim. False: the others closed it without this
        worker (they claimed every token while it stalled)."""
        if not self.gated or self.store.add(self._key("gate"), self.bit[self.rank]) < CLOSED:
            return True
        return bool(self._published_members() & self.bit[self.rank])  # widened to everyone?

    def close(self) -> tuple[int, ...]:
        """Close the iteration for this worker, which claims no more; returns who sums gradients.
        A worker that found the bucket empty closes the gate; a retiring worker knows everyone
        is in (it retires only then)."""
        if self._members is None:
            bits = self._close_gate() if self.gated and not self.retired else self.everyone
            self._members = tuple(w for w in self.workers if bits & self.bit[w])
        return self._members

    def _close_gate(self) -> int:
        value = self.store.add(self._key("gate"), CLOSED)
        if value >= 2 * CLOSED:
            return self._published_members()
        bits = value - CLOSED  # the first to close: the bits set before it are final
        if not self._may_sum_apart(bits):
            bits = self.everyone
        self.store.set(self._key("members"), str(bits))
        return bits

    def _published_members(self) -> int:
        return int(self.wait_get(self._key("members")))

    def _may_sum_apart(self, bits: int) -> bool:
        """Whether the workers of ``bits`` may sum without the rest: alone, or in a group of
        them the job has formed already or may still form (at most ``MAX_MEMBER_GROUPS``)."""
        if bits == self.everyone or bits.bit_count() == 1:
            return True
        formed = keys.token_group(bits)
        if self.store.check([formed]):
            return True
        if self.store.add(keys.TOKEN_GROUPS, 1) > MAX_MEMBER_GROUPS:
            return False
        self.store.set(formed, "1")
        return True

    def sum_key(self, piece: int) -> str:
        """Where the members publish piece ``piece`` of the iteration's summed gradients."""
        return self._key(keys.token_sum(piece))

    def next_token(self) -> tuple[int, bool] | None:
        """``(token, last)``: the claimed token and whether this worker will claim no more this
        iteration; None when nothing is left."""
        if not self.hf:
            position = self.store.add(self._key("all"), 1) - 1
            if position >= self.num_tokens:
                return None
            return self._took(position, position == self.num_tokens - 1)
        own, steals = self._split(self.store.add(self._key(keys.token_bucket(self.rank)), 1))
        mine = self.ranges[self.rank]
        if own + steals <= len(mine):
            return self._took(mine[own - 1], self._last(len(mine) - own - steals))
        while (victim := choose_victim(self._views())) is not None:
            if victim not in self.helping and len(self.workers) > 2:
                self.helping.add(victim)
                self.store.add(self._key(keys.token_helpers(victim)), 1)
            own, steals = self._split(self.store.add(self._key(keys.token_bucket(victim)), STEAL))
            theirs = self.ranges[victim]
            if own + steals <= len(theirs):
                return self._took(theirs[len(theirs) - steals], self._last(len(theirs) - own - steals, skip=victim))
        return None

    def nothing_left(self) -> bool:
        """Whether every token of the iteration has been claimed (by anyone): then the token this
        worker runs is its last. Asked while it runs one that :meth:`next_token` could not call
        last yet, because another worker had not claimed its own."""
        if not self.hf:
            return self.store.add(self._key("all"), 0) >= self.num_tokens
        for w in self.workers:
            own, steals = self._split(self.store.add(self._key(keys.token_bucket(w)), 0))
            if own + steals < len(self.ranges[w]):
                return False
        return True

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
            own, steals = self._split(self.store.add(self._key(keys.token_bucket(w)), 0))
            backlog = max(0, len(self.ranges[w]) - own - steals)
            if backlog:
                views.append(SubBucketView(w, backlog, 0, max(own - 1, 0)))
        if len(views) > 1:  # whom to help depends on who helps already
            views = [
                SubBucketView(
                    v.owner,
                    v.backlog,
                    self._count(keys.token_helpers(v.owner)) - (v.owner in self.helping),
                    v.completed,
                )
                for v in views
            ]
        return views

    def _count(self, name: str) -> int:
        return self.store.add(self._key(name), 0)

    def _last(self, left_here: int, skip: int | None = None) -> bool:
        """HF: is the token just claimed this worker's last? Yes when nothing is left anywhere;
        or retire when the others, all in and started, would drain what is left before this
        worker's token ends (at least one worker never retires, so every token is still claimed)."""
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
            own, steals = self._split(self.store.add(self._key(keys.token_bucket(w)), 0))
            left += max(0, len(self.ranges[w]) - own - steals)
            started = started and own > 0
        if left == 0:
            return True
        if unknown or not started or left / drain_rate > RETIRE_SLACK * self.token_s:
            return False
        if self.gated and not self._all_joined():
            return False  # a stalled worker's tokens would wait for it: keep claiming
        if self.store.add(self._key("retired"), 1) < len(self.workers):
            self.retired = True
            return True
        self.store.add(self._key("retired"), -1)
        return False

    def _all_joined(self) -> bool:
        """Everyone has joined and the gate is still open (so everyone is a member)."""
        value = self.store.add(self._key("gate"), 0)
        return value < CLOSED and value == self.everyone

    def record_speed(self, token_s: float) -> None:
        """Record this worker's seconds per token (when it ran tokens this iteration)."""
        if self.claimed:
            self.token_s = token_s if self.token_s is None else 0.5 * self.token_s + 0.5 * token_s
            self.store.set(keys.token_speed(self.rank), f"{self.token_s:.6f}")

    def finish_iteration(self, sum_pieces: int) -> None:
        """This worker has applied the iteration's update; the last one to get here deletes the
        iteration's keys (nobody reads them any more)."""
        if self.store.add(self._key("done"), 1) < len(self.workers):
            return
        names = ["gate", "members", "all", "retired"]
        names += [name(w) for w in self.workers for name in (keys.token_bucket, keys.token_helpers)]
        names += [keys.token_sum(i) for i in range(sum_pieces)] if self.gated else []
        for name in names + ["done"]:  # ``done`` last: its absence says the iteration is over
            self.store.delete_key(self._key(name))


def sum_pieces(grads: GradBuckets) -> list[tuple[int, slice]]:
    """The published sum's pieces: (buffer index, byte range), each at most ``SUM_PIECE_BYTES``."""
    pieces = []
    for index, buffer in enumerate(grads.buffers):
        size = buffer.numel() * buffer.element_size()
        pieces += [
            (index, slice(start, min(start + SUM_PIECE_BYTES, size))) for start in range(0, size, SUM_PIECE_BYTES)
        ]
    return pieces


def publish_sum(bucket: StoreTokenBucket, grads: GradBuckets) -> None:
    """The members' summed gradients, for the workers that skipped the iteration."""
    raw = [buffer.detach().cpu().view(torch.uint8).numpy() for buffer in grads.buffers]
    for piece, (index, span) in enumerate(sum_pieces(grads)):
        bucket.store.set(bucket.sum_key(piece), raw[index][span].tobytes())


def receive_sum(bucket: StoreTokenBucket, grads: GradBuckets) -> None:
    """Load the members' sum into the gradient buffers (``p.grad`` are views of them)."""
    grads.begin()
    raw = [torch.empty(buffer.numel() * buffer.element_size(), dtype=torch.uint8) for buffer in grads.buffers]
    for piece, (index, span) in enumerate(sum_pieces(grads)):
        raw[index][span] = torch.frombuffer(bytearray(bucket.wait_get(bucket.sum_key(piece))), dtype=torch.uint8)
    for buffer, data in zip(grads.buffers, raw):
        buffer.copy_(data.view(buffer.dtype).view(buffer.shape))


class Tokens(Lockstep):
    """Fela's token bucket on a data-parallel stage (see the module doc)."""

    def __init__(self, trainer: Trainer):
        super().__init__(trainer)
        placement, plan, runtime = trainer.placement, trainer.plan, trainer.runtime
        stage = plan.stages[placement.stage]
        self.stage_group = runtime.group(placement.stage_ranks)
        self.num_tokens = num_first_level_tokens(plan.global_batch, stage.micro_batch, len(stage.workers))
        # The whole stage sums along the plan's trees, as the planner priced it; an iteration that
        # a stalled worker skipped is summed by the others through the backend.
        trees = stage_trees(plan, placement.stage, runtime.rank, self.stage_group)
        self.grads = GradBuckets(trainer.params, trees=trees, trees_group=self.stage_group)
        grad_bytes = sum(b.numel() * b.element_size() for b in self.grads.buffers)
        self.num_pieces = len(sum_pieces(self.grads))
        self.bucket = StoreTokenBucket(
            runtime.store,
            runtime.rank,
            placement.stage_ranks,
            [w.share for w in stage.workers],
            self.num_tokens,
            plan.sync.token_policy,
            max_lag=skip_ahead_limit(grad_bytes, len(placement.stage_ranks), runtime.forms_member_groups),
            timeout_s=runtime.cfg.timeout_s,
            interrupted=trainer.membership.members_changed,
        )
        self.lead_steps = self.bucket.max_lag + Lockstep.lead_steps  # members may run max_lag iterations ahead

    def _group_of(self, members: tuple[int, ...]):
        if len(members) == len(self.trainer.placement.stage_ranks):
            return self.stage_group
        return self.trainer.runtime.members_group(members) if len(members) > 1 else None

    def step(self, work: Work) -> StepResult:
        t, bucket, grads = self.trainer, self.bucket, self.grads
        lag_wait_s = bucket.begin(work.step)
        if not bucket.join():  # stalled past the iteration: apply the members' sum
            receive_start = time.perf_counter()
            receive_sum(bucket, grads)
            t.optimizer_step()
            bucket.finish_iteration(self.num_pieces)
            return StepResult(
                0,
                None,
                0.0,
                comm_s=time.perf_counter() - receive_start,
                wait_s=lag_wait_s,
                extra={"tokens": 0, "skipped": True},
            )
        grads.begin()
        loss_sum, samples, tokens, token_s = 0.0, 0, 0, 0.0
        while (claim := bucket.next_token()) is not None:
            token, last = claim
            if last:
                grads.arm(self._group_of(bucket.close()))
            else:  # the others may not have claimed theirs yet: ask again once backward is under way
                grads.arm_if_last(bucket.nothing_left, lambda: self._group_of(bucket.close()))
            offsets = token_samples(t.global_batch, self.num_tokens, token)
            result = t.compute(t.step_indices(work.step, offsets), weight_by=t.global_batch)
            loss_sum, samples, tokens = loss_sum + result.loss_sum, samples + result.samples, tokens + 1
            token_s += result.compute_s
            if grads.armed:
                break
        members = bucket.close()
        bucket.record_speed(token_s / tokens if tokens else 0.0)
        wait_s, comm_s = grads.finish(self._group_of(members))
        if len(members) < len(t.placement.stage_ranks) and t.runtime.rank == members[0]:  # first in stage order
            publish_start = time.perf_counter()
            publish_sum(bucket, grads)
            comm_s += time.perf_counter() - publish_start
        t.optimizer_step()
        bucket.finish_iteration(self.num_pieces)
        return StepResult(
            samples,
            loss_sum,
            token_s,
            comm_s,
            wait_s + lag_wait_s,
            extra={"tokens": tokens, "over_trees": grads.over_trees, "buckets_in_backward": grads.launched_in_backward},
        )
