"""The worker's one training loop, and the interface a sync mode implements to run in it.

What differs between sync modes (how a step's work is found, how replicas agree) lives in one
:class:`Strategy` class each, picked in one table (:mod:`felactl.agents.worker.strategies`, the
only place the runtime names a mode). What does not differ lives here, written once: the
injected stragglers, the metrics record, the checkpoints and the graceful stop
(:meth:`Trainer.end_step`), the final synchronisation.

Two kinds of strategy:

- :class:`Lockstep` (BSP, tokens, static pipelines, the flexible hybrid): every worker does every
  step ``start_step .. steps - 1``; step ``k``'s samples are the ``k``-th global batch.
- :class:`AtOwnPace` (WBSP, SDPipe): workers claim their next samples from one store counter and
  go at their own pace; a record carries the step its samples begin in (a step is a global batch
  of samples in every mode), and the data position after the run is the counter's.
"""

from __future__ import annotations

import sys
import textwrap
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from felactl.agents.worker.engine import Trainer
from felactl.control import keys
from felactl.errors import FelactlError

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
    agrees_at_arrival = False
    """Whether each step carries the members' :attr:`Trainer.agreement` in a collective of its own
    (BSP's arrival all-reduce); else a membership agrees through the store."""
    settles_anywhere = False
    """Whether the members may stop for a membership change each after a step of its own: then
    :meth:`finish` (collective) leaves the replicas identical and the data position agreed
    wherever each member is (WBSP, SDPipe). Else all members switch after the same step."""

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


class Lockstep(Strategy):
    def work(self) -> Iterator[Work]:
        t = self.trainer
        for step in range(t.start_step, t.runtime.cfg.steps):
            yield Work(step, t.step_indices(step, t.placement.offsets), step)

    def end(self, work: Work) -> bool:
        if self.trainer.end_step(work.step):
            self.stopped_before(work.step + 1)
            return True
        return False

    def stopped_before(self, step: int) -> None:
        """A graceful stop ended the run before ``step``: release what waits for it."""


class AtOwnPace(Strategy):
    records_local_step = True
    settles_anywhere = True

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

    def __init__(self, trainer: Trainer):
        super().__init__(trainer)
        trainer.in_lockstep = False

    def work(self) -> Iterator[Work]:
        local_step = 0
        while indices := self.claim():
            yield Work(indices[0] // self.trainer.global_batch, indices, local_step)
            local_step += 1

    def claim(self) -> list[int]:
        """This worker's next samples; none once the data is handed out or a graceful stop began."""
        t = self.trainer
        total = t.runtime.cfg.steps * t.global_batch
        if t.drain.requested():
            return []
        size = len(t.placement.offsets)
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
        adopt_claimed_position(t, claimed_position(t, t.runtime.store))


def claimed_position(trainer: Trainer, store) -> int:
    """The data position once every sample claimed in ``store`` (a generation's store: its
    counter starts there at zero) is trained."""
    total = trainer.runtime.cfg.steps * trainer.global_batch
    return min(total, trainer.start_position + store.add(DATA_KEY, 0))


def adopt_claimed_position(trainer: Trainer, position: int) -> None:
    """Modes at their own pace keep a fixed global batch, so a step is ``position // batch``."""
    trainer.data_position = position
    trainer.steps_done = position // trainer.global_batch


class Membership:
    """The loop's hooks for a job whose members change while it trains: join, leave, failure
    (:class:`felactl.agents.worker.elastic.ElasticWorker`). A job of fixed members has none of
    it: a failed step fails the worker."""

    def record_extra(self) -> dict[str, Any]:
        return {}

    def after_step(self) -> Any | None:
        """After a completed step: the change every member agreed to make now, if any."""
        return None

    survives_failures = False
    """Whether a failed step (a peer died or hung) is recovered from; a fixed job fails with it."""

    def after_failure(self, why: str) -> Any:
        """A step failed (a peer died or hung, or the user's code raised; ``why``: the exception
        in one line): the change to recover with."""
        raise NotImplementedError

    def switch(self, change: Any) -> Strategy | None:
        """Make ``change`` (re-form the group, replicate the state) and return the strategy to go
        on with, or None when this worker is no longer a member."""
        raise NotImplementedError


def train(trainer: Trainer, strategy: Strategy, membership: Membership | None = None) -> bool:
    """The loop: every sync mode, every plan shape, joins, leaves and failures. Returns False
    when this worker left the job on the way (a scale-in removed it).

    A membership that survives failures is told of any exception a step raises but felactl's
    own (which end the worker): a collective's RuntimeError (a peer died or hung) looks like the
    user's own ``RuntimeError`` (a shape slip in ``loss_fn``), and which it was is not told here
    but by whether it repeats (the coordinator's decision)."""
    membership = membership or Membership()
    while True:
        failed = None
        try:
            change = _steps(trainer, strategy, membership)
        except Exception as exc:  # this step did not complete here
            if not membership.survives_failures or isinstance(exc, FelactlError):
                raise
            failed = failure_line(exc)
            # Indented, so that the log's last traceback stays the one the worker may end with.
            print(textwrap.indent(traceback.format_exc(), "  "), file=sys.stderr, end="", flush=True)
        if failed is not None:
            # Outside the ``except`` and with the strategy dropped, so that neither the traceback
            # nor this frame keeps the failed group's DDP alive while the job re-forms.
            strategy = None
            change = membership.after_failure(failed)
        if change is None:
            strategy.finish()
            return True
        strategy = membership.switch(change)
        if strategy is None:
            return False


def failure_line(exc: BaseException) -> str:
    """An exception in one line, as Python's traceback ends: ``RuntimeError: The size of ...``."""
    return "".join(traceback.format_exception_only(exc)).strip().splitlines()[0]


def _steps(trainer: Trainer, strategy: Strategy, membership: Membership) -> Any | None:
    """Train until the work is done or stopped (None), or until a membership change is agreed."""
    for work in strategy.work():
        start = time.perf_counter()
        pattern_s = trainer.straggler.at_iteration(work.local_step)
        result = strategy.step(work)
        trainer.record(
            step=work.step,
            samples=result.samples,
            loss_sum=result.loss_sum,
            loss_samples=result.loss_samples,
            compute_s=result.compute_s + pattern_s,
            comm_s=result.comm_s,
            wait_s=result.wait_s,
            duration_s=time.perf_counter() - start,
            **({"local_step": work.local_step} if strategy.records_local_step else {}),
            **result.extra,
            **membership.record_extra(),
        )
        if result.sync_failed is not None:
            raise RuntimeError(result.sync_failed)
        if strategy.end(work):
            return None
        if (change := membership.after_step()) is not None:
            return change
    return None
