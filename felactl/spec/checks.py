"""Checks that need two files at once: a plan against the cluster and the model it was made for."""

from __future__ import annotations

from collections.abc import Sequence

from felactl.errors import SpecError
from felactl.spec.cluster import ClusterSpec
from felactl.spec.executable import check_executable
from felactl.spec.model import ModelSpec
from felactl.spec.plan import Plan


def check_plan_against_cluster(plan: Plan, cluster: ClusterSpec, where: str = "plan") -> None:
    """Every device of the plan is in the cluster, on the node and of the kind its placement says."""
    known = cluster.device_names
    for i, dev in enumerate(plan.devices):
        if not cluster.has_device(dev):
            sample = ", ".join(known[:8]) + (", ..." if len(known) > 8 else "")
            raise SpecError(
                where, f"devices[{i}]", f"device {dev!r} is not in cluster {cluster.name!r} (it has: {sample})"
            )
    for i, placed in enumerate(plan.placement):
        node, kind = cluster.node_of(placed.device).name, cluster.device(placed.device).kind
        if placed.node != node:
            raise SpecError(
                where,
                f"placement[{i}].node",
                f"{placed.device!r} is on node {node!r} of cluster {cluster.name!r}, not {placed.node!r}",
            )
        if placed.kind != kind:
            raise SpecError(
                where,
                f"placement[{i}].kind",
                f"{placed.device!r} is a {kind.value} device in cluster {cluster.name!r}, not {placed.kind.value}",
            )
    for s, stage in enumerate(plan.stages):
        for w, worker in enumerate(stage.workers):
            have = cluster.device(worker.device).memory_gb
            if worker.predicted_memory_gb is not None and worker.predicted_memory_gb > have:
                raise SpecError(
                    where,
                    f"stages[{s}].workers[{w}].predicted_memory_gb",
                    f"{worker.predicted_memory_gb:g} GB does not fit {worker.device!r}, which has "
                    f"{have:g} GB in cluster {cluster.name!r}",
                )


def check_plan_against_model(plan: Plan, model: ModelSpec, where: str = "plan") -> None:
    """The plan is of this model (name, source, the config values both give) and the runtime can
    execute it on this model's layers (:func:`~felactl.spec.executable.check_executable`)."""
    for key in ("source", "name"):
        mine, theirs = getattr(plan.model, key), getattr(model, key)
        if mine != theirs:
            raise SpecError(where, f"model.{key}", f"is {mine!r} but the model profile is of {theirs!r}")
    for key in sorted(set(plan.model.config) & set(model.config)):
        if plan.model.config[key] != model.config[key]:
            raise SpecError(
                where,
                f"model.config.{key}",
                f"is {plan.model.config[key]!r} but the model profile has {model.config[key]!r}",
            )
    if not model.splittable and len(plan.stages) > 1:
        raise SpecError(
            where,
            "stages",
            f"{len(plan.stages)} stages, but model {model.name!r} cannot be split "
            "(it is one layer: no nn.Sequential, no block list, no split points): data-parallel plans only",
        )
    check_executable(plan, [layer.params for layer in model.layers], where)
    problem = tied_across_sharding(plan, model)
    if problem is not None:
        raise SpecError(where, "stages", problem)


def sharded_unlike(plan: Plan, stages: Sequence[int]) -> bool:
    """Whether some of ``stages`` are sharded and others not, or over unlike worker counts: a
    weight they all hold cannot sum shard by shard."""
    shapes = {(plan.stages[s].shard, len(plan.stages[s].workers)) for s in stages}
    return len(shapes) > 1 and any(shard for shard, _ in shapes)


def holding_stages(cuts: Sequence[int], layers: Sequence[int]) -> list[int]:
    """The stages, cut at ``cuts`` (stage s holds layers ``cuts[s]`` to ``cuts[s + 1] - 1``), that
    hold any of ``layers`` (a tied weight's readers)."""
    return sorted({s for s in range(len(cuts) - 1) for i in layers if cuts[s] <= i < cuts[s + 1]})


def stage_cuts(plan: Plan) -> list[int]:
    """Where ``plan`` cuts its layers: each stage's first layer, then the last stage's end."""
    return [stage.layer_start for stage in plan.stages] + [plan.stages[-1].layer_end]


def tied_across_sharding(plan: Plan, model: ModelSpec) -> str | None:
    """Where the plan shards some of the stages that hold layers reading one weight and not the
    others (or over unlike worker counts), what it does: the copies of a tied weight sum shard by
    shard, which needs every stage holding it sharded alike, or none (the runtime's refusal,
    ``agents/worker/tied.py:check_sharded_ties``, at plan time)."""
    for tied in model.tied:
        holders = holding_stages(stage_cuts(plan), tied.layers)
        if sharded_unlike(plan, holders):
            names = " and ".join(f"{i} ({model.layers[i].name})" for i in tied.layers)
            held = ", ".join(
                f"stage {s} ({'sharded over ' + str(len(plan.stages[s].workers)) if plan.stages[s].shard else 'replicated'})"
                for s in holders
            )
            return (
                f"layers {names} read one weight (tied), held by {held}: shard all of these stages over "
                "as many workers, or none"
            )
    return None


def tied_across_kinds(plan: Plan, model: ModelSpec, cluster: ClusterSpec) -> str | None:
    """Where the plan puts layers that read one weight (:attr:`ModelSpec.tied`) on devices of more
    than one kind, what it puts where: each holds a copy, stepped alike only where the devices are
    alike. None where every group sits on one kind, or in one stage (one tensor there, however
    many devices of whatever kinds replicate or shard it: no copies to keep alike)."""
    for tied in model.tied:
        group = tied.layers
        holders = holding_stages(stage_cuts(plan), group)
        if len(holders) < 2:
            continue
        kinds: dict[str, list[str]] = {}
        for s in holders:
            for device in plan.stages[s].devices:
                kinds.setdefault(cluster.device(device).model, []).append(f"{device} (stage {s})")
        if len(kinds) > 1:
            names = " and ".join(f"{i} ({model.layers[i].name})" for i in group)
            where = "; ".join(
                f"{kind}: {', '.join(devices[:3])}{' ...' if len(devices) > 3 else ''}"
                for kind, devices in kinds.items()
            )
            return (
                f"layers {names} read one weight (tied), and this plan puts them on {len(kinds)} kinds of "
                f"device ({where}): each holds a copy, which steps alike only on devices alike"
            )
    return None


def check_together(files: Sequence[tuple[str, ClusterSpec | ModelSpec | Plan]]) -> None:
    """Files given together (``felactl check plan.yaml cluster.yaml model.yaml``): every plan is
    executable, and fits every cluster and every model among them. Raises the first problem."""
    plans = [(where, spec) for where, spec in files if isinstance(spec, Plan)]
    for where, plan in plans:
        check_executable(plan, where=where)
        for _, spec in files:
            if isinstance(spec, ClusterSpec):
                check_plan_against_cluster(plan, spec, where)
            elif isinstance(spec, ModelSpec):
                check_plan_against_model(plan, spec, where)
        for _, cluster in files:
            for _, model in files:
                if isinstance(cluster, ClusterSpec) and isinstance(model, ModelSpec):
                    problem = tied_across_kinds(plan, model, cluster)
                    if problem is not None:
                        raise SpecError(where, "stages", problem)
