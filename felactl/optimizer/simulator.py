"""A discrete-event simulation of one training iteration under a plan, with optional stragglers.

Work is tokens (SEEDS.md section 1): stage s's forward token j covers samples
[j * b_s, (j + 1) * b_s); it is ready once the forward tokens of stage s - 1 covering those samples
are done; its backward token once its forward and the backward tokens of stage s + 1 covering
them are done. Devices take ready tokens of the stages they serve:

* every token is first placed in one member's sub-bucket: contiguous runs of the batch by the plan's
  shares (Fela's HF; for ``1f1b`` / ``gpipe`` this is the static pipeline's assignment);
* ``tokens``: a worker takes its own ready tokens, deepest level of the token DAG first (ADS:
  forward s has depth s, backward s depth 2K - 1 - s), then locality (it produced the inputs),
  then id; with none ready it helps: it takes a busy worker's ready token if it would finish it
  sooner than that worker could (so fast workers pull more, stragglers shed work), or if the
  in-flight limit holds that worker back (below);
* ``1f1b`` prefers backward tokens, ``gpipe`` forward ones; no helping (static pipelines).

A token's duration is its compute (cost model, times the device's slowdown) plus fetching its
inputs from the devices that produced them on the actual links (a request there, the tensor
back); the producer serves them from a thread while it computes, at no cost to its tokens (the
runtime's, :class:`~felactl.agents.worker.flexible.TensorStore`); and the runtime's own work
around each token, with a pipeline token's wait for rank 0's answer (:meth:`CostModel.claim_s`;
a static pipeline's messages to its neighbours, :meth:`CostModel.message_overhead_s`). A
backward token taken by a worker other than the one that ran its forward recomputes that forward
first (as the runtime does: the autograd graph lives where the forward ran), and the worker that
ran it keeps its activations to the iteration's end (the runtime frees them there).

**Memory.** Each device holds the weights, gradients and AdamW state of every stage it serves
and, per forward it ran, the activations autograd saves (:func:`cost.saved_bytes_per_sample`)
until that token's backward runs there. A worker takes no forward of a stage (and steals no
backward of it) while it holds ``Stage.max_in_flight`` of that stage's micro-batches: the limit
the planner's memory model assumed. Should every worker be held up by it with tokens left (a plan
the limit cannot run), the limit is lifted for the rest of the iteration and the result says so
(``in_flight_exceeded``). The result reports each device's peak memory. When a stage's last backward token is done its group allreduces
its gradients (trees or ring, as the cost model says): a barrier among the members, who join once
they have no token to run, in the order the allreduces became due. Stragglers: per-device slowdown factors, and sleeps at the iteration's start:
``roundrobin:SECONDS`` (device ``iteration mod N`` sleeps) or ``prob:P:SECONDS`` (each device
sleeps with probability P, seeded).
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field

from felactl.errors import InputError
from felactl.optimizer.cost import (
    CostModel,
    boundary_bytes_per_sample,
    saved_bytes_per_sample,
    stage_memory_bytes,
)
from felactl.optimizer.sharding import micro_batches_each, sharded_comm_s, sharded_memory_bytes
from felactl.spec import Plan, Schedule


@dataclass(frozen=True)
class Stragglers:
    slowdown: dict[str, float] = field(default_factory=dict)
    pattern: str | None = None
    """``roundrobin:SECONDS`` or ``prob:P:SECONDS``."""
    seed: int = 0
    iteration: int = 0


@dataclass(frozen=True)
class Interval:
    device: str
    start_s: float
    end_s: float
    label: str
    """``F0`` / ``B1`` (forward/backward of a stage), ``S0`` (sync), ``sleep``."""


@dataclass(frozen=True)
class SimResult:
    iteration_s: float
    intervals: tuple[Interval, ...]
    peak_memory_bytes: dict[str, float] = field(default_factory=dict)
    """Each device's peak memory in the iteration (see module doc)."""
    in_flight_exceeded: bool = False
    """Whether the limits had to be lifted to finish the iteration."""

    def busy_s(self, device: str) -> float:
        return sum(i.end_s - i.start_s for i in self.intervals if i.device == device and i.label != "sleep")


def sleeps_s(devices: tuple[str, ...], stragglers: Stragglers) -> dict[str, float]:
    """Seconds each device sleeps at the iteration's start under the straggler pattern."""
    if not stragglers.pattern:
        return {}
    parts = stragglers.pattern.split(":")
    try:
        if parts[0] == "roundrobin" and len(parts) == 2:
            return {devices[stragglers.iteration % len(devices)]: float(parts[1])}
        if parts[0] == "prob" and len(parts) == 3:
            p, seconds = float(parts[1]), float(parts[2])
            rng = random.Random(stragglers.seed * 1_000_003 + stragglers.iteration)
            return {d: seconds for d in devices if rng.random() < p}
    except ValueError:
        pass
    raise InputError(f"straggler pattern {stragglers.pattern!r}: expected roundrobin:SECONDS or prob:P:SECONDS")


@dataclass
class _Token:
    stage: int
    index: int
    backward: bool
    first: int
    last: int
    """Samples [first, last)."""
    waiting: int = 0
    producers: list = field(default_factory=list)
    device: str | None = None
    bound: str | None = None
    recompute: bool = False
    """A backward run away from its forward: the forward is run again first."""


class _Simulation:
    def __init__(self, plan: Plan, cost: CostModel, stragglers: Stragglers):
        self.plan, self.cost, self.stragglers = plan, cost, stragglers
        self.num_stages = len(plan.stages)
        self.neighbours = _pipeline_neighbours(plan)
        # Stage.devices builds a tuple per call; membership is asked millions of times on big plans.
        self.stage_members = [frozenset(stage.devices) for stage in plan.stages]
        self.events: list = []
        self.seq = 0
        self.intervals: list[Interval] = []
        self.free: dict[str, bool] = {d: True for d in plan.devices}
        self.busy_until: dict[str, float] = {d: 0.0 for d in plan.devices}
        self.ready: list[list[_Token]] = [[] for _ in range(2 * self.num_stages)]
        self.remaining_bwd = [0] * self.num_stages
        self.sync_joined: list[set] = [set() for _ in plan.stages]
        self.limit = [stage.max_in_flight or math.inf for stage in plan.stages]
        self.held: dict[tuple[str, int], int] = {}
        """(device, stage) -> forwards of that stage whose activations the device holds."""
        self.memory: dict[str, float] = {}
        self.peak: dict[str, float] = {}
        self.relaxed = False
        self._act_bytes = [
            sum(saved_bytes_per_sample(cost.model, i) for i in range(st.layer_start, st.layer_end))
            for st in plan.stages
        ]
        for st, members in zip(plan.stages, self.stage_members):
            weights = stage_memory_bytes(cost.model, st.layer_start, st.layer_end, 1, 0)
            if st.shard:  # each holds its shard and the layers it gathers (the activations come below)
                weights = sharded_memory_bytes(cost.model, st.layer_start, st.layer_end, 0, len(st.workers))
            for d in members:
                self.memory[d] = self.memory.get(d, 0.0) + weights
        self.peak = dict(self.memory)
        self.sync_order: list[int] = []
        """Stages whose allreduce is due, in the order they became due: every member joins them in
        this one order, as collectives must be issued, so two barriers never wait on each other."""
        self._make_tokens()

    def _make_tokens(self) -> None:
        batch = self.plan.global_batch
        self.fwd: list[list[_Token]] = []
        self.bwd: list[list[_Token]] = []
        for s, stage in enumerate(self.plan.stages):
            b = stage.micro_batch
            spans = [(j * b, min((j + 1) * b, batch)) for j in range((batch + b - 1) // b)]
            self.fwd.append([_Token(s, j, False, a, z) for j, (a, z) in enumerate(spans)])
            self.bwd.append([_Token(s, j, True, a, z) for j, (a, z) in enumerate(spans)])
            self.remaining_bwd[s] = len(spans)
            self._bind(stage, self.fwd[s], self.bwd[s])
        for s in range(self.num_stages):
            for tok in self.fwd[s]:
                tok.waiting = len(self._overlap(self.fwd[s - 1], tok)) if s > 0 else 0
            for tok in self.bwd[s]:
                later = self._overlap(self.bwd[s + 1], tok) if s + 1 < self.num_stages else []
                tok.waiting = 1 + len(later)
        for tok in self.fwd[0]:
            self._make_ready(tok)

    def _bind(self, stage, fwd: list[_Token], bwd: list[_Token]) -> None:
        """Put each token in one worker's sub-bucket: workers take contiguous runs of the batch,
        ``share * B`` samples each (the planner writes shares as whole tokens' samples), so a
        worker's tokens of consecutive stages cover the same samples (locality, as ADS prefers)."""
        edges, acc = [], 0.0
        for w in stage.workers:
            acc += w.share * self.plan.global_batch
            edges.append((round(acc), w.device))
        for f, b in zip(fwd, bwd):
            f.bound = b.bound = next((dev for edge, dev in edges if f.first < edge), edges[-1][1])

    @staticmethod
    def _overlap(tokens: list[_Token], tok: _Token) -> list[_Token]:
        return [t for t in tokens if t.first < tok.last and tok.first < t.last]

    def _level(self, tok: _Token) -> int:
        return 2 * self.num_stages - 1 - tok.stage if tok.backward else tok.stage

    def _make_ready(self, tok: _Token) -> None:
        self.ready[self._level(tok)].append(tok)

    def _push(self, time_s: float, kind: str, payload) -> None:
        self.seq += 1
        heapq.heappush(self.events, (time_s, self.seq, kind, payload))

    def _levels(self, device: str):
        """Token levels ``device`` serves, in the order it takes them (see module doc)."""
        levels = range(len(self.ready))
        if self.plan.schedule is Schedule.GPIPE:
            levels = sorted(levels, key=lambda lv: (lv >= self.num_stages, lv))
        else:
            levels = reversed(levels)
        for level in levels:
            stage = level if level < self.num_stages else 2 * self.num_stages - 1 - level
            if device in self.stage_members[stage]:
                yield level

    def _holds_room(self, device: str, tok: _Token) -> bool:
        """Whether ``device`` may take ``tok`` under the stage's in-flight limit: a forward, or a
        backward it would recompute, needs room for one more micro-batch."""
        if self.relaxed or (tok.backward and self.fwd[tok.stage][tok.index].device == device):
            return True
        return self.held.get((device, tok.stage), 0) < self.limit[tok.stage]

    def _hold(self, device: str, stage: int, tok: _Token, sign: int) -> None:
        self.held[(device, stage)] = self.held.get((device, stage), 0) + sign
        self.memory[device] += sign * self._act_bytes[stage] * (tok.last - tok.first)
        self.peak[device] = max(self.peak[device], self.memory[device])

    def _pick(self, device: str, now: float) -> _Token | None:
        """Its own ready tokens first (deepest level, then locality, then id); else, under token
        scheduling, help: take another worker's ready token if it finishes sooner here than there.
        Never a token the in-flight limit forbids (:meth:`_holds_room`)."""
        for level in self._levels(device):
            mine = [t for t in self.ready[level] if t.bound in (None, device) and self._holds_room(device, t)]
            if mine:
                tok = min(mine, key=lambda t: (-sum(p == device for p, _ in t.producers), t.index))
                self.ready[level].remove(tok)
                return tok
        if self.plan.schedule is not Schedule.TOKENS:
            return None
        for level in self._levels(device):
            for tok in self.ready[level]:
                owner = tok.bound
                if not self._holds_room(device, tok):
                    continue
                if not self._holds_room(owner, tok) or now + self._compute_s(tok, device) < self.busy_until[
                    owner
                ] + self._compute_s(tok, owner):
                    self.ready[level].remove(tok)
                    return tok
        return None

    def _compute_s(self, tok: _Token, device: str) -> float:
        stage = self.plan.stages[tok.stage]
        fwd_s, bwd_s = self.cost.stage_times_s(stage.layer_start, stage.layer_end, device, stage.micro_batch)
        if tok.backward and self.fwd[tok.stage][tok.index].device not in (None, device):
            bwd_s += fwd_s  # the forward is recomputed here first
        compute = (bwd_s if tok.backward else fwd_s) * (tok.last - tok.first) / stage.micro_batch
        return compute * self.stragglers.slowdown.get(device, 1.0)

    def _duration_s(self, tok: _Token, device: str) -> float:
        stage = self.plan.stages[tok.stage]
        compute = self._compute_s(tok, device)
        boundary = stage.layer_end if tok.backward else stage.layer_start
        per_sample = boundary_bytes_per_sample(self.cost.model, boundary)
        receive = 0.0
        producers = list(tok.producers)
        if tok.recompute and tok.stage > 0:  # the recomputed forward fetches its inputs again
            producers += self.fwd[tok.stage][tok.index].producers
        for producer, samples in producers:
            request_s = self.cost.link_time_s(device, producer, 0)
            receive += request_s + self.cost.link_time_s(producer, device, samples * per_sample)
        return compute + receive + self._overhead_s(tok, device)

    def _overhead_s(self, tok: _Token, device: str) -> float:
        """The runtime's work around a token it claims and its wait for the claim's answer from
        rank 0 (:meth:`CostModel.claim_s`): the simulator's forward and backward tokens of a
        stage the runtime claims as one
        (:meth:`CostModel.tokens_per_micro_batch`) are charged once, with the forward. A static
        pipeline claims nothing: each forward and backward pays its messages from and to the
        neighbouring stages (:meth:`CostModel.message_overhead_s`)."""
        stage = self.plan.stages[tok.stage]
        if self.plan.schedule is not Schedule.TOKENS and self.num_stages > 1:
            peers = self.neighbours.get((device, tok.stage), ())
            return sum(self.cost.message_overhead_s(device, peer) for peer in peers)
        claims = self.cost.tokens_per_micro_batch(stage.layer_start, stage.layer_end)
        charged = claims == 2 or (claims == 1 and not tok.backward)
        if not charged:
            return 0.0
        return self.cost.claim_s(stage.layer_start, stage.layer_end, device, server=self.plan.devices[0])

    def _dispatch(self, now: float) -> None:
        for device in self.plan.devices:
            if not self.free[device]:
                continue
            tok = self._pick(device, now)
            if tok is None:
                self._join_sync(device, now)
                continue
            self.free[device] = False
            start = now
            if not tok.backward:
                self._hold(device, tok.stage, tok, +1)
            elif self.fwd[tok.stage][tok.index].device != device:
                tok.recompute = True
                self._hold(device, tok.stage, tok, +1)
            end = start + self._duration_s(tok, device)
            self.busy_until[device] = end
            tok.device = device
            label = f"{'B' if tok.backward else 'F'}{tok.stage}"
            self.intervals.append(Interval(device, start, end, label))
            self._push(end, "token", tok)

    def _sync_s(self, stage, device: str) -> float:
        """What of a stage's sum the group waits for after the last backward: a sharded stage's
        gathers and reduce-scatter (:mod:`~felactl.optimizer.sharding`: none of it hidden)."""
        if stage.shard:
            count = micro_batches_each(self.plan.global_batch, len(stage.workers), stage.micro_batch)
            return sharded_comm_s(self.cost, stage.devices, stage.layer_start, stage.layer_end, count)
        return self.cost.exposed_sync_s(stage.devices, stage.layer_start, stage.layer_end, device, stage.micro_batch)

    def _join_sync(self, device: str, now: float) -> bool:
        for s in self.sync_order:
            stage = self.plan.stages[s]
            if device in stage.devices and device not in self.sync_joined[s]:
                self.sync_joined[s].add(device)
                self.free[device] = False
                self.busy_until[device] = math.inf
                if len(self.sync_joined[s]) == len(stage.workers):
                    # The last to join ended its backward last: what of the sum its backward
                    # did not hide is what the group waits for.
                    end = now + self._sync_s(stage, device)
                    for member in stage.devices:
                        self.intervals.append(Interval(member, now, end, f"S{s}"))
                        self.busy_until[member] = end
                    self._push(end, "sync", s)
                return True
        return False

    def _finish(self, tok: _Token) -> None:
        self.free[tok.device] = True
        s = tok.stage
        if tok.backward and (tok.recompute or self.fwd[s][tok.index].device == tok.device):
            self._hold(tok.device, s, tok, -1)  # the graph it kept (or rebuilt) for this backward
        if not tok.backward:
            followers = self._overlap(self.fwd[s + 1], tok) if s + 1 < self.num_stages else []
            followers.append(self.bwd[s][tok.index])
        else:
            followers = self._overlap(self.bwd[s - 1], tok) if s > 0 else []
            self.remaining_bwd[s] -= 1
            if self.remaining_bwd[s] == 0 and len(self.plan.stages[s].workers) > 1:
                self.sync_order.append(s)
        for nxt in followers:
            if nxt.stage != s:
                shared = min(nxt.last, tok.last) - max(nxt.first, tok.first)
                nxt.producers.append((tok.device, shared))
            nxt.waiting -= 1
            if nxt.waiting == 0:
                self._make_ready(nxt)

    def run(self, sleeps: dict[str, float]) -> SimResult:
        for device, seconds in sleeps.items():
            self.free[device] = False
            self.intervals.append(Interval(device, 0.0, seconds, "sleep"))
            self.busy_until[device] = seconds
            self._push(seconds, "wake", device)
        self._dispatch(0.0)
        now = 0.0
        while self.events or not self.relaxed and self._stalled():
            if not self.events:  # every worker is held up by the in-flight limit: lift it (module doc)
                self.relaxed = True
                self._dispatch(now)
                continue
            now, _, kind, payload = heapq.heappop(self.events)
            if kind == "token":
                self._finish(payload)
            elif kind == "wake":
                self.free[payload] = True
            else:
                for member in self.plan.stages[payload].devices:
                    self.free[member] = True
                    self.busy_until[member] = now
            self._dispatch(now)
        self._optimizer_steps()
        end = max((i.end_s for i in self.intervals), default=0.0)
        return SimResult(
            iteration_s=end,
            intervals=tuple(self.intervals),
            peak_memory_bytes=dict(self.peak),
            in_flight_exceeded=self.relaxed,
        )

    def _stalled(self) -> bool:
        """Tokens are left, but nothing runs: only the in-flight limit can hold them up."""
        return any(self.ready) or any(n > 0 for n in self.remaining_bwd)

    def _optimizer_steps(self) -> None:
        """Each device steps the optimizer of every stage it serves once its last work is done
        (the same term :func:`felactl.optimizer.evaluate.predict` charges)."""
        for device in self.plan.devices:
            step_s = sum(
                self.cost.optimizer_step_s(st.layer_start, st.layer_end, device)
                for st, members in zip(self.plan.stages, self.stage_members)
                if device in members
            )
            if step_s > 0:
                done = max((i.end_s for i in self.intervals if i.device == device), default=0.0)
                self.intervals.append(Interval(device, done, done + step_s, "O"))


def _pipeline_neighbours(plan: Plan) -> dict[tuple[str, int], tuple[str, ...]]:
    """A static plan's (device, stage) -> the devices of its pipeline's stages before and after."""
    found = {}
    for pipe in plan.pipelines:
        for s, device in enumerate(pipe):
            found[(device, s)] = tuple(pipe[t] for t in (s - 1, s + 1) if 0 <= t < len(pipe))
    return found


def simulate(plan: Plan, cost: CostModel, stragglers: Stragglers | None = None) -> SimResult:
    """Simulate one iteration of ``plan`` with the cost model's cluster and model."""
    stragglers = stragglers or Stragglers()
    sim = _Simulation(plan, cost, stragglers)
    return sim.run(sleeps_s(plan.devices, stragglers))
