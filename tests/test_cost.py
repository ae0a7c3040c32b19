"""The cost model's formulas, each checked against a hand-computed number."""

from __future__ import annotations

import dataclasses

import pytest

from felactl.optimizer.compute_cost import b_half, efficiency, layer_times_s
from felactl.optimizer.cost import TOKEN_OVERHEAD_S, CostModel, micro_batch_options, stage_memory_bytes
from felactl.optimizer.evaluate import (
    StageChoice,
    exchange_per_sample_s,
    predict,
    stage_fill_s,
    stage_tokens,
    token_samples,
)
from felactl.spec import Device, DeviceKind, Layer, LayerTiming, LinkType, SyncTiming, cpu_of_slot_model, cpu_slot_model
from tests.planner_fixtures import as_cpu_slots, cluster, model, one_way_pair

GPU = Device(name="g", kind=DeviceKind.CUDA, model="G1", tflops=10.0, memory_gb=16.0)


def _linear(params: int = 1_000_000, timings=()) -> Layer:
    return Layer(
        name="fc",
        params=params,
        param_bytes=4 * params,
        activation_bytes_per_sample=4000,
        fwd_flops_per_sample=2.0 * params,
        bwd_flops_per_sample=4.0 * params,
        timings=timings,
    )


def test_b_half_follows_arithmetic_intensity():
    assert b_half(_linear()) == pytest.approx(100.0)  # 2 FLOPs per 4 bytes: ridge 50 / 0.5
    conv = Layer(
        name="conv",
        params=1000,
        param_bytes=4000,
        activation_bytes_per_sample=1,
        fwd_flops_per_sample=4e6,
        bwd_flops_per_sample=8e6,
    )
    assert b_half(conv) == 0.5  # clamped: a conv saturates at once
    assert efficiency(100, 100.0) == 0.5


def test_flops_time_uses_the_saturation_curve():
    fwd, bwd = layer_times_s(_linear(), GPU, 100)
    # 2e6 FLOPs x 100 samples at 10 TFLOP/s x efficiency 0.5
    assert fwd == pytest.approx(2e8 / (10e12 * 0.5))
    assert bwd == pytest.approx(2 * fwd)


def test_measured_times_win_and_are_scaled_to_other_batches():
    layer = _linear(timings=(LayerTiming(device_model="G1", micro_batch=100, fwd_ms=3.0, bwd_ms=6.0),))
    assert layer_times_s(layer, GPU, 100) == pytest.approx((0.003, 0.006))
    fwd_200, _ = layer_times_s(layer, GPU, 200)
    # per sample: 0.03 ms at eff(100) = 0.5; at eff(200) = 2/3 -> 0.0225 ms; x 200 samples
    assert fwd_200 == pytest.approx(200 * 0.003 / 100 * 0.5 / (2 / 3))
    other = Device(name="h", kind=DeviceKind.CUDA, model="H9", tflops=10.0, memory_gb=16.0)
    assert layer_times_s(layer, other, 100) == layer_times_s(_linear(), GPU, 100)


def test_memory_counts_weights_grads_adamw_and_activations():
    net = model([(1000, 10, 1.0), (2000, 20, 1.0)], input_bytes=5)
    # weights: 2 x 4 bytes (param + grad) + 8 bytes AdamW per param = 16 bytes/param
    # saved per sample, without a profiled number: input + output of each layer
    assert stage_memory_bytes(net, 0, 2, micro_batch=4, in_flight=3) == 16 * 3000 + (5 + 10 + 10 + 20) * 4 * 3
    assert stage_memory_bytes(net, 1, 2, micro_batch=1, in_flight=1) == 16 * 2000 + (10 + 20)
    profiled = dataclasses.replace(
        net, layers=(net.layers[0], dataclasses.replace(net.layers[1], saved_bytes_per_sample=7))
    )
    assert stage_memory_bytes(profiled, 1, 2, micro_batch=2, in_flight=1) == 16 * 2000 + 7 * 2


def test_links_relay_when_there_is_no_direct_link():
    spec = cluster([[("g", 10.0, 8.0)], [("g", 10.0, 8.0)]], inter_gbps=2.0)
    cost = CostModel(spec, model([(1, 1, 1.0)]), use_trees=False)
    assert cost.link_time_s("n0.d0", "n1.d0", 2e9) == pytest.approx(20e-6 + 1.0)
    # one fetch = the request there, the tensor back, averaged over the (one) peer
    assert cost.mean_fetch_s("n0.d0", 2e9) == pytest.approx(2 * 20e-6 + 1.0)


def test_a_stage_pays_for_fetching_its_inputs_not_for_serving_its_outputs():
    """The runtimes pull a stage's inputs (tokens: the consumer asks, the producer's server thread
    answers while it computes; static pipelines: isend, then the consumer's recv): each boundary
    tensor is paid once, by the device that waits for it, over the link it arrives on."""
    net = model([(1000, 1_000_000, 1e6), (1000, 10, 1e6)])  # 1 MB of activation per sample at the cut
    cost = CostModel(one_way_pair(), net, use_trees=False)
    request = 100e-6 + 10e-6  # one small message each way
    # the later stage on b fetches activations over a -> b; it sends its input gradients back for free
    assert exchange_per_sample_s(cost, 1, 2, 4, "n1.d0") == pytest.approx((request + 4e6 / 1e9) / 4)
    # the earlier stage on a fetches those gradients over b -> a, and serves its activations for free
    assert exchange_per_sample_s(cost, 0, 1, 4, "n0.d0") == pytest.approx((request + 4e6 / 100e9) / 4)


def test_the_pipeline_fill_waits_for_the_first_activation_and_the_last_gradient():
    net = model([(1000, 1_000_000, 1e6), (1000, 10, 1e6)])
    cost = CostModel(one_way_pair(), net, use_trees=False)
    first = StageChoice(0, 1, 4, (("n0.d0", 1.0),))
    last = StageChoice(1, 2, 4, (("n1.d0", 1.0),))
    _, first_bwd = cost.stage_times_s(0, 1, "n0.d0", 4)
    last_fwd, last_bwd = cost.stage_times_s(1, 2, "n1.d0", 4)
    request = 100e-6 + 10e-6
    activation_in, gradient_back = request + 4e6 / 1e9, request + 4e6 / 100e9
    assert stage_fill_s(cost, first) == pytest.approx(first_bwd + gradient_back)
    assert stage_fill_s(cost, last) == pytest.approx(activation_in + last_fwd + last_bwd)
    got = predict(cost, (first, last), 8, max_stages=2)
    assert got.fill_s == pytest.approx(first_bwd + gradient_back + activation_in + last_fwd + last_bwd)


def test_tokens_are_apportioned_whole():
    shares = (("a", 0.5), ("b", 0.3), ("c", 0.2))
    assert token_samples(shares, 10, 1) == {"a": 5, "b": 3, "c": 2}
    assert token_samples(shares, 10, 4) == {"a": 8, "b": 2, "c": 0}  # 3 tokens, the last holds 2 samples
    assert token_samples((("f", 0.4), ("g", 0.4), ("s", 0.1), ("t", 0.1)), 16, 1) == {"f": 7, "g": 7, "s": 1, "t": 1}
    assert sum(token_samples((("a", 0.5), ("b", 0.5)), 7, 2).values()) == 7


def test_prediction_of_data_parallel_by_hand():
    spec = cluster([[("g", 10.0, 8.0), ("g", 10.0, 8.0)]], intra_gbps=10.0)
    net = model([(1_000_000, 1000, 1e9)])
    cost = CostModel(spec, net, use_trees=False)
    stage = StageChoice(0, 1, 4, (("n0.d0", 0.5), ("n0.d1", 0.5)))
    got = predict(cost, (stage,), 8, max_stages=1)
    compute = 4 * 3e9 / 10e12  # 4 samples x (fwd + bwd) FLOPs at full speed (conv-like layer)
    from felactl.optimizer.ring_cost import ring_allreduce_time_s

    ring = ring_allreduce_time_s(spec, ["n0.d0", "n0.d1"], 4e6)
    assert got.fill_s == 0.0
    one_token = TOKEN_OVERHEAD_S  # each device runs one token of 4 samples; a GPU's host at full speed
    assert got.iteration_s == pytest.approx(compute / efficiency(4, b_half(net.layers[0])) + one_token + ring)


def test_micro_batch_options():
    assert micro_batch_options(20) == (1, 2, 4, 8, 16)
    assert micro_batch_options(256, max_options=4) == (4, 32, 256)


def test_optimizer_step_is_charged_by_parameter_share_on_the_profiled_hardware():
    timing = (LayerTiming(device_model="G1", micro_batch=1, fwd_ms=1.0, bwd_ms=2.0),)
    net = dataclasses.replace(model([(1000, 10, 1.0), (3000, 10, 1.0)]), optimizer_step_ms=8.0)
    net = dataclasses.replace(net, layers=tuple(dataclasses.replace(l, timings=timing) for l in net.layers))
    spec = cluster([[("G1", 10.0, 8.0), ("H9", 10.0, 8.0)]])
    cost = CostModel(spec, net, use_trees=False)
    assert cost.optimizer_step_s(0, 2, "n0.d0") == pytest.approx(0.008)
    assert cost.optimizer_step_s(1, 2, "n0.d0") == pytest.approx(0.006)  # 3000 of 4000 parameters
    assert cost.optimizer_step_s(0, 2, "n0.d1") == 0.0  # not profiled on H9: unknown
    assert CostModel(spec, dataclasses.replace(net, optimizer_step_ms=None)).optimizer_step_s(0, 2, "n0.d0") == 0.0
    # a one-stage, one-device plan: the iteration is its micro-batches' compute plus one step
    stage = StageChoice(0, 2, 1, (("n0.d0", 1.0),))
    with_step = predict(cost, (stage,), 4, 1).iteration_s
    without = predict(
        CostModel(spec, dataclasses.replace(net, optimizer_step_ms=None), use_trees=False), (stage,), 4, 1
    ).iteration_s
    assert without == pytest.approx(4 * (2 * 0.003 + TOKEN_OVERHEAD_S))
    assert with_step - without == pytest.approx(0.008)


def test_simulator_charges_the_same_optimizer_step_as_the_prediction():
    from felactl.optimizer.planner import make_plan

    timing = (LayerTiming(device_model="G1", micro_batch=1, fwd_ms=1.0, bwd_ms=2.0),)
    net = dataclasses.replace(model([(1000, 10, 1.0), (3000, 10, 1.0)]), optimizer_step_ms=8.0)
    net = dataclasses.replace(net, layers=tuple(dataclasses.replace(l, timings=timing) for l in net.layers))
    plan = make_plan(cluster([[("G1", 10.0, 8.0)]]), net, 4, sync="bsp")
    assert plan.predicted.simulated_iteration_s == pytest.approx(plan.predicted.iteration_s)
    assert plan.predicted.iteration_s > 0.008


def test_a_measured_data_parallel_sync_calibrates_its_group_and_the_groups_inside_it():
    spec = cluster([[("g", 10.0, 8.0)] * 4], intra_gbps=10.0)
    plain = model([(1_000_000, 1000, 1e9), (3_000_000, 1000, 1e9)])  # 16 MB of gradients
    link_based = CostModel(spec, plain, use_trees=False)
    trio, pair, other = ("n0.d0", "n0.d1", "n0.d2"), ("n0.d2", "n0.d0"), ("n0.d0", "n0.d3")
    trio_s = link_based.sync_time_s(trio, 16e6)

    def timing(ms: float, cluster_name: str = "test") -> SyncTiming:
        return SyncTiming(cluster=cluster_name, devices=trio[::-1], backend="gloo", micro_batch=4, sync_ms=ms)

    def measured(ms: float, cluster_name: str = "test") -> CostModel:
        return CostModel(
            spec, dataclasses.replace(plain, data_parallel_sync=(timing(ms, cluster_name),)), use_trees=False
        )

    # What the profile measures (a DDP step with its sum less one without) is the sum that
    # backward did not hide: the estimate of that is what it calibrates.
    estimate_s = link_based.measured_sync_estimate_s(timing(1.0))
    assert 0 < estimate_s < trio_s, "the first bucket's sum runs under the backward of the first layer"
    cost = measured(estimate_s * 5e3)  # the trio synced 5x slower than its links say
    assert cost.sync_time_s(trio, 16e6) == pytest.approx(5 * trio_s)  # any device order
    assert cost.sync_time_s(trio, 4e6) == pytest.approx(5 * link_based.sync_time_s(trio, 4e6))  # a stage's bytes
    assert cost.sync_time_s(pair, 16e6) == pytest.approx(5 * link_based.sync_time_s(pair, 16e6))  # inside the trio
    assert cost.sync_time_s(other, 16e6) == pytest.approx(link_based.sync_time_s(other, 16e6))  # not inside it
    # a measurement below the links' estimate is noise; one from another cluster does not apply
    assert measured(estimate_s * 0.5e3).sync_time_s(trio, 16e6) == pytest.approx(trio_s)
    assert measured(estimate_s * 5e3, "elsewhere").sync_time_s(trio, 16e6) == pytest.approx(trio_s)
    stage = StageChoice(0, 2, 4, tuple((d, 1 / 3) for d in trio))
    gap = predict(cost, (stage,), 12, 1).iteration_s - predict(link_based, (stage,), 12, 1).iteration_s
    assert gap == pytest.approx(4 * estimate_s), "the plan's stage is the measured step: 5x its estimate"
    # on a part of the cluster (plan --devices, a re-plan after a scale-in) the whole one's
    # measurement still calibrates the groups it holds
    part = spec.subset(pair)
    on_part = CostModel(part, cost.model, use_trees=False, sync_reference=spec)
    assert on_part.sync_time_s(pair, 16e6) == pytest.approx(5 * link_based.sync_time_s(pair, 16e6))
    assert CostModel(part, cost.model, use_trees=False).sync_time_s(pair, 16e6) == pytest.approx(
        link_based.sync_time_s(pair, 16e6)
    ), "without the whole cluster the measured set is out of sight"


def test_a_model_profile_refuses_two_sync_timings_for_one_group():
    timing = SyncTiming(cluster="c", devices=("a", "b"), backend="gloo", micro_batch=4, sync_ms=1.0)
    with pytest.raises(Exception, match="data_parallel_sync\\[1\\]: a second timing"):
        dataclasses.replace(
            model([(10, 10, 1.0)]), data_parallel_sync=(timing, dataclasses.replace(timing, devices=("b", "a")))
        )


@pytest.mark.parametrize(
    "unknown", [{"sync_ms": 0.0}, {"noise_ms": 9.0, "noisy": True}], ids=["an old profile's zero", "hidden in noise"]
)
def test_a_sync_not_told_apart_from_noise_is_neither_free_nor_a_calibration(tmp_path, unknown):
    from felactl.spec import load_cluster
    from tests.planner_fixtures import two_cpu_slot_cluster

    slots = load_cluster(two_cpu_slot_cluster(tmp_path))
    plain = model([(1_000_000, 1000, 1e9), (2_000_000, 1000, 1e9)])
    pair = ("cpu0", "cpu1")
    link_based = CostModel(slots, plain)
    timing = SyncTiming(cluster="here", devices=pair, backend="gloo", micro_batch=16, **unknown)
    cost = CostModel(slots, dataclasses.replace(plain, data_parallel_sync=(timing,)))
    link_s = link_based.sync_time_s(pair, 12e6)
    assert link_s > 0 and cost.sync_time_s(pair, 12e6) == pytest.approx(link_s)  # the floor, never free
    # the group is still priced from its links alone, so the plan says so (it did not: a 0 counted as measured)
    assert cost.uncalibrated_cpu_groups([pair]) == [pair]
    measured = CostModel(
        slots, dataclasses.replace(plain, data_parallel_sync=(dataclasses.replace(timing, sync_ms=50.0),))
    )
    assert measured.uncalibrated_cpu_groups([pair]) == [] and measured.sync_time_s(pair, 12e6) > cost.sync_time_s(
        pair, 12e6
    )


def test_timings_of_a_device_model_are_scaled_to_each_device_s_measured_speed():
    """Three CPU slots of one model, held to a core, half and a quarter of it (a testbed's cgroup
    shares): the profile timed the model at 2 TFLOP/s, so the slot that measured 0.5 takes 4x."""
    timing = (LayerTiming(device_model="X", micro_batch=4, fwd_ms=1.0, bwd_ms=2.0),)
    net = dataclasses.replace(model([(1000, 10, 1.0), (3000, 10, 1.0)]), optimizer_step_ms=8.0)
    net = dataclasses.replace(net, layers=tuple(dataclasses.replace(l, timings=timing) for l in net.layers))
    spec = cluster([[("X", 2.0, 8.0), ("X", 1.0, 8.0), ("X", 0.5, 8.0)]])
    untold = CostModel(spec, net, use_trees=False)  # an older profile: every slot as the one timed
    assert [untold.stage_times_s(0, 2, d, 4) for d in spec.device_names] == [pytest.approx((0.002, 0.004))] * 3
    cost = CostModel(spec, dataclasses.replace(net, timed_tflops={"X": 2.0}), use_trees=False)
    assert cost.stage_times_s(0, 2, "n0.d0", 4) == pytest.approx((0.002, 0.004))
    assert cost.stage_times_s(0, 2, "n0.d1", 4) == pytest.approx((0.004, 0.008))
    assert cost.stage_times_s(0, 2, "n0.d2", 4) == pytest.approx((0.008, 0.016))
    assert cost.optimizer_step_s(0, 2, "n0.d2") == pytest.approx(0.032)
    # a device of another model keeps its own pricing (FLOPs: no timing of it)
    assert (
        CostModel(cluster([[("Y", 0.5, 8.0)]]), dataclasses.replace(net, timed_tflops={"X": 2.0})).timed_slowdown(
            Device(name="y", kind=DeviceKind.CPU, model="Y", tflops=0.5, memory_gb=1)
        )
        == 1.0
    )


def test_a_cpu_slot_under_a_quota_is_priced_by_its_own_timings_else_by_its_cpus_scaled():
    """Slots of CPU X under cgroup quotas (a testbed's nodes). The profile timed X at full speed
    and, in the node at a tenth of a core, "X @ 0.1 cores": 3x slower than X's timings scaled by
    the matmul rates (small nodes run a model's step slower than their matmul). That slot is
    priced by its own timings and optimizer step; the half-core slot, never timed, by X's scaled
    by X's matmul over its own, as every slot was before slots were keyed by their quota."""
    tenth, half = cpu_slot_model("X", 0.1), cpu_slot_model("X", 0.5)
    assert (tenth, cpu_of_slot_model(tenth), cpu_of_slot_model("X")) == ("X @ 0.1 cores", "X", "X")
    base = model([(1000, 10, 1.0), (3000, 10, 1.0)])
    full_timing = LayerTiming(device_model="X", micro_batch=4, fwd_ms=1.0, bwd_ms=2.0)
    tenth_timing = LayerTiming(device_model=tenth, micro_batch=4, fwd_ms=30.0, bwd_ms=60.0)
    net = dataclasses.replace(
        base,
        layers=tuple(dataclasses.replace(l, timings=(full_timing, tenth_timing)) for l in base.layers),
        optimizer_step_ms=8.0,
        optimizer_step_ms_by_device_model={tenth: 200.0},
        timed_tflops={"X": 1.0, tenth: 0.1},
    )
    gpus = cluster([[("X", 1.0, 8.0), (tenth, 0.1, 8.0), (half, 0.5, 8.0)]])
    spec = as_cpu_slots(gpus)
    cost = CostModel(spec, net, use_trees=False)
    assert [cost.timed_as(spec.device(d)) for d in spec.device_names] == ["X", tenth, "X"]
    assert cost.stage_times_s(0, 2, "n0.d0", 4) == pytest.approx((0.002, 0.004))
    assert cost.stage_times_s(0, 2, "n0.d1", 4) == pytest.approx((0.06, 0.12)), "its own, not X's x 10"
    assert cost.stage_times_s(0, 2, "n0.d2", 4) == pytest.approx((0.004, 0.008)), "X's x 2"
    assert cost.optimizer_step_s(0, 2, "n0.d1") == pytest.approx(0.2)
    assert cost.optimizer_step_s(0, 2, "n0.d2") == pytest.approx(0.016)
    # a GPU is never priced by another model's timings
    assert CostModel(gpus, net, use_trees=False).timed_as(gpus.device("n0.d2")) is None
    # the runtime's own work per token is one thread's: a tenth of a core pays it 10x, though its
    # own timings make its timed_slowdown 1; a full core (no quota) pays it as profiled
    assert cost.timed_slowdown(spec.device("n0.d1")) == pytest.approx(1.0)
    assert cost.token_overhead_s("n0.d1") == pytest.approx(10 * cost.token_cpu_s)
    assert cost.token_overhead_s("n0.d2") == pytest.approx(2 * cost.token_cpu_s)
    assert cost.token_overhead_s("n0.d0") == pytest.approx(cost.token_cpu_s)


def test_a_sum_costs_a_quota_held_slot_its_cpu_stretched_by_the_quota_and_nothing_hides_it():
    """Three CPU slots summing 30 MB: each sends 2 (n - 1) / n of it (40 MB) at 1 ns of a full core
    a byte; the tenth of a core stretches that to 0.4 s, added to the sum whatever the backward
    hid; slots no quota holds add nothing (their links' profile saw that CPU)."""
    from felactl.optimizer.sync_cost import SYNC_CPU_S_PER_BYTE

    assert SYNC_CPU_S_PER_BYTE == 1e-9
    base = model([(1000, 10, 1.0)])
    gpus = cluster([[("X", 1.0, 8.0), (cpu_slot_model("X", 0.5), 0.5, 8.0), (cpu_slot_model("X", 0.1), 0.1, 8.0)]])
    spec = as_cpu_slots(gpus)
    cost = CostModel(spec, base, use_trees=False)
    all_three, full_and_half = ("n0.d0", "n0.d1", "n0.d2"), ("n0.d0", "n0.d1")
    assert cost.quota_sync_cpu_s(all_three, 30e6) == pytest.approx(0.4)
    assert cost.quota_sync_cpu_s(full_and_half, 30e6) == pytest.approx(0.06)  # 30 MB sent at half a core
    assert cost.quota_sync_cpu_s(("n0.d0",), 30e6) == 0.0
    # the same links and the same n0.d0, no slot held by a quota: no CPU term
    links_only = CostModel(as_cpu_slots(cluster([[("X", 1.0, 8.0)] * 3])), base, use_trees=False)
    assert cost.sync_time_s(all_three, 30e6) == pytest.approx(links_only.sync_time_s(all_three, 30e6) + 0.4)
    exposed = cost.exposed_sync_s(all_three, 0, 1, "n0.d0", 4) - links_only.exposed_sync_s(all_three, 0, 1, "n0.d0", 4)
    assert exposed == pytest.approx(2 * 2 / 3 * base.layers[0].param_bytes * 1e-9 * 10)


def test_a_slot_takes_the_timings_of_its_cpu_under_the_nearest_quota_the_profile_has():
    """A profile of a testbed's nodes holds only quota-named models: a slot under no quota (or a
    cluster profiled before slots were named) and a share no node had take the nearest quota's
    timings of the same CPU, scaled by the matmul rates; another CPU takes none."""
    base = model([(1000, 10, 1.0)])
    timings = tuple(
        LayerTiming(device_model=cpu_slot_model("X", q), micro_batch=4, fwd_ms=1.0 / q, bwd_ms=2.0 / q)
        for q in (0.1, 0.45)
    )
    net = dataclasses.replace(
        base,
        layers=(dataclasses.replace(base.layers[0], timings=timings),),
        timed_tflops={cpu_slot_model("X", 0.1): 0.1, cpu_slot_model("X", 0.45): 0.45},
    )
    gpus = cluster([[("X", 1.0, 8.0), (cpu_slot_model("X", 0.2), 0.2, 8.0), ("Y", 1.0, 8.0)]])
    spec = as_cpu_slots(gpus)
    cost = CostModel(spec, net, use_trees=False)
    assert [cost.timed_as(spec.device(d)) for d in spec.device_names] == [
        cpu_slot_model("X", 0.45),
        cpu_slot_model("X", 0.1),  # 0.2 is nearer 0.1 than 0.45 (in ratio)
        None,
    ]
    assert cost.stage_times_s(0, 1, "n0.d0", 4) == pytest.approx((0.001, 0.002))  # 0.45's x 0.45
    assert cost.stage_times_s(0, 1, "n0.d1", 4) == pytest.approx((0.005, 0.01))  # 0.1's x 0.5


def test_a_model_profile_refuses_a_timed_speed_that_is_no_speed():
    from felactl.spec.codec import FieldProblem

    with pytest.raises(FieldProblem, match="timed_tflops"):
        dataclasses.replace(model([(1000, 10, 1.0)]), timed_tflops={"X": -1.0})


def test_a_micro_batch_between_two_measured_ones_interpolates_their_per_sample_times():
    """A CPU saturates at small batches: 64 and 256 took 0.02 and 0.018 ms per sample. 128 lies
    half-way in log2: 0.019 ms per sample, not the saturation curve's 0.02 x eff(64) / eff(128)
    (0.0139 for a linear layer's b_half of 100)."""
    layer = _linear(
        timings=(
            LayerTiming(device_model="G1", micro_batch=64, fwd_ms=1.28, bwd_ms=2.56),
            LayerTiming(device_model="G1", micro_batch=256, fwd_ms=4.608, bwd_ms=9.216),
        )
    )
    fwd, bwd = layer_times_s(layer, GPU, 128)
    assert fwd == pytest.approx(128 * 0.019e-3) and bwd == pytest.approx(2 * fwd)
    assert layer_times_s(layer, GPU, 64) == pytest.approx((1.28e-3, 2.56e-3))  # measured: as measured
    # beyond the measured sizes the curve still scales the nearest one
    assert layer_times_s(layer, GPU, 512)[0] == pytest.approx(
        512 * 0.018e-3 * efficiency(256, 100) / efficiency(512, 100)
    )


def test_on_a_cpu_a_micro_batch_beyond_the_measured_ones_keeps_the_largest_ones_per_sample_time():
    """A CPU is saturated by the sizes a profile measures (16-64): beyond the largest, a sample
    costs what it cost there. The GPU saturation curve made micro-batch 512 of a user's model 2.1x
    cheaper per sample than its 64 (a Linear's b_half of 100), the planner chose 512 for it, and
    the run measured 32 ms a token of 512 where the plan priced 15 (0.43 of the predicted rate)."""
    cpu = Device(name="c", kind=DeviceKind.CPU, model="C1", tflops=0.05, memory_gb=16.0)
    layer = _linear(
        timings=(
            LayerTiming(device_model="C1", micro_batch=16, fwd_ms=0.4, bwd_ms=0.8),
            LayerTiming(device_model="C1", micro_batch=64, fwd_ms=1.28, bwd_ms=2.56),
        )
    )
    assert layer_times_s(layer, cpu, 512) == pytest.approx((512 * 0.02e-3, 512 * 0.04e-3))
    # below the smallest measured size the curve still charges the small batch's inefficiency
    fwd_4, _ = layer_times_s(layer, cpu, 4)
    assert fwd_4 / 4 > 0.4e-3 / 16


def _two_layer_net(bwd_ms: tuple[float, float]):
    """Layer 0: 3M parameters (12 MB); layer 1: 300k (1.2 MB, past DDP's 1 MiB first bucket, so it
    is that bucket alone). Backward ``bwd_ms`` per sample and layer on G1 at any micro-batch, forward 0."""
    net = model([(3_000_000, 10, 1.0), (300_000, 10, 1.0)])
    return dataclasses.replace(
        net,
        layers=tuple(
            dataclasses.replace(
                layer,
                timings=tuple(
                    LayerTiming(device_model="G1", micro_batch=b, fwd_ms=0.0, bwd_ms=b * bwd_ms[i])
                    for b in (1, 2, 4, 8)
                ),
            )
            for i, layer in enumerate(net.layers)
        ),
    )


@pytest.mark.parametrize("bwd_ms", [(50.0, 1.0), (0.01, 1.0)], ids=["hidden", "backward too short to hide it"])
def test_the_first_buckets_sum_runs_under_the_rest_of_the_backward(bwd_ms):
    """DDP (bsp) and the tokens buckets sum the last layers' gradients (the first bucket) while
    backward still runs through the others: priced whole, a data-parallel plan read up to a fifth
    slower than it ran. Hand-computed: bucket 0 (layer 1) is ready after layer 1's backward, bucket 1
    (layer 0) when backward ends; each sums after the one before."""
    net = _two_layer_net(bwd_ms)
    cost = CostModel(cluster([[("G1", 10.0, 8.0)] * 2], intra_gbps=1.0), net, use_trees=False)
    pair = ("n0.d0", "n0.d1")
    first, second = cost.sync_time_s(pair, 1_200_000), cost.sync_time_s(pair, 12_000_000)
    layer0_s, layer1_s = bwd_ms[0] / 1e3, bwd_ms[1] / 1e3
    first_done = layer1_s + first
    exposed = max(first_done, layer1_s + layer0_s) + second - (layer0_s + layer1_s)
    assert cost.exposed_sync_s(pair, 0, 2, "n0.d0", 1) == pytest.approx(exposed)
    if bwd_ms[0] > 10:
        assert exposed == pytest.approx(second), "the first bucket's sum is hidden whole"
    stage = StageChoice(0, 2, 1, (("n0.d0", 0.5), ("n0.d1", 0.5)))
    prediction = predict(cost, (stage,), 2, 1)
    assert prediction.iteration_s == pytest.approx(layer0_s + layer1_s + TOKEN_OVERHEAD_S + exposed)
    if bwd_ms[0] > 10:  # (else two sums, each with its latency, cost a little more than one)
        assert prediction.iteration_s < layer0_s + layer1_s + TOKEN_OVERHEAD_S + cost.sync_time_s(pair, 13_200_000)


def test_the_simulator_charges_the_sum_backward_did_not_hide():
    from felactl.optimizer.planner import make_plan

    net = _two_layer_net((50.0, 1.0))
    plan = make_plan(cluster([[("G1", 10.0, 8.0)] * 2], intra_gbps=1.0), net, 8, sync="bsp", use_trees=False)
    assert len(plan.stages) == 1 and len(plan.stages[0].workers) == 2, "data parallel over the pair"
    assert plan.predicted.simulated_iteration_s == pytest.approx(plan.predicted.iteration_s)


def test_each_token_costs_the_runtime_s_work_around_it_on_the_slot_s_share_of_a_core():
    """The tokens runtime's work per token (asking the token server, gathering the inputs,
    publishing the output) is host CPU: a CPU slot at a quarter of the profiled speed takes 4x as
    long, a GPU's host the profiled time. Unpriced, micro-batches of 64 looked as good as 1024 on
    the testbeds and ran at half their prediction."""
    timing = tuple(LayerTiming(device_model="X", micro_batch=b, fwd_ms=b * 0.01, bwd_ms=b * 0.02) for b in (4, 64))
    net = dataclasses.replace(model([(1000, 10, 1.0), (3000, 10, 1.0)]), timed_tflops={"X": 2.0})
    net = dataclasses.replace(net, layers=tuple(dataclasses.replace(l, timings=timing) for l in net.layers))
    base = cluster([[("X", 2.0, 8.0), ("X", 0.5, 8.0)]])
    slots = tuple(dataclasses.replace(d, kind=DeviceKind.CPU) for d in base.nodes[0].devices)
    cpus = dataclasses.replace(base, nodes=(dataclasses.replace(base.nodes[0], devices=slots),))
    cost = CostModel(cpus, net, use_trees=False)
    assert cost.token_overhead_s("n0.d0") == pytest.approx(TOKEN_OVERHEAD_S)
    assert cost.token_overhead_s("n0.d1") == pytest.approx(4 * TOKEN_OVERHEAD_S)
    gpus = CostModel(cluster([[("X", 0.5, 8.0)]]), net, use_trees=False)
    assert gpus.token_overhead_s("n0.d0") == pytest.approx(TOKEN_OVERHEAD_S)
    # one slot, 64 samples: the compute is the same per sample at 4 and at 64, the tokens are not
    whole = [StageChoice(0, 2, b, (("n0.d1", 1.0),)) for b in (4, 64)]
    small, large = (predict(cost, (stage,), 64, max_stages=1).iteration_s for stage in whole)
    assert small - large == pytest.approx((16 - 1) * 4 * TOKEN_OVERHEAD_S)
    # a pipeline's stage runs a forward and a backward token per micro-batch
    assert stage_tokens(cost, StageChoice(0, 1, 4, (("n0.d1", 1.0),)), 64) == 32
    assert stage_tokens(cost, whole[0], 64) == 16
    # under bsp (DDP), wbsp and sdpipe a worker loops over its own share: no token to ask for
    ddp = dataclasses.replace(cost, data_parallel_tokens=False)
    assert stage_tokens(ddp, whole[0], 64) == 0
    assert stage_tokens(ddp, StageChoice(0, 1, 4, (("n0.d1", 1.0),)), 64) == 32
    small, large = (predict(ddp, (stage,), 64, max_stages=1).iteration_s for stage in whole)
    assert small == pytest.approx(large)


def test_the_planner_prices_tokens_only_where_its_plan_asks_for_them():
    """Under sync tokens a data-parallel worker claims each micro-batch through the store; under
    bsp it runs DDP over its share. The rescale test's job (gpt-mini, batch 16, bsp) stopped
    getting its third device once every micro-batch paid a token it never asks for."""
    from felactl.optimizer.planner import make_baseline_plan, make_plan

    net = model([(1_000_000, 1000, 1e9)])
    spec = cluster([[("g", 10.0, 8.0)] * 2])
    tokens = make_plan(spec, net, 64, sync="tokens", max_stages=1)
    bsp = make_plan(spec, net, 64, sync="bsp", max_stages=1)
    (stage,) = bsp.stages
    share = StageChoice(0, 1, stage.micro_batch, tuple((w.device, w.share) for w in stage.workers))
    plain = CostModel(spec, net, ring_order=bsp.devices, data_parallel_tokens=False)
    assert bsp.predicted.iteration_s == pytest.approx(predict(plain, (share,), 64, 1).iteration_s)
    assert tokens.predicted.iteration_s > bsp.predicted.iteration_s
    dp = make_baseline_plan(spec, net, 64, "dp")
    assert dp.predicted.iteration_s == pytest.approx(bsp.predicted.baselines["dp"])


def test_the_best_ring_of_a_group_is_found_once_whatever_the_sizes_priced(monkeypatch):
    """The exposed-sum pricing asks a ring's time per DDP bucket, for every stage option: finding
    the ring each time made `felactl plan` on mixed.yaml's 48-layer transformer spend 35 s
    building its options (2.7 s with the ring found once per group)."""
    from felactl.optimizer import ring_cost

    found = []
    for search in ("best_ring", "nccl_rings"):  # (GPUs: NCCL's rings)
        real = getattr(ring_cost, search)
        monkeypatch.setattr(ring_cost, search, lambda *a, real=real, **k: found.append(a[1]) or real(*a, **k))
    cost = CostModel(cluster([[("g", 10.0, 8.0)] * 3]), model([(1000, 10, 1.0)]), use_trees=False)
    group = ("n0.d0", "n0.d1", "n0.d2")
    times = [cost.ring_sync_s(group, n) for n in (1e6, 2e6, 4e6)]
    assert len(found) == 1
    fixed_s, per_byte_s = ring_cost.nccl_allreduce_line(cost.cluster, group)
    assert times == pytest.approx([fixed_s + n * per_byte_s for n in (1e6, 2e6, 4e6)])


def _dgx1v():
    from pathlib import Path

    from felactl.spec import load_cluster

    return load_cluster(Path(__file__).parent.parent / "plans" / "clusters" / "dgx1v.yaml")


def test_gpus_sync_over_the_rings_nccl_lays_not_over_blink_trees_the_runtime_never_runs():
    """The runtime streams Blink trees over gloo only (``stage_trees`` returns None on NCCL), and a
    plan of GPUs runs on NCCL; the cost model packed trees for every group, so a DGX-1V fragment with
    no NVLink ring (gpu0, gpu1, gpu5) was priced at the trees' 3.0 ms for 100 MB where NCCL's ring
    takes 13.4: a faster plan promised than the one that runs, and collectives written that nothing reads."""
    dgx = _dgx1v()
    net = model([(25_000_000, 1000, 1e6)] * 2)  # 100 MB of gradients a layer
    cost = CostModel(dgx, net)
    fragment = ("gpu0", "gpu1", "gpu5")
    assert cost.collective(fragment) is None and cost.tree_sync_s(fragment, 1e8) == float("inf")
    # NCCL's ring over the fragment: gpu0 -> gpu1 -> gpu5 -> gpu0, closed by a 10 GB/s PCIe hop
    # (one ring: PCIe's pairs share the lanes), 2 (n - 1) / n of the data over it, 4 steps of the
    # slowest hop's latency (PCIe's 8 us).
    assert cost.sync_time_s(fragment, 1e8) == pytest.approx(4 / 3 * 1e8 / 10e9 + 4 * 8e-6, rel=1e-6)
    assert not cost.trees_ever_faster
    # The whole server: NVLink closes rings, so NCCL keeps to NVLink and lays four (50 + 50 + 25 +
    # 25 GB/s), three times one ring's 50 GB/s.
    whole = dgx.device_names
    assert cost.sync_time_s(whole, 1e8) == pytest.approx(14 / 8 * 1e8 / 150e9 + 14 * 3e-6, rel=1e-6)
    # The same links between CPU slots run over gloo, where the trees do run and are priced (their
    # CPU on a slot bounds them: whether they beat the ring there is test_collectives' matter).
    on_gloo = CostModel(as_cpu_slots(dgx), net)
    assert on_gloo.collective(fragment) is not None
    assert on_gloo.tree_sync_s(fragment, 1e8) < float("inf")


def test_a_plan_of_gpus_writes_no_trees_and_is_priced_as_nccl_runs_it():
    from felactl.optimizer.planner import make_plan

    net = model([(25_000_000, 1000, 1e9)] * 4)
    plan = make_plan(_dgx1v(), net, 64, sync="bsp", devices=["gpu0", "gpu1", "gpu5"])
    assert plan.collectives == ()
    assert plan.predicted.baselines["no_trees"] == pytest.approx(plan.predicted.iteration_s)


def test_nccl_lays_several_rings_over_nvlink_only():
    """NVLink's rings add up (each its own wires); PCIe's do not (the cluster gives PCIe per pair,
    but the pairs share the GPUs' lanes): four GPUs joined by PCIe alone get one ring, as do GPUs
    behind a switch (one port each) and a group across servers (the network its bottleneck)."""
    from felactl.optimizer.graph import nccl_rings

    nvlink = cluster([[("g", 10.0, 8.0)] * 4], intra_gbps=50.0)  # a full NVLink mesh
    # a ring and its reverse; the four links left (0-2, 1-3 both ways) close no ring of all four
    assert [gbps for _, gbps in nccl_rings(nvlink, nvlink.device_names)] == [50.0, 50.0]
    pcie = dataclasses.replace(
        nvlink, intra_node_default=dataclasses.replace(nvlink.intra_node_default, type=LinkType.PCIE)
    )
    assert [gbps for _, gbps in nccl_rings(pcie, pcie.device_names)] == [50.0]
    switched = dataclasses.replace(nvlink, nodes=tuple(dataclasses.replace(n, switch_gbps=50.0) for n in nvlink.nodes))
    assert [gbps for _, gbps in nccl_rings(switched, switched.device_names)] == [50.0]
    two = cluster([[("g", 10.0, 8.0)] * 2] * 2, intra_gbps=50.0, inter_gbps=5.0)
    assert [gbps for _, gbps in nccl_rings(two, two.device_names)] == [5.0]
