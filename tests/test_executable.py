"""Every plan the planner writes can run: the runtime's rules in one place (felactl.spec.executable),
used by the planner's search space, by ``felactl check`` and by the worker at its start."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
from _worker_helpers import hybrid_plan, pipeline_plan
from planner_fixtures import model as made_up_model
from planner_fixtures import random_instance

from felactl.errors import PlanInfeasible, SpecError
from felactl.optimizer.cost import CostModel
from felactl.optimizer.planner import make_plan
from felactl.optimizer.space import build_space
from felactl.spec import (
    ClusterSpec,
    Device,
    DeviceKind,
    Layer,
    LinkDefault,
    LinkType,
    ModelRef,
    Node,
    Plan,
    Schedule,
    Stage,
    StageWorker,
    SyncMode,
    SyncSpec,
    check_executable,
    load_model,
)
from felactl.spec.executable import problems, survivors_keep_state, why_not_rescalable
from felactl.spec.sync_modes import rescalable_mode_names, sync_support

BUILTIN_SPECS = {
    name: load_model(Path(__file__).parent.parent / "plans" / "models" / f"{name}.yaml")
    for name in ("gpt-mini", "vgg-mini", "mlp")
}


def _plan(
    stages: list[tuple[int, int, int, list[int]]],
    num_devices: int,
    *,
    global_batch: int = 32,
    schedule: Schedule = Schedule.TOKENS,
    sync: SyncMode = SyncMode.TOKENS,
    pipelines=(),
) -> Plan:
    return Plan(
        cluster="c",
        model=ModelRef(name="m", source="mlp"),
        devices=tuple(f"d{i}" for i in range(num_devices)),
        global_batch=global_batch,
        schedule=schedule,
        sync=SyncSpec(mode=sync),
        pipelines=pipelines,
        stages=tuple(
            Stage(
                layer_start=a,
                layer_end=b,
                micro_batch=mb,
                workers=tuple(StageWorker(device=f"d{d}", share=1 / len(ds)) for d in ds),
            )
            for a, b, mb, ds in stages
        ),
    )


def _keys(plan: Plan, layer_params=None) -> list[str]:
    return [p.key for p in problems(plan, layer_params)]


def test_the_reported_plan_with_micro_batches_32_2_32_2_is_refused():
    plan = _plan([(0, 1, 32, [0]), (1, 2, 2, [1]), (2, 3, 32, [0]), (3, 4, 2, [1])], 2)
    assert _keys(plan) == ["stages[1].micro_batch", "stages[3].micro_batch"]
    with pytest.raises(SpecError, match=r"plan.yaml: stages\[1\].micro_batch: must be a multiple of stages\[0\]"):
        check_executable(plan, where="plan.yaml")


def test_a_stage_of_parameter_free_layers_only_is_refused():
    plan = _plan([(0, 2, 4, [0]), (2, 3, 4, [1]), (3, 4, 4, [1])], 2)  # layer 2: Flatten
    assert _keys(plan, [100, 50, 0, 10]) == ["stages[1]"]
    with pytest.raises(SpecError, match="layers 2..2 hold no trainable parameter"):
        check_executable(plan, [100, 50, 0, 10])
    assert _keys(plan, [100, 50, 0, 10, 5]) == ["stages[2].layer_end"], "one layer past the plan's stages"


@pytest.mark.parametrize(
    "plan, key, fragment",
    [
        (_plan([(0, 1, 4, [0]), (1, 2, 8, [1])], 2, sync=SyncMode.WBSP), "sync.mode", "cannot run flexible plans"),
        (_plan([(0, 1, 1, [0]), (1, 2, 32, [1])], 2, global_batch=24), "global_batch", "32 first-level tokens"),
        (
            _plan([(0, 1, 4, [0]), (1, 2, 8, [1])], 2, schedule=Schedule.ONE_F_ONE_B, pipelines=(("d0", "d1"),)),
            "stages[1].micro_batch",
            "must equal stages[0].micro_batch",
        ),
        (
            _plan(
                [(0, 1, 4, [0]), (1, 2, 4, [1])],
                2,
                schedule=Schedule.GPIPE,
                sync=SyncMode.WBSP,
                pipelines=(("d0", "d1"),),
            ),
            "sync.mode",
            "static pipelines",
        ),
        (
            _plan(
                [(0, 1, 4, [0, 1]), (1, 2, 4, [1, 2])],
                3,
                schedule=Schedule.ONE_F_ONE_B,
                pipelines=(("d0", "d1"), ("d1", "d2")),
            ),
            "devices[1]",
            "holds 2",
        ),
    ],
)
def test_each_rule_names_the_key(plan, key, fragment):
    found = problems(plan)
    assert [p.key for p in found] == [key] and fragment in found[0].reason


def test_plans_the_runtime_runs_pass():
    assert problems(_plan([(0, 1, 4, [0, 1]), (1, 2, 8, [1]), (2, 3, 16, [0])], 2, global_batch=48), [1, 1, 1]) == []
    assert problems(_plan([(0, 3, 8, [0, 1])], 2, sync=SyncMode.WBSP), [1, 0, 1]) == []


def test_why_a_plan_cannot_rescale_is_one_sentence():
    """The launch, ``--nnodes MIN:MAX`` and an elastic worker say one sentence: a data-parallel plan
    of a mode that rescales live needs none; a plan of stages is told how many and its mode."""
    for mode in SyncMode:
        data_parallel = _plan([(0, 3, 8, [0, 1])], 2, sync=mode)
        assert (why_not_rescalable(data_parallel) is None) is sync_support(mode).rescales_live
    flexible = _plan([(0, 1, 4, [0, 1]), (1, 2, 8, [1]), (2, 3, 16, [0])], 2, global_batch=48)
    assert why_not_rescalable(flexible) == (
        f"live rescaling covers data-parallel plans (one replicated stage) with sync {rescalable_mode_names()}; "
        "this plan runs 3 stage(s) with sync tokens"
    )


def _with_free_layers(model, rng: random.Random):
    """The model with parameter-free layers (ReLU, pooling, Flatten) after some of its layers."""
    layers = []
    for i, layer in enumerate(model.layers):
        layers.append(layer)
        if rng.random() < 0.5:
            layers.append(
                Layer(
                    name=f"free{i}",
                    params=0,
                    param_bytes=0,
                    activation_bytes_per_sample=layer.activation_bytes_per_sample,
                    fwd_flops_per_sample=rng.choice([1e3, 1e7]),
                    bwd_flops_per_sample=1e3,
                )
            )
    return replace(model, layers=tuple(layers))


def test_the_search_space_has_no_stage_without_parameters():
    cluster, model, global_batch = random_instance(3)
    model = _with_free_layers(model, random.Random(3))
    space = build_space(CostModel(cluster, model), global_batch)
    params = [layer.params for layer in model.layers]
    assert 0 in params and space.options
    assert all(sum(params[o.choice.start : o.choice.end]) > 0 for o in space.options)


def test_a_model_without_parameters_is_infeasible_and_says_why():
    cluster, _, _ = random_instance(0)
    with pytest.raises(PlanInfeasible, match="params: model 'm' has no trainable parameter"):
        make_plan(cluster, made_up_model([(0, 1000, 1e6), (0, 1000, 1e6)]), 16)


def _instance(seed: int):
    """A seeded random small cluster, a model (made-up, a built-in's profile, or either with
    parameter-free layers), a global batch (not always a power of two) and a sync mode."""
    cluster, made_up, global_batch = random_instance(seed)
    rng = random.Random(seed)
    model = rng.choice([made_up, *BUILTIN_SPECS.values()])
    if rng.random() < 0.3:
        model = _with_free_layers(model, rng)
    return cluster, model, rng.choice([global_batch, 8, 24, 48]), rng.choice(["tokens", "tokens", "bsp", "sdpipe"])


@pytest.mark.parametrize("seed", range(24))
def test_every_plan_the_planner_writes_is_executable(seed):
    cluster, model, global_batch, sync = _instance(seed)
    try:
        plan = make_plan(cluster, model, global_batch, sync=sync, time_limit_s=10)
    except PlanInfeasible as exc:
        assert str(exc).split(":")[0] in ("memory", "degree", "params"), exc
        return
    check_executable(plan, [layer.params for layer in model.layers])


CPU_MODELS = [("cpu-fast", 0.2, 4.0), ("cpu-slow", 0.05, 1.0), ("cpu-tiny", 0.05, 0.05)]


def cpu_cluster(seed: int) -> ClusterSpec:
    """2-3 CPU slots ``cpu0..`` of one node, of seeded random kinds: plans for it run on this machine."""
    rng = random.Random(seed)
    devices = tuple(
        Device(name=f"cpu{i}", kind=DeviceKind.CPU, model=m, tflops=t, memory_gb=g, local_index=i)
        for i, (m, t, g) in enumerate(rng.choice(CPU_MODELS) for _ in range(rng.randint(2, 3)))
    )
    return ClusterSpec(
        name="cpus",
        nodes=(Node(name="here", devices=devices),),
        intra_node_default=LinkDefault(bandwidth_gbps=rng.choice([0.05, 5.0]), latency_us=50.0, type=LinkType.LOOPBACK),
    )


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("sync", ["tokens", "sdpipe"])
def test_every_plan_for_cpu_slots_is_executable(seed, sync):
    """The clusters the multi-process test launches on, with each built-in model at two batches."""
    for name, model in BUILTIN_SPECS.items():
        for global_batch in (16, 32):
            plan = make_plan(cpu_cluster(seed), model, global_batch, sync=sync, time_limit_s=10)
            check_executable(plan, [layer.params for layer in model.layers], where=f"{name} x {global_batch}")


def test_a_plan_placing_workers_on_gpus_and_cpu_slots_is_refused():
    """One process group has one backend: the launcher runs such a plan on gloo, where every worker
    trains on the CPU, the GPUs' included, at a core's speed where the plan priced a GPU's."""
    from felactl.spec import Placement

    plan = _plan([(0, 3, 8, [0, 1])], 2, sync=SyncMode.BSP)
    mixed = replace(
        plan,
        placement=(
            Placement(device="d0", node="box", kind=DeviceKind.CUDA, local_index=0),
            Placement(device="d1", node="box", kind=DeviceKind.CPU, local_index=0),
        ),
    )
    assert _keys(mixed) == ["placement"]
    with pytest.raises(SpecError, match=r"plan.yaml: placement: .*GPUs and on CPU slots.*one backend"):
        check_executable(mixed, where="plan.yaml")
    one_kind = replace(
        mixed, placement=tuple(replace(p, kind=DeviceKind.CUDA, local_index=i) for i, p in enumerate(mixed.placement))
    )
    assert _keys(one_kind) == []


def test_the_planner_refuses_devices_of_both_kinds_and_plans_either_kind_alone():
    from felactl.errors import InputError

    both = ClusterSpec(
        name="both",
        nodes=(
            Node(
                name="box",
                devices=(
                    Device(name="gpu0", kind=DeviceKind.CUDA, model="G", tflops=10.0, memory_gb=8.0, local_index=0),
                    Device(name="cpu0", kind=DeviceKind.CPU, model="C", tflops=0.1, memory_gb=8.0, local_index=0),
                    Device(name="cpu1", kind=DeviceKind.CPU, model="C", tflops=0.1, memory_gb=8.0, local_index=1),
                ),
            ),
        ),
        intra_node_default=LinkDefault(bandwidth_gbps=10.0, latency_us=5.0, type=LinkType.PCIE),
    )
    net = made_up_model([(1000, 100, 1e6)] * 3)
    with pytest.raises(InputError, match=r"GPUs \(gpu0\) and CPU slots \(cpu0, cpu1\).*one backend.*--devices"):
        make_plan(both, net, 8, sync="bsp")
    assert set(make_plan(both, net, 8, sync="bsp", devices=["cpu0", "cpu1"]).devices) <= {"cpu0", "cpu1"}
    assert make_plan(both, net, 8, sync="bsp", devices=["gpu0"]).devices == ("gpu0",)


def test_survivors_keep_every_stage_only_of_lockstep_stages_that_each_have_whole_replicas():
    """Where one failed worker leaves every stage of one step with the others
    (felactl.agents.worker.survivors): stages in lockstep (static pipelines, the flexible hybrid),
    each replicated. Not one chain (its stages die with their worker), not a sharded stage (its shards), not SDPipe's
    pipelines (at their own pace, no common step), not one stage (data parallel rescales live)."""
    two_chains = pipeline_plan([0, 2, 3], num_replicas=2)
    assert survivors_keep_state(two_chains)
    assert survivors_keep_state(pipeline_plan([0, 2, 3], num_replicas=2, sync="tokens"))  # runs as bsp
    assert not survivors_keep_state(pipeline_plan([0, 2, 3]))
    assert not survivors_keep_state(pipeline_plan([0, 2, 3], num_replicas=2, sync="sdpipe"))
    sharded = replace(two_chains, stages=(replace(two_chains.stages[0], shard=True), *two_chains.stages[1:]))
    assert not survivors_keep_state(sharded)
    assert not survivors_keep_state(pipeline_plan([0, 3], num_replicas=2))
    assert survivors_keep_state(hybrid_plan([(0, 2, 4, [0, 1]), (2, 3, 4, [2, 3])], 4))  # the flexible hybrid
    assert not survivors_keep_state(hybrid_plan([(0, 2, 4, [0, 1]), (2, 3, 4, [2])], 3))
