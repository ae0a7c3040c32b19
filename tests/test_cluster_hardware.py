"""The cluster format says what the hardware is (issue 14, item 6): a NIC a node's devices share,
a switch whose port each device has once."""

from __future__ import annotations

import pytest

from felactl.optimizer.collectives import plan_collective
from felactl.optimizer.cost import CostModel
from felactl.optimizer.ring_cost import ring_allreduce_time_s
from felactl.optimizer.tree_cost import allreduce_throughput_gbps
from felactl.spec import ClusterSpec, Device, DeviceKind, LinkDefault, LinkType, Node, load_cluster, save
from tests.planner_fixtures import model

NET = model([(1_000_000, 4096, 2e6)] * 2)


def _node(name: str, count: int, **hardware) -> Node:
    return Node(
        name=name,
        devices=tuple(
            Device(
                name=f"{name}.gpu{i}", kind=DeviceKind.CUDA, model=name[:4], tflops=30.0, memory_gb=24.0, local_index=i
            )
            for i in range(count)
        ),
        **hardware,
    )


def _cluster(**hardware) -> ClusterSpec:
    """Two nodes of 8 GPUs: 450 GB/s between any two of a node, 12.5 GB/s between nodes."""
    return ClusterSpec(
        name="hw",
        nodes=(_node("a10g", 8, **hardware), _node("b10g", 8, **hardware)),
        intra_node_default=LinkDefault(bandwidth_gbps=450.0, latency_us=2.0, type=LinkType.NVLINK),
        inter_node_default=LinkDefault(bandwidth_gbps=12.5, latency_us=10.0, type=LinkType.NET),
    )


def test_a_shared_nic_is_divided_among_the_nodes_devices():
    shared = CostModel(_cluster(nic_gbps=12.5), NET)
    alone = CostModel(_cluster(), NET)
    assert shared.link_time_s("a10g.gpu0", "b10g.gpu3", 1e8) == pytest.approx(10e-6 + 1e8 / (12.5e9 / 8))
    assert alone.link_time_s("a10g.gpu0", "b10g.gpu3", 1e8) == pytest.approx(10e-6 + 1e8 / 12.5e9)
    # Planning for two of the node's devices: the NIC is theirs.
    two = CostModel(_cluster(nic_gbps=12.5).subset(["a10g.gpu0", "a10g.gpu1", "b10g.gpu0"]), NET)
    assert two.link_time_s("a10g.gpu0", "b10g.gpu0", 1e8) == pytest.approx(10e-6 + 1e8 / (12.5e9 / 2))


def test_a_switch_port_is_counted_once():
    switched = _cluster(switch_gbps=450.0)
    names = [f"a10g.gpu{i}" for i in range(8)]
    coll = plan_collective(switched, names, for_allreduce=False)
    assert coll.rate_gbps == pytest.approx(450.0) and coll.bound_gbps == pytest.approx(450.0)
    assert allreduce_throughput_gbps(switched, coll) <= 450.0 * (1 + 1e-9)
    wired = plan_collective(_cluster(), names, for_allreduce=False)  # a full mesh of 450 GB/s wires: 7 x 450
    assert wired.rate_gbps == pytest.approx(7 * 450.0)
    # A ring sends to one peer at a time: the port is the ring's bottleneck either way.
    assert ring_allreduce_time_s(switched, names, 1e9) == pytest.approx(ring_allreduce_time_s(_cluster(), names, 1e9))


def test_the_nic_caps_the_collective_across_nodes():
    cluster = _cluster(nic_gbps=5.0)
    coll = plan_collective(cluster, cluster.device_names)
    assert coll.rate_gbps <= 5.0 * (1 + 1e-9)
    assert allreduce_throughput_gbps(cluster, coll) <= 5.0 * (1 + 1e-9)


def test_the_fields_round_trip_and_are_checked(tmp_path):
    path = save(_cluster(nic_gbps=12.5, switch_gbps=450.0), tmp_path / "c.yaml")
    node = load_cluster(path).nodes[0]
    assert (node.nic_gbps, node.switch_gbps) == (12.5, 450.0)
    text = path.read_text().replace("nic_gbps: 12.5", "nic_gbps: -1", 1)
    path.write_text(text)
    with pytest.raises(Exception, match=r"nodes\[0\]\.nic_gbps: must be > 0"):
        load_cluster(path)
