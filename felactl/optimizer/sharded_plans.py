"""The sharded plans the planner weighs beside the ILP's replicated stages (FSDP2 under ``bsp``).

* **A shard group**: the whole model as one stage sharded over the k fastest devices, for the k
  whose step is shortest (:func:`felactl.optimizer.sharding.best_shard_group`).
* **Pipelines of sharded stages** (PP x FSDP, as torchtitan composes them): S stages, each over
  n devices, one per pipeline, the S x n fastest devices in cluster order (a stage's group on
  neighbouring devices, so its gathers stay on a node's links where they can, and the pipelines'
  activations cross between nodes), the layers cut where each group's slowest device balances the
  stages. A stage cut from a traced model is gathered whole (:mod:`~felactl.optimizer.sharding`),
  so this pays where a stage's weights fit a device but its optimizer state does not. Each stage
  is sharded or replicated: every stage sharded, or only those whose replica does not fit one of
  their devices (a sharded stage gathers its weights in every micro-batch's forward and backward,
  where a replicated one sums its gradients once a step) and the stages that hold a weight tied
  to theirs (its copies sum shard by shard). Each is priced by the simulator, which runs the
  plan's 1F1B over its pipelines, each sharded stage's gathers and reduce-scatter after its last
  backward (none hidden) and each replicated stage's all-reduce, and kept only where its simulated
  peak memory fits every device; the faster one is the candidate, the fewer sharded stages where
  they tie (a replicated stage's sum is often hidden behind a sharded one's gathers).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from felactl.optimizer import baselines
from felactl.optimizer.cost import CostModel, stage_memory_bytes
from felactl.optimizer.one_chain import one_f_one_b_in_flight
from felactl.optimizer.sharding import best_shard_group, shard_micro_batches, sharded_memory_bytes
from felactl.optimizer.simulator import SimResult, simulate
from felactl.spec import ModelRef, ModelSpec, Plan, Schedule, Stage, StageWorker, SyncMode, SyncSpec
from felactl.spec.checks import holding_stages, tied_across_kinds
from felactl.spec.sync_modes import Execution, sync_support


def candidates(
    cost: CostModel, model: ModelSpec, global_batch: int, max_stages: int, mode: SyncMode
) -> tuple[baselines.Baseline | None, ShardedPipelines | None]:
    """The shard group and the best pipelines of sharded stages that fit (None: none fits, or
    ``mode`` runs no sharded stage)."""
    if Execution.SHARDED not in sync_support(mode).executions:
        return None, None
    return shard_group(cost, global_batch), best_sharded_pipelines(cost, model, global_batch, max_stages)


def shard_group(cost: CostModel, global_batch: int) -> baselines.Baseline | None:
    """The whole model sharded over its fastest devices, priced over rings as the ``fsdp`` baseline is."""
    found = best_shard_group(baselines.rings_only(cost), global_batch)
    return None if isinstance(found, str) else baselines.sharded_baseline(cost, *found)


@dataclass(frozen=True)
class ShardedPipelines:
    plan: Plan
    """Its stages, pipelines and rank order (no prediction yet)."""
    simulation: SimResult

    @property
    def iteration_s(self) -> float:
        return self.simulation.iteration_s

    def summary(self) -> str:
        stages, pipelines = self.plan.stages, len(self.plan.pipelines)
        sharded = [s for s, stage in enumerate(stages) if stage.shard]
        which = (
            "each"
            if len(sharded) == len(stages)
            else f"stage{'s' if len(sharded) > 1 else ''} {', '.join(map(str, sharded))}"
        )
        return (
            f"{pipelines} pipelines of {len(stages)} stages, {which} sharded over {pipelines}: {self.iteration_s:.4g} s"
        )


def best_sharded_pipelines(
    cost: CostModel, model: ModelSpec, global_batch: int, max_stages: int
) -> ShardedPipelines | None:
    """The fastest pipelines of sharded stages that fit memory (module doc), or None."""
    fastest = sorted(cost.cluster.device_names, key=lambda d: cost.per_sample_s(0, model.num_layers, d, 1))
    best = None
    for num_stages in range(2, min(max_stages, model.num_layers, len(fastest) // 2) + 1):
        shards = len(fastest) // num_stages
        used = set(fastest[: num_stages * shards])
        ordered = [d for d in cost.cluster.device_names if d in used]
        groups = [ordered[s * shards : (s + 1) * shards] for s in range(num_stages)]
        for b in shard_micro_batches(global_batch, shards):
            found = _priced(cost, model, global_batch, groups, b)
            if found is not None and (best is None or found.iteration_s < best.iteration_s):
                best = found
    return best


def _priced(
    cost: CostModel, model: ModelSpec, global_batch: int, groups: list[list[str]], micro_batch: int
) -> ShardedPipelines | None:
    times = [
        [max(cost.per_sample_s(layer, layer + 1, d, micro_batch) for d in group) for layer in range(model.num_layers)]
        for group in groups
    ]
    cuts = baselines.balanced_cuts(times, len(groups))
    best = None
    for shard in stage_shardings(cost, model, global_batch, groups, cuts, micro_batch):
        plan = _plan(cost, model, global_batch, groups, cuts, micro_batch, shard)
        if tied_across_kinds(plan, model, cost.cluster) is not None:
            return None  # a tied weight's copies would step on devices that differ (whatever is sharded)
        simulation = simulate(plan, replace(baselines.rings_only(cost), ring_order=plan.devices))
        if any(simulation.peak_memory_bytes.get(d, 0.0) > cost.usable_memory_bytes(d) for d in plan.devices):
            continue
        if best is None or simulation.iteration_s < best.iteration_s:
            best = ShardedPipelines(plan, simulation)
    return best


def stage_shardings(
    cost: CostModel, model: ModelSpec, global_batch: int, groups: list[list[str]], cuts: list[int], micro_batch: int
) -> list[tuple[bool, ...]]:
    """Which stages to shard (module doc): only those whose replica (its 1F1B in-flight
    activations too) does not fit every device of its group, with the stages that share a tied
    weight with one of those, where that shards any and not all; and all of them."""
    num_stages, per_pipeline = len(groups), global_batch // len(groups[0])

    def replica_fits(s: int) -> bool:
        flight = one_f_one_b_in_flight(num_stages, s, per_pipeline, micro_batch)
        need = stage_memory_bytes(model, cuts[s], cuts[s + 1], micro_batch, flight)
        return all(need <= cost.usable_memory_bytes(d) for d in groups[s])

    shard = [not replica_fits(s) for s in range(num_stages)]
    for _ in range(num_stages):  # a tie can chain stages: spread until nothing changes
        for tied in model.tied:
            holders = holding_stages(cuts, tied.layers)
            if any(shard[s] for s in holders):
                for s in holders:
                    shard[s] = True
    every, needed = (True,) * num_stages, tuple(shard)
    # the fewest sharded first: where it is no slower, it is the one kept (module doc)
    return [every] if needed == every or not any(needed) else [needed, every]


def _plan(
    cost: CostModel,
    model: ModelSpec,
    global_batch: int,
    groups: list[list[str]],
    cuts: list[int],
    micro_batch: int,
    shard: tuple[bool, ...],
) -> Plan:
    num_stages, shards = len(groups), len(groups[0])
    share = round(1 / shards, 9)
    stages = []
    for s, group in enumerate(groups):
        # 1F1B keeps micro-batches of stage s in flight: their activations count that often
        flight = one_f_one_b_in_flight(num_stages, s, global_batch // shards, micro_batch)
        if shard[s]:
            memory = sharded_memory_bytes(model, cuts[s], cuts[s + 1], micro_batch * flight, shards)
        else:
            memory = stage_memory_bytes(model, cuts[s], cuts[s + 1], micro_batch, flight)
        memory_gb = memory / 1e9
        workers = [StageWorker(device=d, share=share, predicted_memory_gb=round(memory_gb, 4)) for d in group]
        workers[0] = replace(workers[0], share=round(1.0 - share * (shards - 1), 9))
        stages.append(
            Stage(
                layer_start=cuts[s],
                layer_end=cuts[s + 1],
                micro_batch=micro_batch,
                workers=tuple(workers),
                max_in_flight=flight,  # what 1F1B holds (the simulator keeps to it too)
                shard=shard[s],
            )
        )
    return Plan(
        cluster=cost.cluster.name,
        model=ModelRef(name=model.name, source=model.source, config=model.config),
        devices=tuple(d for group in groups for d in group),
        global_batch=global_batch,
        schedule=Schedule.ONE_F_ONE_B,
        sync=SyncSpec(mode=SyncMode.BSP, use_trees=False),
        stages=tuple(stages),
        pipelines=tuple(zip(*groups)),
    )
