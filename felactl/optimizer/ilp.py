"""The planner's integer program (PuLP + CBC) over the shared search space.

Notation (see :mod:`felactl.optimizer.space` and :mod:`felactl.optimizer.evaluate`):

Sets
    ``C``  cut points 0 = c_0 < c_1 < ... < c_n = L (layers or equal-FLOP blocks)
    ``O``  stage options o = (layer range [i_o, j_o) between two cut points, micro-batch b_o,
           group g_o of slots); ``O(p)`` the options whose group holds profile ``p``; ``O(u)`` those
           holding slot ``u``
    ``P``  device profiles (devices of one slot with identical costs); ``U`` slots

Data
    ``cost[o, p]``  seconds a device of profile p spends on option o per iteration (its share of
                    compute + boundary exchange, plus the group's gradient allreduce)
    ``mem[o, u]``   bytes a device of slot u holds for option o; ``M[u]`` its capacity
    ``fill[o]``     pipeline fill of o (0 for a first stage)
    ``lat[o]``      one micro-batch through o (:func:`felactl.optimizer.evaluate.stage_latency_s`)
    ``rounds[o, p, m]``, ``base[o, p, m]``  the terms of o's in-flight limit on profile p, where it
                    binds, followed by a stage of micro-batch m (:func:`felactl.optimizer.evaluate.held_terms`)
    ``K``           most stages

Variables
    ``x[o]`` in {0, 1}: option o is a stage of the plan;  ``T >= 0``: iteration time;
    ``A[c] >= 0`` for cut points c: the latency of the stages from c on (``A[0]``: all of them);
    ``Y[c, m] >= 0``: a stage of micro-batch m starts at cut c

Objective
    minimise ``T``

Constraints
    (1) start:     sum_{o: i_o = 0} x[o] = 1                          (the first layer is covered)
    (2) flow:      sum_{o: j_o = c} x[o] = sum_{o: i_o = c} x[o]     for every inner cut point c
                   (stages are consecutive: one ending at c means one starting at c)
    (3) stages:    sum_o x[o] <= K
    (4) memory:    sum_{o in O(u)} mem[o, u] x[o] <= M[u]             for every slot u
    (5) time:      sum_{o in O(p)} cost[o, p] x[o] + sum_o fill[o] x[o] <= T   for every profile p
    (6) exclusive: sum_{o in O(u)} x[o] <= 1  for every slot u       (only for static pipelines)
    (7) block:     sum_{o: i_o <= c < j_o} maxcost[o] x[o] + sum_o fill[o] x[o] <= T
                   for every block [c, c') between consecutive cut points, maxcost[o] = max_p cost[o, p]
    (8) twins:     sum_{p in left} load[p] >= sum_{p in right} load[p]  for every pair of twin blocks
                   (:meth:`SearchSpace.twin_blocks`), load[p] the left-hand sum of (5) without fill
    (9) chain:     sum_{o: i_o = c, b_o = m} x[o] <= sum_{o: j_o = c, follows(b_o, m)} x[o]
                   for every inner cut c and micro-batch m: the runtime can run a stage of
                   micro-batch m only after one it may follow (a divisor of m with tokens, m itself
                   in static pipelines: :func:`felactl.spec.executable.micro_batch_follows`), at
                   most its in-flight limit times smaller (:func:`evaluate.chain_follows`: so the
                   memory the model gives each stage holds under the schedule that runs)
    (10) tokens:   sum_{o: j_o = L, i_o > 0, b_o = m} x[o] <= sum_{o: i_o = 0, holds(o, m)} x[o]
                   for every micro-batch m of a last stage (tokens only): the first stage's tokens,
                   rounded up to whole last-stage tokens, each get a sample
                   (:func:`felactl.spec.executable.tokens_hold_samples`)
    (11) after:    A[c] = sum_{o: i_o >= c} lat[o] x[o]               for every cut point c (12) names
    (12) held:     base[o, p, m] + rounds[o, p, m] A[j_o] + A[0] - A[i_o] - T
                       <= H[o, p, m] (2 - x[o] - Y[j_o, m])
                   for every option o, profile p where o's in-flight limit binds and micro-batch m
                   of a stage that may follow o, ``H`` the left-hand side's largest value (``A`` at
                   most the K largest latencies): a stage's worker held back by its in-flight limit
                   (:func:`felactl.optimizer.evaluate.predict`'s ``held``: its rounds each wait for
                   the later stages' latency, ``A[j_o]``; the earlier ones', ``A[0] - A[i_o]``,
                   bring its first input)
    (13) next:     Y[c, m] = sum_{o: i_o = c, b_o = m} x[o]            for every (c, m) (12) names

(1)-(2) make the chosen options a path from layer 0 to layer L, so the last layer is covered too;
on it exactly one stage ends at each cut where one starts, and one starts at 0, which is why (9)
and (10) need only one constraint per micro-batch instead of one per pair of options.
The stage cut, each stage's group (its degree and which device classes), its micro-batch, and
whether devices serve several stages or one are chosen jointly; the shares within a group are
proportional to the members' speed (what token pulling converges to), which keeps the program
linear. T equals :func:`felactl.optimizer.evaluate.predict` of the chosen stages.

(7) and (8) cut off no optimum; they are there for CBC's speed. (7) is valid because exactly one
chosen stage covers each block and its busiest member waits at least ``maxcost`` plus the fill;
without it the LP relaxation splits each block over disjoint groups (half on the A100s, half on
the T4s), each carrying half the load, and its bound is far below any plan (39% on a 48-layer
model over 24 GPUs; 7% with it). (8) breaks symmetry: twin blocks are slot blocks whose swap maps
the space onto itself with equal costs, so every plan has a mirror image of equal time in which
the left block carries at least the right one's load; processed from the largest blocks down,
the swaps that establish this never undo one another, so all (8) hold at once for some optimum
(equal means within ``space.TWIN_TOLERANCE``).
Without it CBC explores every mirror image of a plan (64 x 8 GPUs: > 60 s; with it: ~5 s).
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from dataclasses import dataclass

import pulp

from felactl.errors import PlanInfeasible
from felactl.optimizer.cost import stage_memory_bytes
from felactl.optimizer.evaluate import chain_follows, in_flight
from felactl.optimizer.space import SearchSpace, StageOption
from felactl.spec.executable import tokens_hold_samples

MS = 1e3
"""The program counts time in milliseconds: CBC's tolerances (~1e-7) are absolute, and iterations
of a few milliseconds in seconds would sit close to them."""

GAP_REL = 1e-6
"""CBC stops once its incumbent is within this fraction of its lower bound: optimal in practice."""


@dataclass(frozen=True)
class Solution:
    options: tuple[StageOption, ...]
    """The chosen stages in layer order."""
    objective_s: float
    status: str
    solve_s: float
    gap: float | None


def _expr(terms) -> pulp.LpAffineExpression:
    """sum of coef * var over (var, coef) pairs (a variable may repeat), built in one step: lpSum
    of products is ~5x slower, and the program is rebuilt for every solve."""
    summed: dict = {}
    for var, coef in terms:
        summed[var] = summed.get(var, 0.0) + coef
    return pulp.LpAffineExpression(list(summed.items()))


def _build(space: SearchSpace, exclusive: bool) -> tuple[pulp.LpProblem, list, pulp.LpVariable]:
    prob = pulp.LpProblem("felactl_plan", pulp.LpMinimize)
    options = space.options
    x = [prob.add_variable(f"x_{k}", cat=pulp.LpBinary) for k in range(len(options))]
    t = prob.add_variable("T", lowBound=0)
    prob += t
    starts: dict[int, list] = {}
    ends: dict[int, list] = {}
    for var, opt in zip(x, options):
        starts.setdefault(opt.choice.start, []).append((var, 1))
        ends.setdefault(opt.choice.end, []).append((var, -1))
    prob += _expr(starts.get(0, [])) == 1, "c1_start"
    for c in space.boundaries[1:-1]:
        prob += _expr(ends.get(c, []) + starts.get(c, [])) == 0, f"c2_flow_{c}"
    prob += _expr((var, 1) for var in x) <= space.max_stages, "c3_stages"
    fill = [(var, opt.fill_s * MS) for var, opt in zip(x, options) if opt.fill_s > 0]
    held: dict[int, list] = {}
    busy: dict[int, list] = {}
    for var, opt in zip(x, options):
        for u, num_bytes in opt.memory_bytes.items():
            held.setdefault(u, []).append((var, num_bytes / 1e9))
        for p, cost_s in opt.cost_s.items():
            busy.setdefault(p, []).append((var, cost_s * MS))
    for u, slot in enumerate(space.slots):
        if u in held:
            prob += _expr(held[u]) <= slot.memory_bytes / 1e9, f"c4_memory_{u}"
        if exclusive and u in held:
            prob += _expr((var, 1) for var, _ in held[u]) <= 1, f"c6_exclusive_{u}"
    for p in range(len(space.profiles)):
        prob += _expr(busy.get(p, []) + fill + [(t, -1)]) <= 0, f"c5_time_{p}"
    for lo, hi in zip(space.boundaries, space.boundaries[1:]):
        covering = [
            (var, max(opt.cost_s.values()) * MS)
            for var, opt in zip(x, options)
            if opt.choice.start <= lo and hi <= opt.choice.end
        ]
        prob += _expr(covering + fill + [(t, -1)]) <= 0, f"c7_block_{lo}"
    for k, (left, right) in enumerate(space.twin_blocks()):
        terms = [pair for p in left for pair in busy.get(p, [])]
        terms += [(var, -coef) for p in right for var, coef in busy.get(p, [])]
        prob += _expr(terms) >= 0, f"c8_twins_{k}"
    _add_executable(prob, space, x, exclusive)
    _add_held(prob, space, x, t)
    return prob, x, t


def _add_held(prob: pulp.LpProblem, space: SearchSpace, x: list, t: pulp.LpVariable) -> None:
    """Constraints (11)-(13): the pace of a worker its in-flight limit holds back."""
    options = space.options
    held = [(var, o) for var, o in zip(x, options) if o.held]
    if not held:
        return
    after, starting = {}, {}
    for c in sorted({0} | {o.choice.start for _, o in held} | {o.choice.end for _, o in held}):
        after[c] = prob.add_variable(f"A_{c}", lowBound=0)
        latencies = [(var, -o.latency_s * MS) for var, o in zip(x, options) if o.choice.start >= c]
        prob += _expr(latencies + [(after[c], 1)]) == 0, f"c11_after_{c}"
    for c, m in sorted({(o.choice.end, m) for _, o in held for by_next in o.held.values() for m in by_next}):
        chosen = [(var, -1) for var, o in zip(x, options) if o.choice.start == c and o.choice.micro_batch == m]
        if chosen:
            starting[c, m] = prob.add_variable(f"Y_{c}_{m}", lowBound=0)
            prob += _expr(chosen + [(starting[c, m], 1)]) == 0, f"c13_next_{c}_{m}"
    most = sum(sorted((o.latency_s * MS for o in options), reverse=True)[: space.max_stages])
    for k, (var, o) in enumerate(held):
        for p, by_next in o.held.items():
            for m, (rounds, base_s) in by_next.items():
                if (o.choice.end, m) not in starting:
                    continue  # no stage of micro-batch m can follow
                base_ms = base_s * MS
                big = base_ms + (rounds + 1) * most
                terms = [(after[o.choice.end], rounds), (after[0], 1), (after[o.choice.start], -1), (t, -1)]
                terms += [(var, big), (starting[o.choice.end, m], big)]
                prob += _expr(terms) <= 2 * big - base_ms, f"c12_held_{k}_{p}_{m}"


def _add_executable(prob: pulp.LpProblem, space: SearchSpace, x: list, exclusive: bool) -> None:
    """Constraints (9) and (10): only plans the runtime can execute (static pipelines when exclusive)."""
    options = space.options
    last = space.boundaries[-1]
    for c in space.boundaries[1:-1]:
        ending = [(var, o) for var, o in zip(x, options) if o.choice.end == c]
        starting = [(var, o) for var, o in zip(x, options) if o.choice.start == c]
        for m in sorted({o.choice.micro_batch for _, o in starting}):
            follows = [
                (var, -1)
                for var, o in ending
                if chain_follows(o.choice.micro_batch, m, space.max_stages, space.global_batch, static=exclusive)
            ]
            prob += (
                _expr([(var, 1) for var, o in starting if o.choice.micro_batch == m] + follows) <= 0,
                f"c9_chain_{c}_{m}",
            )
    if exclusive:
        return
    first = [(var, o) for var, o in zip(x, options) if o.choice.start == 0]
    ending_last = [(var, o) for var, o in zip(x, options) if o.choice.end == last and o.choice.start > 0]
    for m in sorted({o.choice.micro_batch for _, o in ending_last}):
        holds = [
            (var, -1)
            for var, o in first
            if tokens_hold_samples(space.global_batch, o.choice.micro_batch, len(o.choice.devices), m)
        ]
        prob += _expr([(var, 1) for var, o in ending_last if o.choice.micro_batch == m] + holds) <= 0, f"c10_tokens_{m}"


def solve(
    space: SearchSpace,
    *,
    exclusive: bool = False,
    time_limit_s: float | None = None,
    lp_path: str | None = None,
    warm: tuple[StageOption, ...] | None = None,
) -> Solution:
    """One CBC run, started from ``warm`` (options of this space) or the best single stage; raise
    PlanInfeasible naming the constraint class when nothing fits. Under a time limit it returns
    the best plan found with CBC's gap to its proven lower bound."""
    if not space.options:
        raise PlanInfeasible(_infeasible_reason(space, exclusive))
    prob, x, t = _build(space, exclusive)
    warm_started = _warm_start(space, x, warm)
    if lp_path:
        prob.writeLP(lp_path)
    with tempfile.TemporaryDirectory(prefix="felactl-cbc-") as tmp:
        log_path = os.path.join(tmp, "cbc.log")
        solver = pulp.PULP_CBC_CMD(
            msg=False, timeLimit=time_limit_s, gapRel=GAP_REL, warmStart=warm_started, logPath=log_path
        )
        began = time.perf_counter()
        prob.solve(solver)
        solve_s = time.perf_counter() - began
        with open(log_path, encoding="utf-8", errors="replace") as log:
            bound = _lower_bound(log.read())
    has_solution = prob.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
    if not has_solution:
        raise PlanInfeasible(_infeasible_reason(space, exclusive))
    chosen = sorted(
        (opt for var, opt in zip(x, space.options) if (var.value() or 0) > 0.5), key=lambda o: o.choice.start
    )
    objective_s = float(t.value()) / MS
    if prob.sol_status == pulp.LpSolutionOptimal:
        return Solution(tuple(chosen), objective_s, pulp.LpStatus[prob.status], solve_s, gap=0.0)
    gap = None if bound is None else max(0.0, (objective_s - bound / MS) / objective_s)
    return Solution(tuple(chosen), objective_s, "time limit", solve_s, gap=gap)


def _lower_bound(log: str) -> float | None:
    """CBC's proven lower bound (in the program's units) from its log, where it stopped early."""
    found = re.search(r"^Lower bound:\s+(\S+)", log, flags=re.MULTILINE)
    try:
        return float(found.group(1)) if found else None
    except ValueError:
        return None


def _warm_start(space: SearchSpace, x: list, warm: tuple[StageOption, ...] | None) -> bool:
    """Start CBC from ``warm`` (options of this space), else from the best single-stage plan
    (data parallel over some group) if one fits: a good incumbent lets it prune most of the tree."""
    if warm:
        chosen = {id(o) for o in warm}
    else:
        whole = [
            (max(o.cost_s.values()), k)
            for k, o in enumerate(space.options)
            if o.choice.start == 0 and o.choice.end == space.boundaries[-1]
        ]
        if not whole:
            return False
        chosen = {id(space.options[min(whole)[1]])}
    for var, opt in zip(x, space.options):
        var.setInitialValue(1 if id(opt) in chosen else 0)
    return True


def _infeasible_reason(space: SearchSpace, exclusive: bool) -> str:
    covered = {c for o in space.options for c in range(o.choice.start, o.choice.end)}
    missing = [c for c in range(space.boundaries[-1]) if c not in covered]
    if missing:
        return _part_that_does_not_fit(space, missing[0])
    if exclusive:
        return (
            f"degree: the devices cannot form equal pipelines of at most {space.max_stages} stages "
            f"in which each device runs one stage within its memory, at one micro-batch size"
        )
    return (
        f"memory: no cut of the model into at most {space.max_stages} stages fits the devices' "
        f"usable memory (largest {max(s.memory_bytes for s in space.slots) / 1e9:.3g} GB) with micro-batches "
        f"the runtime can chain (each stage's a multiple of the one before, every token holding a sample)"
    )


def _part_that_does_not_fit(space: SearchSpace, layer_index: int) -> str:
    """Name what fits on no device: the layer of the uncovered block that needs the most where it
    alone does not fit, else the block (the planner does not cut inside blocks), with the GB each
    needs at micro-batch 1 (parameters, gradients, AdamW state, the micro-batches in flight)."""
    model = space.cost.model
    start = max(c for c in space.boundaries if c <= layer_index)
    end = min(c for c in space.boundaries if c > layer_index)
    largest_gb = max(s.memory_bytes for s in space.slots) / 1e9

    def need_gb(first: int, last: int) -> tuple[float, int]:
        flight = in_flight(space.max_stages, space.global_batch, 1, whole_model=(first, last) == (0, model.num_layers))
        return stage_memory_bytes(model, first, last, 1, flight) / 1e9, flight

    (worst_gb, flight), worst = max((need_gb(i, i + 1), i) for i in range(start, end))
    if worst_gb > largest_gb or end - start == 1:
        part = f"layer {worst} ({model.layers[worst].name!r}) fits"
    else:
        (worst_gb, flight) = need_gb(start, end)
        part = (
            f"layers {start}-{end - 1} ({model.layers[start].name!r}..{model.layers[end - 1].name!r}), one block "
            f"the planner does not cut, fit"
        )
    return (
        f"memory: {part} on no device: {worst_gb:.3g} GB at micro-batch 1 ({flight} in flight) with parameters, "
        f"gradients and AdamW state; the largest device has {largest_gb:.3g} GB usable (its memory less the "
        f"headroom for the CUDA context and fragmentation)"
    )
