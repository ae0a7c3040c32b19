"""A job that cannot rescale live (a pipeline, a sharded stage, a mode that does not rescale, or
``--no-elastic``) changes its workers by starting them again, with nothing for the user to write.

* **A failed worker**: every worker of the next attempt restores its stage from the run's newest
  complete checkpoint (or starts over where there is none) and trains on to the last step, as
  torchrun's ``--max-restarts`` does for a script that checkpoints. A ``restart`` event records
  the failure, the step the next attempt goes on from and the checkpoint. A failure that repeats
  the same way after a restart is the job's own (its code or data) and ends the run; so does the
  last of ``--max-restarts``.
* **``felactl scale``** (not for a job launched ``--no-elastic``): the attempt is drained (its
  workers agree on a last step and checkpoint it, :mod:`felactl.agents.worker.drain`), then every
  worker starts on the plan for the new devices (:mod:`felactl.launcher.restart_plan`: the planner
  on the run's profiles, else the plan's own shape), restoring its stage from that checkpoint
  re-split by the user's parameter names. The request is answered once the new attempt has
  trained a step, with the pause.

Each attempt runs in a fresh membership generation (its process groups under a store prefix of
their own, as a resume's do; its plan is ``plan.<G>.yaml``); its agents stop the last attempt's
workers when they see the next one published. The summary adds each restart and rescale: the step
it went on from, the steps it redid and its pause (last step recorded before it to the first after).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from felactl.control import EventKind, keys
from felactl.control.documents import StopDoc, WorkerState
from felactl.control.events import record
from felactl.control.metrics import RESTART_KINDS, pause_at, restarts
from felactl.control.store import generation_store
from felactl.errors import InputError, WorkerFailed
from felactl.launcher.controlplane import Coordinator
from felactl.launcher.follow import LaunchState, follow
from felactl.launcher.membership.state import FINISHED_FIRST
from felactl.launcher.node_agents import Agents, assign_ranks
from felactl.launcher.restart_plan import devices_after, plan_for_devices
from felactl.launcher.resume import Checkpoint, ResumePoint, pick_checkpoint
from felactl.launcher.rundir import RunDir, read_jsonl
from felactl.launcher.scale_requests import answer, answer_unsigned, open_request, refuse_requests
from felactl.spec import ClusterSpec, ModelSpec, Plan, save
from felactl.spec.executable import survivors_keep_state

log = logging.getLogger(__name__)
DRAIN_FAILED = "a worker failed while the job stopped for the rescale; it restarts on the workers it had"
RESCALE_DRAIN_S = 30.0
"""How long a drained attempt's workers get to agree on a last step and checkpoint it."""
LOST_AFTER_S = 10.0
"""After a failure, how long a live agent gets to stop its workers (SIGTERM, then SIGKILL after
3 s) and report; one that has not by then is taken as lost, with its node."""
SILENT_S = 10 * keys.AGENT_BEAT_S
"""An agent whose beat (sent from a thread of its own, whatever the agent is busy with) has not
moved this long is gone, with its node, without waiting out :data:`LOST_AFTER_S`."""
KEEP_STATE_S = 20.0
"""After a failure, how long the workers that survive get to write their state for the restart
(:mod:`felactl.agents.worker.survivors`) before their agents stop them (each exits once it has),
plus the time their state takes to write (:data:`STATE_WRITE_GBPS`)."""
STATE_WRITE_GBPS = 0.5
"""The pace a survivor's state (its stage's weights and optimizer state) is taken to be written
at, GB/s, to the run's checkpoint directory: a shared file system's, slower than a local disk. A
stage of a 7B model on a GPU (20 GB with its AdamW state) takes 40 s at it: given 20 s in all, its
survivors would be stopped half-way and the restart would go back to the newest regular
checkpoint (reasoned, not measured: no session has had the GPUs)."""


def keep_state_s(plan: Plan) -> float:
    """How long the workers that survive a failure of ``plan`` get to write their state for the
    restart: :data:`KEEP_STATE_S`, and the largest device's simulated peak memory (its stage's
    weights, gradients, optimizer state and activations: more than it writes) at
    :data:`STATE_WRITE_GBPS`; 0 where the plan's survivors do not hold every stage of one step."""
    if not survivors_keep_state(plan):
        return 0.0
    peak_gb = max(plan.predicted.simulated_peak_memory_gb.values(), default=0.0) if plan.predicted else 0.0
    return KEEP_STATE_S + peak_gb / STATE_WRITE_GBPS


@dataclasses.dataclass
class Rescale:
    """A ``felactl scale`` request under way: the plan it restarts on, and how it was made."""

    request_id: str
    kind: EventKind
    plan: Plan
    how: str
    asked_at: float
    before: tuple[str, ...]
    """The devices before it."""
    nodes: dict[str, str]
    """Each device's node in ``plan`` (a plan of one machine may place none)."""
    published_at: float | None = None
    """When the attempt on ``plan`` was published (it is answered after that attempt's first step)."""


@dataclasses.dataclass
class Restarts:
    """One job of fixed members run attempt after attempt (see the module's docstring)."""

    coordinator: Coordinator
    state: LaunchState
    agents: Agents
    nodes: dict[str, tuple[str, ...]]
    """Each node's devices in the plan in force."""
    env_for: Callable[[Path | None, Path, int], dict[str, str]]
    """The workers' environment: the checkpoint directory they start from (None: the start), the
    plan they run and their generation (:func:`felactl.launcher.launch.worker_env`)."""
    max_restarts: int
    steps: int
    """The run's last step."""
    scale_refused: str | None
    """Why ``felactl scale`` is refused (None: it restarts the job on the new workers)."""
    capacity: dict[str, int]
    profiles: tuple[ClusterSpec, ModelSpec] | None
    keep_checkpoints: int = 0
    on_update: Callable[[LaunchState], None] = lambda state: None
    rescale: Rescale | None = None
    answered: dict[str, dict] = dataclasses.field(default_factory=dict)
    """Each request answered, by id: ``felactl scale`` sends a request again while it waits."""
    attempt: int = 0
    """The attempt running now."""
    base_generation: int = 0
    """The first attempt's membership generation (a resume's is past every one the run used)."""
    failures: int = 0
    last_failures: frozenset[str] = frozenset()
    """The lines the last failure's workers raised (the same again: the job's own failure)."""

    def run(self, resume: ResumePoint | None, started: Callable[[], None] = lambda: None) -> dict[str, Any]:
        """Attempt after attempt until one reaches the last step (its summary, with the restarts)
        or a failure may not be restarted (:class:`WorkerFailed`)."""
        self.base_generation = resume.generation if resume is not None else 0
        checkpoint = resume.checkpoint if resume is not None else None
        while True:
            attempt = self.attempt
            self._publish(attempt, self.base_generation + attempt, checkpoint)
            if attempt == 0:
                started()
            try:
                summary = follow(
                    self.coordinator,
                    self.state,
                    self.agents,
                    self.on_update,
                    keep_checkpoints=self.keep_checkpoints,
                    attempt=attempt,
                    serve_requests=self._serve,
                    node_loss_is_fatal=False,  # a lost node is re-planned without (_lost_nodes)
                )
            except WorkerFailed as failure:
                self._after_failure(failure)
            else:
                if self.rescale is not None and summary["steps"] >= self.steps:
                    self._answer(self.rescale.request_id, {"ok": False, "error": FINISHED_FIRST})
                    self.rescale = None
                if self.rescale is None:
                    return {**summary, **changes_summary(self.state.run)}
                before = self.state.plan.devices
                self._adopt(self.rescale.plan, self.rescale.nodes)
                self._record(self.rescale.kind, before, planned_by=self.rescale.how)
            newest = _newest(self.state.run)  # the drain's, or the newest before the failure
            checkpoint = newest.directory if newest is not None else None
            self.attempt += 1

    def _after_failure(self, failure: WorkerFailed) -> None:
        """Whether a failed attempt is restarted (else :class:`WorkerFailed`), and on which plan:
        without the nodes whose agent is gone."""
        self.failures += 1
        if self.failures > self.max_restarts:
            raise WorkerFailed(
                f"{failure} (after {self.failures - 1} restart(s); --max-restarts {self.max_restarts})"
            ) from None
        if failure.failures & self.last_failures:  # a worker raised again what one raised before
            raise WorkerFailed(
                f"{failure}: it failed the same way after a restart from the checkpoint, so it is the "
                "job's own code or data, not a worker's; not restarted again"
            ) from None
        self.last_failures = failure.failures
        before = self.state.plan.devices
        lost = self._lost_nodes(self.attempt)
        if lost:
            self._go_on_without(lost, failure)
        if self.rescale is not None:
            self._answer(self.rescale.request_id, {"ok": False, "error": f"{DRAIN_FAILED}: {failure}"})
            self.rescale, self.state.draining = None, False
        self._record(EventKind.RESTART, before, reason=str(failure), **({"lost_nodes": lost} if lost else {}))

    # --- attempts ---------------------------------------------------------------------------
    def _publish(self, attempt: int, generation: int, checkpoint: Path | None) -> None:
        plan_path = self.state.run.plan_of(generation)
        if generation and not plan_path.exists():
            save(self.state.plan, plan_path)
        env = self.env_for(checkpoint, plan_path, generation)
        assignments = assign_ranks(self.state.plan, self.state.members, self.nodes, env, any_slots=attempt > 0)
        keep_s = self._keep_state_s()
        self.coordinator.publish_assignments(
            {
                # a rescale is an attempt too
                a_id: dataclasses.replace(a, attempt=attempt, max_restarts=None, keep_state_s=keep_s)
                for a_id, a in assignments.items()
            },
            attempt=attempt,
        )
        if self.rescale is not None:
            self.rescale.published_at = time.time()

    def _keep_state_s(self) -> float:
        return keep_state_s(self.state.plan)

    def _adopt(self, plan: Plan, nodes: dict[str, str]) -> None:
        """Run ``plan`` from the next attempt on: its devices on their ``nodes``."""
        by_node: dict[str, list[str]] = {}
        for device in plan.devices:
            by_node.setdefault(nodes[device], []).append(device)
        self.nodes = {node: tuple(by_node.get(node, ())) for node in self.nodes}
        self.state.plan = plan

    def _record(self, kind: EventKind, before: tuple[str, ...], **details: Any) -> None:
        """The event of a restart or rescale, as the next attempt starts: its generation, the
        workers before and after, and the checkpoint it goes on from."""
        checkpoint = _newest(self.state.run)
        if checkpoint is not None and checkpoint.stage0.get("kept_by_survivors"):
            details["kept_by_survivors"] = True  # written at the failure from the survivors' memory
        record(
            self.state.run.events,
            kind,
            attempt=self.attempt + 1,
            generation=self.base_generation + self.attempt + 1,
            members_before=list(before),
            members_after=list(self.state.plan.devices),
            from_step=checkpoint.step if checkpoint is not None else 0,
            checkpoint=str(checkpoint.directory) if checkpoint is not None else None,
            **details,
        )
        start = f"from step {checkpoint.step}" if checkpoint is not None else "from the start (no checkpoint yet)"
        if details.get("kept_by_survivors"):
            start += ", the state the workers that survived kept"
        if kind is EventKind.RESTART:
            lost = f"; node(s) {', '.join(details['lost_nodes'])} lost" if details.get("lost_nodes") else ""
            log.warning(
                "%s%s; every worker starts again %s (restart %d of at most %d)",
                details["reason"],
                lost,
                start,
                self.failures,
                self.max_restarts,
            )
        else:
            log.warning(
                "%s: workers %s -> %s (%s); every worker starts again %s",
                kind.value,
                list(before),
                list(self.state.plan.devices),
                details.get("planned_by"),
                start,
            )

    def _lost_nodes(self, attempt: int) -> list[str]:
        """The nodes whose agent is gone: the attempt's workers are stopped (each live agent
        stops its own and reports, in a few seconds); an agent whose beat stopped for
        :data:`SILENT_S`, or not heard of within :data:`LOST_AFTER_S`, is taken as lost with its
        node. One that said its workers are still ending (they write their state for the
        restart) gets :data:`KEEP_STATE_S` more to report how they ended, so that the restart
        finds what they wrote."""
        keep_s = self._keep_state_s()
        if keep_s:  # the workers that wait to step together stop waiting and write their state
            workers = generation_store(self.coordinator.store, self.coordinator.prefix, self.base_generation + attempt)
            workers.set(keys.ATTEMPT_FAILED, "1")
        self.coordinator.publish(keys.attempt_stop(attempt), StopDoc.KIND.value, StopDoc("restart", keep_s).to_body())
        node_of = {m.agent_id: m.node_name for m in self.state.members}
        unheard = dict(node_of)
        ending: set[str] = set()
        beats = _BeatWatch(self.coordinator.agent_beat)
        start = time.monotonic()
        while unheard or ending:
            waited = time.monotonic() - start
            if waited > LOST_AFTER_S + keep_s or (not ending and waited > LOST_AFTER_S):
                break
            for agent_id in [*unheard, *ending]:
                report = self.coordinator.agent_state(agent_id)
                if not report or int(report.get("attempt", 0)) != attempt:
                    continue
                if report.get("ending"):  # its workers still write their state
                    unheard.pop(agent_id, None)
                    ending.add(agent_id)
                elif report.get("state") != WorkerState.HEALTHY.value:  # they ended
                    unheard.pop(agent_id, None)
                    ending.discard(agent_id)
            if all(beats.silent(a) for a in [*unheard, *ending]):  # the ones left are gone
                break
            time.sleep(0.1)
        # one still ending past its time is gone too (its agent keeps its workers no longer than that)
        lost = {**unheard, **{agent_id: node_of[agent_id] for agent_id in ending}}
        return sorted(set(lost.values()))

    def _go_on_without(self, lost: list[str], failure: WorkerFailed) -> None:
        """Re-plan on the devices of the nodes left (:func:`plan_for_devices`); where none is
        left, or no plan runs on them, the failure ends the run."""
        where = {d: node for node, devices in self.nodes.items() for d in devices}
        left = [d for d in self.state.plan.devices if where[d] not in lost]
        names = ", ".join(repr(n) for n in lost)
        try:
            if not left:
                raise InputError("no node is left")
            plan, _ = plan_for_devices(self.state.plan, left, {d: where[d] for d in left}, self.profiles)
        except InputError as exc:
            raise WorkerFailed(
                f"{failure}; the agent of node {names} is gone and the job cannot go on without it: {exc}"
            ) from None
        self.state.members = [m for m in self.state.members if m.node_name not in lost]
        self.nodes = {node: devices for node, devices in self.nodes.items() if node not in lost}
        self._adopt(plan, {d: where[d] for d in left})

    # --- felactl scale ------------------------------------------------------------------------
    def _serve(self) -> None:
        """Between follow's looks: answer a rescale whose attempt has trained a step; take a new
        request (one at a time: another waits its turn in the queue)."""
        if self.rescale is not None and self.rescale.published_at is not None:
            self._answer_when_running()
            return
        if self.scale_refused is not None:
            refuse_requests(self.coordinator, self.state.run, self.scale_refused)
            return
        if self.rescale is not None:
            return  # draining: the queue waits
        store, queue = self.coordinator.store, self.coordinator.prefix + keys.SCALE_REQUESTS
        if store.queue_len(queue) == 0:
            return
        request_id, command, why = open_request(self.coordinator, store.queue_pop(queue, block=False))
        if command is None:
            self.coordinator.refuse(keys.SCALE_REQUESTS, why)
            if request_id and request_id not in self.answered:
                answer_unsigned(self.coordinator, request_id, why)
            return
        if request_id in self.answered:  # sent again while it was under way: the same answer
            answer(self.coordinator, request_id, self.answered[request_id])
            return
        try:
            self.rescale = self._plan_request(request_id, command)
        except (InputError, ValueError, TypeError) as exc:
            record(self.state.run.events, EventKind.REFUSED, reason=str(exc), command=command)
            self._answer(request_id, {"ok": False, "error": str(exc)})
            return
        # The attempt's workers drain: they agree on a last step, checkpoint it and exit 0.
        name = keys.attempt_stop(self.attempt)
        self.coordinator.publish(name, StopDoc.KIND.value, StopDoc("rescale", RESCALE_DRAIN_S).to_body())
        self.state.draining = True

    def _plan_request(self, request_id: str, command: dict) -> Rescale:
        plan = self.state.plan
        nodes = {d: node for node, devices in self.nodes.items() for d in devices}
        profile = self.profiles[0].device_names_by_node() if self.profiles is not None else None
        devices, where = devices_after(command, plan, nodes, self.capacity, profile)
        new, how = plan_for_devices(plan, devices, where, self.profiles)
        kind = EventKind.SCALE_OUT if len(devices) > len(plan.devices) else EventKind.SCALE_IN
        return Rescale(request_id, kind, new, how, asked_at=time.time(), before=plan.devices, nodes=where)

    def _answer_when_running(self) -> None:
        rescale = self.rescale
        self.state.read_new()
        pause_s = pause_at(self.state.records, rescale.published_at)
        if pause_s is None:  # the new attempt has not trained a step yet
            return
        result = {
            "kind": rescale.kind.value,
            "members_before": list(rescale.before),
            "members_after": list(self.state.plan.devices),
            "stages": len(self.state.plan.stages),
            "planned_by": rescale.how,
            "by_restart": True,
            "pause_s": pause_s,
        }
        self._answer(rescale.request_id, {"ok": True, "result": result})
        self.rescale, self.state.draining = None, False

    def _answer(self, request_id: str, reply: dict) -> None:
        self.answered[request_id] = reply
        answer(self.coordinator, request_id, reply)


def _newest(run: RunDir) -> Checkpoint | None:
    """The run's newest complete checkpoint (None: none yet, the next attempt starts over)."""
    try:
        return pick_checkpoint(run)
    except InputError:
        return None


def changes_summary(run: RunDir) -> dict[str, Any]:
    """The summary's ``restarts`` (:func:`felactl.control.metrics.restarts`); ``{}`` without one."""
    events = read_jsonl(run.events)
    if not any(e.get("kind") in RESTART_KINDS for e in events):
        return {}
    return {"restarts": restarts(events, read_jsonl(run.metrics))}


class _BeatWatch:
    """When each agent's beat counter last moved, read as it is asked about."""

    STALLED_S = 1.0
    """A gap between two looks this long is the watcher's own stall (this process swapped out,
    say), in which a beat had no chance to be seen: silences start again after it."""

    def __init__(self, read: Callable[[str], str | None], clock: Callable[[], float] = time.monotonic):
        self.read, self.clock = read, clock
        self.moved: dict[str, tuple[str | None, float]] = {}
        self.looked = clock()

    def silent(self, agent_id: str) -> bool:
        """Whether ``agent_id`` beat once and has not since for :data:`SILENT_S` (one never seen
        beating is left to the deadline)."""
        beat, now = self.read(agent_id), self.clock()
        if now - self.looked > self.STALLED_S:
            self.moved = {a: (b, now) for a, (b, _) in self.moved.items()}
        self.looked = now
        last = self.moved.get(agent_id)
        if last is None or last[0] != beat:
            self.moved[agent_id] = (beat, now)
            return False
        return beat is not None and now - last[1] > SILENT_S
