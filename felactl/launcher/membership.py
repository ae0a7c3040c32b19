"""The coordinator's membership decision, apart from its doing.

:func:`decide` takes what the coordinator knows (:class:`State`: the generation, its members, the
workers' and agents' last signs of life, newcomers being started, a switch in progress, requests
waiting for it) and what it saw since (:class:`Seen`: the clock, heartbeats, exit codes, ``done``
and ``ready`` marks, ``switched`` reports, agents that joined, ``felactl scale`` requests), and
returns the next state and the actions to take: drop workers, switch to a new generation, start
newcomers or give them up, admit an agent, answer or refuse a request, finish, fail.

It reads no store, starts no process, reads no clock (the time is ``Seen.now``) and plans nothing,
so every rule of membership can be tested with a table of made-up states and sightings, as torch
elastic tests its agent with fake workers (``tests/test_membership.py``).

The executor, :class:`felactl.launcher.elastic.ElasticController`, does the rest: each poll it
gathers a :class:`Seen` from the store and the agents' reports, calls :func:`decide`, and applies the
actions (signed commands to agents, plans, generation documents, events, answers). Only what it
cannot know in advance comes back as a sighting: a change whose plan the planner refused
(``Seen.planning_failed``) is undone by :func:`decide` like any other.

The coordinator is never blocked on a change: while newcomers start or a switch waits for its
reports, failures are still noticed, and scale requests wait their turn (``State.deferred``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

from felactl.control import EventKind
from felactl.errors import EXIT_BAD_INPUT, InputError
from felactl.launcher.scale_plan import ScalingPolicy


# --- what the coordinator knows ------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Rules:
    """The job's fixed terms: timeouts, slots, where logs are."""

    heartbeat_timeout_s: float = 5.0
    ready_timeout_s: float = 60.0
    switch_timeout_s: float = 60.0
    agent_gone_s: float = 1.25
    """An agent this long silent when its worker goes silent is taken for gone with it (two
    missed agent beats, and a half for a busy machine)."""
    min_nodes: int = 1
    """Nodes the job needs to start on (torchrun's ``--nnodes MIN:MAX``): a node whose workers
    cannot start fails the job unless this many others are left, which go on without it."""
    max_nproc_per_node: int | None = None
    profile: Mapping[str, tuple[str, ...]] | None = None
    """Node -> its devices in the run's cluster profile; None when the run has no profile (the
    planner can place a newcomer only on a profiled device)."""
    logs: str = "logs"
    run_id: str = "run"
    device_prefix: str = "cpu"
    """How a newcomer's device is named without a profile (``cpu3``; ``cuda3`` in a GPU job)."""


@dataclass(frozen=True)
class Worker:
    """A worker process the coordinator started or launched (a member, a newcomer, or one that
    left: its id is never reused). ``beat`` is its newest heartbeat seen and ``since`` when that
    changed (or when the worker was started)."""

    node: str
    device: str
    agent_id: str
    beat: str | None = None
    since: float = 0.0


@dataclass(frozen=True)
class Agent:
    """A node's agent, its worker slots (when neither a profile nor --max-nproc-per-node says
    otherwise) and its own beat, followed like a worker's."""

    agent_id: str
    slots: int
    beat: str | None = None
    since: float = 0.0


@dataclass(frozen=True)
class Request:
    """A ``felactl scale`` request as opened: its command, or None with ``problem`` when it is
    not signed for this job or malformed."""

    id: str
    command: Mapping | None
    problem: str = ""


@dataclass(frozen=True)
class Starting:
    """Newcomers started for ``request``, joining once all are ``ready``."""

    request: Request
    policy: ScalingPolicy | None
    node: str
    newcomers: tuple[int, ...]
    deadline: float
    ready: frozenset[int] = frozenset()


@dataclass(frozen=True)
class Switching:
    """A published generation waiting for every member's ``switched`` report."""

    generation: int
    kind: str
    members: tuple[int, ...]
    before: tuple[int, ...]
    deadline: float
    if_finished: tuple[int, ...]
    """The members should the workers that stay finish their last step before switching (the
    change is moot): the old members, or for a failure the survivors (the dead never finish)."""
    request_id: str | None = None
    reported: frozenset[int] = frozenset()

    @property
    def stayers(self) -> tuple[int, ...]:
        return tuple(w for w in self.members if w in self.before)


@dataclass(frozen=True, kw_only=True)
class State:
    rules: Rules
    generation: int
    members: tuple[int, ...]
    workers: Mapping[int, Worker]
    agents: Mapping[str, Agent]
    """Node -> its agent, in the order the nodes came (the first is where ``--add`` goes by default)."""
    next_id: int
    done: frozenset[int] = frozenset()
    stuck_since: float | None = None
    starting: Starting | None = None
    switching: Switching | None = None
    deferred: tuple[Request, ...] = ()
    """Requests that came while a change was under way, served in order once it is done."""
    answered: frozenset[str] = frozenset()
    reformed_after: frozenset[tuple[int, str]] = frozenset()
    """The failed steps the newest generation was re-formed after, as (step, the failure's line):
    the same failure on the same step again is the job's, not a worker's."""
    launching: bool = False
    """No member has started yet (built its model and formed its group): a member lost now is a
    node that could not start."""

    @property
    def busy(self) -> bool:
        return self.starting is not None or self.switching is not None


# --- what it saw -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Exit:
    code: int
    failure: str | None = None


@dataclass(frozen=True)
class Stuck:
    """A member's report that its step failed: which step, why (one line), and the members it
    then could not reach."""

    unreachable: frozenset[int] = frozenset()
    step: int = -1
    why: str = ""


@dataclass(frozen=True)
class Join:
    """An agent admitted to the running job for ``node``."""

    node: str
    agent_id: str
    slots: int


@dataclass(frozen=True, kw_only=True)
class Seen:
    now: float
    joins: tuple[Join, ...] = ()
    agent_beats: Mapping[str, str | None] = field(default_factory=dict)
    """Agent id -> its beat key's value (None: absent) for the agents looked at."""
    heartbeats: Mapping[int, str] = field(default_factory=dict)
    """Worker -> its newest valid heartbeat; a worker missing here keeps the beat it had (a
    forged or unreadable beat neither revives a silent worker nor silences a live one)."""
    exits: Mapping[int, Exit] = field(default_factory=dict)
    started: frozenset[int] = frozenset()
    """Workers whose heartbeat says they have started (their model built, their group formed)."""
    done: frozenset[int] = frozenset()
    stuck: Mapping[int, Stuck] = field(default_factory=dict)
    """The members that said their step failed in the current generation, each with its report."""
    ready: frozenset[int] = frozenset()
    switched: frozenset[int] = frozenset()
    """Members that reported the generation being switched to."""
    requests: tuple[Request, ...] = ()
    planning_failed: str | None = None
    """The executor's report: the change :func:`decide` just asked for could not be planned."""


# --- what to do ------------------------------------------------------------------------------
@dataclass(frozen=True)
class AdmitAgent:
    node: str
    agent_id: str
    replaces: str | None


@dataclass(frozen=True)
class IgnoreAgent:
    """An agent joined for a node whose agent still answers."""

    node: str
    agent_id: str


@dataclass(frozen=True)
class Drop:
    """Kill these workers (peers blocked in a collective with them fail at once)."""

    reasons: Mapping[int, str]


@dataclass(frozen=True)
class StartNewcomers:
    """Ask ``node``'s agent for these workers (id -> device); ``members`` is who the change
    would have, to plan for while they start."""

    node: str
    agent_id: str
    newcomers: Mapping[int, str]
    members: tuple[int, ...]
    policy: ScalingPolicy | None


@dataclass(frozen=True)
class StopNewcomers:
    wids: tuple[int, ...]


@dataclass(frozen=True)
class Switch:
    """Plan for ``members`` and publish them as ``generation`` (the members were ``before``)."""

    generation: int
    members: tuple[int, ...]
    before: tuple[int, ...]
    kind: str
    reason: str | None = None
    policy: ScalingPolicy | None = None


@dataclass(frozen=True)
class SwitchDone:
    """Record the switch (with the reports that came) and answer its request with it."""

    generation: int
    request_id: str | None


@dataclass(frozen=True)
class SwitchAbandoned:
    """The workers finished before switching: the generation before stays in force."""

    generation: int


@dataclass(frozen=True)
class Answer:
    request_id: str
    result: Mapping


@dataclass(frozen=True)
class AnswerAgain:
    request_id: str


@dataclass(frozen=True)
class Refuse:
    """Refuse a request (``request_id`` "": record it, answer nobody); ``forged``: it is not
    signed for this job, so any answer goes unsigned."""

    request_id: str
    reason: str
    command: Mapping | None = None
    forged: bool = False


@dataclass(frozen=True)
class Finish:
    pass


@dataclass(frozen=True)
class Fail:
    reason: str
    worker: int | None = None
    """The worker whose log tells more (the executor adds where that log is)."""
    bad_input: bool = False
    """Every worker that failed refused its input (exit 2) before it started (a global batch its
    dataset cannot fill): the launch ends as bad input, exit 2."""


Action = (
    AdmitAgent
    | IgnoreAgent
    | Drop
    | StartNewcomers
    | StopNewcomers
    | Switch
    | SwitchDone
    | SwitchAbandoned
    | Answer
    | AnswerAgain
    | Refuse
    | Finish
    | Fail
)

FINISHED_FIRST = "the job finished its last step; nothing changed"
FAILED_FIRST = "the job failed; nothing changed"


# --- the decision ----------------------------------------------------------------------------
def decide(state: State, seen: Seen) -> tuple[State, list[Action]]:
    """The next state and what to do, in order. A :class:`Fail` comes last and ends the job; a
    :class:`Finish` means every member finished its last step."""
    state = _follow_signs_of_life(state, seen)
    if seen.planning_failed is not None:
        return _undo_change(state, seen.planning_failed)
    actions: list[Action] = []
    state = _admit_agents(state, seen, actions)
    if state.switching is not None:
        state = _follow_switch(state, seen, actions)
    if state.switching is None and not _failed(actions):
        state = _follow_members(state, seen, actions)
    if state.starting is not None and not _failed(actions):
        state = _follow_newcomers(state, seen, actions)
    if _failed(actions):
        return state, actions
    state = _serve_requests(state, (*state.deferred, *seen.requests), seen.now, actions)
    if not state.busy and _all_done(state):
        actions.append(Finish())
    return state, actions


def _failed(actions: list[Action]) -> bool:
    return bool(actions) and isinstance(actions[-1], Fail)


def _follow_signs_of_life(state: State, seen: Seen) -> State:
    """Heartbeats and agent beats (each silence is timed from its last change) and done marks."""
    workers = {}
    for wid, w in state.workers.items():
        beat = seen.heartbeats.get(wid, w.beat)
        workers[wid] = w if beat == w.beat else dataclasses.replace(w, beat=beat, since=seen.now)
    agents = {}
    for node, a in state.agents.items():
        beat = seen.agent_beats[a.agent_id] if a.agent_id in seen.agent_beats else a.beat
        agents[node] = a if beat == a.beat else dataclasses.replace(a, beat=beat, since=seen.now)
    done = state.done | (seen.done & set(workers))
    launching = state.launching and not seen.started & set(state.members)
    return dataclasses.replace(state, workers=workers, agents=agents, done=done, launching=launching)


def _admit_agents(state: State, seen: Seen, actions: list[Action]) -> State:
    """A ``felactl agent`` joining the running job (a new node, or a node whose agent died) is
    given no workers: ``felactl scale --add N --node NAME`` starts them there."""
    for join in seen.joins:
        old = state.agents.get(join.node)
        if old is not None and agent_silent_s(state, join.node, seen.now) is None:
            actions.append(IgnoreAgent(join.node, join.agent_id))
            continue
        agents = {**state.agents, join.node: Agent(join.agent_id, join.slots, since=seen.now)}
        state = dataclasses.replace(state, agents=agents)
        actions.append(AdmitAgent(join.node, join.agent_id, old.agent_id if old else None))
    return state


def _follow_switch(state: State, seen: Seen, actions: list[Action]) -> State:
    switching = state.switching
    reported = switching.reported | (seen.switched & set(switching.members))
    switching = dataclasses.replace(switching, reported=reported)
    if reported >= set(switching.members):
        actions.append(SwitchDone(switching.generation, switching.request_id))
        return _answered(dataclasses.replace(state, switching=None), switching.request_id)
    stayers = switching.stayers
    if stayers and not reported & set(stayers) and all(w in state.done for w in stayers):
        # Nobody trains any more: the change is moot. The finished workers are the members
        # (their done marks end the job) and a newcomer that never joined is stopped.
        return _abandon_switch(state, switching, actions)
    dead = dead_workers(state, [w for w in switching.members if w not in reported], seen)
    if dead:
        # The switch ends as it stands (recorded with the reports that came) and the survivors
        # switch again without the dead.
        state, dead = _lost(state, dead, seen, actions)
        if dead is None:
            return state
        actions.append(Drop(dead))
        actions.append(SwitchDone(switching.generation, switching.request_id))
        state = _answered(dataclasses.replace(state, switching=None), switching.request_id)
        return _switch_without(state, dead, seen.now, actions)
    if seen.now > switching.deadline:
        missing = sorted(set(switching.members) - reported)
        return _fail(
            state,
            f"generation {switching.generation}: workers {missing} did not switch within "
            f"{state.rules.switch_timeout_s:g} s; see {state.rules.logs}",
            actions,
        )
    return dataclasses.replace(state, switching=switching)


def _abandon_switch(state: State, switching: Switching, actions: list[Action]) -> State:
    newcomers = tuple(w for w in switching.members if w not in switching.before)
    actions.append(SwitchAbandoned(switching.generation))
    if newcomers:
        actions.append(StopNewcomers(newcomers))
    state = dataclasses.replace(state, switching=None, members=switching.if_finished)
    if switching.request_id is None:
        return state
    actions.append(
        Refuse(
            switching.request_id,
            f"the job finished its last step before generation {switching.generation} could start; nothing changed",
        )
    )
    return _answered(state, switching.request_id)


def _follow_members(state: State, seen: Seen, actions: list[Action]) -> State:
    """Drop the dead; re-form a generation whose collective failed with everyone alive."""
    dead = dead_workers(state, state.members, seen)
    if dead:
        state, dead = _lost(state, dead, seen, actions)
        if dead is None:
            return state
        actions.append(Drop(dead))
        return _switch_without(state, dead, seen.now, actions)
    if not seen.stuck:
        return dataclasses.replace(state, stuck_since=None)
    repeated = next((w for w in sorted(seen.stuck) if _report(seen.stuck[w]) in state.reformed_after), None)
    if repeated is not None:
        return _fail_repeated(state, repeated, seen.stuck[repeated], actions)
    stuck_since = state.stuck_since if state.stuck_since is not None else seen.now
    state = dataclasses.replace(state, stuck_since=stuck_since)
    # Once every member has reported, nobody is dead (the dead report nothing); until then a silent
    # one may yet be found dead by its heartbeat.
    everyone = set(seen.stuck) >= set(state.members)
    if not everyone and seen.now - stuck_since <= state.rules.heartbeat_timeout_s:
        return state
    unreachable = {w: report.unreachable for w, report in seen.stuck.items()}
    group = reachable_group(state.members, unreachable)
    if len(group) < len(state.members):
        cut_off = {w: _partition_reason(w, group, unreachable) for w in state.members if w not in group}
        actions.append(Drop(cut_off))
        return _switch_without(state, cut_off, seen.now, actions)
    return _switch(
        state,
        state.members,
        EventKind.RE_FORM.value,
        seen.now,
        actions,
        reason="a collective failed with every member alive",
        reformed_after=frozenset(_report(report) for report in seen.stuck.values() if report.why and report.step >= 0),
    )


def _report(stuck: Stuck) -> tuple[int, str]:
    return stuck.step, stuck.why


def _fail_repeated(state: State, wid: int, stuck: Stuck, actions: list[Action]) -> State:
    """The job re-formed after a failed step and the same step failed the same way again: the
    failure is the job's (its model, data, loss or optimizer raised), and re-forming would only
    repeat it. An exception of the user's code is seen here whatever its type (a shape slip is
    torch's RuntimeError, as a collective's failure is)."""
    return _fail(
        state,
        f"worker {wid}: step {stuck.step} failed again after the job re-formed, the same way: {stuck.why} "
        "(a failure that repeats on the same step is the job's own code or data, not a worker's)",
        actions,
        worker=wid,
    )


def reachable_group(members: tuple[int, ...], unreachable: Mapping[int, frozenset[int]]) -> tuple[int, ...]:
    """The largest group of ``members`` that all reach one another, when each member's report of
    whom it could not reach is all that is known (two members are apart when either says so; a
    member that did not report is taken to reach whoever does not say otherwise). Among groups as
    large, the one of the lowest worker ids. A maximum clique (Bron-Kerbosch with a pivot): the
    members of a job are few, and a partition leaves few cliques."""
    apart = {w: set() for w in members}
    for w, lost in unreachable.items():
        for v in lost:
            if w in apart and v in apart and v != w:
                apart[w].add(v)
                apart[v].add(w)
    near = {w: set(members) - apart[w] - {w} for w in members}
    best: tuple[int, ...] = ()

    def grow(clique: set[int], candidates: set[int], excluded: set[int]) -> None:
        nonlocal best
        if not candidates and not excluded:
            found = tuple(sorted(clique))
            if len(found) > len(best) or (len(found) == len(best) and found < best):
                best = found
            return
        pivot = max(candidates | excluded, key=lambda w: len(near[w] & candidates))
        for w in sorted(candidates - near[pivot]):
            grow(clique | {w}, candidates & near[w], excluded & near[w])
            candidates = candidates - {w}
            excluded = excluded | {w}

    grow(set(), set(members), set())
    return best


def _partition_reason(wid: int, group: tuple[int, ...], unreachable: Mapping[int, frozenset[int]]) -> str:
    apart = sorted(
        {v for v in unreachable.get(wid, ()) if v in group} | {v for v in group if wid in unreachable.get(v, ())}
    )
    return (
        f"worker {wid}: cut off from worker(s) {', '.join(map(str, apart))} by a network partition "
        f"(the largest group that reaches itself goes on: {', '.join(map(str, group))})"
    )


def _lost(
    state: State, dead: Mapping[int, str], seen: Seen, actions: list[Action]
) -> tuple[State, Mapping[int, str] | None]:
    """The workers to drop for the ``dead``: themselves, once the job has started. Before, a
    worker that failed is a node that could not start (a module it cannot import, a device it
    lacks): its node is left out whole when ``min_nodes`` others are left, else the job fails at
    once, naming the node and why (None: it failed)."""
    if not state.launching:
        return state, dead
    failed = [node for node in state.agents if any(state.workers[w].node == node for w in dead)]
    left = {state.workers[w].node for w in state.members} - set(failed)
    names = ", ".join(repr(node) for node in failed)
    why = f"node {names} could not start" if len(failed) == 1 else f"nodes {names} could not start"
    if len(left) < state.rules.min_nodes:
        needs = ""
        if left:
            total = len(state.agents)
            needs = (
                f"; the job needs {state.rules.min_nodes} of its {total} nodes and {len(left)} "
                f"{'is' if len(left) == 1 else 'are'} left (with --nnodes {len(left)}:{total} it goes on "
                "without a node that cannot start)"
            )
        refused = all(w in seen.exits and seen.exits[w].code == EXIT_BAD_INPUT for w in dead)
        failed_state = _fail(state, f"{why}: {_said_once(dead)}{needs}", actions, worker=min(dead), bad_input=refused)
        return failed_state, None
    node_of = {w: state.workers[w].node for w in state.members}
    return state, {
        w: dead.get(w, f"worker {w}: left out with node {node_of[w]!r}, which could not start")
        for w in state.members
        if node_of[w] in failed
    }


def _said_once(dead: Mapping[int, str]) -> str:
    """The workers' reasons, each said once: ``workers 0, 1 exited with code 2: <line>`` where
    several workers failed alike (every worker of a job refuses the same input)."""
    alike: dict[str, list[int]] = {}
    for wid, reason in sorted(dead.items()):
        alike.setdefault(reason.removeprefix(f"worker {wid} "), []).append(wid)
    return "; ".join(
        f"worker {wids[0]} {rest}" if len(wids) == 1 else f"workers {', '.join(map(str, wids))} {rest}"
        for rest, wids in alike.items()
    )


def _switch_without(state: State, dead: Mapping[int, str], now: float, actions: list[Action]) -> State:
    survivors = tuple(w for w in state.members if w not in dead)
    reasons = "; ".join(dead.values())
    if not survivors:
        return _fail(
            state,
            f"worker failed: no worker is left ({reasons}); logs in {state.rules.logs}; a run with "
            f"checkpoints continues with `felactl launch --resume {state.rules.run_id}`",
            actions,
        )
    return _switch(state, survivors, EventKind.FAILURE.value, now, actions, reason=reasons, if_finished=survivors)


def _switch(
    state: State,
    members: tuple[int, ...],
    kind: str,
    now: float,
    actions: list[Action],
    *,
    reason: str | None = None,
    policy: ScalingPolicy | None = None,
    request_id: str | None = None,
    if_finished: tuple[int, ...] | None = None,
    reformed_after: frozenset[tuple[int, str]] = frozenset(),
) -> State:
    generation = state.generation + 1
    switching = Switching(
        generation=generation,
        kind=kind,
        members=members,
        before=state.members,
        deadline=now + state.rules.switch_timeout_s,
        request_id=request_id,
        if_finished=state.members if if_finished is None else if_finished,
    )
    actions.append(Switch(generation, members, state.members, kind, reason, policy))
    return dataclasses.replace(
        state, generation=generation, members=members, switching=switching, reformed_after=reformed_after
    )


def _follow_newcomers(state: State, seen: Seen, actions: list[Action]) -> State:
    starting = state.starting
    ready = starting.ready | (seen.ready & set(starting.newcomers))
    starting = dataclasses.replace(starting, ready=ready)
    waiting = [w for w in starting.newcomers if w not in ready]
    # Before it is ready a newcomer has no heartbeat: only its exit, or the deadline, says it failed.
    failed = [exit_reason(w, seen.exits[w]) for w in waiting if w in seen.exits and w not in state.done]
    if failed or (waiting and seen.now > starting.deadline):
        why = "; ".join(failed) or f"not ready within {state.rules.ready_timeout_s:g} s, the launch's --join-timeout"
        return _give_up_newcomers(state, f"the new worker(s) did not start ({why}); see {state.rules.logs}", actions)
    if _all_done(state):
        return _give_up_newcomers(
            state, "the job finished its last step while the new worker(s) were starting; nothing changed", actions
        )
    if waiting or state.switching is not None:  # a failure's switch goes first; then the scale-out
        return dataclasses.replace(state, starting=starting)
    state = dataclasses.replace(state, starting=None)
    return _switch(
        state,
        (*state.members, *starting.newcomers),
        EventKind.SCALE_OUT.value,
        seen.now,
        actions,
        policy=starting.policy,
        request_id=starting.request.id,
    )


def _give_up_newcomers(state: State, reason: str, actions: list[Action]) -> State:
    starting = state.starting
    actions.append(StopNewcomers(starting.newcomers))
    actions.append(Refuse(starting.request.id, reason, starting.request.command))
    return _answered(dataclasses.replace(state, starting=None), starting.request.id)


def _undo_change(state: State, reason: str) -> tuple[State, list[Action]]:
    """The change just decided could not be planned: nothing changes, its request is refused
    and its newcomers are stopped."""
    actions: list[Action] = []
    if state.switching is not None and state.switching.request_id is not None:
        switching = state.switching
        newcomers = tuple(w for w in switching.members if w not in switching.before)
        if newcomers:
            actions.append(StopNewcomers(newcomers))
        actions.append(Refuse(switching.request_id, reason))
        state = dataclasses.replace(
            state, generation=switching.generation - 1, members=switching.before, switching=None
        )
        return _answered(state, switching.request_id), actions
    if state.starting is not None:
        return _give_up_newcomers(state, reason, actions), actions
    raise ValueError(f"internal: a planning failure with no requested change under way ({reason})")


def _fail(
    state: State, reason: str, actions: list[Action], worker: int | None = None, bad_input: bool = False
) -> State:
    """Fail the job; the requests it will not serve are refused first."""
    waiting = [r for r in state.deferred if r.id not in state.answered]
    if state.starting is not None:
        waiting.insert(0, state.starting.request)
    for request in waiting:
        actions.append(Refuse(request.id, FAILED_FIRST, request.command))
    if state.switching is not None and state.switching.request_id is not None:
        actions.append(Refuse(state.switching.request_id, FAILED_FIRST))
    actions.append(Fail(reason, worker, bad_input))
    return dataclasses.replace(state, deferred=())


# --- requests --------------------------------------------------------------------------------
def _serve_requests(state: State, requests: tuple[Request, ...], now: float, actions: list[Action]) -> State:
    state = dataclasses.replace(state, deferred=())
    for request in requests:
        if request.command is None:
            # Only ever an unsigned "no", and never over the answer to a genuine request of that id.
            answer_to = request.id if request.id and not _known(state, request.id) else ""
            actions.append(Refuse(answer_to, request.problem, forged=True))
        elif request.id in state.answered:
            actions.append(AnswerAgain(request.id))  # its sender sent it again: the same answer, nothing redone
        elif _known(state, request.id):
            continue  # sent again while under way: answered once done
        elif state.busy:
            state = dataclasses.replace(state, deferred=(*state.deferred, request))
        elif _all_done(state):
            actions.append(Refuse(request.id, FINISHED_FIRST, request.command))
            state = _answered(state, request.id)
        else:
            state = _serve(state, request, now, actions)
    return state


def _known(state: State, request_id: str) -> bool:
    """Answered, or under way."""
    under_way = {r.id for r in state.deferred}
    if state.starting is not None:
        under_way.add(state.starting.request.id)
    if state.switching is not None and state.switching.request_id is not None:
        under_way.add(state.switching.request_id)
    return request_id in state.answered or request_id in under_way


def _serve(state: State, request: Request, now: float, actions: list[Action]) -> State:
    command = request.command
    try:
        op = command.get("op")
        policy = (
            ScalingPolicy(command["scaling_policy"], command.get("max_batch"))
            if command.get("scaling_policy")
            else None
        )
        if op == "add":
            return _scale_out(state, request, int(command.get("count", 0)), command.get("node"), policy, now, actions)
        if op == "remove":
            return _scale_in(state, request, [int(r) for r in command.get("ranks", [])], policy, now, actions)
        if op == "to":
            target = int(command.get("count", 0))
            if target < 1:
                raise InputError(f"--to {target}: a job needs at least one worker")
            if target > len(state.members):
                return _scale_out(
                    state, request, target - len(state.members), command.get("node"), policy, now, actions
                )
            if target < len(state.members):
                return _scale_in(state, request, list(state.members[target:]), policy, now, actions)
            actions.append(
                Answer(
                    request.id, {"kind": "unchanged", "members": list(state.members), "generation": state.generation}
                )
            )
            return _answered(state, request.id)
        raise InputError(f"unknown scale operation {op!r}")
    except (InputError, ValueError, TypeError) as exc:  # a signed but malformed command is refused too
        actions.append(Refuse(request.id, str(exc), command))
        return _answered(state, request.id)


def _scale_in(
    state: State, request: Request, wids: list[int], policy: ScalingPolicy | None, now: float, actions: list[Action]
) -> State:
    unknown = [w for w in wids if w not in state.members]
    if unknown:
        raise InputError(
            f"--remove {unknown[0]}: no such worker in the job (workers: {', '.join(map(str, state.members))})"
        )
    stay = tuple(w for w in state.members if w not in wids)
    if not stay:
        raise InputError("cannot remove every worker: at least one must stay (stop the job instead)")
    return _switch(state, stay, EventKind.SCALE_IN.value, now, actions, policy=policy, request_id=request.id)


def _scale_out(
    state: State,
    request: Request,
    count: int,
    node: str | None,
    policy: ScalingPolicy | None,
    now: float,
    actions: list[Action],
) -> State:
    """Start ``count`` newcomers on ``node``; they join once ready (start-up happens while the job trains)."""
    if count < 1:
        raise InputError(f"--add {count}: add at least one worker")
    node = node or next(iter(state.agents))
    if node not in state.agents:
        raise InputError(f"--node {node!r}: no agent of this job runs there (nodes: {', '.join(state.agents)})")
    silent_s = agent_silent_s(state, node, now)
    if silent_s is not None:
        raise InputError(
            f"--node {node!r}: its agent has not answered for {silent_s:.1f} s (killed or "
            "unreachable); add workers on another node or restart `felactl agent` there"
        )
    used = sum(1 for w in state.members if state.workers[w].node == node)
    slots = capacity(state, node)
    if used + count > slots:
        profiled = state.rules.profile is not None and node in state.rules.profile
        where = (
            "device(s) in the run's cluster profile"
            if profiled and state.rules.max_nproc_per_node is None
            else "worker slot(s)"
        )
        hint = (
            "one worker per GPU, as NCCL runs one rank per GPU: add on another node with --node"
            if state.rules.device_prefix == "cuda"
            else "a CPU node offers one slot per core; launch with --max-nproc-per-node to allow more"
        )
        raise InputError(f"node {node!r} has {slots} {where} and {used} in use: cannot add {count} ({hint})")
    devices = _free_devices(state, node, count)
    agent_id = state.agents[node].agent_id
    newcomers = {state.next_id + i: device for i, device in enumerate(devices)}
    workers = {**state.workers, **{w: Worker(node, d, agent_id, since=now) for w, d in newcomers.items()}}
    starting = Starting(
        request=request,
        policy=policy,
        node=node,
        newcomers=tuple(newcomers),
        deadline=now + state.rules.ready_timeout_s,
    )
    actions.append(StartNewcomers(node, agent_id, newcomers, (*state.members, *newcomers), policy))
    return dataclasses.replace(state, workers=workers, next_id=state.next_id + count, starting=starting)


def capacity(state: State, node: str) -> int:
    """Worker slots of ``node``: --max-nproc-per-node, else its profiled devices, else what its agent offers."""
    if state.rules.max_nproc_per_node is not None:
        return state.rules.max_nproc_per_node
    if state.rules.profile is not None and node in state.rules.profile:
        return len(state.rules.profile[node])
    return state.agents[node].slots


def _free_devices(state: State, node: str, count: int) -> list[str]:
    """Names for newcomers: the profile's devices of ``node`` that no member holds (so the
    planner knows them); without a profile, ``cpu<id>`` (``cuda<id>`` in a GPU job)."""
    taken = {state.workers[w].device for w in state.members}
    if state.rules.profile is None:
        names = [f"{state.rules.device_prefix}{state.next_id + i}" for i in range(count)]
        return [name if name not in taken else f"w{state.next_id + i}" for i, name in enumerate(names)]
    profiled = state.rules.profile.get(node)
    if profiled is None:
        raise InputError(f"node {node!r} is not in the run's cluster profile: the planner cannot place workers there")
    free = [d for d in profiled if d not in taken]
    if len(free) < count:
        raise InputError(
            f"node {node!r} has {len(free)} free device(s) in the run's cluster profile "
            f"({len(profiled)} in all): cannot add {count}; the planner places workers on "
            f"profiled devices only (profile the node with more slots, e.g. felactl profile "
            f"--nproc-per-node {len(profiled) + count}, for the next launch)"
        )
    return free[:count]


# --- liveness --------------------------------------------------------------------------------
def dead_workers(state: State, wids, seen: Seen) -> dict[int, str]:
    """Of ``wids``, those whose process ended unasked or whose heartbeat stopped, with why."""
    rules, dead = state.rules, {}
    for wid in wids:
        if wid in state.done:
            continue
        if wid in seen.exits:
            dead[wid] = exit_reason(wid, seen.exits[wid])
            continue
        w = state.workers[wid]
        grace = rules.heartbeat_timeout_s if w.beat is not None else rules.ready_timeout_s
        silent_s = seen.now - w.since
        if silent_s > grace:
            dead[wid] = f"worker {wid}: no heartbeat for {silent_s:.1f} s"
            # Its worker's silence and the agent's start within a beat of each other: an agent
            # silent a few of its beats is gone with it.
            if agent_silent_s(state, w.node, seen.now, rules.agent_gone_s) is not None:
                dead[wid] += f" (the agent of node {w.node!r} is gone too)"
    return dead


def exit_reason(wid: int, exit: Exit) -> str:
    return f"worker {wid} exited with code {exit.code}" + (f": {exit.failure}" if exit.failure else "")


def agent_silent_s(state: State, node: str, now: float, grace_s: float | None = None) -> float | None:
    """Seconds the agent of ``node`` has been silent, once past ``grace_s`` (default: the
    heartbeat timeout; an agent never heard gets the start-up time too); else None."""
    agent = state.agents[node]
    silent = now - agent.since
    grace = grace_s if grace_s is not None else state.rules.heartbeat_timeout_s
    if agent.beat is None:
        grace = max(grace, state.rules.ready_timeout_s)
    return silent if silent > grace else None


def _all_done(state: State) -> bool:
    return all(w in state.done for w in state.members)


def _answered(state: State, request_id: str | None) -> State:
    if request_id is None:
        return state
    return dataclasses.replace(state, answered=state.answered | {request_id})
