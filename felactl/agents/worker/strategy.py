"""The interface a sync mode implements to run in the worker's one loop, and its two kinds.

What differs between sync modes (how a step's work is found, how replicas agree on gradients or
weights) lives in one :class:`Strategy` class each, picked in one table
(:mod:`felactl.agents.worker.strategies`, the only place the runtime names a mode) and run by
:func:`felactl.agents.worker.loop.train`. A strategy also owns how the members of an elastic job
agree on where to switch to a new generation (:meth:`Strategy.generation_to_switch_to`) and how
their states come together after a failure (:meth:`Strategy.merge_after_failure`); the facts it
decides on (the generations seen, whether one is planned) are the membership's, which it asks
through :class:`felactl.agents.worker.membership_view.MembershipView`.

Two kinds of strategy:

- :class:`Lockstep` (BSP, tokens, static pipelines, the flexible hybrid): every worker does every
  step ``start_step .. steps - 1``; step ``k``'s samples are the ``k``-th global batch.
- :class:`AtOwnPace` (WBSP, SDPipe): workers claim their next samples from one store counter and
  go at their own pace; a record carries the step its samples begin in (a step is a global batch
  of samples in every mode), and the data position after the run is the counter's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from felactl.agents.worker.engine import Trainer
from felactl.agents.worker.membership_view import MembershipView
from felactl.control import keys

if TYPE_CHECKING:
    from felactl.agents.worker.survivors import KeptState

DATA_KEY = keys.DATA_NEXT
"""The store counter modes at their own pace claim samples from (counted from the start position)."""


@dataclass
class Work:
    """One iteration of the loop: the samples it trains and the step they belong to."""

    step: int
    """The global step (batch) the samples begin in."""
    indices: Sequence[int]
    """Global sample ids (a strategy that hands out its samples itself may ignore them)."""
    local_step: int
    """This worker's own count of iterations (what the injected stragglers follow)."""


@dataclass
class StepResult:
    samples: int
    loss_sum: float | None
    """Sum over the samples the loss was computed on (None: this worker computed no loss)."""
    compute_s: float
    comm_s: float = 0.0
    wait_s: float = 0.0
    loss_samples: int | None = None
    """The samples ``loss_sum`` is over, where not ``samples``."""
    extra: dict[str, Any] = field(default_factory=dict)
    """More fields for the metrics record (tokens, skipped, ...)."""
    sync_failed: str | None = None
    """A mode at its own pace trained the samples into this worker's parameters, and then its sync
    with the others failed (a peer died): the step is recorded, then fails as a collective would
    (the next generation merges what each member holds)."""


class Strategy:
    """A sync mode. Subclasses set things up in ``__init__`` (collectively: every rank constructs
    its strategy at the same point), train one iteration in :meth:`step`, and leave the replicas
    agreeing in :meth:`finish`."""

    records_local_step = False
    """Whether a record also carries the worker's own iteration count (when it is not the step)."""
    lead_steps = 2
    """How many steps past its own a member proposes to stop or switch at: more than any member
    can be ahead of another, so that nobody has passed the agreed step yet. In lockstep a step's
    collectives wait for everyone, so another member completes at most one more step before it
    reads the proposal: two leaves a step to spare. (Tokens let a member run ``max_lag``
    iterations ahead, and look that much further.)"""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer

    def work(self) -> Iterator[Work]:
        raise NotImplementedError

    def step(self, work: Work) -> StepResult:
        raise NotImplementedError

    def end(self, work: Work) -> bool:
        """After a recorded iteration: checkpoint when due; True when a graceful stop ends here."""
        raise NotImplementedError

    def finish(self) -> None:
        """After the last iteration (also after a graceful stop)."""

    def close(self) -> None:
        """Let go of what holds this generation's groups: the membership destroys them next (a
        switch, a failure, the end of the run). Called once, after :meth:`finish` if that ran."""

    def kept_state(self) -> KeptState | None:
        """Where a failure leaves every survivor's state of one step (their checkpoint for the
        restart: :mod:`felactl.agents.worker.survivors`), what tells this worker's step; else None."""
        return None

    def generation_to_switch_to(self, membership: MembershipView) -> int | None:
        """After a completed step of an elastic job: the newer generation every member agreed to
        switch to now, or None. Members that train in lockstep switch after the same step: the
        first to see a new generation proposes, through the store, one :attr:`lead_steps` ahead."""
        return membership.switch_at_agreed_step(self.lead_steps)

    @classmethod
    def merge_after_failure(cls, trainer: Trainer, failed_store: dist.Store | None) -> None:
        """Before this mode trains in a generation formed after a failure (collective over its
        group): bring together the states the failure left apart. ``failed_store``: the failed
        generation's store; None for a member that was not in it (a newcomer). In lockstep every
        member holds the state of the last step it completed: replication hands the furthest one's
        to those behind, and there is nothing to merge."""


class Lockstep(Strategy):
    def work(self) -> Iterator[Work]:
        t = self.trainer
        for step in range(t.start_step, t.runtime.cfg.steps):
            yield Work(step, t.step_indices(step, t.placement.offsets), step)

    def end(self, work: Work) -> bool:
        if self.trainer.end_step(work.step, self.lead_steps):
            self.stopped_before(work.step + 1)
            return True
        return False

    def stopped_before(self, step: int) -> None:
        """A graceful stop ended the run before ``step``: release what waits for it."""


class AtOwnPace(Strategy):
    records_local_step = True

    def trained_then_synced(self, result, sync: Callable[[], tuple[float, float]]) -> StepResult:
        """The step's result after ``sync()`` (returning comm and wait seconds) merged this worker's
        update with the others'. A sync that fails (a peer died) leaves the samples trained into
        this worker's parameters, which the next generation merges: the step is recorded, not lost."""
        try:
            comm_s, wait_s = sync()
        except RuntimeError as exc:
            return StepResult(
                result.samples,
                result.loss_sum,
                result.compute_s,
                extra={"synced": False},
                sync_failed=str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
            )
        return StepResult(result.samples, result.loss_sum, result.compute_s, comm_s, wait_s)

    def work(self) -> Iterator[Work]:
        local_step = 0
        while indices := self.claim():
            yield Work(indices[0] // self.trainer.global_batch, indices, local_step)
            local_step += 1

    def claim(self) -> list[int]:
        """This worker's next samples: its share of a batch, at least one (a share a re-plan by
        measured speeds rounded to no sample ended its loop as if the data were handed out, and the
        job hung at its next switch); none once the data is handed out or a graceful stop began."""
        t = self.trainer
        total = t.runtime.cfg.steps * t.global_batch
        if t.drain.requested():
            return []
        size = max(1, len(t.placement.offsets))
        end = t.start_position + t.runtime.store.add(DATA_KEY, size)
        start = end - size
        return list(range(start, min(end, total))) if start < total else []

    def end(self, work: Work) -> bool:
        self.trainer.end_local_step(work.indices)
        return False

    def finish(self) -> None:
        """Every claimed sample is trained once the mode's final synchronisation is done (call
        this after it): the run's data position is the counter's."""
        t = self.trainer
        t.sync_replicas(buffers_only=True)
        t.adopt_position(claimed_position(t, t.runtime.store))

    def generation_to_switch_to(self, membership: MembershipView) -> int | None:
        """Modes at their own pace need no common step to switch at: a member that sees a planned
        generation settles with the others (:meth:`finish`: every member's progress merged, the
        replicas identical, the data position agreed) wherever each stands, and then they switch
        to the newest generation any of them saw."""
        newest = membership.newest_generation()
        if newest <= membership.generation:
            return None
        if not membership.is_planned(newest):  # a member died: the settle would wait on it
            raise RuntimeError(f"worker {self.trainer.worker_id}: generation {newest} re-forms the job after a failure")
        self.finish()
        agreed = torch.tensor([newest], dtype=torch.int64, device=self.trainer.runtime.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        return int(agreed.item())

    @classmethod
    def merge_after_failure(cls, trainer: Trainer, failed_store: dist.Store | None) -> None:
        """After a failure, members of a mode at its own pace hold different parameters (each its
        own progress since it last merged): they take the mean of theirs, and go on from the data
        position past every sample claimed before the failure. The failed member's progress that
        it had not yet merged (what it pushed to no one, or its last claimed samples) is lost with
        it, as in any asynchronous mode; a newcomer brings no state and takes the others'."""
        holds_state = failed_store is not None
        device = trainer.runtime.device
        flat = trainer.flat_params() if holds_state else torch.zeros_like(trainer.flat_params())
        facts = torch.tensor([float(holds_state)], dtype=torch.float64, device=device)
        dist.all_reduce(flat)
        dist.all_reduce(facts)
        position = torch.tensor([claimed_position(trainer, failed_store) if holds_state else 0], device=device)
        dist.all_reduce(position, op=dist.ReduceOp.MAX)
        if holds_state:
            trainer.set_flat_params(flat / float(facts.item()))
            trainer.adopt_position(int(position.item()))


def claimed_position(trainer: Trainer, store) -> int:
    """The data position once every sample claimed in ``store`` (a generation's store: its
    counter starts there at zero) is trained."""
    total = trainer.runtime.cfg.steps * trainer.global_batch
    return min(total, trainer.start_position + store.add(DATA_KEY, 0))
