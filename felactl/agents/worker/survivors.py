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
store, and one decision, step or give up, that the first to write it makes for everyone): after
a failure, either every survivor stepped or none did. The first worker to fail says so in the
store (:data:`felactl.control.keys.ATTEMPT_FAILED`; a killed one cannot, and the launcher says it
then, once its agent reported the failure), so that one waiting there stops waiting, fails the
step and leaves its state too (:class:`~felactl.errors.AnotherWorkerFailed`). Its agent gives it
the time (:attr:`felactl.control.documents.Assignment.keep_state_s`).
"""

from __future__ import annotations

import logging
import time

import torch

from felactl.agents.worker.checkpoint import checkpoint_path, stage_state
from felactl.agents.worker.engine import Trainer
from felactl.agents.worker.strategy import Strategy
from felactl.control import keys
from felactl.errors import AnotherWorkerFailed
from felactl.spec.executable import survivors_keep_state

log = logging.getLogger(__name__)


def stop_if_another_failed(trainer: Trainer) -> None:
    """:class:`AnotherWorkerFailed` where, in a job whose survivors keep their state, a worker of this
    attempt failed (:data:`~felactl.control.keys.ATTEMPT_FAILED`): for a wait on the others
    (the commit, a token's reply), so that this worker leaves its state instead of waiting on."""
    if survivors_keep_state(trainer.plan) and trainer.runtime.store.check([keys.ATTEMPT_FAILED]):
        raise AnotherWorkerFailed(
            f"worker {trainer.worker_id}: another worker of this attempt failed; nothing is stepped"
        )


STEP, GIVEN_UP = b"1", b"0"
"""What :func:`~felactl.control.keys.step_committed` holds: everyone steps, or nobody does. The
first to write it decides (compare-and-set): the last worker to sum the step, or one that gave up
waiting because another failed."""


class StepCommit:
    """Every worker of the job steps its optimizer for a step only once every one has summed that
    step's gradients (see the module's docstring)."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer

    def agree(self, step: int) -> float:
        """Before step ``step``'s optimizer step; the seconds this worker waited for the others.
        :class:`AnotherWorkerFailed` where a worker of this attempt failed."""
        start = time.perf_counter()
        store, world, decided = self.trainer.runtime.store, self.trainer.runtime.world_size, keys.step_committed(step)
        summed = store.add(keys.step_commit(step), 1)
        if summed == 1:  # the first here, who waits anyway: everyone is past step - 2's keys
            for key in (keys.step_commit(step - 2), keys.step_committed(step - 2)):
                store.delete_key(key)  # a long run leaves no key a step
        if summed >= world:
            outcome = store.compare_set(decided, "", STEP)  # unless a waiter gave the step up first
        else:
            self.trainer.wait_for_key(store, decided, unless=lambda: self._give_up(decided))
            outcome = store.get(decided)
        if outcome != STEP:
            raise AnotherWorkerFailed(
                f"worker {self.trainer.worker_id}: another worker of this attempt failed; step {step} is given up"
            )
        return time.perf_counter() - start

    def _give_up(self, decided: str) -> None:
        """Waiting, and another worker failed: give the step up for everyone, unless the last of
        the others summed it first (then the wait ends at once, and everyone steps)."""
        try:
            stop_if_another_failed(self.trainer)
        except AnotherWorkerFailed:
            if self.trainer.runtime.store.compare_set(decided, "", GIVEN_UP) != STEP:
                raise


class KeptState:
    """A lockstep strategy's optimizer steps where the plan keeps the survivors' state: each after
    the commit (:class:`StepCommit`), and the step the state is of at any moment."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        self.commit = StepCommit(trainer) if survivors_keep_state(trainer.plan) else None
        self.steps: int | None = trainer.steps_done
        """The steps the state is of (None while the optimizer steps)."""
        self.buffers = self._buffers() if self.commit is not None else {}

    def optimizer_step(self, step: int) -> dict[str, float]:
        """Step ``step``'s optimizer step (after the commit, where there is one); the commit's
        seconds for the step's record (none without one)."""
        commit_s = self.commit.agree(step) if self.commit is not None else None
        self.steps = None
        self.trainer.optimizer_step()
        self.steps = step + 1
        if commit_s is None:
            return {}
        self.buffers = self._buffers()
        return {"commit_s": commit_s}

    def _buffers(self) -> dict[int, dict[str, torch.Tensor]]:
        """Each stage's buffers as they stand (a batch norm's running statistics: the next step's
        forwards move them before it is summed, and a step that fails there is trained again)."""
        return {p.stage: {k: b.detach().clone() for k, b in p.module.named_buffers()} for p in self.trainer.parts}

    def restore_buffers(self) -> None:
        """Put back the buffers of the step the state is of."""
        with torch.no_grad():
            for part in self.trainer.parts:
                for name, buffer in part.module.named_buffers():
                    buffer.copy_(self.buffers[part.stage][name])

    def kept_steps(self) -> int | None:
        """The steps the state is of, where the survivors keep it; else None (no commit, or mid-step)."""
        return self.steps if self.commit is not None else None


def leave_state(trainer: Trainer, strategy: Strategy) -> None:
    """This worker fails (its step raised), in a job whose survivors keep its state: offer each
    stage it holds as the checkpoint of the step its state is of, and write those it is the first
    to offer. Never raises: the failure it follows is the worker's news, not this."""
    if not survivors_keep_state(trainer.plan):
        return
    try:
        trainer.runtime.store.set(keys.ATTEMPT_FAILED, b"1")  # the others stop waiting to step
        kept = strategy.kept_state()
        steps = kept.kept_steps() if kept is not None else None
        if steps is None or steps == 0:
            return  # nothing trained since the start (or a half-stepped state)
        kept.restore_buffers()
        for part in trainer.parts:
            if trainer.runtime.store.add(keys.kept_stage(steps, part.stage), 1) != 1:
                continue  # another replica of the stage writes it
            if checkpoint_path(trainer.runtime.cfg.run_dir, steps, part.stage).exists():
                continue  # the regular checkpoint of that step holds it already
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
