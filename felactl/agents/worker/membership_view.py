"""What the trainer and its strategy ask the job's membership while they train.

The :class:`~felactl.agents.worker.engine.Trainer` is given its worker's membership at
construction; it and its strategy see it through :class:`MembershipView` only: the generations
(the newest seen, whether one is planned, the step agreed to switch at), whether a wait on the
others should give up, and what a checkpoint records. The membership decides nothing here: where
to switch is the strategy's decision (:meth:`felactl.agents.worker.strategy.Strategy.generation_to_switch_to`).
"""

from __future__ import annotations

import abc
from typing import Any, Protocol


class MembershipView(Protocol):
    """What the trainer and its strategy ask the job's membership while they train
    (every :class:`felactl.agents.worker.membership.Membership` answers; a fixed one, that nothing
    changes)."""

    generation: int
    """The membership generation this worker trains in."""
    drain_key: str
    """Where a graceful stop's last step is agreed (:func:`felactl.control.keys.last_step`): the
    job's, or, where each attempt is a job of its own (a restart), the attempt's."""

    @abc.abstractmethod
    def newest_generation(self) -> int:
        """The newest generation this member has seen published (its own while none is newer)."""
        ...

    @abc.abstractmethod
    def is_planned(self, generation: int) -> bool:
        """Whether ``generation`` is a planned scale-out or -in (not a re-form after a failure)."""
        ...

    @abc.abstractmethod
    def members_changed(self) -> bool:
        """Whether the job is re-formed because a member failed: a wait on the others then never
        ends (a planned rescale is made at a step the members agree on; every wait before it ends)."""
        ...

    @abc.abstractmethod
    def switch_at_agreed_step(self, lead_steps: int) -> int | None:
        """After a completed step: the generation the members agreed, through the store, to switch
        to once every member has done this step (the first to see it proposes a step
        ``lead_steps`` past its own); None while there is none (or not yet)."""
        ...

    @abc.abstractmethod
    def checkpoint_extra(self) -> dict[str, Any]:
        """What a checkpoint records besides the state (an elastic job: its membership)."""
        ...
