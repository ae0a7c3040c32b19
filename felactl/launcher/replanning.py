"""Planning each generation of an elastic job for its members: the planner on the run's profiles
where the run has them, else the launched plan's stage with shares by the workers' measured
speeds (:mod:`felactl.launcher.scale_plan` does both), with the global batch and learning rate
the scaling policy gives the new number of workers. A failure's survivors always get a plan."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from felactl.launcher.membership.state import Worker
from felactl.launcher.rundir import read_jsonl
from felactl.launcher.scale_plan import REPLAN_TIME_LIMIT_S, ScalingPolicy, replan, replan_with_planner
from felactl.spec import ClusterSpec, ModelSpec, Plan
from felactl.spec.executable import check_scaled_batch

log = logging.getLogger(__name__)
FAILURE_REPLAN_TIME_LIMIT_S = 2.0
"""Survivors of a failure wait while the coordinator re-plans: the solver gets less time."""
RECENT_METRICS_BYTES = 256 << 10
"""How much of metrics.jsonl's end a re-plan by measured speeds reads (~200 records of ~150 B,
with room): a run of a million steps is not read whole at each rescale."""


@dataclass(frozen=True)
class Replanner:
    """Plans one elastic job's generations."""

    base: tuple[int, float, int]
    """The launched plan's global batch and learning rate, and its number of workers."""
    policy: ScalingPolicy
    """The launch's scaling policy (a ``felactl scale`` request may name another)."""
    profiles: tuple[ClusterSpec, ModelSpec] | None
    """The profiles the launched plan was made from, where the run kept them."""
    metrics: Path
    """The run's metrics.jsonl, for measured speeds."""

    def plan_for_survivors(
        self, current: Plan, workers: Mapping[int, Worker], survivors: list[int]
    ) -> tuple[Plan, dict]:
        """A failure must not end the job: if the planner finds nothing for the survivors, they
        keep the launched stage with shares by measured speed."""
        try:
            return self.plan_for(current, workers, survivors, time_limit_s=FAILURE_REPLAN_TIME_LIMIT_S)
        except Exception as exc:  # a failure must never end the job because of the planner
            log.warning("elastic: %s; re-planning by measured speeds instead", exc)
            plan, how = self.plan_for(current, workers, survivors, use_profiles=False)
            return plan, {**how, "planner_refused": str(exc)}

    def _speeds(self, workers: Mapping[int, Worker]) -> dict[str, float]:
        recent: dict[int, list[dict]] = {}
        for r in read_jsonl(self.metrics, tail_bytes=RECENT_METRICS_BYTES)[-200:]:
            recent.setdefault(int(r["rank"]), []).append(r)
        speeds = {}
        for wid, records in recent.items():
            compute_s = sum(r["compute_s"] for r in records[-5:])
            if wid in workers and compute_s > 0:
                speeds[workers[wid].device] = sum(r["samples"] for r in records[-5:]) / compute_s
        return speeds

    def plan_for(
        self,
        current: Plan,
        workers: Mapping[int, Worker],
        members: list[int],
        policy: ScalingPolicy | None = None,
        time_limit_s: float = REPLAN_TIME_LIMIT_S,
        use_profiles: bool = True,
    ) -> tuple[Plan, dict]:
        """The plan for ``members`` (rank order) and how it was made: the planner on the run's
        profiles where it has them (and ``use_profiles``), else the launched plan's stage with
        shares by measured speed; ``current``: the plan in force, ``workers``: every worker's
        device and node."""
        policy = policy or self.policy
        batch, lr = policy.batch_and_lr(*self.base[:2], self.base[2], len(members))
        check_scaled_batch(current.sync.mode, self.base[0], batch)
        devices = [workers[w].device for w in members]
        nodes = {workers[w].device: workers[w].node for w in members}
        began = time.perf_counter()
        if self.profiles is not None and use_profiles:
            plan = replan_with_planner(
                current, *self.profiles, devices, nodes, global_batch=batch, lr=lr, time_limit_s=time_limit_s
            )
            how = "planner"
        else:
            plan = replan(current, devices, self._member_speeds(workers, members), nodes, global_batch=batch, lr=lr)
            how = "measured speeds"
        return plan, {
            "planned_by": how,
            "plan_s": round(time.perf_counter() - began, 3),
            "predicted_iteration_s": plan.predicted.iteration_s if plan.predicted else None,
        }

    def _member_speeds(self, workers: Mapping[int, Worker], members: list[int]) -> dict[str, float]:
        speeds = self._speeds(workers)
        node_speed = {}  # a newcomer runs at the mean speed of its node's workers
        for w in members:
            if workers[w].device in speeds:
                node_speed.setdefault(workers[w].node, []).append(speeds[workers[w].device])
        for w in members:
            d = workers[w].device
            if d not in speeds and workers[w].node in node_speed:
                values = node_speed[workers[w].node]
                speeds[d] = sum(values) / len(values)
        return speeds
