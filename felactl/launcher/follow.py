"""Following a started run to its end: agents' states on the store (or the elastic controller's
polls), workers' records in ``metrics.jsonl`` for the live view, checkpoints pruned as it goes,
storage trouble said on the console, and the summary it ends with."""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from felactl.control import EventKind
from felactl.control.documents import WorkerState
from felactl.control.metrics import summary_so_far
from felactl.errors import EXIT_BAD_INPUT, InputError, WorkerFailed
from felactl.fsutil import JsonlTail
from felactl.launcher.controlplane import Coordinator, Member
from felactl.launcher.elastic import ElasticController
from felactl.launcher.node_agents import Agents
from felactl.launcher.resume import prune_checkpoints
from felactl.launcher.rundir import RunDir, read_jsonl
from felactl.launcher.scale_requests import refuse_requests
from felactl.spec import Plan

log = logging.getLogger(__name__)
PRUNE_EVERY_S = 2.0
"""How often the launch deletes checkpoints beyond --keep-checkpoints (a glob of a few dirs)."""
POLL_S = 0.2


@dataclass
class LaunchState:
    """What the live view shows: the run, its members, the records so far."""

    run: RunDir
    plan: Plan
    members: list[Member] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    not_elastic: str = ""
    """Why ``felactl scale`` is refused; empty for an elastic job (:attr:`elastic`)."""
    draining: bool = False
    """The launch stopped this attempt's workers to restart them (a rescale of a job of fixed
    members): the attempt ends when every agent reports its workers ended, stopped ones too."""
    _metrics: JsonlTail | None = field(default=None, repr=False)

    @property
    def elastic(self) -> bool:
        """Whether the job rescales live (nothing says why not)."""
        return not self.not_elastic

    def read_new(self) -> None:
        """Take in the records the workers appended to metrics.jsonl since the last look."""
        if self._metrics is None:
            self._metrics = JsonlTail(self.run.metrics)
        self.records.extend(self._metrics.read_new())

    def summary_so_far(self) -> dict[str, Any] | None:
        """The summary of every step recorded by now (what felactl status would read: a view
        drawn after a graceful stop's drain shows the steps it trained), None before the first;
        with the run's events, so a resumed run counts neither its redone steps nor the time it
        lay stopped."""
        self.read_new()
        return summary_so_far(self.records, read_jsonl(self.run.events))


def follow(
    coordinator: Coordinator,
    state: LaunchState,
    agents: Agents,
    on_update: Callable[[LaunchState], None],
    controller: ElasticController | None = None,
    keep_checkpoints: int = 0,
    attempt: int = 0,
    serve_requests: Callable[[], None] | None = None,
    node_loss_is_fatal: bool = True,
) -> dict[str, Any]:
    """Until every agent reports its workers done: follow metrics, and fail fast on a failure
    (an elastic job instead re-forms without the failed worker; its controller says when it is
    done). Then prune its last checkpoints beyond ``keep_checkpoints``, and return its summary
    (:class:`WorkerFailed` when no step was recorded). ``attempt``: the one of a job that restarts
    (:mod:`felactl.launcher.restarts`) whose reports count, an earlier one's are stale; it serves
    ``felactl scale`` (``serve_requests``; else every request is refused). A lost agent started
    over ssh or in a testbed node ends the job unless it survives that (an elastic job, or one
    that restarts without the node: ``node_loss_is_fatal``)."""
    events = JsonlTail(state.run.events)
    pruned_at = 0.0
    while True:
        agents.check(node_loss_is_fatal=node_loss_is_fatal)
        _say_storage_trouble(events)
        on_update(state)
        if keep_checkpoints and time.monotonic() - pruned_at > PRUNE_EVERY_S:
            prune_checkpoints(state.run.checkpoints, len(state.plan.stages), keep_checkpoints)
            pruned_at = time.monotonic()
        if controller is not None:
            if controller.poll():
                break
            time.sleep(POLL_S)
            continue
        if serve_requests is not None:
            serve_requests()
        else:
            refuse_requests(coordinator, state.run, state.not_elastic)
        coordinator.audit()
        states = {m.agent_id: _report_of(coordinator.agent_state(m.agent_id), attempt) for m in state.members}
        failed = {aid: s for aid, s in states.items() if s and s.get("state") == WorkerState.FAILED.value}
        if failed:
            line = _failure_line(failed, state)
            if _refused(failed):
                raise InputError(line)
            raise WorkerFailed(line, raised_lines(failed))
        ended = {WorkerState.SUCCEEDED.value} | ({WorkerState.STOPPED.value} if state.draining else set())
        if all(s and s.get("state") in ended for s in states.values()):
            break
        time.sleep(POLL_S)
    _say_storage_trouble(events)
    on_update(state)
    prune_checkpoints(state.run.checkpoints, len(state.plan.stages), keep_checkpoints)  # the last ones too
    return _summary(state)


def _report_of(report: dict | None, attempt: int) -> dict | None:
    """An agent's report on ``attempt``'s workers (None: none yet; its last attempt's is stale)."""
    return report if report is not None and int(report.get("attempt", 0)) == attempt else None


def _refused(failed: dict[str, dict]) -> bool:
    """Whether every worker that failed refused its input (exit 2: a plan its model does not fit,
    found as it built the model): the launch's bad input, said as such (exit 2), not a failure."""
    codes = [
        code for s in failed.values() for rank, code in s.get("exit_codes", {}).items() if rank in s.get("failures", {})
    ]
    return bool(codes) and all(code == EXIT_BAD_INPUT for code in codes)


def raised_lines(failed: dict[str, dict]) -> frozenset[str]:
    """What the failed workers raised, when the failure is theirs alone: empty where a worker was
    killed by a signal (its peers then fail on the lost connection, a line that repeats with every
    such kill: not the job's own failure)."""
    codes = [
        int(s.get("exit_codes", {}).get(rank, 1)) for s in failed.values() for rank in s.get("failures", {})
    ]  # of the failed workers only: those the agent stopped after a failure are not failed
    if any(code < 0 for code in codes):
        return frozenset()
    return frozenset(line for s in failed.values() for line in s.get("failures", {}).values())


KILLED_FROM_OUTSIDE = (-signal.SIGKILL, -signal.SIGTERM)
"""Exit codes of a worker something outside killed (a person, the OOM killer), whose peers' errors
follow from it; a SIGABRT (NCCL's watchdog, a C++ abort) may itself follow from a peer's death."""


def _failure_line(failed: dict[str, dict], state: LaunchState) -> str:
    """One line of what the failed workers said: the ranks of a node that said the same, once
    (a plan every worker refuses the same way is one reason, not four); a worker killed from
    outside first (its peers' lost connections came after it, and read as the cause)."""
    node_of = {m.agent_id: m.node_name for m in state.members}
    said: dict[tuple[str, str], list[int]] = {}
    killed: set[tuple[str, str]] = set()  # a worker killed by a signal: its peers' errors follow from it
    for agent_id, s in failed.items():
        node = node_of.get(agent_id, agent_id)
        for rank, line in s.get("failures", {}).items():
            said.setdefault((node, line), []).append(int(rank))
            if int(s.get("exit_codes", {}).get(rank, 1)) in KILLED_FROM_OUTSIDE:
                killed.add((node, line))
    parts = []
    for (node, line), ranks in sorted(said.items(), key=lambda item: (item[0] not in killed, item[0][0], min(item[1]))):
        which = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, sorted(ranks)))}"
        parts.append(f"node {node!r} {which}: {line}")
    return f"worker failed ({'; '.join(parts) or 'no message'}); logs in {state.run.logs}"


def _say_storage_trouble(events: JsonlTail) -> None:
    """What the workers could not write (events.jsonl says it where it can be written; else each
    worker's log does): a warning on the console, the job goes on."""
    for e in events.read_new():
        if e.get("kind") == EventKind.CHECKPOINT_FAILED.value:
            log.warning(
                "worker %s: the checkpoint of step %s was not written (%s); training goes on",
                e.get("worker"),
                e.get("step"),
                e.get("reason"),
            )


def _summary(state: LaunchState) -> dict[str, Any]:
    summary = state.summary_so_far()
    if summary is None:
        raise WorkerFailed(f"the workers ended without recording a step; logs in {state.run.logs}")
    predicted = state.plan.predicted
    measured_iteration_s = summary["wall_s"] / max(summary["steps"], 1)
    summary.update(
        run=state.run.run_id,
        run_dir=str(state.run.path),
        iteration_s=measured_iteration_s,
        sync=state.plan.sync.mode.value,
    )
    if predicted is not None:
        summary["predicted_iteration_s"] = predicted.iteration_s
        summary["predicted_ratio"] = measured_iteration_s / predicted.iteration_s
    return summary
