"""Fela's tokens, as pure logic: the token DAG of one iteration, and the policies that pick a token.

A token means "run sub-model ``level`` (forward or backward) on one micro-batch of its size".
With weights ``w`` (``w[0] == 1``, non-decreasing, each dividing the next) and ``n1`` first-level
tokens, level ``i`` has ``n1 / w[i]`` tokens; forward token ``(i, j)`` needs the forward tokens
``(i-1, j*r) .. (i-1, j*r + r - 1)`` with ``r = w[i] / w[i-1]``. Backward ``(K-1, j)`` needs forward
``(K-1, j)``; backward ``(i, j)`` needs backward ``(i+1, j // r)`` and its own forward ``(i, j)``
(whose activations it reuses).

Policies (SEEDS.md section 1):

- **ADS**: deepest ready level first (the DAG's depth: forward levels, then backward levels in
  reverse), then locality (the share of the token's inputs this worker produced), then lowest id.
- **HF**: one sub-bucket per worker, drained without contention; an idle worker helps the owner
  whose sub-bucket would finish last: the largest ``backlog / rate / (1 + helpers)``, where rate is
  the owner's completed tokens this iteration (plus one). That is "the slowest worker with the
  fewest helpers" as one number; ties go to fewer helpers, then the lower rank.
- **CTD**: a level may be restricted to a subset of workers (a stage's worker set).
- ``pin_backward``: a backward token runs where its forward ran (the autograd graph and the
  saved activations live there), as the runtime requires.
- ``max_in_flight`` (level -> count, the plan's ``Stage.max_in_flight``): a worker gets no forward
  token of a level, and no backward it would recompute, while it holds that many of the level's
  forwards whose backward it has not run (the memory the planner gave it). A forward whose
  backward another worker took stays held to the iteration's end, as the runtime keeps it. Should
  nothing run and only the limit hold tokens back, it is lifted for the rest of the iteration
  (``limit_lifted``) rather than hang.

No I/O here: the runtime keeps the same state in the control-plane store (data parallel) or feeds
this server its requests; tests drive it directly.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

POLICIES = ("ads", "hf", "ads+hf")


@dataclass(frozen=True, order=True, slots=True)
class Token:
    level: int
    backward: bool
    index: int

    def __str__(self) -> str:
        return f"{'B' if self.backward else 'F'}{self.level}.{self.index}"


def token_samples(global_batch: int, num_tokens: int, index: int) -> range:
    """The samples (offsets within the iteration's global batch) of first-level token ``index``.

    Tokens differ in size by at most one sample, so ``global_batch`` need not divide evenly.
    """
    start = index * global_batch // num_tokens
    return range(start, (index + 1) * global_batch // num_tokens)


class TokenDAG:
    def __init__(self, num_first: int, weights: Sequence[int] = (1,)):
        if not weights or weights[0] != 1:
            raise ValueError(f"weights must start with 1, got {list(weights)}")
        for a, b in zip(weights, weights[1:]):
            if b < a or b % a:
                raise ValueError(f"each weight must be a multiple of the one before, got {list(weights)}")
        if num_first < 1 or num_first % weights[-1]:
            raise ValueError(f"{num_first} first-level tokens cannot be grouped by the last weight {weights[-1]}")
        self.num_first = num_first
        self.weights = tuple(weights)

    @property
    def num_levels(self) -> int:
        return len(self.weights)

    def count(self, level: int) -> int:
        return self.num_first // self.weights[level]

    def tokens(self) -> list[Token]:
        return [
            Token(level, backward, j)
            for backward in (False, True)
            for level in range(self.num_levels)
            for j in range(self.count(level))
        ]

    def depth(self, token: Token) -> int:
        return 2 * self.num_levels - 1 - token.level if token.backward else token.level

    def inputs(self, token: Token) -> list[Token]:
        i, j = token.level, token.index
        if not token.backward:
            if i == 0:
                return []
            r = self.weights[i] // self.weights[i - 1]
            return [Token(i - 1, False, j * r + k) for k in range(r)]
        if i == self.num_levels - 1:
            return [Token(i, False, j)]
        r = self.weights[i + 1] // self.weights[i]
        return [Token(i + 1, True, j // r), Token(i, False, j)]


@dataclass(frozen=True, slots=True)
class SubBucketView:
    """What HF needs to know about one worker's sub-bucket to decide whom to help."""

    owner: int
    backlog: int
    """Tokens still waiting in the sub-bucket."""
    helpers: int
    completed: int
    """Tokens the owner itself completed this iteration (its speed, as all started together)."""

    @property
    def finish_estimate(self) -> float:
        return self.backlog / (self.completed + 1) / (self.helpers + 1)


def choose_victim(views: Iterable[SubBucketView]) -> int | None:
    """HF: the owner whose non-empty sub-bucket would finish last, or None when all are empty."""
    candidates = [v for v in views if v.backlog > 0]
    if not candidates:
        return None
    best = max(candidates, key=lambda v: (v.finish_estimate, -v.helpers, -v.owner))
    return best.owner


@dataclass
class _State:
    ready: dict[Token, int] = field(default_factory=dict)
    """Ready, not yet handed out -> sub-bucket owner."""
    running: dict[Token, int] = field(default_factory=dict)
    done_by: dict[Token, int] = field(default_factory=dict)
    helpers: dict[int, set[int]] = field(default_factory=dict)
    completed: dict[int, int] = field(default_factory=dict)
    held: dict[tuple[int, int], int] = field(default_factory=dict)
    """(worker, level) -> forwards of that level whose activations the worker holds."""


class TokenServer:
    """One iteration's tokens: holds no parameters, only the DAG, the ready bucket and who did what.

    ``level_workers`` (CTD) restricts a level to a worker subset; ``shares`` splits the first
    level's tokens into the workers' sub-buckets (equal by default).
    """

    def __init__(
        self,
        dag: TokenDAG,
        workers: Sequence[int],
        policy: str = "ads+hf",
        level_workers: Mapping[int, Sequence[int]] | None = None,
        shares: Mapping[int, float] | None = None,
        pin_backward: bool = False,
        max_in_flight: Mapping[int, int] | None = None,
    ):
        if policy not in POLICIES:
            raise ValueError(f"token policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.dag = dag
        self.workers = tuple(workers)
        self.policy = policy
        self.level_workers = {lvl: tuple(ws) for lvl, ws in (level_workers or {}).items()}
        self.pin_backward = pin_backward
        self.max_in_flight = {lvl: n for lvl, n in (max_in_flight or {}).items() if n}
        self.limit_lifted = False
        self.state = _State(completed={w: 0 for w in self.workers}, helpers={w: set() for w in self.workers})
        self._assign_first_level(shares or {w: 1.0 for w in self.allowed(0)})

    def allowed(self, level: int) -> tuple[int, ...]:
        return self.level_workers.get(level, self.workers)

    def _assign_first_level(self, shares: Mapping[int, float]) -> None:
        owners = [w for w in self.allowed(0) if shares.get(w, 0) > 0]
        total = sum(shares[w] for w in owners)
        n, start, cumulative = self.dag.count(0), 0, 0.0
        for w in owners:
            cumulative += shares[w]
            end = n if w == owners[-1] else round(n * cumulative / total)
            for j in range(start, end):
                self.state.ready[Token(0, False, j)] = w
            start = end

    @property
    def finished(self) -> bool:
        return len(self.state.done_by) == 2 * sum(self.dag.count(i) for i in range(self.dag.num_levels))

    def may_run(self, worker: int, token: Token) -> bool:
        if self.pin_backward and token.backward:
            return self.state.done_by.get(Token(token.level, False, token.index)) == worker
        return worker in self.allowed(token.level)

    def locality(self, worker: int, token: Token) -> float:
        inputs = self.dag.inputs(token)
        if not inputs:
            return 0.0
        return sum(self.state.done_by.get(t) == worker for t in inputs) / len(inputs)

    def _has_room(self, worker: int, token: Token) -> bool:
        """The in-flight limit (module doc): a forward, or a backward run away from its forward,
        needs room for one more of its level's micro-batches on ``worker``."""
        limit = self.max_in_flight.get(token.level)
        if limit is None or self.limit_lifted:
            return True
        if token.backward and self.state.done_by.get(Token(token.level, False, token.index)) == worker:
            return True
        return self.state.held.get((worker, token.level), 0) < limit

    def request(self, worker: int) -> Token | None:
        """The next token for ``worker`` under the policy, or None if none is ready for it now."""
        allowed = [t for t in self.state.ready if self.may_run(worker, t)]
        mine = [t for t in allowed if self._has_room(worker, t)]
        if allowed and not mine and not self.state.running:
            self.limit_lifted, mine = True, allowed  # only the limit holds tokens back: lift it
        if not mine:
            return None
        if "hf" in self.policy:
            own = [t for t, owner in self.state.ready.items() if owner == worker and t in mine]
            if not own:
                victim = self._victim(worker, mine)
                self.state.helpers[victim].add(worker)
                own = [t for t in mine if self.state.ready[t] == victim]
            mine = own
        if "ads" in self.policy:
            token = min(mine, key=lambda t: (-self.dag.depth(t), -self.locality(worker, t), t))
        else:
            token = min(mine)
        del self.state.ready[token]
        self.state.running[token] = worker
        if not token.backward:
            self.state.held[(worker, token.level)] = self.state.held.get((worker, token.level), 0) + 1
        return token

    def _victim(self, worker: int, mine: list[Token]) -> int:
        backlog: dict[int, int] = {}
        for t in mine:
            owner = self.state.ready[t]
            backlog[owner] = backlog.get(owner, 0) + 1
        views = [
            SubBucketView(owner, n, len(self.state.helpers[owner] - {worker}), self.state.completed[owner])
            for owner, n in backlog.items()
        ]
        return choose_victim(views)

    def complete(self, worker: int, token: Token) -> list[Token]:
        """Record ``token`` done by ``worker``; returns the tokens that became ready."""
        if self.state.running.pop(token, None) != worker:
            raise ValueError(f"token {token} was not handed to worker {worker}")
        self.state.done_by[token] = worker
        self.state.completed[worker] += 1
        if token.backward and self.state.done_by.get(Token(token.level, False, token.index)) == worker:
            self.state.held[(worker, token.level)] -= 1  # its graph is freed with this backward
        newly = [t for t in self._dependents(token) if all(i in self.state.done_by for i in self.dag.inputs(t))]
        for t in newly:
            self.state.ready[t] = self._owner_of(t)
        return newly

    def _dependents(self, token: Token) -> list[Token]:
        dag, i, j = self.dag, token.level, token.index
        if not token.backward:
            if i + 1 < dag.num_levels:
                return [Token(i + 1, False, j // (dag.weights[i + 1] // dag.weights[i]))]
            return [Token(i, True, j)]
        if i == 0:
            return []
        r = dag.weights[i] // dag.weights[i - 1]
        return [Token(i - 1, True, j * r + k) for k in range(r)]

    def _owner_of(self, token: Token) -> int:
        """A new token goes to the sub-bucket of the allowed worker that produced most of its inputs
        (ties: the shorter sub-bucket, then the lower rank)."""
        if self.pin_backward and token.backward:
            return self.state.done_by[Token(token.level, False, token.index)]
        backlog = {w: 0 for w in self.workers}
        for owner in self.state.ready.values():
            backlog[owner] += 1
        return max(self.allowed(token.level), key=lambda w: (self.locality(w, token), -backlog[w], -w))
