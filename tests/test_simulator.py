"""The discrete-event simulator: agreement with the ILP, and what stragglers cost."""

from __future__ import annotations

from pathlib import Path

import pytest

from felactl.errors import InputError
from felactl.optimizer.cost import CostModel
from felactl.optimizer.planner import make_plan
from felactl.optimizer.simulator import Stragglers, simulate, sleeps_s
from felactl.spec import load_cluster, load_model
from tests.planner_fixtures import cluster, model

ROOT = Path(__file__).resolve().parents[1]


def _two_stage_plan():
    # conv-like layers, then two FC layers too large to share an 8 GB device: a 3-stage plan
    spec = cluster(
        [[("fast", 20.0, 8.0), ("fast", 20.0, 8.0)], [("slow", 5.0, 8.0), ("slow", 5.0, 8.0)]],
        intra_gbps=50.0,
        inter_gbps=10.0,
    )
    net = model([(50_000, 200_000, 5e9), (100_000, 100_000, 5e9), (300_000_000, 16_000, 6e8), (200_000_000, 400, 4e8)])
    # Batch 256: with each token's overhead priced, at 128 the planner gives each FC layer a stage
    # of one 128-sample token, and the ILP's fill counts that one token twice (as fill and as load).
    return spec, net, make_plan(spec, net, 256, use_trees=False)


@pytest.mark.parametrize("cluster_name,model_name", [("dgx1v", "vgg-mini"), ("dgx1v", "gpt-mini"), ("dgx1v-x2", "mlp")])
def test_simulator_agrees_with_the_ilp_on_shipped_examples(cluster_name, model_name):
    spec = load_cluster(ROOT / "plans" / "clusters" / f"{cluster_name}.yaml")
    net = load_model(ROOT / "plans" / "models" / f"{model_name}.yaml")
    plan = make_plan(spec, net, 256)
    simulated, predicted = plan.predicted.simulated_iteration_s, plan.predicted.iteration_s
    if len(plan.stages) == 1:
        assert simulated == pytest.approx(predicted, rel=0.10)
    else:  # mlp on two DGX-1Vs pipelines its 0.2 ms step over 3 stages since the trees' pieces are
        # priced: the simulator overlaps the fill the ILP charges whole
        assert 0.9 * predicted <= simulated <= 1.12 * predicted


def test_simulator_agrees_with_the_ilp_on_a_memory_forced_pipeline():
    _, _, plan = _two_stage_plan()
    assert len(plan.stages) >= 2  # the two FC layers fit no device together
    # The ILP charges a whole micro-batch of fill per stage; token pulling overlaps part of it.
    simulated, predicted = plan.predicted.simulated_iteration_s, plan.predicted.iteration_s
    assert 0.8 * predicted <= simulated <= 1.10 * predicted


def test_a_slow_device_costs_time_and_helpers_absorb_part_of_it():
    spec, net, plan = _two_stage_plan()
    cost = CostModel(spec.subset(plan.devices), net, use_trees=False)
    base = simulate(plan, cost).iteration_s
    victim = plan.stages[0].workers[0].device
    slowed = simulate(plan, cost, Stragglers(slowdown={victim: 3.0})).iteration_s
    busy = simulate(plan, cost).busy_s(victim)
    assert base < slowed
    # without helping the victim's own work would take 3x: others take some of its tokens
    assert slowed < base + 2.0 * busy


def test_sleep_patterns():
    devices = ("a", "b", "c")
    assert sleeps_s(devices, Stragglers(pattern="roundrobin:0.5", iteration=4)) == {"b": 0.5}
    first = sleeps_s(devices, Stragglers(pattern="prob:0.5:1", seed=7))
    assert first == sleeps_s(devices, Stragglers(pattern="prob:0.5:1", seed=7))  # seeded
    assert set(first.values()) <= {1.0}
    with pytest.raises(InputError, match="straggler pattern"):
        sleeps_s(devices, Stragglers(pattern="sometimes"))


def test_a_round_robin_sleep_delays_the_iteration_by_at_most_the_sleep():
    spec, net, plan = _two_stage_plan()
    cost = CostModel(spec.subset(plan.devices), net, use_trees=False)
    base = simulate(plan, cost).iteration_s
    delayed = simulate(plan, cost, Stragglers(pattern=f"roundrobin:{base / 2}")).iteration_s
    assert base < delayed <= base * 1.5 + 1e-9


def test_a_producer_serves_its_output_while_it_computes():
    """One micro-batch through a two-stage pipeline over a link that differs by direction: each
    stage pays for fetching its input (a request there, the tensor back over the link it arrives
    on) and nothing for serving its output (the runtime's server thread sends it). Charged a
    'send' before its next token, as the simulator once did, the first stage's device paid the
    activation's 4 ms on the slow link twice."""
    from felactl.optimizer.evaluate import StageChoice
    from felactl.optimizer.planner import _plan_from
    from felactl.spec import SyncMode
    from tests.planner_fixtures import one_way_pair

    net = model([(1000, 1_000_000, 1e6), (1000, 10, 1e6)])  # 1 MB of activation per sample at the cut
    cost = CostModel(one_way_pair(), net, use_trees=False, token_cpu_s=0.0, token_server_cpu_s=0.0)
    stages = (StageChoice(0, 1, 4, (("n0.d0", 1.0),)), StageChoice(1, 2, 4, (("n1.d0", 1.0),)))
    plan = _plan_from(stages, cost, net, 4, SyncMode.TOKENS, use_trees=False, max_stages=2)
    first_fwd, first_bwd = cost.stage_times_s(0, 1, "n0.d0", 4)
    last_fwd, last_bwd = cost.stage_times_s(1, 2, "n1.d0", 4)
    request = 100e-6 + 10e-6
    activation_in, gradient_back = request + 4e6 / 1e9, request + 4e6 / 100e9
    expected = first_fwd + activation_in + last_fwd + last_bwd + gradient_back + first_bwd
    assert simulate(plan, cost).iteration_s == pytest.approx(expected)


def test_a_static_pipelines_stage_pays_its_messages_to_each_neighbour():
    """A static pipeline claims no tokens: each forward and backward of a stage handles one message
    from or to each neighbouring stage, host work a CPU slot under a quota pays over its quota:
    PIPELINE_MESSAGE_CPU_S to another node (measured on the one-slow testbed, where an inner
    stage's host work per micro-batch was twice an end stage's; priced as two tokens at every
    stage, a 1F1B chain through its 0.12-core node ran 0.66 of its prediction), LOCAL_MESSAGE_CPU_S
    to one on its own node (over loopback: priced at the testbed's, a chain of two local slots was
    predicted at half the speed it ran). BENCHMARKS.md, 2026-11-30."""
    import dataclasses

    from felactl.optimizer.cost import LOCAL_MESSAGE_CPU_S, PIPELINE_MESSAGE_CPU_S
    from felactl.spec import ModelRef, Plan, Schedule, Stage, StageWorker, SyncMode, SyncSpec
    from tests.planner_fixtures import as_cpu_slots

    # stage 0 on n0; stages 1 (a 0.12-core slot) and 2 on n1: one remote and one local neighbour
    slots = as_cpu_slots(cluster([[("Xeon", 1.0, 8.0)], [("Xeon @ 0.12 cores", 1.0, 8.0), ("Xeon", 1.0, 8.0)]]))
    net = model([(1000, 100, 1e6)] * 3)
    devices = ("n0.d0", "n1.d0", "n1.d1")
    plan = Plan(
        cluster=slots.name,
        model=ModelRef(name=net.name, source=net.source),
        devices=devices,
        global_batch=4,
        schedule=Schedule.ONE_F_ONE_B,
        sync=SyncSpec(mode=SyncMode.BSP, use_trees=False),
        stages=tuple(
            Stage(layer_start=s, layer_end=s + 1, micro_batch=1, workers=(StageWorker(device=d, share=1.0),))
            for s, d in enumerate(devices)
        ),
        pipelines=(devices,),
    )

    def busy(remote_s: float, local_s: float) -> dict[str, float]:  # of ``plan`` as it is when called
        cost = dataclasses.replace(CostModel(slots, net), message_cpu_s=remote_s, local_message_cpu_s=local_s)
        intervals = simulate(plan, cost).intervals
        return {d: sum(i.end_s - i.start_s for i in intervals if i.device == d and i.label[0] in "FB") for d in devices}

    tokens = 2 * plan.global_batch  # a forward and a backward per micro-batch
    remote, local = PIPELINE_MESSAGE_CPU_S, LOCAL_MESSAGE_CPU_S
    for schedule in (Schedule.ONE_F_ONE_B, Schedule.GPIPE):
        plan = dataclasses.replace(plan, schedule=schedule)
        priced, without = busy(remote, local), busy(0.0, 0.0)
        paid = {d: priced[d] - without[d] for d in devices}
        assert paid["n0.d0"] == pytest.approx(tokens * remote), "one neighbour, on another node: a message a token"
        assert paid["n1.d1"] == pytest.approx(tokens * local), "one neighbour, on its node"
        assert paid["n1.d0"] == pytest.approx(tokens * (remote + local) / 0.12), "both, over its quota"
    plan = dataclasses.replace(plan, schedule=Schedule.TOKENS, pipelines=(), sync=SyncSpec(mode=SyncMode.TOKENS))
    assert busy(10 * remote, 10 * local) == busy(0.0, 0.0), "the tokens runtime pays its tokens, not messages"
