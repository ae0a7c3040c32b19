"""The moves that both the decision and the serving of requests make: begin a switch to a new
generation, mark a request answered; and whether every member has finished."""

from __future__ import annotations

import dataclasses

from felactl.launcher.membership.state import Action, State, Switch, Switching
from felactl.launcher.scale_plan import ScalingPolicy


def begin_switch(
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


def all_done(state: State) -> bool:
    return all(w in state.done for w in state.members)


def mark_answered(state: State, request_id: str | None) -> State:
    if request_id is None:
        return state
    return dataclasses.replace(state, answered=state.answered | {request_id})
