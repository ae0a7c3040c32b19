"""The membership of a job whose members never change: every plan shape, every sync mode.

It forms the process groups once (the default group, then each stage's), and nothing changes
after: no generation follows, no wait is interrupted, a failed step fails the worker (its agent
and the launcher end the job, or start it again under ``--max-restarts``).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from felactl.agents.worker.config import WorkerConfig
from felactl.agents.worker.engine import Trainer
from felactl.agents.worker.membership import Membership, load_checked
from felactl.agents.worker.runtime import Runtime, start
from felactl.agents.worker.stages import stage_rank_sets
from felactl.agents.worker.strategies import strategy_for
from felactl.agents.worker.strategy import Strategy
from felactl.agents.worker.survivors import leave_state
from felactl.agents.worker.tied import tied_rank_sets, tied_weights
from felactl.control import keys
from felactl.spec.executable import plan_backend


class FixedMembership(Membership):
    """The members the plan names, ranked as the launcher placed them, for the whole run."""

    def __init__(self, cfg: WorkerConfig):
        self.cfg = cfg
        self.generation = cfg.generation
        # a restarted attempt must not read the last step its predecessor drained at
        self.drain_key = keys.last_step(cfg.generation)
        self.runtime: Runtime | None = None
        self.trainer: Trainer | None = None

    def start(self) -> tuple[Trainer, Strategy]:
        """The groups, then the trainer with every replica holding its stage's first replica's
        state (a resume's checkpoint restored first); every worker starts training together."""
        plan, bundle = load_checked(self.cfg)
        self.runtime = start(self.cfg, plan_backend(plan))
        self.runtime.make_groups(stage_rank_sets(plan) + tied_rank_sets(plan, tied_weights(plan, bundle)))
        self.trainer = Trainer(self.runtime, plan, membership=self, bundle=bundle)
        self.trainer.begin()
        dist.barrier()
        return self.trainer, strategy_for(plan)(self.trainer)

    def finish(self, finished: bool, wall_s: float) -> dict[str, Any]:
        self.trainer.final_checkpoint()
        self.trainer.finish(wall_s)
        dist.barrier()
        return dict(self.trainer.totals, wall_s=wall_s)

    def close(self) -> None:
        if self.runtime is not None:
            self.runtime.close()

    def record_extra(self) -> dict[str, Any]:
        """A restarted job's records say their attempt's generation: a step it redid counts the
        redo's loss (:func:`felactl.control.metrics.step_losses`)."""
        return {"generation": self.generation} if self.generation else {}

    def after_step(self, strategy: Strategy) -> None:
        return None

    def failing(self, trainer: Trainer, strategy: Strategy) -> None:
        """The launcher restarts every worker: leave this one's state where it is of one step at
        every survivor (:mod:`felactl.agents.worker.survivors`)."""
        leave_state(trainer, strategy)

    def newest_generation(self) -> int:
        return self.generation

    def is_planned(self, generation: int) -> bool:
        return False  # no generation follows this one

    def members_changed(self) -> bool:
        return False

    def switch_at_agreed_step(self, lead_steps: int) -> None:
        return None

    def checkpoint_extra(self) -> dict[str, Any]:
        """A restarted attempt's checkpoint names its generation: its plan (``plan.<G>.yaml``,
        which may cut the model elsewhere) says how many stage files make it complete."""
        return {"generation": self.generation} if self.generation else {}
