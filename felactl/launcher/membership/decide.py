"""The decision: :func:`decide` takes the state and what was seen, and returns the next state and
the actions, in order (the package's docstring tells the rules' split from their doing)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from felactl.control import EventKind
from felactl.errors import EXIT_BAD_INPUT
from felactl.launcher.membership.requests import serve_requests
from felactl.launcher.membership.signs_of_life import (
    agent_silent_s,
    dead_workers,
    exit_reason,
    partition_reason,
    reachable_group,
)
from felactl.launcher.membership.state import (
    FAILED_FIRST,
    Action,
    AdmitAgent,
    Agent,
    Drop,
    Fail,
    Finish,
    IgnoreAgent,
    Refuse,
    Seen,
    State,
    StopNewcomers,
    Stuck,
    SwitchAbandoned,
    SwitchDone,
    Switching,
)
from felactl.launcher.membership.transitions import all_done, begin_switch, mark_answered


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
    state = serve_requests(state, (*state.deferred, *seen.requests), seen.now, actions)
    if not state.busy and all_done(state):
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
        return mark_answered(dataclasses.replace(state, switching=None), switching.request_id)
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
        state = mark_answered(dataclasses.replace(state, switching=None), switching.request_id)
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
    return mark_answered(state, switching.request_id)


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
        cut_off = {w: partition_reason(w, group, unreachable) for w in state.members if w not in group}
        actions.append(Drop(cut_off))
        return _switch_without(state, cut_off, seen.now, actions)
    return begin_switch(
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
    return begin_switch(state, survivors, EventKind.FAILURE.value, now, actions, reason=reasons, if_finished=survivors)


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
    if all_done(state):
        return _give_up_newcomers(
            state, "the job finished its last step while the new worker(s) were starting; nothing changed", actions
        )
    if waiting or state.switching is not None:  # a failure's switch goes first; then the scale-out
        return dataclasses.replace(state, starting=starting)
    state = dataclasses.replace(state, starting=None)
    return begin_switch(
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
    return mark_answered(dataclasses.replace(state, starting=None), starting.request.id)


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
        return mark_answered(state, switching.request_id), actions
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
