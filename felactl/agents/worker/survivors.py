"""A failure in a job of fixed members: the workers that survive leave their state for the restart.

A job of fixed members (a pipeline, ``--no-elastic``) starts every worker again after a failure
(:mod:`felactl.launcher.restarts`), each from the run's newest complete checkpoint: the steps
since it are trained again. Where every stage has replicas that hold it whole
(:func:`felactl.spec.executable.survivors_keep_state`), the workers that survive still hold
every stage of the last step they completed. Each of them, as it fails, offers its stage, and
the first to offer writes it as the checkpoint of that step (:func:`leave_state`); the restart
goes on from there and redoes nothing. The state comes from the survivors' memory, as Elan's
replicas hand theirs to a newcomer, through the run's checkpoint directory: the next attempt's
processes are new ones, on a plan that may cut the model elsewhere.

That checkpoint must be of one step at every stage. A pipeline's stages end a step at different
times (the last stage first), and each stage's replicas sum their gradients in a group of their
own: the last stage's replicas could step their optimizer for step k while the first stage's
sum failed with the dead worker. So no worker steps its optimizer for a step before every worker
of the job has summed that step's gradients (:class:`StepCommit`: a counter in the attempt's
store, one round trip a step): after a failure, either every survivor stepped or none did. The
first worker to fail says so in the store (:data:`felactl.control.keys.ATTEMPT_FAILED`; a killed
one cannot, but its peers then fail on the lost connection), so that one waiting there stops
waiting, fails the step and leaves its state too. Its agent gives it the time
(:attr:`felactl.control.documents.Assignment.keep_state_s`).
"""

from __future__ import annotations

import logging
import time

from felactl.agents.worker.checkpoint import stage_state
from felactl.agents.worker.engine import Trainer
from felactl.agents.worker.strategy import Strategy
from felactl.control import keys
from felactl.spec.executable import survivors_keep_state

log = logging.getLogger(__name__)


class AttemptFailed(RuntimeError):
    """Another worker of this attempt failed: this one stops waiting for it (nobody steps)."""


def stop_if_another_failed(trainer: Trainer) -> None:
    """:class:`AttemptFailed` where, in a job whose survivors keep their state, a worker of this
    attempt failed (:data:`~felactl.control.keys.ATTEMPT_FAILED`): for a wait on the others
    (the commit, a token's reply), so that this worker leaves its state instead of waiting on."""
    if survivors_keep_state(trainer.plan) and trainer.runtime.store.check([keys.ATTEMPT_FAILED]):
        raise AttemptFailed(f"worker {trainer.worker_id}: another worker of this attempt failed; nothing is stepped")


class StepCommit:
    """Every worker of the job steps its optimizer for a step only once every one has summed that
    step's gradients (see the module's docstring)."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer

    def agree(self, step: int) -> float:
        """Before step ``step``'s optimizer step; the seconds this worker waited for the others.
        :class:`AttemptFailed` where a worker of this attempt failed."""
        start = time.perf_counter()
        store, world = self.trainer.runtime.store, self.trainer.runtime.world_size
        if store.add(keys.step_commit(step), 1) >= world:
            store.set(keys.step_committed(step), b"1")
            for key in (keys.step_commit(step - 1), keys.step_committed(step - 1)):
                store.delete_key(key)  # every worker is past it: a long run leaves no key a step
        else:
            self.trainer.wait_for_key(
                store, keys.step_committed(step), unless=lambda: stop_if_another_failed(self.trainer)
            )
        return time.perf_counter() - start


class KeptState:
    """A lockstep strategy's optimizer steps where the plan keeps the survivors' state: each after
    the commit (:class:`StepCommit`), and the step the state is of at any moment."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        self.commit = StepCommit(trainer) if survivors_keep_state(trainer.plan) else None
        self.steps: int | None = trainer.steps_done
        """The steps the state is of (None while the optimizer steps)."""

    def optimizer_step(self, step: int) -> dict[str, float]:
        """Step ``step``'s optimizer step (after the commit, where there is one); the commit's
        seconds for the step's record (none without one)."""
        commit_s = self.commit.agree(step) if self.commit is not None else None
        self.steps = None
        self.trainer.optimizer_step()
        self.steps = step + 1
        return {} if commit_s is None else {"commit_s": commit_s}

    def kept_steps(self) -> int | None:
        """:meth:`felactl.agents.worker.strategy.Strategy.kept_steps` of the strategy it steps for."""
        return self.steps if self.commit is not None else None


def leave_state(trainer: Trainer, strategy: Strategy) -> None:
    """This worker fails (its step raised), in a job whose survivors keep its state: offer each
    stage it holds as the checkpoint of the step its state is of, and write those it is the first
    to offer. Never raises: the failure it follows is the worker's news, not this."""
    if not survivors_keep_state(trainer.plan):
        return
    try:
        trainer.runtime.store.set(keys.ATTEMPT_FAILED, b"1")  # the others stop waiting to step
        steps = strategy.kept_steps()
        if steps is None or steps == 0 or steps == trainer.checkpointed_at:
            return  # nothing trained since the start or the last checkpoint (or a half-stepped state)
        for part in trainer.parts:
            if trainer.runtime.store.add(keys.kept_stage(steps, part.stage), 1) != 1:
                continue  # another replica of the stage writes it
            state = stage_state(part.module, part.optimizer)
            if trainer.write_checkpoint(part, state, steps=steps, kept_by_survivors=True):
                log.warning(
                    "worker %d: wrote stage %d after step %d from its memory for the restart",
                    trainer.worker_id,
                    part.stage,
                    steps,
                )
    except Exception as exc:  # noqa: BLE001 - a store gone too, a disk full: the restart takes an older checkpoint
        log.warning("worker %d: could not leave its state for the restart (%s)", trainer.worker_id, exc)
