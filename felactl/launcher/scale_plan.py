"""Re-planning a data-parallel job for a new membership, and the hybrid-scaling policies.

A run launched with the profiles its plan was made from (``felactl launch --cluster --model``;
``felactl demo`` does) runs the planner again on them for the new device set
(:func:`replan_with_planner`): the ILP picks the micro-batch and the shares, Blink packs the
group's trees, and the plan carries its prediction, restricted to one stage because the live
runtime re-forms data-parallel groups. Without the profiles (:func:`replan`) the plan's structure
is kept (one stage, its micro-batch, optimizer and sync mode) on the new device set, with each
device's share of the global batch proportional to its measured speed (samples per compute second
in the run's recent metrics; a newcomer is credited with the mean speed of the workers already on
its node, equal shares when nothing was measured). Pipelines and flexible-hybrid plans are refused
(see felactl.launcher.elastic).

Hybrid scaling (Elan): how the global batch and the learning rate follow the number of workers.

``fixed-batch``
    The global batch and the learning rate stay as launched; more workers only split the same
    batch finer (each step is the same computation, so the loss curve does not change).
``linear-lr``
    The global batch grows (and shrinks) in proportion to the workers, ``B = B0 * n / n0``, up to
    a cap (``--max-batch``, default ``4 * B0``), never below one sample per worker; the learning
    rate follows the batch linearly, ``lr = lr0 * B / B0`` (Goyal et al.'s linear scaling rule),
    so it is capped with it and held once the cap is reached.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from felactl import limits
from felactl.errors import InputError, PlanInfeasible
from felactl.limits import check_flag
from felactl.spec import ClusterSpec, ModelSpec, Placement, Plan, Schedule, Stage, StageWorker, placements_from

REPLAN_TIME_LIMIT_S = 10.0

POLICIES = ("fixed-batch", "linear-lr")


@dataclass(frozen=True)
class ScalingPolicy:
    name: str = "fixed-batch"
    max_batch: int | None = None
    """linear-lr's cap on the global batch (default: 4 x the launch's batch)."""

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise InputError(f"--scaling-policy must be one of {', '.join(POLICIES)}, got {self.name!r}")
        check_flag("--max-batch", self.max_batch, limits.BATCH)

    def batch_and_lr(self, base_batch: int, base_lr: float, base_workers: int, workers: int) -> tuple[int, float]:
        """The global batch and learning rate for ``workers`` (the launch ran ``base_workers``)."""
        if self.name == "fixed-batch":
            return base_batch, base_lr
        cap = self.max_batch or 4 * base_batch
        batch = max(workers, min(cap, round(base_batch * workers / base_workers)))
        return batch, base_lr * batch / base_batch


def shares_by_speed(devices: list[str], speeds: dict[str, float]) -> list[float]:
    """Shares proportional to ``speeds`` (a device without one gets the mean of the others)."""
    known = [speeds[d] for d in devices if speeds.get(d, 0) > 0]
    mean = sum(known) / len(known) if known else 1.0
    weights = [speeds[d] if speeds.get(d, 0) > 0 else mean for d in devices]
    total = sum(weights)
    return [w / total for w in weights]


def with_a_sample_each(shares: list[float], total: int) -> list[float]:
    """``shares`` lifted so that :func:`~felactl.spec.stages.split_by_shares` gives every member at
    least one of ``total`` samples (a member measured 25x slower than its peers got none: one at
    its own pace took that for the data handed out and left the loop; a lockstep one would skip
    its step's collectives). 1.5 samples' worth each: the cumulative rounding then never gives two
    members the same bound. What a lifted member gains is taken from the others in proportion to
    what they hold above the floor; equal shares where the floor leaves nothing above it."""
    floor = 1.5 / total
    if floor * len(shares) >= 1:
        return [1 / len(shares)] * len(shares)
    lifted = [max(share, floor) for share in shares]
    excess = sum(lifted) - 1.0
    above = sum(share - floor for share in lifted)
    return [share - excess * (share - floor) / above for share in lifted]


def place_devices(plan: Plan, devices: Sequence[str], nodes: Mapping[str, str]) -> tuple[Placement, ...]:
    """Where ``devices`` (rank order) go when ``plan``'s job is rescaled without a cluster profile:
    a device of ``plan`` keeps its place; a new one goes on its node (``nodes``) at the lowest index
    there that no other device holds, of the plan's kind: the GPU a newcomer is started on."""
    if not plan.placement:
        return ()
    kinds = {p.device: p for p in plan.placement}
    where = {d: nodes.get(d) or (kinds[d].node if d in kinds else "") for d in devices}
    used = {(where[d], kinds[d].local_index) for d in devices if d in kinds}
    entries = []
    for d in devices:
        if d in kinds:
            index = kinds[d].local_index
        else:
            index = next(i for i in range(len(devices) + len(used)) if (where[d], i) not in used)
            used.add((where[d], index))
        kind = kinds[d].kind if d in kinds else plan.placement[0].kind
        entries.append(Placement(device=d, node=where[d], kind=kind, local_index=index))
    return tuple(entries)


def replan(
    plan: Plan,
    devices: list[str],
    speeds: dict[str, float],
    nodes: dict[str, str],
    *,
    global_batch: int,
    lr: float,
    placement: tuple[Placement, ...] | None = None,
) -> Plan:
    """``plan``'s single stage on ``devices`` (rank order), shares by speed; ``nodes`` places them
    (a device keeps its index on its node; a new one takes the lowest free index there), unless
    ``placement`` gives the devices' places outright."""
    if len(plan.stages) != 1:
        raise InputError(f"rescaling re-plans data-parallel plans only; this plan has {len(plan.stages)} stages")
    if global_batch < len(devices):
        raise InputError(f"a global batch of {global_batch} cannot feed {len(devices)} workers")
    stage = plan.stages[0]
    shares = with_a_sample_each(shares_by_speed(devices, speeds), global_batch)
    new_stage = Stage(
        layer_start=stage.layer_start,
        layer_end=stage.layer_end,
        micro_batch=stage.micro_batch,
        workers=tuple(StageWorker(device=d, share=s) for d, s in zip(devices, shares)),
    )
    if placement is None:
        placement = place_devices(plan, devices, nodes)
    pipelines = () if plan.schedule is Schedule.TOKENS else tuple((d,) for d in devices)
    return dataclasses.replace(
        plan,
        devices=tuple(devices),
        global_batch=global_batch,
        stages=(new_stage,),
        pipelines=pipelines,
        collectives=(),
        placement=placement,
        predicted=None,
        solver=None,
        training=dataclasses.replace(plan.training, lr=lr),
    )


def replan_with_planner(
    plan: Plan,
    cluster: ClusterSpec,
    model: ModelSpec,
    devices: list[str],
    nodes: dict[str, str],
    *,
    global_batch: int,
    lr: float,
    time_limit_s: float = REPLAN_TIME_LIMIT_S,
) -> Plan:
    """The planner, run again on the profiles for ``devices`` (rank order), one stage: its
    micro-batch, shares, trees and prediction, laid out in the members' rank order."""
    from felactl.optimizer.planner import make_plan

    try:
        solved = make_plan(
            cluster,
            model,
            global_batch,
            sync=plan.sync.mode.value,
            devices=devices,
            max_stages=1,
            time_limit_s=time_limit_s,
            use_trees=plan.sync.use_trees,
            ranks=devices,  # the live workers keep their ranks: priced by the rings they make
        )
    except PlanInfeasible as exc:
        raise InputError(f"the planner finds no plan for workers {', '.join(devices)}: {exc}") from None
    stage = solved.stages[0]
    shares = {w.device: w.share for w in stage.workers}
    idle = [d for d in devices if shares.get(d, 0.0) <= 0]
    if idle:
        raise InputError(
            f"the planner gives no work to {', '.join(idle)} at a global batch of {global_batch} (it "
            f"would slow the job down), and a live job keeps every member busy: scale with "
            f"--scaling-policy linear-lr to grow the batch, or add elsewhere with --node"
        )
    laid_out = replan(
        plan, devices, shares, nodes, global_batch=global_batch, lr=lr, placement=placements_from(cluster, devices)
    )
    return dataclasses.replace(
        laid_out,
        stages=(dataclasses.replace(laid_out.stages[0], micro_batch=stage.micro_batch),),
        collectives=solved.collectives,
        predicted=solved.predicted,
        solver=solved.solver,
    )
