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
                   of a stage that may follow o, ``H`` the left-hand side's largest value (``A``
                   at most the longest chain of latencies): a stage's worker held back by its
                   in-flight limit (:func:`felactl.optimizer.evaluate.predict`'s ``held``: its
                   rounds each wait for the later stages' latency, ``A[j_o]``; the earlier ones',
                   ``A[0] - A[i_o]``, bring its first input). Generated as solutions break them
                   (:func:`solve`), after leaving out the options whose least ``held`` is above
                   the best single stage's time (:func:`_without_hopeless`)
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
from dataclasses import dataclass, replace

import pulp

from felactl.errors import PlanDoesNotFit, PlanInfeasible
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
    """``Optimal``; ``near optimal``: row generation stopped within :data:`HELD_GAP` of a round's
    optimum (:func:`solve`); ``time limit``: the best plan when time or rounds ran out."""
    solve_s: float
    gap: float | None
    """``(objective - lower bound) / objective``: 0 where optimal, None where CBC stopped with no
    bound."""


def _expr(terms) -> pulp.LpAffineExpression:
    """sum of coef * var over (var, coef) pairs (a variable may repeat), built in one step: lpSum
    of products is ~5x slower, and the program is rebuilt for every solve."""
    summed: dict = {}
    for var, coef in terms:
        summed[var] = summed.get(var, 0.0) + coef
    return pulp.LpAffineExpression(list(summed.items()))


def _build(
    space: SearchSpace, exclusive: bool, rows: frozenset = frozenset()
) -> tuple[pulp.LpProblem, list, pulp.LpVariable]:
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
    _add_held(prob, space, x, t, rows)
    return prob, x, t


def _add_held(prob: pulp.LpProblem, space: SearchSpace, x: list, t: pulp.LpVariable, rows: frozenset) -> None:
    """Constraints (11)-(13) for the rows (12) ``rows`` names: (option index, profile, micro-batch
    of the next stage). ``H`` is the row's largest value, with the most latency any chain of stages
    before and after the option could add (:func:`_latency_bounds`)."""
    if not rows:
        return
    options = space.options
    before, after_most = _latency_bounds(space)
    held = [(k, p, m) + options[k].held[p][m] for k, p, m in sorted(rows)]
    cuts = {0} | {options[k].choice.start for k, *_ in held} | {options[k].choice.end for k, *_ in held}
    after, starting = {}, {}
    for c in sorted(cuts):
        after[c] = prob.add_variable(f"A_{c}", lowBound=0)
        latencies = [(var, -o.latency_s * MS) for var, o in zip(x, options) if o.choice.start >= c]
        prob += _expr(latencies + [(after[c], 1)]) == 0, f"c11_after_{c}"
    for c, m in sorted({(options[k].choice.end, m) for k, _, m, *_ in held}):
        chosen = [(var, -1) for var, o in zip(x, options) if o.choice.start == c and o.choice.micro_batch == m]
        starting[c, m] = prob.add_variable(f"Y_{c}_{m}", lowBound=0)
        prob += _expr(chosen + [(starting[c, m], 1)]) == 0, f"c13_next_{c}_{m}"
    for k, p, m, rounds, base_s in held:
        o = options[k]
        base_ms = base_s * MS
        big = base_ms + (rounds * after_most[o.choice.end] + before[o.choice.start]) * MS
        terms = [(after[o.choice.end], rounds), (after[0], 1), (after[o.choice.start], -1), (t, -1)]
        terms += [(x[k], big), (starting[o.choice.end, m], big)]
        prob += _expr(terms) <= 2 * big - base_ms, f"c12_held_{k}_{p}_{m}"


def _held_ms(space: SearchSpace, chosen: list[int]) -> dict[tuple[int, int, int], float]:
    """The value of every row (12) of the chosen options (indices, in layer order) that applies to
    them (its micro-batch is the next stage's): :func:`evaluate.predict`'s ``held``, in ms."""
    options = [space.options[k] for k in chosen]
    latencies = [o.latency_s * MS for o in options]
    values = {}
    for i, (k, o) in enumerate(zip(chosen, options)):
        if i + 1 == len(options):
            continue
        m = options[i + 1].choice.micro_batch
        for p, by_next in o.held.items():
            if m in by_next:
                rounds, base_s = by_next[m]
                values[k, p, m] = base_s * MS + rounds * sum(latencies[i + 1 :]) + sum(latencies[:i])
    return values


def _without_hopeless(space: SearchSpace) -> SearchSpace:
    """``space`` without the options whose in-flight limit alone makes any plan holding them
    slower than the best single stage (a plan of the program: its value bounds the optimum),
    with the least latency any chain of stages before and after them could add: on 24 GPUs, 573
    of 1966 options."""
    cuts = space.boundaries
    whole = [
        max(o.cost_s.values()) + o.fill_s for o in space.options if (o.choice.start, o.choice.end) == (0, cuts[-1])
    ]
    if not whole:
        return space
    best = min(whole)
    before, after = _latency_bounds(space, min)

    def least(o: StageOption) -> float:
        by_next: dict[int, float] = {}
        for held in o.held.values():
            for m, (rounds, base_s) in held.items():
                value = base_s + rounds * after[o.choice.end] + before[o.choice.start]
                by_next[m] = max(by_next.get(m, 0.0), value)
        return min(by_next.values(), default=0.0)

    kept = [o for o in space.options if not o.held or least(o) <= best * (1 + HELD_TOLERANCE)]
    return space if len(kept) == len(space.options) else replace(space, options=kept)


def _latency_bounds(space: SearchSpace, pick=max) -> tuple[dict[int, float], dict[int, float]]:
    """For each cut point c, the most (``pick=min``: the least) latency
    (:attr:`StageOption.latency_s`) a chain of stages from the first layer to c, and one from c to
    the last, can add up to (longest or shortest paths over the options: bounds of
    ``A[0] - A[c]`` and ``A[c]``)."""
    cuts = space.boundaries
    before = dict.fromkeys(cuts, 0.0)
    after = dict.fromkeys(cuts, 0.0)
    for c in cuts[1:]:  # in increasing order: every option ending at c starts before it
        before[c] = pick(
            (before[o.choice.start] + o.latency_s for o in space.options if o.choice.end == c), default=0.0
        )
    for c in reversed(cuts[:-1]):
        after[c] = pick((after[o.choice.end] + o.latency_s for o in space.options if o.choice.start == c), default=0.0)
    return before, after


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
    """The program's optimum, started from ``warm`` (options of this space) or the best single
    stage; raise PlanInfeasible naming the constraint class when nothing fits. Under a time limit
    it returns the best plan found with the gap to the proven lower bound.

    Rows (12) are generated as the solutions break them: all of them at once, big-M rows, made
    the 24-GPU search 5x slower, and few bind. Each round solves with the rows so far; where the
    chosen stages break one of theirs, every row of those stages joins and the program is solved
    again, from the best plan so far. A round's optimum is a lower bound of the program's (it
    has fewer rows), and the one that breaks none is the program's optimum; the best plan within
    :data:`HELD_GAP` of a round's optimum is kept as ``near optimal``."""
    if not space.options:
        raise _infeasible(space, exclusive)
    space = _without_hopeless(space)
    began, rows, best = time.perf_counter(), frozenset(), None
    for _ in range(MAX_ROW_ROUNDS):
        left = None if time_limit_s is None else max(MIN_ROUND_S, time_limit_s - (time.perf_counter() - began))
        chosen, objective_ms, optimal, bound_ms = _solve_rows(space, exclusive, left, lp_path, warm, rows)
        held = _held_ms(space, chosen)
        value_ms = max([objective_ms, *held.values()])
        if best is None or value_ms < best[1]:
            best = (chosen, value_ms)
        broken = {row[0] for row, v in held.items() if v > objective_ms * (1 + HELD_TOLERANCE)}
        spent = time.perf_counter() - began
        if optimal and best[1] <= objective_ms * (1 + HELD_GAP):
            status = "Optimal" if best[1] <= objective_ms * (1 + GAP_REL) else "near optimal"
            return _solution(space, best[0], best[1], status, spent, objective_ms)
        if not broken or time_limit_s is not None and spent >= time_limit_s:
            break  # the best plan so far, with the last round's lower bound
        rows |= _rows_like(space, broken)
        warm = tuple(space.options[k] for k in best[0])
    return _solution(space, best[0], best[1], "time limit", time.perf_counter() - began, bound_ms)


def _rows_like(space: SearchSpace, broken: set[int]) -> frozenset:
    """Every row (12) of the ``broken`` options and of their mirror images: options of the same
    layer range and micro-batch on as many devices whose rows are the same (twin slots cost the
    same, so with the broken option's own rows alone the next round chose its twin)."""

    def shape(o: StageOption) -> tuple:
        terms = sorted((m, r, round(b, 9)) for held in o.held.values() for m, (r, b) in held.items())
        return o.choice.start, o.choice.end, o.choice.micro_batch, len(o.choice.devices), tuple(terms)

    shapes = {shape(space.options[k]) for k in broken}
    return frozenset(
        (k, p, m)
        for k, o in enumerate(space.options)
        if o.held and shape(o) in shapes
        for p, by_next in o.held.items()
        for m in by_next
    )


MAX_ROW_ROUNDS = 20
"""Rounds of row generation at most (each adds the rows of the stages that broke one)."""
MIN_ROUND_S = 1.0
"""Seconds a round gets where the time limit is all but spent."""
HELD_GAP = 1e-3
"""Row generation stops once the best plan is within this fraction of a round's optimum (a lower
bound of the program's), as ``near optimal`` with that gap: another round of rows took the
Llama-7B-like plan on 36 GPUs from 2.6 s of CPU to 10 s for a plan 0.09% faster."""
HELD_TOLERANCE = 1e-7
"""A row (12) broken by less than this fraction of the objective is CBC's rounding."""


def _solution(space: SearchSpace, chosen: list[int], objective_ms: float, status: str, solve_s: float, bound_ms):
    options = tuple(space.options[k] for k in chosen)
    if status == "Optimal":
        return Solution(options, objective_ms / MS, status, solve_s, gap=0.0)
    gap = None if bound_ms is None else max(0.0, (objective_ms - bound_ms) / objective_ms)
    return Solution(options, objective_ms / MS, status, solve_s, gap=gap)


def _solve_rows(space: SearchSpace, exclusive: bool, time_limit_s, lp_path, warm, rows: frozenset):
    """One CBC run over the program with rows (12) ``rows``: (chosen option indices in layer
    order, objective in ms, whether proven optimal, lower bound in ms or None)."""
    prob, x, t = _build(space, exclusive, rows)
    warm_started = _warm_start(space, x, warm)
    if lp_path:
        prob.writeLP(lp_path)
    with tempfile.TemporaryDirectory(prefix="felactl-cbc-") as tmp:
        log_path = os.path.join(tmp, "cbc.log")
        solver = pulp.PULP_CBC_CMD(
            msg=False, timeLimit=time_limit_s, gapRel=GAP_REL, warmStart=warm_started, logPath=log_path
        )
        prob.solve(solver)
        with open(log_path, encoding="utf-8", errors="replace") as log:
            bound = _lower_bound(log.read())
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        raise _infeasible(space, exclusive)
    chosen = sorted(
        (k for k, var in enumerate(x) if (var.value() or 0) > 0.5), key=lambda k: space.options[k].choice.start
    )
    optimal = prob.sol_status == pulp.LpSolutionOptimal
    objective_ms = float(t.value())
    return chosen, objective_ms, optimal, objective_ms if optimal else bound


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


def _infeasible(space: SearchSpace, exclusive: bool) -> PlanInfeasible:
    """Why nothing is feasible: a part of the model, or every cut, fits no device's memory
    (:class:`PlanDoesNotFit`), or no equal pipelines can be formed."""
    covered = {c for o in space.options for c in range(o.choice.start, o.choice.end)}
    missing = [c for c in range(space.boundaries[-1]) if c not in covered]
    if missing:
        return PlanDoesNotFit(_part_that_does_not_fit(space, missing[0]))
    if exclusive:
        return PlanInfeasible(
            f"degree: the devices cannot form equal pipelines of at most {space.max_stages} stages "
            f"in which each device runs one stage within its memory, at one micro-batch size"
        )
    return PlanDoesNotFit(
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
