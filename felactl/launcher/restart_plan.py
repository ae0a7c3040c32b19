"""The plan a job that cannot rescale live restarts on when ``felactl scale`` changes its workers
(:mod:`felactl.launcher.restarts` drains it, then starts every worker on this plan from the
checkpoint the drain wrote, re-split to the new stages by the user's parameter names).

Pure: which devices a scale command leaves the job with (:func:`devices_after`), and the plan for
them (:func:`plan_for_devices`): the planner on the run's profiles where the run kept them
(``felactl launch --cluster C --model M``), free to choose any stages; else the launched plan's
own shape on the new devices: its stages and cuts, as many pipelines as the devices make (a
multiple of its stages), or its one sharded stage over all of them.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

from felactl.errors import InputError, PlanInfeasible
from felactl.launcher.scale_plan import place_devices
from felactl.spec import ClusterSpec, ModelSpec, Plan, Stage, StageWorker
from felactl.spec.executable import check_executable
from felactl.spec.stages import placements_from

REPLAN_TIME_LIMIT_S = 10.0
"""The planner's time on a rescale: the job is drained and waits for it."""


def devices_after(
    command: dict,
    plan: Plan,
    nodes: Mapping[str, str],
    capacity: Mapping[str, int],
    profile: Mapping[str, tuple[str, ...]] | None,
) -> tuple[list[str], dict[str, str]]:
    """The devices (rank order, grouped by node) and their nodes after ``command`` (a ``felactl
    scale`` request: ``add`` ``count`` on ``node``, ``remove`` ``ranks``, or ``to`` ``count``).
    ``nodes``: each device's node now; ``capacity``: the workers each node may run; ``profile``:
    each node's profiled devices (a newcomer takes a free one, so the planner knows it)."""
    devices, where = list(plan.devices), dict(nodes)
    op = command.get("op")
    if op == "to":
        target = int(command.get("count", 0))
        if target < 1:
            raise InputError(f"--to {target}: a job needs at least one worker")
        op, command = (
            ("add", {**command, "count": target - len(devices)})
            if target > len(devices)
            else ("remove", {"ranks": list(range(target, len(devices)))})
        )
    if op == "remove":
        ranks = [int(r) for r in command.get("ranks", [])]
        unknown = [r for r in ranks if not 0 <= r < len(devices)]
        if unknown:
            raise InputError(f"--remove {unknown[0]}: no such worker in the job (workers: 0..{len(devices) - 1})")
        gone = {devices[r] for r in ranks}
        left = [d for d in devices if d not in gone]
        if not left:
            raise InputError("cannot remove every worker: at least one must stay (stop the job instead)")
        emptied = sorted({where[d] for d in gone} - {where[d] for d in left})
        if emptied:
            raise InputError(
                f"--remove: node {emptied[0]!r} would keep no worker; a job restarted on new workers keeps "
                "every node it has (stop that node's agent to leave it)"
            )
        return left, {d: where[d] for d in left}
    if op != "add":
        raise InputError(f"unknown scale operation {op!r}")
    count = int(command.get("count", 0))
    if count < 1:
        raise InputError(f"--add {count}: add at least one worker")
    node = command.get("node") or where[devices[0]]
    if node not in capacity:
        raise InputError(f"--node {node!r}: no agent of this job runs there (nodes: {', '.join(capacity)})")
    used = sum(1 for d in devices if where[d] == node)
    if used + count > capacity[node]:
        raise InputError(
            f"node {node!r} has {capacity[node]} worker slot(s) and {used} in use: cannot add {count} "
            "(launch with --max-nproc-per-node to allow more)"
        )
    new = _new_devices(node, count, set(devices), profile, plan)
    where.update({d: node for d in new})
    # A node's devices take consecutive ranks (its agent starts them as one block): the newcomers
    # go after their node's last device, the nodes in the order they had.
    node_order = list(dict.fromkeys(where[d] for d in devices + new))
    ordered = sorted(devices + new, key=lambda d: node_order.index(where[d]))
    return ordered, {d: where[d] for d in ordered}


def _new_devices(
    node: str, count: int, taken: set[str], profile: Mapping[str, tuple[str, ...]] | None, plan: Plan
) -> list[str]:
    if profile is not None:
        free = [d for d in profile.get(node, ()) if d not in taken]
        if len(free) < count:
            raise InputError(
                f"node {node!r} has {len(free)} free device(s) in the run's cluster profile: cannot add {count}"
            )
        return free[:count]
    if any(p.kind.value == "cuda" for p in plan.placement):
        raise InputError("--add on GPUs needs the run's cluster profile (launch with --cluster and --model)")
    # named as the node's devices are (``vm-cpu1``: ``vm-cpu2``), else ``cpu<k>``
    on_node = [p.device for p in plan.placement if p.node == node] or list(plan.devices)
    prefix = re.sub(r"\d+$", "", on_node[-1]) if on_node and re.search(r"\d$", on_node[-1]) else "cpu"
    names, k = [], 0
    while len(names) < count:
        if f"{prefix}{k}" not in taken:
            names.append(f"{prefix}{k}")
        k += 1
    return names


def plan_for_devices(
    plan: Plan, devices: list[str], nodes: Mapping[str, str], profiles: tuple[ClusterSpec, ModelSpec] | None
) -> tuple[Plan, str]:
    """The plan for ``devices`` (rank order) and how it was made (``planner`` or ``same shape``);
    an :class:`InputError` that says why where none runs there."""
    if profiles is not None:
        return _planned(plan, devices, *profiles), "planner"
    stages = plan.stages
    if len(stages) == 1 and stages[0].shard and len(devices) < 2:
        raise InputError(
            f"a sharded stage runs on 2 workers or more, not {len(devices)} (its workers split the model's "
            "state); keep at least 2, or launch again without --shard"
        )
    if len(stages) == 1 and stages[0].shard:
        new_stages = (_stage_on(stages[0], devices, share=1 / len(devices)),)
        pipelines: tuple[tuple[str, ...], ...] = tuple((d,) for d in devices) if plan.pipelines else ()
    elif len(devices) % len(stages):
        raise InputError(
            f"a plan of {len(stages)} stage(s) restarts on a multiple of {len(stages)} workers without the run's "
            f"profiles, not {len(devices)} (launch with --cluster and --model and the planner re-plans it)"
        )
    else:
        replicas = len(devices) // len(stages)
        pipelines = tuple(tuple(devices[r * len(stages) : (r + 1) * len(stages)]) for r in range(replicas))
        new_stages = tuple(
            _stage_on(stage, [pipe[s] for pipe in pipelines], share=1 / replicas) for s, stage in enumerate(stages)
        )
        if plan.schedule.value == "tokens":
            pipelines = ()
    new = dataclasses.replace(
        plan,
        devices=tuple(devices),
        stages=new_stages,
        pipelines=pipelines,
        collectives=(),
        placement=place_devices(plan, devices, nodes),
        predicted=None,
        solver=None,
    )
    check_executable(new, where="the re-planned plan")
    return new, "same shape"


def _stage_on(stage: Stage, devices: list[str], share: float) -> Stage:
    return dataclasses.replace(stage, workers=tuple(StageWorker(device=d, share=share) for d in devices))


def _planned(plan: Plan, devices: list[str], cluster: ClusterSpec, model: ModelSpec) -> Plan:
    from felactl.optimizer.planner import make_plan

    try:
        solved = make_plan(
            cluster,
            model,
            plan.global_batch,
            sync=plan.sync.mode.value,
            devices=devices,
            time_limit_s=REPLAN_TIME_LIMIT_S,
            use_trees=plan.sync.use_trees,
        )
    except PlanInfeasible as exc:
        raise InputError(f"the planner finds no plan for workers {', '.join(devices)}: {exc}") from None
    return dataclasses.replace(
        plan,
        devices=solved.devices,
        schedule=solved.schedule,
        stages=solved.stages,
        pipelines=solved.pipelines,
        collectives=solved.collectives,
        placement=placements_from(cluster, solved.devices),
        predicted=solved.predicted,
        solver=solved.solver,
    )
