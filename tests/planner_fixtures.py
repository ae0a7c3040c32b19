"""Made-up clusters and models for the planner's tests (no torch, no files)."""

from __future__ import annotations

import dataclasses
import random

from benchmarks.synthetic_models import transformer_spec
from felactl.spec import ClusterSpec, Device, DeviceKind, Layer, Link, LinkDefault, LinkType, ModelSpec, Node


def cluster(
    devices_per_node: list[list[tuple[str, float, float]]],
    *,
    intra_gbps: float = 50.0,
    inter_gbps: float = 5.0,
    name: str = "test",
) -> ClusterSpec:
    """Nodes of devices given as (model, tflops, memory_gb); uniform intra/inter-node links."""
    nodes = []
    for n, devs in enumerate(devices_per_node):
        nodes.append(
            Node(
                name=f"n{n}",
                devices=tuple(
                    Device(
                        name=f"n{n}.d{i}",
                        kind=DeviceKind.CUDA,
                        model=model,
                        tflops=tflops,
                        memory_gb=memory_gb,
                        local_index=i,
                    )
                    for i, (model, tflops, memory_gb) in enumerate(devs)
                ),
            )
        )
    return ClusterSpec(
        name=name,
        nodes=tuple(nodes),
        intra_node_default=LinkDefault(bandwidth_gbps=intra_gbps, latency_us=5.0, type=LinkType.NVLINK),
        inter_node_default=LinkDefault(bandwidth_gbps=inter_gbps, latency_us=20.0, type=LinkType.NET),
    )


def as_cpu_slots(spec: ClusterSpec) -> ClusterSpec:
    """``spec`` with every device a CPU slot (the fixtures' clusters are of GPUs): where the runtime
    runs Blink trees (over gloo) and the cost model prices them; a group of GPUs syncs over NCCL."""
    return dataclasses.replace(
        spec,
        nodes=tuple(
            dataclasses.replace(n, devices=tuple(dataclasses.replace(d, kind=DeviceKind.CPU) for d in n.devices))
            for n in spec.nodes
        ),
    )


def one_way_pair() -> ClusterSpec:
    """Devices n0.d0 and n1.d0 on two nodes: n0 -> n1 at 1 GB/s and 100 us, n1 -> n0 at 100 GB/s
    and 10 us (a link that differs by direction)."""
    base = cluster([[("g", 10.0, 8.0)], [("g", 10.0, 8.0)]])
    return dataclasses.replace(
        base,
        links=(
            Link(src="n0.d0", dst="n1.d0", bandwidth_gbps=1.0, latency_us=100.0, type=LinkType.NET),
            Link(src="n1.d0", dst="n0.d0", bandwidth_gbps=100.0, latency_us=10.0, type=LinkType.NET),
        ),
    )


def model(layers: list[tuple[int, int, float]], *, input_bytes: int = 4096, name: str = "m") -> ModelSpec:
    """Layers given as (params, activation_bytes_per_sample, fwd_flops_per_sample); bwd = 2 x fwd."""
    return ModelSpec(
        name=name,
        source="mlp",
        input_bytes_per_sample=input_bytes,
        layers=tuple(
            Layer(
                name=f"l{i}",
                params=p,
                param_bytes=4 * p,
                activation_bytes_per_sample=a,
                fwd_flops_per_sample=f,
                bwd_flops_per_sample=2 * f,
            )
            for i, (p, a, f) in enumerate(layers)
        ),
    )


def random_instance(seed: int) -> tuple[ClusterSpec, ModelSpec, int]:
    """A cluster of 2-5 devices in up to 3 classes and a model of 3-6 layers, conv-like and FC-like."""
    rng = random.Random(seed)
    kinds = [("fast", 20.0, rng.choice([8.0, 16.0])), ("mid", 10.0, 8.0), ("slow", 4.0, rng.choice([2.0, 8.0]))]
    num_devices = rng.randint(2, 5)
    picked = sorted(rng.choice(kinds[: rng.randint(1, 3)]) for _ in range(num_devices))
    split = rng.randint(1, num_devices)
    nodes = [picked[:split], picked[split:]] if split < num_devices else [picked]
    layers = []
    for _ in range(rng.randint(3, 6)):
        if rng.random() < 0.5:  # conv-like: few params, many FLOPs per sample
            p = rng.randint(10_000, 500_000)
            layers.append((p, rng.randint(50_000, 400_000), p * rng.uniform(200, 2000)))
        else:  # fully connected: FLOPs ~ 2 x params per sample
            p = rng.randint(5_000_000, 60_000_000)
            layers.append((p, rng.randint(2_000, 20_000), 2.0 * p))
    return (
        cluster(nodes, intra_gbps=rng.choice([25.0, 100.0]), inter_gbps=rng.choice([1.0, 10.0])),
        model(layers),
        rng.choice([16, 32, 64]),
    )


def two_cpu_slot_cluster(tmp_path, cores=(0, 1)):
    """``cluster.yaml`` of one node "here" (the only node, so it is this machine) with CPU slots
    cpu0, cpu1 pinned to ``cores``."""
    from felactl.spec import ClusterSpec, Device, DeviceKind, LinkDefault, LinkType, Node, save

    node = Node(
        name="here",
        devices=tuple(
            Device(
                name=f"cpu{i}",
                kind=DeviceKind.CPU,
                model="cpu",
                tflops=0.05,
                memory_gb=4.0,
                cpu_cores=(core,),
                local_index=i,
            )
            for i, core in enumerate(cores)
        ),
    )
    return save(
        ClusterSpec(
            name="here",
            nodes=(node,),
            intra_node_default=LinkDefault(bandwidth_gbps=5.0, latency_us=50.0, type=LinkType.LOOPBACK),
        ),
        tmp_path / "cluster.yaml",
    )


def tight_instance(seed: int) -> tuple[ClusterSpec, ModelSpec, int]:
    """A cluster of 2-6 devices in 1-3 classes and a 4-10 layer model whose weights and
    activations fill a good part of their memory, so plans cut it and keep micro-batches in flight."""
    rng = random.Random(seed)
    kinds = [("big", 30.0, rng.choice([24.0, 40.0])), ("mid", 12.0, 16.0), ("small", 6.0, rng.choice([8.0, 12.0]))]
    num_devices = rng.randint(2, 6)
    picked = sorted(rng.choice(kinds[: rng.randint(1, 3)]) for _ in range(num_devices))
    split = rng.randint(1, num_devices)
    nodes = [picked[:split], picked[split:]] if split < num_devices else [picked]
    layers = []
    for _ in range(rng.randint(4, 10)):
        p = rng.randint(20_000_000, 250_000_000)
        layers.append((p, rng.randint(200_000, 8_000_000), 2.0 * p * rng.uniform(1, 50)))
    return (
        cluster(nodes, intra_gbps=rng.choice([25.0, 100.0]), inter_gbps=rng.choice([1.0, 10.0])),
        model(layers),
        rng.choice([32, 64, 128, 256]),
    )


def calibrated_exposed_sync_s(cost, sync) -> tuple[float, float]:
    """(what the cost model charges for the measured step's sum, what it should charge): a
    profile's measured sync (a DDP step with its sum less one without) is the whole model's sum
    that backward did not hide, on the slower device of the set; the cost model charges that
    much, never less than its links' estimate of it."""
    device = cost.timed_sync_device(sync)
    charged = cost.exposed_sync_s(tuple(sync.devices), 0, cost.model.num_layers, device, sync.micro_batch)
    estimate_s = cost.measured_sync_estimate_s(sync)
    return charged, max(estimate_s, sync.sync_ms / 1e3) if sync.measured else estimate_s


def fast_feeds_slow(layer_activation_bytes: int, slow_tflops: float = 2.5) -> tuple[ClusterSpec, ModelSpec]:
    """A fast 16 GB device and four slow 8 GB ones, and a 4-layer model whose first layer's 9.6 GB
    of weights, gradients and AdamW state fit the fast device only, beside little else: plans are
    pipelines from the fast device into the slow ones, whose later stage takes far longer per
    micro-batch than the fast one, so the fast one's in-flight limit can set the pace. Its
    activations (``layer_activation_bytes`` per sample and layer) decide how many micro-batches
    the fast device has room to hold."""
    spec = cluster([[("fast", 40.0, 16.0)], [("slow", slow_tflops, 8.0)] * 4], intra_gbps=50.0, inter_gbps=10.0)
    act = layer_activation_bytes
    net = model([(600_000_000, act, 2e9), (90_000_000, act, 2e10), (90_000_000, act, 2e10), (90_000_000, 4096, 2e10)])
    return spec, net


def gpt2xl_like() -> ModelSpec:
    """A GPT-2-XL-like model (embedding, 48 blocks of width 1600 with 25 heads, head; sequence
    1024; fp32), each block saving what autograd keeps of a GPT block without recomputation
    (benchmarks' :func:`transformer_spec` with ``heads``): with the H100 / A10G / L4 cluster of
    ``plans/clusters/h100-a10g-l4.yaml`` and a global batch of 512, memory holds few micro-batches
    in flight."""
    spec = transformer_spec(50, width=1600, seq_len=1024, vocab=50257, heads=25)
    return dataclasses.replace(spec, name="gpt2xl-like")
