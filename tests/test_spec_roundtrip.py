"""Every file format survives to_dict -> from_dict and save -> load (YAML and JSON) unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest

from felactl.spec import (
    ClusterSpec,
    Collective,
    Device,
    DeviceKind,
    Layer,
    LayerTiming,
    Link,
    LinkDefault,
    LinkType,
    ModelRef,
    ModelSpec,
    Node,
    Plan,
    Prediction,
    Schedule,
    SolverInfo,
    Stage,
    StageWorker,
    SyncMode,
    SyncSpec,
    Training,
    Tree,
    dump_yaml,
    from_dict,
    load,
    save,
    to_dict,
)

CLUSTER_FILES = sorted((Path(__file__).parent.parent / "plans" / "clusters").glob("*.yaml"))


def make_cluster() -> ClusterSpec:
    gpu = lambda name, i: Device(
        name=name, kind=DeviceKind.CUDA, model="Tesla V100-SXM2-16GB", tflops=14.0, memory_gb=16.0, local_index=i
    )
    cpu = Device(
        name="host.cpu0",
        kind=DeviceKind.CPU,
        model="Intel(R) Xeon(R) Gold 6148",
        tflops=0.8,
        memory_gb=64.0,
        cpu_cores=(0, 1, 2, 3),
        bf16_tflops=1.2,
    )
    return ClusterSpec(
        name="lab",
        description="two V100s over NVLink and a CPU slot",
        nodes=(
            Node(
                name="box0",
                hostname="10.0.0.5",
                num_cpu_cores=40,
                memory_gb=256.0,
                devices=(gpu("box0.gpu0", 0), gpu("box0.gpu1", 1)),
            ),
            Node(name="host", devices=(cpu,)),
        ),
        links=(
            Link(
                src="box0.gpu0", dst="box0.gpu1", bandwidth_gbps=47.5, latency_us=2.5, type=LinkType.NVLINK, num_links=2
            ),
            Link(
                src="box0.gpu1", dst="box0.gpu0", bandwidth_gbps=47.5, latency_us=2.5, type=LinkType.NVLINK, num_links=2
            ),
        ),
        intra_node_default=LinkDefault(bandwidth_gbps=12.0, latency_us=8.0, type=LinkType.PCIE),
        inter_node_default=LinkDefault(bandwidth_gbps=1.25, latency_us=45.0, type=LinkType.NET),
    )


def make_model() -> ModelSpec:
    def layer(i: int, params: int, act: int, flops: float) -> Layer:
        timings = tuple(
            LayerTiming(
                device_model=dm, micro_batch=b, fwd_ms=0.1 * b * (i + 1) / speed, bwd_ms=0.2 * b * (i + 1) / speed
            )
            for dm, speed in (("Tesla V100-SXM2-16GB", 3.0), ("Intel(R) Xeon(R) Gold 6148", 1 / 7))
            for b in (1, 4, 16)
        )
        return Layer(
            name=f"{i}.Block",
            kind="Block",
            params=params,
            param_bytes=4 * params,
            activation_bytes_per_sample=act,
            saved_bytes_per_sample=9 * act if i else None,
            fwd_flops_per_sample=flops,
            bwd_flops_per_sample=2 * flops,
            timings=timings,
        )

    return ModelSpec(
        name="gpt-mini",
        source="gpt-mini",
        config={"depth": 3, "width": 128, "num_heads": 4, "seq_len": 32, "vocab_size": 103},
        input_bytes_per_sample=256,
        layers=tuple(layer(i, 198_016 + i, 16_384, 1.3e7 + 0.5 * i) for i in range(3)),
    )


def make_plan() -> Plan:
    """A two-stage 1F1B plan on the cluster above: stage 0 replicated on the GPUs, stage 1 on the CPU."""
    return Plan(
        cluster="lab",
        model=ModelRef(name="gpt-mini", source="gpt-mini", config={"depth": 3, "width": 128}),
        devices=("box0.gpu0", "box0.gpu1", "host.cpu0"),
        global_batch=64,
        schedule=Schedule.ONE_F_ONE_B,
        sync=SyncSpec(mode=SyncMode.WBSP, overlap=True, use_trees=True),
        training=Training(optimizer="sgd", lr=0.05, seed=7),
        stages=(
            Stage(
                layer_start=0,
                layer_end=2,
                micro_batch=8,
                predicted_compute_s=0.0125,
                workers=(
                    StageWorker(device="box0.gpu0", share=0.625, predicted_memory_gb=1.5),
                    StageWorker(device="box0.gpu1", share=0.375),
                ),
            ),
            Stage(layer_start=2, layer_end=3, micro_batch=4, workers=(StageWorker(device="host.cpu0", share=1.0),)),
        ),
        pipelines=(("box0.gpu0", "host.cpu0"), ("box0.gpu1", "host.cpu0")),
        collectives=(
            Collective(
                group="stage0",
                devices=("box0.gpu0", "box0.gpu1"),
                root="box0.gpu0",
                trees=(Tree(edges=(("box0.gpu0", "box0.gpu1"),), weight=47.5),),
                rate_gbps=47.5,
                bound_gbps=47.5,
                ring_gbps=23.75,
            ),
        ),
        predicted=Prediction(
            iteration_s=0.21,
            samples_per_s=304.76,
            simulated_iteration_s=0.2234,
            baselines={"dp": 0.35, "mp": 0.61, "hp": 0.27, "no_trees": 0.24},
        ),
        solver=SolverInfo(name="PULP_CBC_CMD", status="Optimal", solve_s=0.84, gap=0.0),
    )


SPECS = {"cluster": (ClusterSpec, make_cluster), "model": (ModelSpec, make_model), "plan": (Plan, make_plan)}


@pytest.mark.parametrize("name", SPECS)
def test_dict_round_trip(name):
    cls, make = SPECS[name]
    spec = make()
    data = to_dict(spec)
    assert list(data)[:2] == ["kind", "schema_version"]
    assert from_dict(cls, data, f"{name}.yaml") == spec


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
@pytest.mark.parametrize("name", SPECS)
def test_file_round_trip(name, suffix, tmp_path):
    cls, make = SPECS[name]
    spec = make()
    path = save(spec, tmp_path / f"{name}{suffix}")
    loaded = load(cls, path)
    assert loaded == spec
    assert to_dict(loaded) == to_dict(spec)
    assert [p.name for p in tmp_path.iterdir()] == [f"{name}{suffix}"]  # no temp file left behind


def test_round_trip_keeps_what_the_runtime_reads(tmp_path):
    plan = load(Plan, save(make_plan(), tmp_path / "plan.yaml"))
    assert plan.schedule is Schedule.ONE_F_ONE_B and plan.sync.mode is SyncMode.WBSP
    assert plan.stages[0].devices == ("box0.gpu0", "box0.gpu1")
    assert plan.collectives[0].trees[0].edges == (("box0.gpu0", "box0.gpu1"),)
    assert plan.rank_of("host.cpu0") == 2 and plan.num_layers == 3
    cluster = load(ClusterSpec, save(make_cluster(), tmp_path / "cluster.yaml"))
    assert cluster.device("host.cpu0").cpu_cores == (0, 1, 2, 3)
    assert cluster.link("box0.gpu0", "host.cpu0").bandwidth_gbps == 1.25


def test_optional_fields_left_unset_are_not_written():
    text = dump_yaml(
        Plan(
            cluster="c",
            model=ModelRef(name="m", source="mlp"),
            devices=("d0",),
            global_batch=8,
            stages=(Stage(layer_start=0, layer_end=5, micro_batch=8, workers=(StageWorker(device="d0", share=1.0),)),),
        )
    )
    assert "predicted" not in text and "solver" not in text and "null" not in text


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=lambda p: p.name)
def test_example_clusters_round_trip(path, tmp_path):
    cluster = load(ClusterSpec, path)
    assert from_dict(ClusterSpec, to_dict(cluster)) == cluster
    assert load(ClusterSpec, save(cluster, tmp_path / path.name)) == cluster


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_specs_built_in_code_are_checked_too(bad):
    """A NaN computed by a profiler or planner is refused when the spec is built, not when it is
    read back (NaN slips through ``< 0`` and ``<= 0``)."""
    from felactl.spec.codec import FieldProblem

    with pytest.raises(FieldProblem, match="fwd_ms"):
        LayerTiming(device_model="cpu", micro_batch=1, fwd_ms=bad, bwd_ms=0.1)
    with pytest.raises(FieldProblem, match="bandwidth_gbps"):
        Link(src="a", dst="b", bandwidth_gbps=bad, latency_us=1.0, type=LinkType.NET)


def test_a_plan_whose_reduce_trees_grow_from_other_roots_than_its_broadcast_trees_is_refused(tmp_path):
    """Pieces dealt to a root go up that root's reduce trees and down its broadcast trees: a root
    with trees one way only would leave its pieces unsummed or never sent back."""
    from felactl.spec.codec import FieldProblem

    chain = Tree(edges=(("a", "b"), ("b", "c")), weight=1.0)
    into_b = Tree(edges=(("b", "a"), ("a", "c")), weight=1.0)
    with pytest.raises(FieldProblem, match="rooted at b where the broadcast trees are rooted at a"):
        Collective(
            group="g", devices=("a", "b", "c"), root="a", trees=(chain,), reduce_trees=(into_b,),
            rate_gbps=1.0, bound_gbps=1.0, ring_gbps=1.0,
        )  # fmt: skip
    rooted = Collective(
        group="g", devices=("a", "b", "c"), root="a", trees=(chain, Tree(edges=(("b", "c"), ("c", "a")), weight=2.0)),
        reduce_trees=(into_b, Tree(edges=(("a", "c"), ("c", "b")), weight=2.0)),
        rate_gbps=3.0, bound_gbps=3.0, ring_gbps=1.0,
    )  # fmt: skip
    assert [t.root for t in rooted.trees] == ["a", "b"]


def test_a_tree_must_grow_from_one_root():
    from felactl.spec.codec import FieldProblem

    with pytest.raises(FieldProblem, match="one root"):
        Tree(edges=(("a", "b"), ("b", "a")), weight=1.0)
    with pytest.raises(FieldProblem, match="one root"):
        Tree(edges=(("a", "b"), ("c", "d")), weight=1.0)
