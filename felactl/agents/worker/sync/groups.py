"""SDPipe's central group scheduler as a pure state machine (time is passed in, no I/O).

Workers ``arrive`` when they finished a local step. A group closes when ``max_group`` workers
wait, or ``wait_s`` after the first of them arrived. Adaptive wait: a group smaller than 2 doubles
it (up to 10 ms), any other shrinks it by 0.9 (down to 0.01 ms). Connectivity: a union-find over
the groups formed since the replicas were last all connected; once ``connect_every`` rounds (a
round = as many arrivals as there are active workers) passed without that, grouping waits until
the waiting workers cover every component and merges them all in one group.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_WAIT_S = 0.010
MIN_WAIT_S = 0.00001


def adapt_wait(wait_s: float, group_size: int) -> float:
    return min(2 * wait_s, MAX_WAIT_S) if group_size < 2 else max(0.9 * wait_s, MIN_WAIT_S)


class UnionFind:
    def __init__(self, items):
        self.parent = {x: x for x in items}

    def find(self, x: int) -> int:
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, members) -> None:
        members = list(members)
        for m in members[1:]:
            self.parent[self.find(m)] = self.find(members[0])

    def components(self, items) -> set[int]:
        return {self.find(x) for x in items}


@dataclass
class GroupScheduler:
    members: list[int]
    max_group: int = 2
    wait_s: float = 0.001
    connect_every: int = 4
    active: set[int] = field(init=False)
    waiting: list[int] = field(default_factory=list)
    first_arrival: float | None = None
    arrivals_since_connected: int = 0
    groups_formed: int = 0

    def __post_init__(self) -> None:
        self.active = set(self.members)
        self.uf = UnionFind(self.members)

    @property
    def connection_due(self) -> bool:
        return self.arrivals_since_connected >= self.connect_every * max(len(self.active), 1)

    def arrive(self, rank: int, now: float) -> None:
        if not self.waiting:
            self.first_arrival = now
        self.waiting.append(rank)
        self.arrivals_since_connected += 1

    def leave(self, rank: int) -> None:
        self.active.discard(rank)
        self.waiting = [w for w in self.waiting if w != rank]

    def deadline(self) -> float | None:
        """When the waiting workers' group closes on time (None: nobody waits, or a connection is due)."""
        if not self.waiting or self.connection_due:
            return None
        return self.first_arrival + self.wait_s

    def poll(self, now: float) -> list[list[int]]:
        """The groups that close now (each worker of ``waiting`` appears in at most one)."""
        groups = []
        if self.connection_due:
            if self.waiting and self.uf.components(self.waiting) == self.uf.components(self.active):
                groups.append(self._close(list(self.waiting), now))
            return groups
        while len(self.waiting) >= self.max_group:
            groups.append(self._close(self.waiting[: self.max_group], now))
        if self.waiting and now >= self.first_arrival + self.wait_s:
            groups.append(self._close(list(self.waiting), now))
        return groups

    def _close(self, group: list[int], now: float) -> list[int]:
        self.waiting = (
            self.waiting[len(group) :]
            if self.waiting[: len(group)] == group
            else [w for w in self.waiting if w not in group]
        )
        self.first_arrival = now if self.waiting else None
        self.wait_s = adapt_wait(self.wait_s, len(group))
        self.uf.union(group)
        self.groups_formed += 1
        if len(self.uf.components(self.active)) <= 1:
            self.uf = UnionFind(self.members)
            self.arrivals_since_connected = 0
        return group
