"""Memory holds under the schedule that runs (issue 14, item 1): the simulator holds every worker
to the in-flight limit the plan's memory model assumed, recomputes the forward of a stolen
backward, reports each device's peak memory; plans keep headroom."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from felactl.cli.plan import _why_sharded
from felactl.errors import PlanInfeasible
from felactl.optimizer.cost import CostModel, MemoryHeadroom, stage_memory_bytes
from felactl.optimizer.planner import make_plan
from felactl.optimizer.simulator import Stragglers, simulate
from felactl.spec import (
    ModelRef,
    Plan,
    Schedule,
    Stage,
    StageWorker,
    SyncMode,
    SyncSpec,
    check_executable,
    load_cluster,
    load_model,
)
from felactl.spec.checks import tied_across_kinds
from felactl.spec.model import TiedWeight
from tests.planner_fixtures import as_cpu_slots, cluster, model, tight_instance

ROOT = Path(__file__).resolve().parents[1]

FAST_THEN_SLOW = cluster([[("fast", 40.0, 16.0), ("slow", 2.0, 16.0)]])
NET = model([(10_000_000, 2_000_000, 2e9), (10_000_000, 2_000_000, 2e9)])


def _pipeline(max_in_flight):
    """Stage 0 on the fast device, stage 1 on the slow one: the fast one runs ahead."""
    stages = tuple(
        Stage(
            layer_start=s,
            layer_end=s + 1,
            micro_batch=4,
            max_in_flight=max_in_flight,
            workers=(StageWorker(device=d, share=1.0),),
        )
        for s, d in enumerate(("n0.d0", "n0.d1"))
    )
    return Plan(
        cluster="test",
        model=ModelRef(name="m", source="mlp"),
        devices=("n0.d0", "n0.d1"),
        global_batch=64,
        schedule=Schedule.TOKENS,
        sync=SyncSpec(mode=SyncMode.TOKENS),
        stages=stages,
    )


def test_the_simulator_holds_a_worker_to_the_in_flight_limit():
    cost = CostModel(FAST_THEN_SLOW, NET)
    weights = stage_memory_bytes(NET, 0, 1, 4, 0)
    per_micro_batch = stage_memory_bytes(NET, 0, 1, 4, 1) - weights
    unlimited = simulate(_pipeline(None), cost)
    assert unlimited.peak_memory_bytes["n0.d0"] >= weights + 8 * per_micro_batch  # runs far ahead
    limited = simulate(_pipeline(2), cost)
    assert limited.peak_memory_bytes["n0.d0"] == pytest.approx(weights + 2 * per_micro_batch)
    assert not limited.in_flight_exceeded
    assert limited.iteration_s == pytest.approx(unlimited.iteration_s, rel=0.05)  # the slow stage sets the pace


def test_a_stolen_backward_recomputes_its_forward():
    """Data parallel on two devices, one asleep at the start: the other takes its tokens, and the
    backwards whose forward ran on the sleeper cost the thief a forward more."""
    spec = cluster([[("g", 10.0, 16.0), ("g", 10.0, 16.0)]])
    stage = Stage(
        layer_start=0,
        layer_end=2,
        micro_batch=4,
        max_in_flight=1,
        workers=(StageWorker(device="n0.d0", share=0.5), StageWorker(device="n0.d1", share=0.5)),
    )
    plan = Plan(
        cluster="test",
        model=ModelRef(name="m", source="mlp"),
        devices=("n0.d0", "n0.d1"),
        global_batch=16,
        schedule=Schedule.TOKENS,
        sync=SyncSpec(mode=SyncMode.TOKENS),
        stages=(stage,),
    )
    cost = CostModel(spec, NET)
    fwd, bwd = cost.stage_times_s(0, 2, "n0.d0", 4)
    sim = simulate(plan, cost, Stragglers(slowdown={"n0.d1": 100.0}))
    stolen = [i for i in sim.intervals if i.device == "n0.d0" and i.label == "B0" and i.end_s - i.start_s > bwd * 1.5]
    assert all(i.end_s - i.start_s == pytest.approx(fwd + bwd) for i in stolen)


@pytest.mark.parametrize("seed", range(12))
def test_simulated_peak_memory_fits_each_device_less_headroom(seed):
    spec, net, batch = tight_instance(seed)
    plan = make_plan(spec, net, batch, time_limit_s=20)
    cost = CostModel(spec.subset(plan.devices), net)
    result = simulate(plan, cost)
    assert not result.in_flight_exceeded
    for device in plan.devices:
        assert result.peak_memory_bytes[device] <= cost.usable_memory_bytes(device) * (1 + 1e-9)
        assert plan.predicted.simulated_peak_memory_gb[device] == pytest.approx(
            result.peak_memory_bytes[device] / 1e9, abs=1e-5
        )


def test_headroom_is_configurable_and_cuda_only_for_the_reserve():
    spec = cluster([[("g", 10.0, 10.0)]])
    cost = CostModel(spec, NET, headroom=MemoryHeadroom(reserved_gb=2.0, fraction=0.2))
    assert cost.usable_memory_bytes("n0.d0") == pytest.approx(6e9)
    assert CostModel(spec, NET).usable_memory_bytes("n0.d0") == pytest.approx(8e9)
    # 13 GB of weights, gradients and AdamW state: fits 16 GB less the default headroom, not less 4 GB
    big = model([(800_000_000, 4096, 1e9)])
    plan = make_plan(cluster([[("g", 10.0, 16.0)]]), big, 8)
    assert plan.predicted.simulated_peak_memory_gb["n0.d0"] <= 16 * 0.9 - 1
    with pytest.raises(Exception, match="memory"):
        make_plan(cluster([[("g", 10.0, 16.0)]]), big, 8, headroom=MemoryHeadroom(reserved_gb=4.0))


def _llama7b_on_a10gs():
    from benchmarks.synthetic_models import transformer_spec

    cluster = load_cluster(ROOT / "plans" / "clusters" / "h100-a10g-l4.yaml")
    a10gs = [d for d in cluster.device_names if d.startswith("a10g")]
    return cluster, transformer_spec(34, width=4096, seq_len=2048, vocab=32000), a10gs


def test_a_model_no_replica_fits_is_planned_sharded_and_fits_every_device():
    """Llama-7B-like (6.7B parameters: 107 GB of weights, gradients and AdamW state) on 16 A10G of
    24 GB: no cut into stages fits, sharded over the 16 it does; the simulator runs it within each
    device's usable memory."""
    cluster, model, a10gs = _llama7b_on_a10gs()
    plan = make_plan(cluster, model, 256, devices=a10gs, sync="bsp")
    (stage,) = plan.stages
    assert stage.shard and len(stage.workers) == 16 and plan.sync.mode is SyncMode.BSP
    cost = CostModel(cluster.subset(a10gs), model)
    for device, peak_gb in plan.predicted.simulated_peak_memory_gb.items():
        assert 0 < peak_gb * 1e9 <= cost.usable_memory_bytes(device)
    check_executable(plan)
    with pytest.raises(PlanInfeasible, match="sharded over every device it fits .* plan with --sync bsp"):
        make_plan(cluster, model, 256, devices=a10gs, sync="tokens")  # tokens cannot run a sharded stage


def test_sharding_is_not_chosen_where_a_replica_fits_and_is_faster(tmp_path):
    cluster, model, a10gs = _llama7b_on_a10gs()
    small = dataclasses.replace(model, layers=model.layers[:1] + model.layers[1:3] + model.layers[-1:])
    plan = make_plan(cluster, small, 256, devices=a10gs, sync="bsp")
    assert not any(stage.shard for stage in plan.stages)
    assert plan.predicted.baselines["fsdp"] > plan.predicted.iteration_s


def test_a_model_that_fits_nowhere_even_sharded_says_how_much_sharding_would_need():
    cluster, model, a10gs = _llama7b_on_a10gs()
    with pytest.raises(
        PlanInfeasible, match=r"sharded over every device: does not fit sharded either: needs [\d.]+ GB per device"
    ):
        make_plan(cluster, model, 256, devices=a10gs[:4], sync="bsp")


def test_a_plan_that_puts_a_tied_weight_on_two_kinds_of_gpu_is_refused_with_where():
    """A model tied end to end (an LM's head and embedding) that fits replicated on no device of an
    H100-like and an A10G-like: the ILP's only plan cuts it in two, one stage on each kind, whose
    copies of the one weight would not step alike; under tokens (which runs no sharded stage) it is
    refused at plan time, saying where and what to plan instead; under bsp the planner falls back on
    the model sharded over both, one stage, one tensor. (Once a GPT-2-XL on the H100 / A10G / L4
    cluster, whose premise, a split over kinds, CBC's time limit did not always keep under load.)"""
    two_kinds = cluster([[("h100", 40.0, 4.0)], [("a10g", 10.0, 4.0)]])
    untied = model([(30_000_000, 200_000, 2e8)] * 8)
    (first, last) = make_plan(two_kinds, untied, 64).stages  # the premise: cut over the two kinds
    assert {first.workers[0].device, last.workers[0].device} == {"n0.d0", "n1.d0"}
    tied = dataclasses.replace(untied, tied=(TiedWeight(layers=(0, 7), params=untied.layers[0].params),))
    with pytest.raises(
        PlanInfeasible,
        match=r"layers 0 \(l0\) and 7 \(l7\) read one weight .* on 2 kinds of device .*"
        r"plan it on one kind \(--devices of a10g or h100\), or with --max-stages 1",
    ):
        make_plan(two_kinds, tied, 64, sync="tokens")
    (sharded,) = make_plan(two_kinds, tied, 64, sync="bsp").stages
    assert sharded.shard and {w.device for w in sharded.workers} == {"n0.d0", "n1.d0"}


def test_a_sharded_plan_leaves_out_a_device_that_would_slow_every_gather():
    """Llama-7B-like on 8 A10G-like devices and one of a tenth their speed, none holding a replica:
    a sharded stage runs equal shares in lockstep, so the slow one would set every step's pace; the
    planner shards over the 8 (each of which holds its bigger share) and says so, while the fsdp
    baseline, over all 9, is priced slower."""
    _, model, _ = _llama7b_on_a10gs()
    devices = [("a10g", 125.0, 24.0)] * 8 + [("old", 12.5, 24.0)]
    spread = cluster([devices[:3], devices[3:6], devices[6:]], intra_gbps=16.0, inter_gbps=12.5)
    plan = make_plan(spread, model, 288, sync="bsp")
    (stage,) = plan.stages
    assert stage.shard and {w.device for w in stage.workers} == {f"n{i // 3}.d{i % 3}" for i in range(8)}
    assert plan.solver.name == "sharded" and plan.predicted.baselines["fsdp"] > plan.predicted.iteration_s
    assert "over every device (fsdp)" in _why_sharded(plan)
    cost = CostModel(spread, model)
    for device, peak_gb in plan.predicted.simulated_peak_memory_gb.items():
        assert 0 < peak_gb * 1e9 <= cost.usable_memory_bytes(device)
    check_executable(plan)


def test_a_sharded_plan_over_devices_the_batch_does_not_divide_runs_equal_micro_batch_counts():
    """64 samples over 3 devices: 22, 21, 21 (the runtime's split); at micro-batch 1 that is 22
    micro-batches on one and 21 on the others, which a sharded stage cannot run: the planner takes
    a micro-batch that gives each as many (11 of 2), and the plan passes the runtime's check."""
    _, model, _ = _llama7b_on_a10gs()
    small = dataclasses.replace(model, layers=model.layers[:1] + model.layers[1:9] + model.layers[-1:])
    three = cluster([[("a10g", 125.0, 24.0)] * 3])
    plan = make_plan(three, small, 64, sync="bsp")
    (stage,) = plan.stages
    assert stage.shard and len(stage.workers) == 3
    check_executable(plan)


def test_where_nodes_are_joined_by_a_slow_link_the_planner_pipelines_sharded_stages():
    """Llama-7B-like on two nodes of 8 A10G-like devices joined at 1 GB/s: sharded whole over all
    16 every gather crosses the slow link, over one node's 8 it is slow too; pipelines of stages
    each sharded inside a node (PP x FSDP) send only activations across it (8 stages: a stage cut
    from a traced model is gathered whole, which 4 stages' do not leave room for). The plan runs
    (executable, a tied weight nowhere), fits every device in simulation, and is predicted faster
    than the fsdp baseline."""
    _, model, _ = _llama7b_on_a10gs()
    nodes = cluster([[("a10g", 125.0, 24.0)] * 8] * 2, intra_gbps=16.0, inter_gbps=1.0)
    said: list[str] = []
    plan = make_plan(nodes, model, 256, sync="bsp", max_stages=8, progress=said.append)
    assert any("pipelines of" in line for line in said)
    assert len(plan.stages) > 1 and all(stage.shard for stage in plan.stages)
    assert plan.schedule is Schedule.ONE_F_ONE_B and len(plan.pipelines) == len(plan.stages[0].workers)
    for stage in plan.stages:
        assert len({d.split(".")[0] for d in stage.devices}) == 1, "a stage's gathers stay inside a node"
    check_executable(plan)
    cost = CostModel(nodes, model)
    for device, peak_gb in plan.predicted.simulated_peak_memory_gb.items():
        assert 0 < peak_gb * 1e9 <= cost.usable_memory_bytes(device)
    assert plan.predicted.iteration_s < plan.predicted.baselines["fsdp"]
    assert _why_sharded(plan).startswith(f"each of its {len(plan.stages)} stages is sharded over")


def test_pipelines_shard_only_the_stage_whose_replica_does_not_fit():
    """A model whose first layer holds 1.3B parameters (an embedding-sized table: 20.8 GB of
    weights, gradients and AdamW state) before four 50M-parameter blocks, on two nodes of four
    24 GB devices joined at 1 GB/s: no replica of the first stage fits, so it is sharded over its
    node's four; the second stage's replica (1.6 GB) fits, and it is replicated (one all-reduce a
    step instead of gathers in every micro-batch). The plan runs (executable) and fits in
    simulation; every stage sharded is no faster; a tied weight across the stages shards both."""
    from felactl.optimizer import sharded_plans

    nodes = cluster([[("a10g", 125.0, 24.0)] * 4] * 2, intra_gbps=16.0, inter_gbps=1.0)
    net = model([(1_300_000_000, 16_000, 1e6)] + [(50_000_000, 16_000, 3e8)] * 4)
    said: list[str] = []
    plan = make_plan(nodes, net, 64, sync="bsp", max_stages=4, progress=said.append)
    assert [stage.shard for stage in plan.stages] == [True, False] and plan.solver.name == "sharded"
    assert any("stage 0 sharded over 4" in line for line in said), said
    check_executable(plan)
    cost = CostModel(nodes, net)
    peaks = plan.predicted.simulated_peak_memory_gb
    assert all(0 < peaks[d] * 1e9 <= cost.usable_memory_bytes(d) for d in plan.devices)
    stage1 = plan.stages[1]
    replica = stage_memory_bytes(net, stage1.layer_start, stage1.layer_end, stage1.micro_batch, stage1.max_in_flight)
    assert stage1.workers[0].predicted_memory_gb == pytest.approx(replica / 1e9, rel=1e-3), "its whole replica"
    why = _why_sharded(plan)
    assert why.startswith("stage 0 of its 2 stages is sharded over 4 devices") and "stage 1 is replicated" in why
    groups = [list(stage.devices) for stage in plan.stages]
    cuts = [plan.stages[0].layer_start, plan.stages[1].layer_start, plan.stages[1].layer_end]
    mb = plan.stages[0].micro_batch
    shardings = sharded_plans.stage_shardings(cost, net, 64, groups, cuts, mb)
    assert shardings == [(True, False), (True, True)]
    assert plan.predicted.iteration_s <= simulate_sharded(cost, net, groups, cuts, mb, (True, True))
    tied = dataclasses.replace(net, tied=(TiedWeight(layers=(0, 4), params=1000),))
    assert sharded_plans.stage_shardings(CostModel(nodes, tied), tied, 64, groups, cuts, mb) == [(True, True)]


def test_plan_shows_which_stage_is_sharded_and_which_replicated(tmp_path):
    """The same cluster and model as files, through ``felactl plan``: --explain marks the sharded
    stage, the note says which stage is replicated and why, --json carries each stage's flag."""
    import json

    from typer.testing import CliRunner

    from felactl.cli.main import app
    from felactl.spec import save

    save(cluster([[("a10g", 125.0, 24.0)] * 4] * 2, intra_gbps=16.0, inter_gbps=1.0), tmp_path / "c.yaml")
    save(model([(1_300_000_000, 16_000, 1e6)] + [(50_000_000, 16_000, 3e8)] * 4), tmp_path / "m.yaml")
    args = ["plan", "--cluster", str(tmp_path / "c.yaml"), "--model", str(tmp_path / "m.yaml"), "--global-batch", "64"]
    shown = CliRunner().invoke(app, [*args, "--sync", "bsp", "--explain", "-o", str(tmp_path / "p.yaml")])
    assert shown.exit_code == 0, shown.output
    assert "0 (sharded)" in shown.output and "1 (sharded)" not in shown.output
    assert "stage 1 is replicated, as its replicas fit" in " ".join(shown.output.split())
    as_json = CliRunner().invoke(app, [*args, "--sync", "bsp", "--json", "-o", str(tmp_path / "q.yaml")])
    assert as_json.exit_code == 0, as_json.output
    assert [stage["shard"] for stage in json.loads(as_json.stdout)["stages"]] == [True, False]


def test_a_plan_that_shards_one_holder_of_a_tied_weight_and_not_another_is_refused_at_check(tmp_path):
    """A tied weight's copies sum shard by shard: a plan (one written by hand, say) that shards the
    stage holding the embedding and replicates the one holding the tied head cannot run; ``felactl
    check`` says so with the model profile, exit 2 in one line, before any worker starts."""
    from typer.testing import CliRunner

    from felactl.cli.main import app
    from felactl.spec import save

    nodes = cluster([[("a10g", 125.0, 24.0)] * 4] * 2, intra_gbps=16.0, inter_gbps=1.0)
    net = model([(1_300_000_000, 16_000, 1e6)] + [(50_000_000, 16_000, 3e8)] * 4)
    plan = make_plan(nodes, net, 64, sync="bsp", max_stages=4)
    assert [stage.shard for stage in plan.stages] == [True, False]
    tied = dataclasses.replace(net, tied=(TiedWeight(layers=(0, 4), params=1000),))
    save(plan, tmp_path / "plan.yaml")
    save(tied, tmp_path / "model.yaml")
    result = CliRunner().invoke(app, ["check", str(tmp_path / "plan.yaml"), str(tmp_path / "model.yaml")])
    assert result.exit_code == 2, result.output
    line = " ".join(result.output.split())
    assert "read one weight (tied), held by stage 0 (sharded over 4), stage 1 (replicated)" in line
    save(net, tmp_path / "untied.yaml")
    assert CliRunner().invoke(app, ["check", str(tmp_path / "plan.yaml"), str(tmp_path / "untied.yaml")]).exit_code == 0


def simulate_sharded(cost, net, groups, cuts, micro_batch, shard) -> float:
    """The simulated iteration of the pipelines of ``groups`` cut at ``cuts``, sharded as ``shard``."""
    from felactl.optimizer import baselines, sharded_plans

    plan = sharded_plans._plan(cost, net, 64, groups, cuts, micro_batch, shard)
    return simulate(plan, dataclasses.replace(baselines.rings_only(cost), ring_order=plan.devices)).iteration_s


def test_a_sharded_stage_pays_each_units_gathers_at_its_slowest_hosts_pace():
    """FSDP's host work per unit gather (FSDP_GATHER_CPU_S) is paid by every gather of the stage,
    at the pace of the slowest member's host: a CPU slot held to 0.12 of a core takes 1/0.12 as
    long, and every member waits for it (the must-shard benchmark: ~37 ms a gather there)."""
    from felactl.optimizer.cost import FSDP_GATHER_CPU_S
    from felactl.optimizer.sharding import fsdp_units, sharded_comm_s

    def slots(quota):
        spec = as_cpu_slots(cluster([[("Xeon", 1.0, 8.0)], [("Xeon", 1.0, 8.0)]]))
        nodes = [
            dataclasses.replace(spec.nodes[0]),
            dataclasses.replace(
                spec.nodes[1], devices=(dataclasses.replace(spec.nodes[1].devices[0], model=f"Xeon @ {quota} cores"),)
            ),
        ]
        return dataclasses.replace(spec, nodes=tuple(nodes))

    net = model([(1000, 100, 1e6)] * 6)
    full, throttled = CostModel(slots(1), net), CostModel(slots(0.12), net)
    devices = ("n0.d0", "n1.d0")
    units = fsdp_units(net, 0, net.num_layers)
    assert units == 5 and fsdp_units(net, 1, 3) == 1, "the whole model: its blocks and the root; a stage: one"
    extra = sharded_comm_s(throttled, devices, 0, 6, 4) - sharded_comm_s(full, devices, 0, 6, 4)
    assert extra == pytest.approx(9 * units * FSDP_GATHER_CPU_S * (1 / 0.12 - 1))


def test_where_the_ilps_cut_puts_a_tied_weight_on_two_kinds_a_sharded_plan_runs_instead():
    """The must-shard benchmark's own profiles (tests/data: the LLaMA example, tied, timed in every
    node of the one-slow testbed, each node's memory capped at 0.75 of its training state): the
    ILP's fastest plan puts the embedding and the tied head on nodes of two kinds; `felactl plan`
    exited 2 there, though the model sharded over every node fits. Now the planner falls back on
    that sharded plan. And one stage holds one tensor, whatever kinds its devices are: no copies."""
    data = ROOT / "tests" / "data"
    capped = load_cluster(data / "one-slow-capped.cluster.yaml")
    llama = load_model(data / "llama-one-slow.model.yaml")
    assert llama.tied
    plan = make_plan(capped, llama, 64, sync="bsp")
    assert [stage.shard for stage in plan.stages] == [True] and plan.solver.name == "sharded"
    assert len({capped.device(d).model for d in plan.devices}) == 2
    assert tied_across_kinds(plan, llama, capped) is None


def test_a_sharded_plan_over_devices_of_unequal_memory_leaves_out_those_too_small_to_hold_a_shard():
    """Llama-7B-like on 4 fast GPUs of 16 GB and 4 slower of 40 GB: no cut into stages fits;
    sharded over all 8 (or any group with a 16 GB one) a shard does not fit the small ones, over
    the 4 large ones it does. The planner shards over those (it once took groups fastest first
    only, every one of which held a small device, and refused the model, "needs 19.1 GB per device
    (13.4 GB usable on the smallest)"); every worker's simulated peak fits its device."""
    from benchmarks.synthetic_models import transformer_spec

    uneven = cluster([[("fast-16g", 100.0, 16.0)] * 4, [("big-40g", 60.0, 40.0)] * 4])
    llama7b = transformer_spec(34, width=4096, seq_len=2048, vocab=32000)
    plan = make_plan(uneven, llama7b, 256, sync="bsp")
    (stage,) = plan.stages
    assert stage.shard and {w.device for w in stage.workers} == {f"n1.d{i}" for i in range(4)}
    cost = CostModel(uneven, llama7b)
    for device, peak_gb in plan.predicted.simulated_peak_memory_gb.items():
        assert 0 < peak_gb * 1e9 <= cost.usable_memory_bytes(device)


def test_a_model_no_group_of_unequal_devices_holds_sharded_is_refused_with_the_smallest_ones_memory():
    from benchmarks.synthetic_models import transformer_spec

    small = cluster([[("gpu-24g", 60.0, 24.0)] * 2, [("gpu-12g", 60.0, 12.0)] * 2])
    llama7b = transformer_spec(34, width=4096, seq_len=2048, vocab=32000)
    usable = CostModel(small, llama7b).usable_memory_bytes("n1.d0") / 1e9
    with pytest.raises(PlanInfeasible, match=rf"needs [\d.]+ GB per device \({usable:.3g} GB usable on the smallest\)"):
        make_plan(small, llama7b, 256, sync="bsp")
