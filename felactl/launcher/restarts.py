"""A job that cannot rescale live (a pipeline, a sharded stage, a mode that does not rescale, or
``--no-elastic``) survives a failed worker by starting again from its newest checkpoint, as
torchrun's ``--max-restarts`` does for a script that checkpoints, but with nothing for the user to
write: every worker of the next attempt restores its stage from the run's newest complete
checkpoint (or starts over where there is none) and trains on to the run's last step.

Each attempt runs in a fresh membership generation (its process groups under a store prefix of
their own, as a resume's do); its agents stop the last attempt's workers when they see the next
one published. A ``restart`` event records the failure, the step the next attempt starts from and
the checkpoint; the summary adds each restart's ``pause_s`` (from the last step recorded before
the failure to the first step after it) and the steps the restart redid. A failure that repeats the
same way in the next attempt is the job's own (its code or data), and ends the run; so does the
last of ``--max-restarts``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from felactl.control import EventKind
from felactl.control.events import record
from felactl.errors import InputError, WorkerFailed
from felactl.launcher.controlplane import Coordinator
from felactl.launcher.follow import LaunchState, follow
from felactl.launcher.node_agents import Agents, assign_ranks
from felactl.launcher.resume import ResumePoint, pick_checkpoint
from felactl.launcher.rundir import RunDir, read_jsonl


def follow_with_restarts(
    coordinator: Coordinator,
    state: LaunchState,
    agents: Agents,
    nodes: dict[str, tuple[str, ...]],
    env_for: Callable[[ResumePoint | None], dict[str, str]],
    *,
    resume: ResumePoint | None,
    max_restarts: int,
    on_update: Callable[[LaunchState], None],
    keep_checkpoints: int,
    started: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    """Run the job attempt after attempt until one reaches the last step (its summary, with the
    restarts) or a failure may not be restarted (:class:`WorkerFailed`). ``env_for(point)``: the
    workers' environment, resuming from ``point`` (None: from the start); ``started``: called once
    the first attempt's assignments are out."""
    base_generation = resume.generation if resume is not None else 0
    point, last_failures = resume, frozenset()
    for attempt in range(max_restarts + 1):
        env = {**env_for(point), "FELACTL_GENERATION": str(base_generation + attempt)}
        assignments = assign_ranks(state.plan, state.members, nodes, env)
        coordinator.publish_assignments(
            {aid: dataclasses.replace(a, attempt=attempt, max_restarts=max_restarts) for aid, a in assignments.items()},
            attempt=attempt,
        )
        if attempt == 0:
            started()
        try:
            summary = follow(coordinator, state, agents, on_update, keep_checkpoints=keep_checkpoints, attempt=attempt)
        except WorkerFailed as failure:
            if attempt == max_restarts:
                raise WorkerFailed(f"{failure} (after {attempt} restart(s); --max-restarts {max_restarts})") from None
            if failure.failures & last_failures:  # a worker raised again what one raised before
                raise WorkerFailed(
                    f"{failure}: it failed the same way after a restart from the checkpoint, so it is the job's "
                    "own code or data, not a worker's; not restarted again"
                ) from None
            last_failures = failure.failures
            point = restart_point(state.run, base_generation + attempt + 1)
            record(
                state.run.events,
                EventKind.RESTART,
                attempt=attempt + 1,
                max_restarts=max_restarts,
                from_step=point.step if point is not None else 0,
                checkpoint=str(point.checkpoint) if point is not None else None,
                reason=str(failure),
            )
            continue
        return {**summary, **restarts_summary(state.run)}
    raise AssertionError("unreachable: the last attempt either finishes or raises")


def restart_point(run: RunDir, generation: int) -> ResumePoint | None:
    """Where the next attempt starts: the run's newest complete checkpoint, in ``generation`` (a
    fresh one: nothing of the failed attempt's store keys is reused); None: from the start, with
    no checkpoint written yet (``--checkpoint-every`` bounds what a restart redoes)."""
    try:
        chosen = pick_checkpoint(run)
    except InputError:
        return None
    return ResumePoint(
        run=run, checkpoint=chosen.directory, step=chosen.step, plan_path=chosen.plan_path, generation=generation
    )


def restarts_summary(run: RunDir) -> dict[str, Any]:
    """The summary's ``restarts``: for each, the step it went on from, the steps it redid and its
    pause (last step recorded before the failure to the first step after it); ``{}`` without one."""
    restarts = [e for e in read_jsonl(run.events) if e.get("kind") == EventKind.RESTART.value]
    if not restarts:
        return {}
    records = read_jsonl(run.metrics)
    out = []
    for event in restarts:
        before = [r for r in records if r["time"] <= event["time"]]
        after = [r for r in records if r["time"] > event["time"]]
        last_step = max((r["step"] for r in before), default=-1)
        out.append(
            {
                "attempt": event["attempt"],
                "from_step": event["from_step"],
                "redone_steps": max(last_step + 1 - event["from_step"], 0),
                "pause_s": round(min(r["time"] for r in after) - max(r["time"] for r in before), 3)
                if before and after
                else None,
                "reason": event["reason"],
            }
        )
    return {"restarts": out}
