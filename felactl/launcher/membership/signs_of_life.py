"""Who is still in the job: the members whose process ended or whose heartbeat stopped, an agent
gone silent, and the largest group of members that still reach one another after a partition."""

from __future__ import annotations

from collections.abc import Mapping

from felactl.launcher.membership.state import Exit, Seen, State


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


def partition_reason(wid: int, group: tuple[int, ...], unreachable: Mapping[int, frozenset[int]]) -> str:
    apart = sorted(
        {v for v in unreachable.get(wid, ()) if v in group} | {v for v in group if wid in unreachable.get(v, ())}
    )
    return (
        f"worker {wid}: cut off from worker(s) {', '.join(map(str, apart))} by a network partition "
        f"(the largest group that reaches itself goes on: {', '.join(map(str, group))})"
    )
