"""Serving ``felactl scale`` requests: each is answered once (a request sent again gets the same
answer), waits while a change is under way, and becomes a scale-out (newcomers on a node with
free slots) or a scale-in (a switch without the removed workers); a request that cannot be met
is refused with the reason."""

from __future__ import annotations

import dataclasses

from felactl.control import EventKind
from felactl.errors import InputError
from felactl.launcher.membership.signs_of_life import agent_silent_s
from felactl.launcher.membership.state import (
    FINISHED_FIRST,
    Action,
    Answer,
    AnswerAgain,
    Refuse,
    Request,
    Starting,
    StartNewcomers,
    State,
    Worker,
)
from felactl.launcher.membership.transitions import all_done, begin_switch, mark_answered
from felactl.launcher.scale_plan import ScalingPolicy

NO_AGENT_THERE = "no agent of this job runs there"
"""How a scale-out onto a node without an agent is refused (inside a Slurm allocation, felactl
scale then starts one: :mod:`felactl.launcher.slurm_scale`)."""


def serve_requests(state: State, requests: tuple[Request, ...], now: float, actions: list[Action]) -> State:
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
        elif all_done(state):
            actions.append(Refuse(request.id, FINISHED_FIRST, request.command))
            state = mark_answered(state, request.id)
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
            return mark_answered(state, request.id)
        raise InputError(f"unknown scale operation {op!r}")
    except (InputError, ValueError, TypeError) as exc:  # a signed but malformed command is refused too
        actions.append(Refuse(request.id, str(exc), command))
        return mark_answered(state, request.id)


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
    return begin_switch(state, stay, EventKind.SCALE_IN.value, now, actions, policy=policy, request_id=request.id)


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
        raise InputError(f"--node {node!r}: {NO_AGENT_THERE} (nodes: {', '.join(state.agents)})")
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
