"""The worker's one training loop: every sync mode, every plan shape, joins, leaves and failures.

Every worker runs ``membership.start() -> train(trainer, strategy, membership) ->
membership.finish()`` (:func:`felactl.agents.worker.main.run_worker`). What differs between sync
modes lives in a :class:`~felactl.agents.worker.strategy.Strategy`; who is in the job, in the
:class:`~felactl.agents.worker.membership.Membership`. What does not differ lives here, written
once: the injected stragglers, the metrics record, the checkpoints and the graceful stop (the
strategy's ``end``, :meth:`Trainer.end_step`), the final synchronisation.

The loop calls the membership at named points: :meth:`~Membership.record_extra` for each record,
:meth:`~Membership.after_step` after each completed step (the change every member agreed to make
now, if any), :meth:`~Membership.after_failure` when a step failed (in a membership that survives
failures), and :meth:`~Membership.switch` to make a change and get the strategy to go on with.
Before any of the last two, and before the run ends, the strategy is closed
(:meth:`~Strategy.close`): the groups it used are about to be destroyed.
"""

from __future__ import annotations

import sys
import textwrap
import time
import traceback
from typing import Any

from felactl.agents.worker.engine import Trainer
from felactl.agents.worker.hooks import check_evaluable, evaluation, learning_rate
from felactl.agents.worker.membership import Membership
from felactl.agents.worker.strategy import Strategy
from felactl.errors import FelactlError


def train(trainer: Trainer, strategy: Strategy, membership: Membership) -> bool:
    """The loop: every sync mode, every plan shape, joins, leaves and failures. Returns False
    when this worker left the job on the way (a scale-in removed it).

    A membership that survives failures is told of any exception a step raises but felactl's
    own (which end the worker): a collective's RuntimeError (a peer died or hung) looks like the
    user's own ``RuntimeError`` (a shape slip in ``loss_fn``), and which it was is not told here
    but by whether it repeats (the coordinator's decision)."""
    check_evaluable(trainer)
    while True:
        failed = None
        try:
            change = _steps(trainer, strategy, membership)
        except Exception as exc:  # this step did not complete here
            if not membership.survives_failures or isinstance(exc, FelactlError):
                membership.failing(trainer, strategy)
                # The membership's close() destroys the groups next: let go of the DDP, also of the
                # frames the traceback keeps (Trainer.compute's ``ddp``), before it does.
                strategy.close()
                traceback.clear_frames(exc.__traceback__)
                raise
            failed = failure_line(exc)
            # Indented, so that the log's last traceback stays the one the worker may end with.
            print(textwrap.indent(traceback.format_exc(), "  "), file=sys.stderr, end="", flush=True)
        try:
            if failed is None and change is None:
                strategy.finish()
        finally:  # before the membership destroys this generation's groups (a switch, a failure, the end)
            strategy.close()
        if failed is not None:
            # Outside the ``except`` and with the strategy dropped, so that neither the traceback
            # nor this frame keeps the failed group's tensors alive while the job re-forms.
            strategy = None
            change = membership.after_failure(failed)
        elif change is None:
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
        duration_s = time.perf_counter() - start
        trainer.record(
            step=work.step,
            samples=result.samples,
            loss_sum=result.loss_sum,
            loss_samples=result.loss_samples,
            compute_s=result.compute_s + pattern_s,
            comm_s=result.comm_s,
            wait_s=result.wait_s,
            duration_s=duration_s,
            **({"local_step": work.local_step} if strategy.records_local_step else {}),
            **result.extra,
            **membership.record_extra(),
            **learning_rate(trainer),
            **evaluation(trainer, work.step),
        )
        if result.sync_failed is not None:
            raise RuntimeError(result.sync_failed)
        if strategy.end(work):
            return None
        if (change := membership.after_step(strategy)) is not None:
            return change
    return None
