"""The coordinator's side of live rescaling: signed scale commands, failures, new generations.

The launch process polls :meth:`ElasticController.poll` between its other chores. What to do
is decided apart, by the pure :func:`felactl.launcher.membership.decide.decide` (the package's
docstring tells the split); the controller looks (store keys, agents' reports, the request queue:
:mod:`felactl.launcher.sightings`) and does. It

* pops ``felactl scale`` requests from the store queue ``<job>elastic/scale/requests``; each is
  ``{id, command, signature = sign(secret, "scale|id|command")}``. A wrong signature or a replayed
  id is refused, logged in ``events.jsonl`` and changes nothing; so is a request that cannot be
  met (more workers than the node's slots, an unknown worker, removing the last one). The answer
  goes under ``scale/reply/<id>``.
* scales out by asking the node's agent (a signed ``add`` command) to start newcomers, waiting
  until each says ``ready`` (torch imported, model built: start-up happens while the job trains),
  re-planning (felactl.launcher.replanning), and only then publishing the next generation;
* scales in by publishing a generation without the removed workers (they leave after the step);
* drops a member whose process ended or whose heartbeat has not moved for ``heartbeat_timeout_s``
  (killing it through its agent, so peers blocked in a collective with it fail at once), then
  publishes a generation of the survivors.

Each change waits (without blocking the poll: failures are still noticed, requests wait their
turn) for every member's ``switched`` report and appends one event: kind, members
before and after, ``pause_s`` (the longest gap, on workers that stayed, between their last step
before and their first step after), bytes replicated and from whom. Worker ids (``rank`` in
metrics) are stable across generations; the ``--remove`` ranks are those ids.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from felactl.control import EventKind, keys
from felactl.control.documents import Assignment, CommandDoc, GenerationDoc
from felactl.control.events import record, write_event
from felactl.control.keys import AGENT_BEAT_S, command_queue
from felactl.errors import InputError, StorageError, WorkerFailed
from felactl.fsutil import STORAGE_ERRORS
from felactl.launcher.controlplane import Coordinator, Member
from felactl.launcher.launch_defaults import HEARTBEAT_TIMEOUT_S, JOIN_TIMEOUT_S, SWITCH_TIMEOUT_S
from felactl.launcher.membership.decide import decide
from felactl.launcher.membership.state import (
    AdmitAgent,
    Agent,
    Answer,
    AnswerAgain,
    Drop,
    Fail,
    Finish,
    IgnoreAgent,
    Refuse,
    Rules,
    Seen,
    StartNewcomers,
    State,
    StopNewcomers,
    Switch,
    SwitchAbandoned,
    SwitchDone,
    Worker,
)
from felactl.launcher.node_agents import WORKER_MODULE
from felactl.launcher.replanning import Replanner
from felactl.launcher.resume import resume_hint
from felactl.launcher.rundir import RunDir
from felactl.launcher.scale_plan import ScalingPolicy, place_devices
from felactl.launcher.scale_requests import answer, answer_unsigned
from felactl.launcher.sightings import Lookout, offered_slots
from felactl.spec import ClusterSpec, ModelSpec, Plan, save
from felactl.spec.executable import plan_backend

log = logging.getLogger(__name__)
AGENT_GONE_S = 2.5 * AGENT_BEAT_S
"""A worker's silence and its agent's start within a beat of each other: two missed agent beats
(and a half, for a busy machine) tell the agent is gone with it."""


@dataclass(frozen=True, kw_only=True)
class ElasticSettings:
    policy: ScalingPolicy = field(default_factory=ScalingPolicy)
    heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S
    max_nproc_per_node: int | None = None
    """Worker slots per node; default: GPUs, or for a CPU node its cores."""
    ready_timeout_s: float = JOIN_TIMEOUT_S
    """How long newcomers a scale-out starts get to be ready (the launch's ``--join-timeout``)."""
    switch_timeout_s: float = SWITCH_TIMEOUT_S
    min_nodes: int | None = None
    """Nodes the job needs to start on (the rest may fail to start); None: every node."""


class ElasticController:
    """The executor of membership: each :meth:`poll` gathers what the store and the agents' reports
    show (:class:`~felactl.launcher.sightings.Lookout`), asks
    :func:`felactl.launcher.membership.decide.decide` what to do, and does it (:meth:`_apply`):
    signed commands to agents, plans (:class:`~felactl.launcher.replanning.Replanner`),
    generation documents, events, answers."""

    def __init__(
        self,
        coordinator: Coordinator,
        run: RunDir,
        plan: Plan,
        members: list[Member],
        nodes: dict[str, tuple[str, ...]],
        settings: ElasticSettings,
        start_generation: int = 0,
        plan_path=None,
        worker: tuple[str, dict[str, str]] | None = None,
    ):
        self.coordinator, self.run, self.plan, self.settings = coordinator, run, plan, settings
        # What an agent that joins mid-job is told to run: the launch's worker module and environment.
        self.worker_module, self.worker_env = worker or (WORKER_MODULE, {})
        self.joined: dict[str, Assignment] = {}
        self.store = coordinator.store
        self.lookout = Lookout(coordinator)
        self.first_plan = (start_generation, plan_path or run.plan)
        # With the profiles the plan came from, every change runs the planner again on them.
        self.profiles = run.profiles()
        self.state = _launch_state(run, plan, members, nodes, settings, self.profiles, start_generation)
        self.replanner = Replanner(
            base=(plan.global_batch, plan.training.lr, len(self.state.workers)),
            policy=settings.policy,
            profiles=self.profiles,
            metrics=run.metrics,
        )
        self.answers: dict[str, dict] = {}
        """Scale request id -> the answer given (a request sent again gets it again, nothing is redone)."""
        self.under_way: _Published | None = None
        """The generation published and not yet switched to: how it was planned, its reports so far."""
        self.early_plan: tuple[tuple[int, ...], tuple[Plan, dict]] | None = None
        """The plan made while newcomers start, and for which members."""
        self._doers = {
            AdmitAgent: self._admit_agent,
            IgnoreAgent: self._ignore_agent,
            Drop: self._drop,
            StartNewcomers: self._start_newcomers,
            StopNewcomers: self._stop_newcomers,
            Switch: self._switch,
            SwitchDone: self._switch_done,
            SwitchAbandoned: self._switch_abandoned,
            Answer: self._answer,
            AnswerAgain: self._answer_again,
            Refuse: self._refuse,
            Finish: lambda action: None,
            Fail: self._fail,
        }
        self._publish_generation(start_generation, list(self.state.members), self.first_plan[1], "launch")

    @property
    def members(self) -> list[int]:
        return list(self.state.members)

    @property
    def generation(self) -> int:
        return self.state.generation

    # --- the loop's step --------------------------------------------------------------------------
    def poll(self) -> bool:
        """One look and what it calls for; True once every member has finished its last step."""
        return self._apply(self.lookout.look(self.state, None if self.under_way is None else self.under_way.reports))

    def _apply(self, seen: Seen) -> bool:
        self.state, actions = decide(self.state, seen)
        for action in actions:
            self._doers[type(action)](action)
        return any(isinstance(a, Finish) for a in actions)

    # --- doing ------------------------------------------------------------------------------------
    def _admit_agent(self, action: AdmitAgent) -> None:
        self.joined[action.agent_id] = Assignment(
            rank_offset=0,
            world_size=1,
            module=self.worker_module,
            env=dict(self.worker_env),
            num_workers=0,
            elastic=True,
        )
        self.coordinator.publish_assignments(self.joined)
        record(
            self.run.events,
            EventKind.NODE_JOINED,
            node=action.node,
            agent=action.agent_id,
            replaces=action.replaces,
            members=self.members,
        )

    def _ignore_agent(self, action: IgnoreAgent) -> None:
        log.warning(
            "elastic: agent %s joined for node %r, whose agent still answers; ignored", action.agent_id, action.node
        )

    def _drop(self, action: Drop) -> None:
        log.warning("elastic: dropping %s", "; ".join(action.reasons.values()))
        for wid in action.reasons:
            self._command(wid, {"op": "kill", "worker_id": wid})

    def _stop_newcomers(self, action: StopNewcomers) -> None:
        for wid in action.wids:
            self._command(wid, {"op": "kill", "worker_id": wid})

    def _fail(self, action: Fail) -> None:
        log_path = (
            None if action.worker is None else self.lookout.tables(self.state).get(str(action.worker), {}).get("log")
        )
        node = None if action.worker is None else self.state.workers[action.worker].node
        reason = action.reason + (f"; its log: {log_path} (on node {node!r})" if log_path else "")
        raise InputError(reason) if action.bad_input else WorkerFailed(reason)

    def _command(self, wid: int, command: dict) -> None:
        agent_id = self.state.workers[wid].agent_id
        body = CommandDoc.from_body(command).to_body()
        self.store.queue_push(
            command_queue(self.coordinator.prefix, agent_id),
            self.coordinator.seal.seal(
                keys.agent_commands(agent_id), CommandDoc.KIND.value, body, generation=self.generation
            ),
        )

    def _start_newcomers(self, action: StartNewcomers) -> None:
        """Ask the node's agent for the newcomers, then plan for them while they import torch and
        build the model."""
        profiled = self._profiled_node(action.node)
        workers = self.state.workers
        # Without a profile, the index the re-plan will give each newcomer: its GPU on a GPU job.
        placed = {
            p.device: p.local_index
            for p in place_devices(
                self.plan,
                [workers[w].device for w in action.members],
                {workers[w].device: workers[w].node for w in action.members},
            )
        }
        for wid, device in action.newcomers.items():
            env = {
                "FELACTL_WORKER_ID": str(wid),
                "FELACTL_JOIN": "1",
                "RANK": "0",
                "WORLD_SIZE": "1",
                "FELACTL_PLAN": str(self._plan_path(self.generation).resolve()),
            }
            if profiled is not None:  # the device's own index (its GPU), not a count
                index = next(i for i, d in enumerate(profiled.devices) if d.name == device)
                local_index = self.profiles[0].device(device).local_index
                env["LOCAL_RANK"] = str(index if local_index is None else local_index)
            elif device in placed:
                env["LOCAL_RANK"] = str(placed[device])
            self._command(wid, {"op": "add", "worker_id": wid, "env": env})
        try:
            self.early_plan = (
                action.members,
                self.replanner.plan_for(self.plan, self.state.workers, list(action.members), action.policy),
            )
        except Exception as exc:
            self._apply(Seen(now=time.monotonic(), planning_failed=_planning_failure(exc)))

    def _profiled_node(self, node: str):
        return None if self.profiles is None else next((n for n in self.profiles[0].nodes if n.name == node), None)

    def _answer(self, action: Answer) -> None:
        self.answers[action.request_id] = {"ok": True, "result": dict(action.result)}
        answer(self.coordinator, action.request_id, self.answers[action.request_id])

    def _answer_again(self, action: AnswerAgain) -> None:
        answer(self.coordinator, action.request_id, self.answers[action.request_id])

    def _refuse(self, action: Refuse) -> None:
        if action.forged:  # recorded as every forgery is: a few per key, not one line per attempt
            self.coordinator.refuse(keys.SCALE_REQUESTS, action.reason)
            if action.request_id:  # its sender may hold a wrong secret: it could not verify a signed answer
                answer_unsigned(self.coordinator, action.request_id, action.reason)
            return
        log.warning("elastic: refused %s", action.reason)
        command = None if action.command is None else dict(action.command)
        record(self.run.events, EventKind.REFUSED, reason=action.reason, command=command, members=self.members)
        if not action.request_id:
            return
        self.answers[action.request_id] = {"ok": False, "error": action.reason}
        answer(self.coordinator, action.request_id, self.answers[action.request_id])

    # --- a new generation -----------------------------------------------------------------------
    def _switch(self, action: Switch) -> None:
        try:
            plan, how = self._plan_switch(action)
        except _Unplanned as exc:
            self._apply(Seen(now=time.monotonic(), planning_failed=str(exc)))
            return
        if list(plan.devices) != [self.state.workers[w].device for w in action.members]:
            raise RuntimeError(
                f"internal: the plan for generation {action.generation} does not list the members' "
                "devices in rank order"
            )
        try:
            plan_path = save(plan, self._plan_path(action.generation))
        except STORAGE_ERRORS as exc:
            self._unrecorded(action, exc)
            return
        self._publish_generation(action.generation, list(action.members), plan_path, action.kind)
        self.under_way = _Published(action, plan, how, previous=self.plan)
        self.plan = plan

    def _unrecorded(self, action: Switch, exc: Exception) -> None:
        """The run directory cannot take the new generation's plan, which its members load and a
        resume needs. A requested change is refused: the job goes on as it is. A re-form after a
        failure cannot happen without it: the job stops, naming the checkpoint to resume from."""
        why = f"{self._plan_path(action.generation)} cannot be written ({getattr(exc, 'strerror', None) or exc})"
        if action.kind in (EventKind.FAILURE, EventKind.RE_FORM):
            raise StorageError(f"the job stopped: it must re-form, and its new plan {why}; {resume_hint(self.run)}")
        self._apply(Seen(now=time.monotonic(), planning_failed=f"the run directory is not writable: {why}"))

    def _plan_switch(self, action: Switch) -> tuple[Plan, dict]:
        """The plan of the switch: unchanged for a re-form; for a failure, never none (a failure
        must not end the job); for a requested change, the planner's or a refusal (:class:`_Unplanned`)."""
        if action.kind == EventKind.RE_FORM:
            return self.plan, {"planned_by": "unchanged"}
        if action.kind == EventKind.FAILURE:
            return self.replanner.plan_for_survivors(self.plan, self.state.workers, list(action.members))
        early, self.early_plan = self.early_plan, None
        if early is not None and early[0] == action.members:
            return early[1]
        try:
            return self.replanner.plan_for(self.plan, self.state.workers, list(action.members), action.policy)
        except InputError as exc:
            raise _Unplanned(str(exc)) from exc
        except Exception as exc:
            if action.kind == EventKind.SCALE_IN:
                raise  # as it always did: a scale-in's planner crash is not a refusal
            raise _Unplanned(_planning_failure(exc)) from exc

    def _switch_done(self, action: SwitchDone) -> None:
        published = self.under_way
        self.under_way = None
        switch = published.action
        event = {
            **_event(
                switch.kind,
                switch.generation,
                list(switch.before),
                list(switch.members),
                published.reports,
                published.plan,
                switch.reason,
            ),
            **published.how,
        }
        write_event(self.run.events, event)
        if action.request_id is not None:
            self.answers[action.request_id] = {"ok": True, "result": event}
            answer(self.coordinator, action.request_id, self.answers[action.request_id])

    def _switch_abandoned(self, action: SwitchAbandoned) -> None:
        log.warning(
            "elastic: the workers had finished before generation %d could start; nothing changed", action.generation
        )
        self.plan, self.under_way = self.under_way.previous, None

    def _plan_path(self, generation: int):
        if generation == self.first_plan[0]:
            return self.first_plan[1]
        return self.run.plan_of(generation)

    def _publish_generation(self, generation: int, members: list[int], plan_path, kind: str) -> None:
        """The signed document of ``generation``, then the hint that it exists; the coordinator keeps
        both as written (a deleted or bumped ``generation`` key is written back)."""
        self.coordinator.owned.pop(keys.generation_document(generation - 1), None)
        doc = GenerationDoc(generation=generation, members=list(members), plan=str(plan_path.resolve()), kind=kind)
        self.coordinator.publish(
            keys.generation_document(generation), GenerationDoc.KIND.value, doc.to_body(), generation=generation
        )
        self.coordinator.own(keys.GENERATION, str(generation))


def _launch_state(
    run: RunDir,
    plan: Plan,
    members: list[Member],
    nodes: dict[str, tuple[str, ...]],
    settings: ElasticSettings,
    profiles: tuple[ClusterSpec, ModelSpec] | None,
    start_generation: int,
) -> State:
    """The membership state a launch starts in: the plan's workers on the agents that joined, the
    launch's settings as the rules, no member started yet."""
    now = time.monotonic()
    agents = {m.node_name: Agent(m.agent_id, offered_slots(m), since=now) for m in members}
    workers = {
        plan.rank_of(d): Worker(node, d, agents[node].agent_id, since=now)
        for node, devices in nodes.items()
        for d in devices
    }
    profile = None if profiles is None else profiles[0].device_names_by_node()
    rules = Rules(
        heartbeat_timeout_s=settings.heartbeat_timeout_s,
        ready_timeout_s=settings.ready_timeout_s,
        switch_timeout_s=settings.switch_timeout_s,
        agent_gone_s=AGENT_GONE_S,
        min_nodes=len(nodes) if settings.min_nodes is None else settings.min_nodes,
        max_nproc_per_node=settings.max_nproc_per_node,
        profile=profile,
        logs=str(run.logs),
        run_id=run.run_id,
        device_prefix="cuda" if plan_backend(plan) == "nccl" else "cpu",
    )
    return State(
        rules=rules,
        generation=start_generation,
        members=tuple(sorted(workers)),
        workers=workers,
        agents=agents,
        next_id=len(workers),
        launching=True,
    )


@dataclass
class _Published:
    """A generation published and waiting for its members' reports."""

    action: Switch
    plan: Plan
    how: dict
    previous: Plan
    """The plan in force before it, back in force should the switch be abandoned."""
    reports: dict[int, dict] = field(default_factory=dict)


class _Unplanned(Exception):
    """A requested change the planner could not plan: it is refused, nothing changes."""


def _planning_failure(exc: Exception) -> str:
    if isinstance(exc, InputError):
        return str(exc)
    return f"re-planning for the new membership failed ({type(exc).__name__}: {exc}); nothing changed"


def _event(
    kind: str,
    generation: int,
    before: list[int],
    after: list[int],
    reports: dict[int, dict],
    plan: Plan,
    reason: str | None,
) -> dict:
    stayed = [r["pause_s"] for r in reports.values() if r.get("stayed") and r.get("pause_s") is not None]
    senders: dict[str, int] = {}
    for r in reports.values():
        if r.get("received"):
            for wid, nbytes in r.get("senders", {}).items():
                senders[wid] = senders.get(wid, 0) + int(nbytes)
    event = {
        "time": time.time(),
        "kind": kind,
        "generation": generation,
        "members_before": before,
        "members_after": after,
        "added": [w for w in after if w not in before],
        "removed": [w for w in before if w not in after],
        "pause_s": round(max(stayed), 6) if stayed else None,
        "replicated_bytes": sum(senders.values()),
        "replicated_from": senders,
        "step": max((r.get("step", 0) for r in reports.values()), default=None),
        "global_batch": plan.global_batch,
        # the rate the workers train at: the plan's (its scaling policy's) unless the job brings its optimizer
        "lr": next((r["lr"] for r in reports.values() if r.get("lr") is not None), plan.training.lr),
        "switch_s": {str(w): _timings(r) for w, r in sorted(reports.items())},
    }
    if reason:
        event["reason"] = reason
    return event


def _timings(report: dict) -> dict:
    """One worker's switch: its pause, re-form, replication and DDP times, and its parameters' checksum."""
    out = {k: round(report[k], 4) for k in ("pause_s", "form_s", "replicate_s", "wrap_s") if report.get(k) is not None}
    if report.get("param_checksum") is not None:
        out["param_checksum"] = report["param_checksum"]
    return out
