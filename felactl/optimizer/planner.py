"""The one entry point of planning: ``make_plan(cluster, model, global_batch) -> Plan``.

What is decided jointly, by one ILP (:mod:`ilp`): the cut into stages, each stage's group of
devices (its degree and device classes), its micro-batch, and whether devices serve several
stages (tokens) or one (pipelines, with ``--sync sdpipe``). What is decomposed: devices are
grouped into classes and slots (:mod:`space`), deep models into equal-FLOP blocks; shares inside a
group follow the members' speed; for SDPipe the pipeline degree R is enumerated outside the ILP
(one solve per R); the Blink trees of each candidate group are packed before the solve and enter
the ILP as its sync cost; ``no_trees`` prices the plan's own stages with rings only (no second solve).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial

from felactl import limits
from felactl.errors import InputError, PlanDoesNotFit, PlanInfeasible
from felactl.optimizer import baselines, ilp, sharded_plans
from felactl.optimizer.cost import CostModel, MemoryHeadroom, stage_memory_bytes, stage_param_bytes
from felactl.optimizer.evaluate import StageChoice, memory_limits, predict, stage_in_flight, token_samples
from felactl.optimizer.graph import abbreviate_names
from felactl.optimizer.one_chain import as_static_pipelines, in_chain_order
from felactl.optimizer.ranks import rank_order
from felactl.optimizer.sharding import sharded_memory_bytes, sharding_hint
from felactl.optimizer.simulator import SimResult, simulate
from felactl.optimizer.space import build_space
from felactl.spec import (
    ClusterSpec,
    DeviceKind,
    ModelRef,
    ModelSpec,
    Plan,
    Prediction,
    Schedule,
    SolverInfo,
    Stage,
    StageWorker,
    SyncMode,
    SyncSpec,
    placements_from,
)
from felactl.spec.checks import tied_across_kinds
from felactl.spec.plan import SIMULATION_TOLERANCE, simulation_agrees
from felactl.spec.sync_modes import SYNC_MODE_SUPPORT, Execution, sync_support

SYNC_MODES = tuple(m.value for m in SYNC_MODE_SUPPORT)
DEFAULT_MAX_STAGES = 4
"""Most stages a plan cuts the model into unless told (``felactl plan --max-stages``)."""
DEFAULT_TIME_LIMIT_S = 30.0
"""Seconds each CBC solve may take by default: the issue's 512-GPU case proves its optimum in a
few seconds; where a larger one does not, the plan keeps the best found and records the gap."""


def check_devices(cluster: ClusterSpec, devices: Sequence[str] | None) -> tuple[str, ...]:
    """The devices to plan for, in rank order (all of the cluster's when ``devices`` is None).
    Refused (InputError) where they are both GPUs and CPU slots: a job has one backend (NCCL on
    GPUs, gloo on CPU slots), and on gloo a GPU priced at its own speed would run at a core's."""
    if devices is not None:
        unknown = [d for d in devices if not cluster.has_device(d)]
        if unknown:
            raise InputError(f"devices: no device named {unknown[0]!r} in cluster {cluster.name!r}")
        if not devices:
            raise PlanInfeasible("degree: no devices to plan for")
    names = cluster.device_names if devices is None else tuple(d for d in cluster.device_names if d in set(devices))
    gpus = [d for d in names if cluster.device(d).kind is DeviceKind.CUDA]
    if gpus and len(gpus) < len(names):
        cpus = [d for d in names if d not in set(gpus)]
        raise InputError(
            f"cluster {cluster.name!r}: the devices to plan for are GPUs ({abbreviate_names(gpus)}) and CPU "
            f"slots ({abbreviate_names(cpus)}); a job runs on one backend (NCCL on GPUs, gloo on CPU slots): "
            f"plan for one kind with --devices"
        )
    return names


def _same_stages(space, options: Sequence) -> tuple | None:
    """The options of ``space`` with the same layer range, micro-batch and group as ``options``
    (another space's solution), or None where one is missing."""

    def key(o):
        return o.choice.start, o.choice.end, o.choice.micro_batch, o.group

    index = {key(o): o for o in space.options}
    found = tuple(index.get(key(o)) for o in options)
    return None if not found or None in found else found


def _solve_best(
    cost: CostModel,
    global_batch: int,
    mode: SyncMode,
    max_stages: int,
    time_limit_s: float | None,
    lp_path: str | None,
    progress: Callable[[str], None],
    extra_micro_batches: tuple[int, ...] = (),
    warm: Sequence = (),
    unheld: bool = False,
) -> ilp.Solution:
    """As the mode's row plans it (``SyncModeSupport.planned_as``): the flexible hybrid (tokens, BSP),
    one solve; data parallel (WBSP), one stage; static pipelines (SDPipe), one solve per degree R.
    ``warm``: an earlier solution's stages to start CBC from; ``unheld``: no in-flight limit binding."""
    planned_as = sync_support(mode).planned_as
    if planned_as is Execution.DATA_PARALLEL:
        max_stages = 1
    space = build_space(cost, global_batch, max_stages=max_stages, extra_micro_batches=extra_micro_batches)
    if unheld:
        space = replace(space, options=[o for o in space.options if not o.held])
    progress(
        f"search space: {len(space.options)} stage options, {len(space.slots)} slots, "
        f"{len(space.boundaries) - 1} blocks"
    )
    if planned_as is not Execution.PIPELINE:
        return ilp.solve(space, time_limit_s=time_limit_s, lp_path=lp_path, warm=_same_stages(space, warm))
    best, last_error = None, None
    for degree in sorted({len(cost_devices(space, g)) for g in range(len(space.groups))}):
        sub = replace(space, options=[o for o in space.options if len(o.choice.devices) == degree])
        try:
            found = ilp.solve(
                sub, exclusive=True, time_limit_s=time_limit_s, lp_path=lp_path, warm=_same_stages(sub, warm)
            )
        except PlanInfeasible as exc:
            last_error = exc
            continue
        progress(f"pipelines of degree {degree}: {found.objective_s:.4g} s")
        if best is None or found.objective_s < best.objective_s:
            best = found
    if best is None:
        raise last_error or PlanInfeasible("degree: no pipeline degree fits")
    return best


def cost_devices(space, group: int) -> tuple[str, ...]:
    return tuple(d for s in space.groups[group] for d in space.slots[s].devices)


def _stage(choice: StageChoice, cost: CostModel, global_batch: int, max_stages: int) -> Stage:
    """The plan's stage of ``choice``: its workers' shares as whole tokens' samples, their memory,
    and its in-flight limit (none where it is every micro-batch of a pipeline's stage)."""
    c, model = choice, cost.model
    flight = stage_in_flight(cost, c, global_batch, max_stages)
    if c.shard:
        memory_gb = sharded_memory_bytes(model, c.start, c.end, c.micro_batch, len(c.shares)) / 1e9
    else:
        memory_gb = stage_memory_bytes(model, c.start, c.end, c.micro_batch, flight) / 1e9
    # sharded: equal shares, as the runtime splits them (sharding.equal_micro_batch_counts)
    shard_samples = {d: share * global_batch for d, share in c.shares}
    samples = shard_samples if c.shard else token_samples(c.shares, global_batch, c.micro_batch)
    workers = tuple(
        StageWorker(device=d, share=round(samples[d] / global_batch, 9), predicted_memory_gb=round(memory_gb, 4))
        for d, _ in c.shares
    )
    fix = 1.0 - sum(w.share for w in workers)
    workers = (replace(workers[0], share=workers[0].share + fix),) + workers[1:]
    unlimited = flight >= math.ceil(global_batch / c.micro_batch) and not cost.whole_model(c.start, c.end)
    return Stage(
        layer_start=c.start,
        layer_end=c.end,
        micro_batch=c.micro_batch,
        workers=workers,
        max_in_flight=None if unlimited else flight,
        shard=c.shard,
    )


def _plan_from(
    choices: Sequence[StageChoice],
    cost: CostModel,
    model: ModelSpec,
    global_batch: int,
    mode: SyncMode,
    use_trees: bool,
    max_stages: int,
) -> Plan:
    """The plan of ``choices`` (an ILP solution's stages, or a baseline's), without its prediction.
    Its ranks: in ``cost.ring_order`` where that fixes them (a baseline's cluster order, as
    torchrun numbers ranks; a live job's members), else in the order :func:`rank_order` gives."""
    stages = [_stage(c, cost, global_batch, max_stages) for c in choices]
    used = {d for c in choices for d in c.devices}
    devices = tuple(d for d in cost.cluster.device_names if d in used)
    schedule, pipelines = Schedule.TOKENS, ()
    if sync_support(mode).planned_as is Execution.PIPELINE:
        schedule = Schedule.ONE_F_ONE_B
        pipelines = tuple(zip(*(st.devices for st in stages)))
    collectives = []
    if use_trees:
        for s, st in enumerate(stages):
            coll = cost.collective(st.devices)
            # Trees only where they are no slower than the ring (the sync was priced so): the runtime
            # runs the trees it is given, and the ring (the backend's allreduce) where it has none.
            nbytes = stage_param_bytes(model, st.layer_start, st.layer_end)
            if coll is not None and cost.tree_sync_s(st.devices, nbytes) <= cost.ring_sync_s(st.devices, nbytes):
                collectives.append(replace(coll, group=f"stage{s}"))
    if cost.ring_order is not None:
        devices = tuple(d for d in cost.ring_order if d in used)
    else:
        devices = rank_order(cost, stages, {frozenset(c.devices) for c in collectives})
    return Plan(
        cluster=cost.cluster.name,
        model=ModelRef(name=model.name, source=model.source, config=model.config),
        devices=devices,
        global_batch=global_batch,
        schedule=schedule,
        sync=SyncSpec(mode=mode, use_trees=use_trees),
        stages=tuple(stages),
        pipelines=pipelines,
        collectives=tuple(collectives),
    )


def _predicted(
    plan: Plan,
    iteration_s: float,
    simulation: SimResult,
    baselines_s: dict[str, float],
    missing: dict[str, str],
) -> Prediction:
    """What a plan records of its costs: its iteration time (the cost model's), the baselines', and
    the simulator's iteration time and peak memory under it."""
    return Prediction(
        iteration_s=iteration_s,
        samples_per_s=plan.global_batch / iteration_s,
        baselines={k: round(v, 9) for k, v in baselines_s.items()},
        baselines_missing=missing,
        simulated_iteration_s=simulation.iteration_s,
        simulated_peak_memory_gb={d: round(b / 1e9, 6) for d, b in simulation.peak_memory_bytes.items()},
    )


def _checked(cluster: ClusterSpec, model: ModelSpec, global_batch: int, sync: str) -> SyncMode:
    if sync not in SYNC_MODES:
        raise InputError(f"--sync: expected one of {', '.join(SYNC_MODES)}, got {sync!r}")
    problem = limits.BATCH.problem(global_batch)
    if problem is not None:  # beyond the bound, the baselines' and the ILP's token counts never end
        raise InputError(f"global batch {problem}")
    if model.total_params == 0:
        raise PlanInfeasible(f"params: model {model.name!r} has no trainable parameter: nothing to train")
    return SyncMode(sync)


def plan_cost_model(plan: Plan, cluster: ClusterSpec, model: ModelSpec, *, use_trees: bool) -> CostModel:
    """The cost model ``plan`` is priced by, for a reader to explain or simulate it: its devices,
    the rings its rank order makes, and the tokens its sync mode claims."""
    return _cost_model(cluster.subset(plan.devices), cluster, model, plan.sync.mode, use_trees, None, plan.devices)


def make_plan(
    cluster: ClusterSpec,
    model: ModelSpec,
    global_batch: int,
    *,
    sync: str = "tokens",
    devices: Sequence[str] | None = None,
    time_limit_s: float | None = DEFAULT_TIME_LIMIT_S,
    use_trees: bool = True,
    debug_lp_path: str | None = None,
    max_stages: int = DEFAULT_MAX_STAGES,
    progress: Callable[[str], None] | None = None,
    headroom: MemoryHeadroom | None = None,
    ranks: Sequence[str] | None = None,
) -> Plan:
    """Plan ``model`` on ``cluster`` (or the ``devices`` of it) for one global batch per iteration.
    ``ranks``: the devices' rank order where it is fixed already (a live job's members keep their
    ranks when it is re-planned): the plan keeps it, and is solved and priced with the rings it
    makes; else the planner numbers the ranks (:func:`rank_order`)."""
    progress = progress or (lambda _msg: None)
    mode = _checked(cluster, model, global_batch, sync)
    use_trees = use_trees and sync_support(mode).sums_over_trees  # wbsp, sdpipe: a server, groups
    if not model.splittable:
        max_stages = 1  # no cut between its layers: data-parallel plans only
    cost = _cost_model(
        cluster.subset(check_devices(cluster, devices)), cluster, model, mode, use_trees, headroom, ranks
    )
    found, missing = baselines.baselines_and_missing(cost, global_batch)
    # The baselines' micro-batches join the searched ones, so DP itself is in the space: never worse
    # under the same sync (under sync tokens a data-parallel worker pays a claim per micro-batch
    # that the DP baseline, DDP, does not: there a plan can come out slower than DP, and says so).
    extra = tuple(sorted({b.micro_batch for b in found.values()}))
    began = time.perf_counter()
    sharded, piped = sharded_plans.candidates(cost, model, global_batch, max_stages, mode)

    def solved(bound: int) -> _Candidate:
        solve = partial(_solve_best, cost, global_batch, mode, bound, time_limit_s, debug_lp_path, progress, extra)
        return _as_simulated(solve, partial(_Candidate.of, cost, model, global_batch, mode, use_trees, bound), progress)

    try:
        chosen, max_stages = _fewest_in_flight(solved, max_stages, progress)
    except PlanInfeasible as exc:
        if sharded is None and piped is None:
            raise PlanInfeasible(f"{exc}{sharding_hint(found, missing, mode)}") from None
        chosen = None  # nothing replicated fits: sharded, it does
    solve_s = time.perf_counter() - began
    if chosen is not None and (sharded or piped) and tied_across_kinds(chosen.plan, model, cluster) is not None:
        chosen = None  # its cut puts a tied weight's copies on devices that differ; a sharded plan runs
    if piped is not None and piped.iteration_s <= min(c.iteration_s for c in (chosen, sharded, piped) if c is not None):
        progress(piped.summary())
        return _sharded_pipelines_plan(cluster, cost, piped, found, missing, solve_s)
    if sharded is not None and (chosen is None or sharded.iteration_s < chosen.iteration_s):
        progress(f"the model sharded over {len(sharded.stages[0].shares)} devices: {sharded.iteration_s:.4g} s")
        return _baseline_plan(cluster, cost, model, global_batch, sharded, found, missing, solve_s, SHARDED_SOLVER)
    return _solved_plan(cluster, cost, chosen, found, missing, global_batch, max_stages, solve_s)


def _cost_model(sub, cluster, model, mode, use_trees, headroom, ranks) -> CostModel:
    """The cost model of the devices ``sub`` of ``cluster`` (``make_plan``'s, a plan's): the tokens
    ``mode`` claims, and the rings of the rank order ``ranks`` where it is fixed."""
    return CostModel(
        sub,
        model,
        use_trees=use_trees,
        sync_reference=cluster,
        headroom=headroom or MemoryHeadroom(),
        ring_order=tuple(ranks) if ranks is not None else None,
        data_parallel_tokens=sync_support(mode).data_parallel_tokens,
    )


def _fewest_in_flight(solved: Callable[[int], _Candidate], max_stages: int, progress) -> tuple[_Candidate, int]:
    """``solved(max_stages)``, and the bound it was solved under. The ILP prices each stage's
    activations at ``max_stages`` micro-batches in flight (1F1B's first stage of that many stages
    holds that many; the tokens runtime is limited to it): where no cut fits the devices' memory so,
    one stage fewer at most holds fewer at every stage, down to 2 (a user's 1F1B chain of two
    stages, 4.6 MB a slot, was refused at 6 MB under 4)."""
    for bound in range(max_stages, 1, -1):
        try:
            return solved(bound), bound
        except PlanDoesNotFit as exc:
            if bound == 2:
                raise
            progress(f"{exc}: trying at most {bound - 1} stages, fewer micro-batches in flight")
    return solved(max_stages), max_stages  # one stage: nothing in flight to spare


def _solved_plan(
    cluster: ClusterSpec,
    cost: CostModel,
    chosen: _Candidate,
    found: dict[str, baselines.Baseline],
    missing: dict[str, str],
    global_batch: int,
    max_stages: int,
    solve_s: float,
) -> Plan:
    """The ILP's chosen candidate as the plan ``make_plan`` returns: priced, with the baselines'
    times beside it (and, where trees sync it, its own stages over rings only). Refused where it
    puts layers that read one weight on devices of two kinds (:func:`tied_across_kinds`)."""
    plan, ranked, stages, iteration_s = chosen.plan, chosen.ranked, chosen.stages, chosen.iteration_s
    problem = tied_across_kinds(plan, cost.model, cluster)
    if problem is not None:
        kinds = sorted({cluster.device(d).model for d in plan.devices})
        raise PlanInfeasible(
            f"{problem}: plan it on one kind (--devices of {' or '.join(kinds)}), or with --max-stages 1"
        )
    found_s = {name: b.iteration_s for name, b in found.items()}
    if cost.use_trees and not cost.trees_ever_faster:
        found_s["no_trees"] = iteration_s  # no stage's sync used trees: the same program
    elif cost.use_trees:
        # The plan's own stages synced over rings: priced, not solved again (a second solve doubled
        # the planner's time). The best rings-only plan could differ; this is the trees' own gain.
        found_s["no_trees"] = predict(replace(ranked, use_trees=False), stages, global_batch, max_stages).iteration_s
    prediction = _predicted(plan, iteration_s, chosen.simulation, found_s, missing)
    solution = chosen.solution
    info = SolverInfo(name="PULP_CBC_CMD", status=solution.status, solve_s=round(solve_s, 4), gap=solution.gap)
    return replace(plan, predicted=prediction, solver=info, placement=placements_from(cluster, plan.devices))


def _as_simulated(solve: Callable[..., ilp.Solution], candidate: Callable, progress: Callable[[str], None]):
    """The ILP's solution as a :class:`_Candidate`, re-ranked by the simulator where an in-flight
    limit may hold a worker back and the simulator runs it slower than priced: the cost model
    prices the limit's pace (:func:`evaluate.held_terms`), not the queues at later stages nor how
    workers then take each other's tokens, which the simulator runs. The other candidate is then
    the best plan no limit holds back (solved over the options without one); the one simulated
    faster is kept, the one whose prediction agrees where both simulate within the tolerance of
    each other (a 36-GPU plan predicted 6.99 s simulated 8.52 s, data parallel over its H100s
    8.56 s both ways)."""
    chosen = candidate(solve())
    if not chosen.held or chosen.simulation.iteration_s <= chosen.iteration_s * (1 + SIMULATION_TOLERANCE):
        return chosen
    progress(f"simulated {chosen.simulation.iteration_s:.4g} s: solving with no in-flight limit binding")
    try:
        other = candidate(solve(unheld=True))
    except PlanInfeasible:
        return chosen
    first_s, other_s = chosen.simulation.iteration_s, other.simulation.iteration_s
    if other_s < first_s or (other.agrees and simulation_agrees(first_s, other_s)):
        return other
    return chosen


@dataclass(frozen=True)
class _Candidate:
    """A solution as it will run: its stages with the in-flight limits memory needs, its plan, the
    cost model in its rank order, its predicted iteration and its simulation."""

    solution: ilp.Solution
    stages: tuple[StageChoice, ...]
    plan: Plan
    ranked: CostModel
    iteration_s: float  # the cost model's; the simulator's where it runs as static pipelines
    held: bool  # an in-flight limit binds a worker (evaluate.held_terms)
    simulation: SimResult

    @property
    def agrees(self) -> bool:
        return simulation_agrees(self.iteration_s, self.simulation.iteration_s)

    @classmethod
    def of(cls, cost, model, global_batch, mode, use_trees, max_stages, solution: ilp.Solution) -> _Candidate:
        stages = in_chain_order(cost, tuple(o.choice for o in solution.options))
        if sync_support(mode).planned_as is not Execution.PIPELINE:  # 1F1B holds its own count in flight
            stages = memory_limits(cost, stages, global_batch, max_stages)
        flexible = _plan_from(stages, cost, model, global_batch, mode, use_trees, max_stages)
        plan = as_static_pipelines(flexible, cost)
        ranked = replace(cost, ring_order=plan.devices)  # priced as it will run: its rings in its rank order
        prediction, simulation = predict(ranked, stages, global_batch, max_stages), simulate(plan, ranked)
        if plan is not flexible:  # static pipelines: predict prices the tokens runtime, the simulator 1F1B
            return cls(solution, stages, plan, ranked, simulation.iteration_s, False, simulation)
        return cls(solution, stages, plan, ranked, prediction.iteration_s, prediction.held_s > 0, simulation)


BASELINE_NAMES = ("dp", "mp", "hp", "fsdp")
SHARDED_SOLVER = "sharded"
"""The solver of a plan where the planner chose a sharded plan (:mod:`.sharded_plans`)."""


def _sharded_pipelines_plan(cluster, cost, piped, found, missing, solve_s: float) -> Plan:
    """Pipelines of sharded stages as ``make_plan`` returns them: priced by their simulation."""
    plan, sim = piped.plan, piped.simulation
    prediction = _predicted(plan, sim.iteration_s, sim, {k: b.iteration_s for k, b in found.items()}, missing)
    info = SolverInfo(name=SHARDED_SOLVER, status="Simulated", solve_s=round(solve_s, 4))
    return replace(plan, predicted=prediction, solver=info, placement=placements_from(cluster, plan.devices))


def make_baseline_plan(
    cluster: ClusterSpec,
    model: ModelSpec,
    global_batch: int,
    baseline: str,
    *,
    devices: Sequence[str] | None = None,
    headroom: MemoryHeadroom | None = None,
) -> Plan:
    """The runnable plan of one baseline (:mod:`baselines`: ``dp``, ``mp``, ``hp``): the stages
    ``make_plan`` prices it by (``felactl plan --compare``), synced as its systems do, BSP over
    rings, its ``predicted.iteration_s`` the very number ``make_plan`` records for it. Raises
    PlanInfeasible saying why where the baseline has no plan here."""
    if baseline not in BASELINE_NAMES:
        raise InputError(f"--baseline: expected one of {', '.join(BASELINE_NAMES)}, got {baseline!r}")
    _checked(cluster, model, global_batch, SyncMode.BSP.value)
    sub = cluster.subset(check_devices(cluster, devices))
    cost = baselines.rings_only(
        CostModel(sub, model, use_trees=False, sync_reference=cluster, headroom=headroom or MemoryHeadroom())
    )
    began = time.perf_counter()
    found, missing = baselines.baselines_and_missing(cost, global_batch)
    solve_s = time.perf_counter() - began
    if baseline not in found:
        raise PlanInfeasible(f"baseline {baseline}: no plan: {missing[baseline]}")
    return _baseline_plan(
        cluster, cost, model, global_batch, found[baseline], found, missing, solve_s, f"baseline:{baseline}"
    )


def _baseline_plan(
    cluster: ClusterSpec,
    cost: CostModel,
    model: ModelSpec,
    global_batch: int,
    chosen: baselines.Baseline,
    found: dict[str, baselines.Baseline],
    missing: dict[str, str],
    solve_s: float,
    solver_name: str,
) -> Plan:
    """The runnable plan of ``chosen`` (a baseline of ``found``, or the planner's shard group),
    priced by the rings it syncs over; ``solver_name`` says what chose it."""
    rings = baselines.rings_only(cost)
    plan = _plan_from(
        chosen.stages, rings, model, global_batch, SyncMode.BSP, use_trees=False, max_stages=len(chosen.stages)
    )
    prediction = _predicted(
        plan, chosen.iteration_s, simulate(plan, rings), {k: b.iteration_s for k, b in found.items()}, missing
    )
    info = SolverInfo(name=solver_name, status="Baseline", solve_s=round(solve_s, 4))
    return replace(plan, predicted=prediction, solver=info, placement=placements_from(cluster, plan.devices))
