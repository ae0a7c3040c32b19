"""SDPipe's central group scheduler as a pure state machine (time is passed in, no I/O).

Workers ``arrive`` when they finished a local step. A group closes when ``max_group`` workers
wait, or ``wait_s`` after the first of them arrived. Adaptive wait: a group smaller than 2 doubles
it (up to 10 ms), any other shrinks it by 0.9 (down to 0.01 ms).

Connectivity: a union-find over the groups formed since the replicas were last all connected.
Every ``connect_every``-th arrival of a worker is a *connecting* one: that worker is held, and
averages with every worker that arrives meanwhile, until the union connects every replica; then
it goes on. SDPipe's paper holds all grouping once ``connect_every`` rounds passed without a
connection; with several pipeline stages that deadlocks: stage 0's scheduler can hold pipeline A
for pipeline B's stage-0 worker, which waits in its step for B's stage-1 worker, which stage 1's
scheduler holds for A's stage-1 worker, which waits in its step for A's stage-0 worker. Holding
only the worker whose own turn it is, at the same own step in every stage of its pipeline, leaves
every other worker free to finish its step and arrive (tests/test_sdpipe_schedule.py simulates it).
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
    held: list[int] = field(default_factory=list)
    """Workers on a connecting arrival: in every group formed until the replicas connect."""
    first_arrival: float | None = None
    groups_formed: int = 0
    connections: int = 0
    """How often the groups' union connected every replica."""

    def __post_init__(self) -> None:
        self.active = set(self.members)
        self.arrivals = {rank: 0 for rank in self.members}
        self.uf = UnionFind(self.members)

    @property
    def connected(self) -> bool:
        return len(self.uf.components(self.active)) <= 1

    def arrive(self, rank: int, now: float) -> None:
        self.arrivals[rank] += 1
        if self.arrivals[rank] % self.connect_every == 0:
            self.held.append(rank)
            return
        if not self.waiting:
            self.first_arrival = now
        self.waiting.append(rank)

    def leave(self, rank: int) -> None:
        self.active.discard(rank)
        self.waiting = [w for w in self.waiting if w != rank]

    def deadline(self) -> float | None:
        """When the waiting workers' group closes on time (None: nobody waits, or it closes at once)."""
        if not self.waiting or self.held:
            return None
        return self.first_arrival + self.wait_s

    def poll(self, now: float) -> list[list[int]]:
        """The groups that close now. A member in ``held`` after the poll stays for another group;
        every other member of a group is done."""
        if self.held:
            return self._connecting(now)
        groups = []
        while len(self.waiting) >= self.max_group:
            groups.append(self.waiting[: self.max_group])
            self._close(groups[-1], now)
        if self.waiting and now >= self.first_arrival + self.wait_s:
            groups.append(list(self.waiting))
            self._close(groups[-1], now)
        return groups

    def _connecting(self, now: float) -> list[list[int]]:
        """The held workers average with everyone waiting; they are released once that connects
        every replica (also when the others left)."""
        spans = len(self.uf.components(self.held)) > 1
        if not (self.waiting or spans or self.connected):
            return []
        group = self.held + self.waiting
        if self._close(group, now):
            self.held = []
        return [group]

    def _close(self, group: list[int], now: float) -> bool:
        """Form ``group``; True when that connected every replica (the union-find starts over)."""
        self.waiting = [w for w in self.waiting if w not in group]
        self.first_arrival = now if self.waiting else None
        self.wait_s = adapt_wait(self.wait_s, len(group))
        self.uf.union(group)
        self.groups_formed += 1
        self.connections += self.connected
        if self.connected:
            self.uf = UnionFind(self.members)
            return True
        return False
