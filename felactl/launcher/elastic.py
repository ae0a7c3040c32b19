"""The coordinator's side of live rescaling: signed scale commands, failures, new generations.

The launch process polls :meth:`ElasticController.poll` between its other chores. What to do
is decided apart, by the pure :func:`felactl.launcher.membership.decide.decide` (its docstring tells the
split); the controller looks (store keys, agents' reports, the request queue) and does. It

* pops ``felactl scale`` requests from the store queue ``<job>elastic/scale/requests``; each is
  ``{id, command, signature = sign(secret, "scale|id|command")}``. A wrong signature or a replayed
  id is refused, logged in ``events.jsonl`` and changes nothing; so is a request that cannot be
  met (more workers than the node's slots, an unknown worker, removing the last one). The answer
  goes under ``scale/reply/<id>``.
* scales out by asking the node's agent (a signed ``add`` command) to start newcomers, waiting
  until each says ``ready`` (torch imported, model built: start-up happens while the job trains),
  re-planning (felactl.launcher.scale_plan), and only then publishing the next generation;
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

import json
import logging
import time
from dataclasses import dataclass, field

from felactl.agents.agent import AGENT_BEAT_S, command_queue
from felactl.control import EventKind, Forged, keys
from felactl.control.documents import (
    Assignment,
    CommandDoc,
    DoneDoc,
    GenerationDoc,
    HeartbeatDoc,
    ReadyDoc,
    ScaleReplyDoc,
    ScaleRequestDoc,
    StuckDoc,
    SwitchedDoc,
)
from felactl.control.events import record, write_event
from felactl.control.seal import Opened
from felactl.errors import InputError, StorageError, WorkerFailed
from felactl.fsutil import STORAGE_ERRORS
from felactl.launcher.controlplane import Coordinator, Member
from felactl.launcher.membership.decide import decide
from felactl.launcher.membership.state import (
    AdmitAgent,
    Agent,
    Answer,
    AnswerAgain,
    Drop,
    Exit,
    Fail,
    Finish,
    IgnoreAgent,
    Join,
    Refuse,
    Request,
    Rules,
    Seen,
    StartNewcomers,
    State,
    StopNewcomers,
    Stuck,
    Switch,
    SwitchAbandoned,
    SwitchDone,
    Worker,
)
from felactl.launcher.resume import resume_hint
from felactl.launcher.rundir import RunDir, read_jsonl
from felactl.launcher.scale_plan import REPLAN_TIME_LIMIT_S, ScalingPolicy, place_devices, replan, replan_with_planner
from felactl.spec import DeviceKind, Plan, load_cluster, load_model, save
from felactl.spec.executable import check_scaled_batch

log = logging.getLogger(__name__)
POLL_S = 0.02
FAILURE_REPLAN_TIME_LIMIT_S = 2.0
"""Survivors of a failure wait while the coordinator re-plans: the solver gets less time."""
RECENT_METRICS_BYTES = 256 << 10
"""How much of metrics.jsonl's end a re-plan by measured speeds reads (~200 records of ~150 B,
with room): a run of a million steps is not read whole at each rescale."""
AGENT_GONE_S = 2.5 * AGENT_BEAT_S
"""A worker's silence and its agent's start within a beat of each other: two missed agent beats
(and a half, for a busy machine) tell the agent is gone with it."""


@dataclass(frozen=True, kw_only=True)
class ElasticSettings:
    policy: ScalingPolicy = field(default_factory=ScalingPolicy)
    heartbeat_timeout_s: float = 5.0
    max_nproc_per_node: int | None = None
    """Worker slots per node; default: GPUs, or for a CPU node its cores."""
    ready_timeout_s: float = 60.0
    switch_timeout_s: float = 60.0
    min_nodes: int | None = None
    """Nodes the job needs to start on (the rest may fail to start); None: every node."""


class ElasticController:
    """The executor of membership: each :meth:`poll` gathers what the store and the agents' reports
    show (:meth:`_observe`), asks :func:`felactl.launcher.membership.decide.decide` what to do, and does
    it (:meth:`_apply`): signed commands to agents, plans, generation documents, events, answers."""

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
        self.worker_module, self.worker_env = worker or ("felactl.agents.worker", {})
        self.joined: dict[str, Assignment] = {}
        self.store = coordinator.store
        self.reader = coordinator.reader
        self.first_plan = (start_generation, plan_path or run.plan)
        # With the profiles the plan came from, every change runs the planner again on them.
        self.profiles = (load_cluster(run.cluster), load_model(run.model)) if run.cluster.exists() else None
        now = time.monotonic()
        agents = {m.node_name: Agent(m.agent_id, _offered_slots(m), since=now) for m in members}
        workers = {
            plan.rank_of(d): Worker(node, d, agents[node].agent_id, since=now)
            for node, devices in nodes.items()
            for d in devices
        }
        profile = (
            None
            if self.profiles is None
            else {n.name: tuple(d.name for d in n.devices) for n in self.profiles[0].nodes}
        )
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
            device_prefix="cuda" if plan.placement and plan.placement[0].kind is DeviceKind.CUDA else "cpu",
        )
        self.state = State(
            rules=rules,
            generation=start_generation,
            members=tuple(sorted(workers)),
            workers=workers,
            agents=agents,
            next_id=len(workers),
            launching=True,
        )
        self.base = (plan.global_batch, plan.training.lr, len(workers))
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
        return self._apply(self._observe())

    def _apply(self, seen: Seen) -> bool:
        self.state, actions = decide(self.state, seen)
        for action in actions:
            self._doers[type(action)](action)
        return any(isinstance(a, Finish) for a in actions)

    # --- looking ----------------------------------------------------------------------------------
    def _observe(self) -> Seen:
        self.coordinator.audit()
        state = self.state
        joins = tuple(Join(m.node_name, m.agent_id, _offered_slots(m)) for m in self.coordinator.poll_joins())
        watched = set(state.members) | set(state.starting.newcomers if state.starting else ())
        table = self._tables()
        exits = {
            w: Exit(int(table[str(w)]["exit_code"]), table[str(w)].get("failure"))
            for w in watched
            if table.get(str(w), {}).get("exit_code") is not None
        }
        beats = {w: opened for w in watched if (opened := self._beat(w)) is not None}
        heartbeats = {w: str(opened.seq) for w, opened in beats.items()}
        started = frozenset(w for w, opened in beats.items() if _started(opened.body))
        # Every member's done mark is read (not just until one is missing): every forgery is noticed.
        done = frozenset([w for w in watched if w not in state.done and self._is_done(w)])
        stuck = {} if state.switching is not None else self._stuck_reports()
        ready = (
            frozenset()
            if state.starting is None
            else frozenset(
                w
                for w in state.starting.newcomers
                if w not in state.starting.ready and self.reader.read(keys.ready(w), ReadyDoc.KIND.value) is not None
            )
        )
        switched = frozenset() if state.switching is None else self._read_reports(state.switching)
        agent_beats = {a.agent_id: self._agent_beat(a.agent_id) for a in state.agents.values()}
        return Seen(
            now=time.monotonic(),
            joins=joins,
            agent_beats=agent_beats,
            heartbeats=heartbeats,
            exits=exits,
            started=started,
            done=done,
            stuck=stuck,
            ready=ready,
            switched=switched,
            requests=self._pop_requests(),
        )

    def _tables(self) -> dict[str, dict]:
        table = {}
        for agent in self.state.agents.values():
            state = self.coordinator.agent_state(agent.agent_id) or {}
            table.update(state.get("workers", {}))
        return table

    def _agent_beat(self, agent_id: str) -> str | None:
        raw = self.reader.raw(keys.agent_beat(agent_id))
        return None if raw is None else raw.decode("utf-8", "replace")

    def _beat(self, wid: int) -> Opened | None:
        """The newest valid heartbeat of ``wid``, else None: a forged or replayed beat does not
        keep a silent worker alive, and garbage does not make a live one silent."""
        return self.reader.read(keys.heartbeat(wid), HeartbeatDoc.KIND.value)

    def _is_done(self, wid: int) -> bool:
        """Whether worker ``wid`` finished its last step: a valid signed ``done`` (a forged one is refused)."""
        return self.reader.read(keys.done(wid), DoneDoc.KIND.value) is not None

    def _stuck_reports(self) -> dict[int, Stuck]:
        """The members whose step failed in this generation, each with its report."""
        generation, members, reports = self.state.generation, self.state.members, {}
        for w in members:
            doc = self.reader.read_doc(keys.stuck(generation, w), StuckDoc, generation=generation)
            if doc is not None:
                unreachable = frozenset(v for v in doc.unreachable if isinstance(v, int) and v in members)
                reports[w] = Stuck(unreachable, doc.step, doc.why)
        return reports

    def _read_reports(self, switching) -> frozenset[int]:
        """The members that reported the generation being switched to (their reports kept for its event)."""
        generation = switching.generation
        for w in switching.members:
            if w not in self.under_way.reports:
                opened = self.reader.read(keys.switched(generation, w), SwitchedDoc.KIND.value, generation=generation)
                if opened is not None and isinstance(opened.body.get("report"), dict):
                    self.under_way.reports[w] = opened.body["report"]
        return frozenset(self.under_way.reports)

    def _pop_requests(self) -> tuple[Request, ...]:
        queue, requests = self.coordinator.prefix + keys.SCALE_REQUESTS, []
        while self.store.queue_len(queue) > 0:
            request_id, command, why = open_request(self.coordinator, self.store.queue_pop(queue, block=False))
            requests.append(Request(request_id, command, why))
        return tuple(requests)

    # --- doing ------------------------------------------------------------------------------------
    def _admit_agent(self, action: AdmitAgent) -> None:
        self.joined[action.agent_id] = Assignment(
            rank_offset=0, world_size=1, module=self.worker_module, env=dict(self.worker_env), num_workers=0
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
        log_path = None if action.worker is None else self._tables().get(str(action.worker), {}).get("log")
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
            self.early_plan = (action.members, self._plan_for(list(action.members), action.policy))
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
            return self._plan_for_survivors(list(action.members))
        early, self.early_plan = self.early_plan, None
        if early is not None and early[0] == action.members:
            return early[1]
        try:
            return self._plan_for(list(action.members), action.policy)
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
        return self.run.path / f"plan.{generation}.yaml"

    def _publish_generation(self, generation: int, members: list[int], plan_path, kind: str) -> None:
        """The signed document of ``generation``, then the hint that it exists; the coordinator keeps
        both as written (a deleted or bumped ``generation`` key is written back)."""
        self.coordinator.owned.pop(keys.generation_document(generation - 1), None)
        doc = GenerationDoc(generation=generation, members=list(members), plan=str(plan_path.resolve()), kind=kind)
        self.coordinator.publish(
            keys.generation_document(generation), GenerationDoc.KIND.value, doc.to_body(), generation=generation
        )
        self.coordinator.own(keys.GENERATION, str(generation))

    # --- planning -------------------------------------------------------------------------------
    def _plan_for_survivors(self, survivors: list[int]) -> tuple[Plan, dict]:
        """A failure must not end the job: if the planner finds nothing for the survivors, they
        keep the launched stage with shares by measured speed."""
        try:
            return self._plan_for(survivors, time_limit_s=FAILURE_REPLAN_TIME_LIMIT_S)
        except Exception as exc:  # a failure must never end the job because of the planner
            log.warning("elastic: %s; re-planning by measured speeds instead", exc)
            plan, how = self._plan_for(survivors, use_profiles=False)
            return plan, {**how, "planner_refused": str(exc)}

    def _speeds(self) -> dict[str, float]:
        recent: dict[int, list[dict]] = {}
        for r in read_jsonl(self.run.metrics, tail_bytes=RECENT_METRICS_BYTES)[-200:]:
            recent.setdefault(int(r["rank"]), []).append(r)
        speeds = {}
        for wid, records in recent.items():
            compute_s = sum(r["compute_s"] for r in records[-5:])
            if wid in self.state.workers and compute_s > 0:
                speeds[self.state.workers[wid].device] = sum(r["samples"] for r in records[-5:]) / compute_s
        return speeds

    def _plan_for(
        self,
        members: list[int],
        policy: ScalingPolicy | None = None,
        time_limit_s: float = REPLAN_TIME_LIMIT_S,
        use_profiles: bool = True,
    ) -> tuple[Plan, dict]:
        """The plan for ``members`` (rank order) and how it was made: the planner on the run's
        profiles where it has them (and ``use_profiles``), else the launched plan's stage with
        shares by measured speed."""
        policy = policy or self.settings.policy
        batch, lr = policy.batch_and_lr(*self.base[:2], self.base[2], len(members))
        check_scaled_batch(self.plan.sync.mode, self.base[0], batch)
        workers = self.state.workers
        devices = [workers[w].device for w in members]
        nodes = {workers[w].device: workers[w].node for w in members}
        began = time.perf_counter()
        if self.profiles is not None and use_profiles:
            plan = replan_with_planner(
                self.plan, *self.profiles, devices, nodes, global_batch=batch, lr=lr, time_limit_s=time_limit_s
            )
            how = "planner"
        else:
            plan = replan(self.plan, devices, self._member_speeds(members), nodes, global_batch=batch, lr=lr)
            how = "measured speeds"
        return plan, {
            "planned_by": how,
            "plan_s": round(time.perf_counter() - began, 3),
            "predicted_iteration_s": plan.predicted.iteration_s if plan.predicted else None,
        }

    def _member_speeds(self, members: list[int]) -> dict[str, float]:
        speeds, workers = self._speeds(), self.state.workers
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


def _started(heartbeat: dict) -> bool:
    """Whether a heartbeat says its worker has started: it counts its steps done from 0 once its
    model is built and its group formed (-1 before)."""
    step = heartbeat.get("step")
    return isinstance(step, int) and not isinstance(step, bool) and step >= 0


def _offered_slots(member: Member) -> int:
    """The worker slots an agent offers: its GPUs, else its cores, else what it asked for."""
    info = member.info
    return int(info.get("num_gpus") or info.get("num_cpu_cores") or member.num_slots)


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
        "lr": plan.training.lr,
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


def open_request(coordinator: Coordinator, raw: bytes) -> tuple[str, dict | None, str]:
    """A ``felactl scale`` request: (its id, its command, "") when it is signed for this job, else
    (the id it claims, or "", None, what is wrong)."""
    try:
        opened = coordinator.seal.open(keys.SCALE_REQUESTS, raw, ScaleRequestDoc.KIND.value)
        request = ScaleRequestDoc.from_body(opened.body)
    except (Forged, ValueError) as exc:
        claimed = ""
        try:
            claimed = str(json.loads(raw)["body"]["id"])
        except (ValueError, KeyError, TypeError):
            pass
        why = exc.reason if isinstance(exc, Forged) else f"malformed ({exc})"
        if why.startswith("wrong signature"):
            why = "the scale command is not signed with this job's secret"
        return (claimed if _good_id(claimed) else ""), None, f"scale request: {why}"
    if not _good_id(request.id):
        return "", None, "scale request: a bad id"
    return request.id, request.command, ""


def _good_id(request_id: str) -> bool:
    return request_id.isalnum() and 0 < len(request_id) <= 64


def answer(coordinator: Coordinator, request_id: str, reply: dict) -> None:
    """The signed answer to request ``request_id`` (felactl scale acts on nothing else)."""
    name = keys.scale_reply(request_id)
    body = ScaleReplyDoc(
        id=request_id, ok=bool(reply.get("ok")), result=reply.get("result") or {}, error=str(reply.get("error", ""))
    ).to_body()
    coordinator.store.set(coordinator.prefix + name, coordinator.seal.seal(name, ScaleReplyDoc.KIND.value, body))


def answer_unsigned(coordinator: Coordinator, request_id: str, why: str) -> None:
    """A refusal to a request this job cannot verify: its sender may hold a wrong secret and could
    not verify a signed one. It only ever says no (felactl scale takes no unsigned success)."""
    coordinator.store.set(coordinator.prefix + keys.scale_reply(request_id), json.dumps({"ok": False, "error": why}))


def refuse_requests(coordinator: Coordinator, run: RunDir, reason: str) -> None:
    """A job that cannot be rescaled still answers ``felactl scale`` (refused, logged), never leaves it waiting."""
    store = coordinator.store
    queue = coordinator.prefix + keys.SCALE_REQUESTS
    while store.queue_len(queue) > 0:
        raw = store.queue_pop(queue, block=False)
        request_id, command, why = open_request(coordinator, raw)
        if command is None:
            coordinator.refuse(keys.SCALE_REQUESTS, why)
            if request_id:
                answer_unsigned(coordinator, request_id, why)
            continue
        record(run.events, EventKind.REFUSED, reason=reason)
        answer(coordinator, request_id, {"ok": False, "error": reason})
