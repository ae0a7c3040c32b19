"""The one entry point of planning: ``make_plan(cluster, model, global_batch) -> Plan``.

What is decided jointly, by one ILP (:mod:`ilp`): the cut into stages, each stage's group of
devices (its degree and device classes), its micro-batch, and whether devices serve several
stages (tokens) or one (pipelines, with ``--sync sdpipe``). What is decomposed: devices are
grouped into classes and slots (:mod:`space`), deep models into equal-FLOP blocks; shares inside a
group follow the members' speed; for SDPipe the pipeline degree R is enumerated outside the ILP
(one solve per R); the Blink trees of each candidate group are packed before the solve and enter
the ILP as its sync cost; ``no_trees`` is a second solve with rings only.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable, Sequence

from felactl.errors import InputError, PlanInfeasible
from felactl.optimizer import baselines, ilp
from felactl.optimizer.cost import CostModel
from felactl.optimizer.evaluate import predict, token_samples
from felactl.optimizer.simulator import simulate
from felactl.optimizer.space import build_space
from felactl.spec import (ClusterSpec, placements_from, ModelRef, ModelSpec, Plan, Prediction, Schedule, SolverInfo, Stage,
                          StageWorker, SyncMode, SyncSpec)

SYNC_MODES = tuple(m.value for m in SyncMode)
DEFAULT_TIME_LIMIT_S = 30.0
"""Seconds each CBC solve may take by default: the issue's 512-GPU case proves its optimum in a
few seconds; where a larger one does not, the plan keeps the best found and records the gap."""


def check_devices(cluster: ClusterSpec, devices: Sequence[str] | None) -> tuple[str, ...]:
    """The devices to plan for, in rank order (all of the cluster's when ``devices`` is None)."""
    if devices is None:
        return cluster.device_names
    unknown = [d for d in devices if not cluster.has_device(d)]
    if unknown:
        raise InputError(f"devices: no device named {unknown[0]!r} in cluster {cluster.name!r}")
    if not devices:
        raise PlanInfeasible("degree: no devices to plan for")
    return tuple(d for d in cluster.device_names if d in set(devices))


def _same_stages(space, options: Sequence) -> tuple | None:
    """The options of ``space`` with the same layer range, micro-batch and group as ``options``
    (another space's solution), or None where one is missing."""
    def key(o):
        return o.choice.start, o.choice.end, o.choice.micro_batch, o.group

    index = {key(o): o for o in space.options}
    found = tuple(index.get(key(o)) for o in options)
    return None if not found or None in found else found


def _solve_best(cost: CostModel, global_batch: int, mode: SyncMode, max_stages: int, time_limit_s: float | None,
                lp_path: str | None, progress: Callable[[str], None],
                extra_micro_batches: tuple[int, ...] = (), warm: Sequence = ()) -> ilp.Solution:
    """Tokens/BSP: one solve. WBSP: one stage. SDPipe: one solve per pipeline degree R. ``warm``:
    stages of an earlier solution (of another cost model) to start CBC from where they exist."""
    if mode is SyncMode.WBSP:
        max_stages = 1
    space = build_space(cost, global_batch, max_stages=max_stages, extra_micro_batches=extra_micro_batches)
    progress(f"search space: {len(space.options)} stage options, {len(space.slots)} slots, "
             f"{len(space.boundaries) - 1} blocks")
    if mode is not SyncMode.SDPIPE:
        return ilp.solve(space, time_limit_s=time_limit_s, lp_path=lp_path, warm=_same_stages(space, warm))
    best, last_error = None, None
    for degree in sorted({len(cost_devices(space, g)) for g in range(len(space.groups))}):
        sub = replace(space, options=[o for o in space.options if len(o.choice.devices) == degree])
        try:
            found = ilp.solve(sub, exclusive=True, time_limit_s=time_limit_s, lp_path=lp_path,
                              warm=_same_stages(sub, warm))
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


def _plan_from(solution: ilp.Solution, cost: CostModel, model: ModelSpec, global_batch: int, mode: SyncMode,
               use_trees: bool) -> Plan:
    stages, used = [], set()
    for opt in solution.options:
        c = opt.choice
        memory_gb = max(opt.memory_bytes.values()) / 1e9
        samples = token_samples(c.shares, global_batch, c.micro_batch)
        workers = tuple(StageWorker(device=d, share=round(samples[d] / global_batch, 9),
                                    predicted_memory_gb=round(memory_gb, 4)) for d, _ in c.shares)
        fix = 1.0 - sum(w.share for w in workers)
        workers = (replace(workers[0], share=workers[0].share + fix),) + workers[1:]
        stages.append(Stage(layer_start=c.start, layer_end=c.end, micro_batch=c.micro_batch, workers=workers))
        used.update(c.devices)
    devices = tuple(d for d in cost.cluster.device_names if d in used)
    schedule, pipelines = Schedule.TOKENS, ()
    if mode is SyncMode.SDPIPE:
        schedule = Schedule.ONE_F_ONE_B
        pipelines = tuple(zip(*(st.devices for st in stages)))
    collectives = []
    if use_trees:
        for s, st in enumerate(stages):
            coll = cost.collective(st.devices)
            if coll is not None:
                collectives.append(replace(coll, group=f"stage{s}"))
    return Plan(cluster=cost.cluster.name, model=ModelRef(name=model.name, source=model.source, config=model.config),
                devices=devices, global_batch=global_batch, schedule=schedule,
                sync=SyncSpec(mode=mode, use_trees=use_trees), stages=tuple(stages), pipelines=pipelines,
                collectives=tuple(collectives))


def make_plan(cluster: ClusterSpec, model: ModelSpec, global_batch: int, *, sync: str = "tokens",
              devices: Sequence[str] | None = None, time_limit_s: float | None = DEFAULT_TIME_LIMIT_S,
              use_trees: bool = True,
              debug_lp_path: str | None = None, max_stages: int = 4,
              progress: Callable[[str], None] | None = None) -> Plan:
    """Plan ``model`` on ``cluster`` (or the ``devices`` of it) for one global batch per iteration."""
    progress = progress or (lambda _msg: None)
    if sync not in SYNC_MODES:
        raise InputError(f"--sync: expected one of {', '.join(SYNC_MODES)}, got {sync!r}")
    if global_batch < 1:
        raise PlanInfeasible(f"batch split: the global batch must be at least 1 sample, got {global_batch}")
    mode = SyncMode(sync)
    sub = cluster.subset(check_devices(cluster, devices))
    cost = CostModel(sub, model, use_trees=use_trees, sync_reference=cluster)
    found = baselines.baselines(cost, global_batch)
    # The baselines' micro-batches join the searched ones, so DP itself is in the space: never worse.
    extra = tuple(sorted({b for _, b in found.values()}))
    began = time.perf_counter()
    solution = _solve_best(cost, global_batch, mode, max_stages, time_limit_s, debug_lp_path, progress, extra)
    solve_s = time.perf_counter() - began
    plan = _plan_from(solution, cost, model, global_batch, mode, use_trees)
    stages = tuple(o.choice for o in solution.options)
    iteration_s = predict(cost, stages, global_batch, max_stages).iteration_s
    found_s = {name: t for name, (t, _) in found.items()}
    if use_trees and not cost.trees_ever_faster:
        found_s["no_trees"] = solution.objective_s  # no stage's sync used trees: the same program
    elif use_trees:
        progress("re-solving with rings only (no_trees baseline)")
        rings = replace(cost, use_trees=False)
        # The plan found with trees is a plan with rings too: CBC starts from it.
        found_s["no_trees"] = _solve_best(rings, global_batch, mode, max_stages, time_limit_s, None,
                                          progress, extra, warm=solution.options).objective_s
    simulated = simulate(plan, cost).iteration_s
    prediction = Prediction(iteration_s=iteration_s, samples_per_s=global_batch / iteration_s,
                            baselines={k: round(v, 9) for k, v in found_s.items()}, simulated_iteration_s=simulated)
    info = SolverInfo(name="PULP_CBC_CMD", status=solution.status, solve_s=round(solve_s, 4), gap=solution.gap)
    return replace(plan, predicted=prediction, solver=info, placement=placements_from(cluster, plan.devices))
