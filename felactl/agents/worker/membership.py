"""Who is in the job: the interface between a worker's run sequence, its loop and its members.

Every worker runs ``membership.start() -> train(trainer, strategy, membership) ->
membership.finish()`` (:func:`felactl.agents.worker.main.run_worker`). A :class:`Membership`
holds every fact about who is in the job (this worker's rank, the generation, the process
groups, the step to switch at), as torchft's ``Manager`` does; the loop calls it at a few named
points, and the trainer and its strategy ask it what they need through
:class:`~felactl.agents.worker.membership_view.MembershipView`. A strategy owns how the members agree on
gradients or weights, and where they switch (:mod:`felactl.agents.worker.strategy`).

Two memberships: :class:`~felactl.agents.worker.fixed.FixedMembership` (the members never change:
every plan shape and sync mode) and :class:`~felactl.agents.worker.elastic.ElasticMembership`
(generations the coordinator publishes: joins, leaves, failures). Which one a worker runs is its
agent's assignment (:attr:`felactl.control.documents.Assignment.elastic`), which the agent hands
its workers as ``FELACTL_ELASTIC`` (:mod:`felactl.agents.worker.config`).
"""

from __future__ import annotations

import abc
from typing import Any

from torch import nn

from felactl import models
from felactl.agents.worker import shared_model
from felactl.agents.worker.config import WorkerConfig
from felactl.agents.worker.engine import Trainer
from felactl.agents.worker.membership_view import MembershipView
from felactl.agents.worker.strategy import Strategy
from felactl.control import keys
from felactl.spec import Plan
from felactl.spec.executable import check_executable


class Membership(MembershipView):
    """One worker's view of who is in the job: the hooks its run sequence and loop call, and
    (:class:`MembershipView`, abstract here) what its trainer and strategy ask."""

    survives_failures: bool = False
    """Whether a failed step (a peer died or hung) is recovered from; a fixed job fails with it."""

    # --- the run sequence ---------------------------------------------------------------------
    @abc.abstractmethod
    def start(self) -> tuple[Trainer, Strategy]:
        """Join the job: form the process groups, build the trainer (its model, optimizer and a
        resume's state), and return it with the strategy to train with."""

    @abc.abstractmethod
    def finish(self, finished: bool, wall_s: float) -> dict[str, Any]:
        """After the loop (``finished``: False when this worker left the job on the way): the
        last checkpoint and this worker's summary; returns its totals."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release what :meth:`start` took (the process groups, threads), whatever happened."""

    drain_key: str = keys.LAST_STEP
    """Where a graceful stop's last step is agreed (:class:`~felactl.agents.worker.drain.Drain`)."""

    # --- the loop's hooks ---------------------------------------------------------------------
    def record_extra(self) -> dict[str, Any]:
        """More fields for each metrics record."""
        return {}

    @abc.abstractmethod
    def after_step(self, strategy: Strategy) -> Any | None:
        """After a completed step: the change every member agreed to make now, if any (where to
        switch, ``strategy`` decides: :meth:`Strategy.generation_to_switch_to`)."""

    def failing(self, trainer: Trainer, strategy: Strategy) -> None:
        """A step failed and the failure ends this worker (before the strategy is closed): leave
        what the job's restart can use. Nothing by default."""

    def after_failure(self, why: str) -> Any:
        """A step failed (a peer died or hung, or the user's code raised; ``why``: the exception
        in one line): the change to recover with. Called only where :attr:`survives_failures`."""
        raise NotImplementedError

    def switch(self, change: Any) -> Strategy | None:
        """Make ``change`` (re-form the group, replicate the state) and return the strategy to go
        on with, or None when this worker is no longer a member."""
        raise NotImplementedError


def load_checked(cfg: WorkerConfig) -> tuple[Plan, models.ModelBundle]:
    """The plan and its model, refused (InputError) before this worker connects to anyone unless
    the runtime can execute the one on the other."""
    plan = cfg.load_plan()
    bundle = shared_model.take(plan) or models.build(plan.model.source, plan.model.config, seed=plan.training.seed)
    bundle.check_global_batch(plan.global_batch)
    # A one-stage plan of a model that is no nn.Sequential runs the user's module whole: its layer
    # count is the profile's business, and counting it would trace the model (seconds) for nothing.
    whole = len(plan.stages) == 1 and not isinstance(bundle.model, nn.Sequential)
    check_executable(plan, None if whole else bundle.layer_params(), where=str(cfg.plan_path))
    return plan, bundle
