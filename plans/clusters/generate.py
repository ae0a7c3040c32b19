"""Write the hand-made cluster specs of plans/clusters/ (run: ``python plans/clusters/generate.py``).

The specs are for clusters we plan for but do not sit on, with published link topologies and
effective (not peak) fp32 throughput:

- ``dgx1v.yaml``: one DGX-1 with 8 V100-SXM2 and the hybrid cube-mesh NVLink graph (SEEDS.md
  section 4), 25 GB/s per NVLink per direction; pairs without NVLink talk over PCIe.
- ``dgx1v-x2.yaml``: two of them joined by 100 Gb/s (12.5 GB/s) networking.
- ``mixed.yaml``: 2 nodes x 4 A100 (NVLink between every pair), 2 x 4 V100 (half a DGX-1V),
  2 x 4 T4 (PCIe only), joined by 25 Gb/s (3.125 GB/s) Ethernet.
- ``h100-a10g-l4.yaml`` (36 GPUs): 2 x 8 H100-SXM (NVSwitch, a 450 GB/s port per GPU; 400 Gb/s
  InfiniBand, 50 GB/s, per node), 2 x 8 A10G (PCIe, one 100 Gb/s NIC, 12.5 GB/s, shared by the
  8), 1 x 4 L4 (PCIe, one 25 Gb/s NIC, 3.125 GB/s): the switch and the shared NICs are written
  as such (``switch_gbps``, ``nic_gbps``), so the planner does not count a port or a NIC per link.

Each file is written atomically with ``felactl.spec.save`` and loads with ``load_cluster``.
"""

from __future__ import annotations

from pathlib import Path

from felactl.spec import ClusterSpec, Device, DeviceKind, Link, LinkDefault, LinkType, Node, save

NVLINK_GBPS_PER_LINK = 25.0
NVLINK_LATENCY_US = 3.0
PCIE_GBPS = 10.0
PCIE_LATENCY_US = 8.0

# Links per GPU pair of a DGX-1V (SEEDS.md section 4).
DGX1V_NVLINKS: dict[tuple[int, int], int] = {
    (0, 1): 1,
    (0, 2): 1,
    (0, 3): 2,
    (0, 4): 2,
    (1, 2): 2,
    (1, 3): 1,
    (1, 5): 2,
    (2, 3): 2,
    (2, 6): 1,
    (3, 7): 1,
    (4, 5): 1,
    (4, 6): 1,
    (4, 7): 2,
    (5, 6): 2,
    (5, 7): 1,
    (6, 7): 2,
}
V100 = dict(model="Tesla V100-SXM2-16GB", tflops=14.0, memory_gb=16.0)
A100 = dict(model="NVIDIA A100-SXM4-40GB", tflops=19.5, memory_gb=40.0, bf16_tflops=250.0)
T4 = dict(model="Tesla T4", tflops=8.0, memory_gb=16.0)
H100 = dict(model="NVIDIA H100 80GB HBM3", tflops=60.0, memory_gb=80.0, bf16_tflops=700.0)
A10G = dict(model="NVIDIA A10G", tflops=25.0, memory_gb=24.0, bf16_tflops=70.0)
L4 = dict(model="NVIDIA L4", tflops=25.0, memory_gb=24.0, bf16_tflops=120.0)


def _node(name: str, prefix: str, count: int, hardware: dict) -> Node:
    devices = tuple(Device(name=f"{prefix}{i}", kind=DeviceKind.CUDA, local_index=i, **hardware) for i in range(count))
    return Node(name=name, devices=devices)


def _nvlinks(node: Node, pair_links: dict[tuple[int, int], int]) -> list[Link]:
    """Both directions of every NVLink pair; ``bandwidth_gbps`` is the sum over bundled links."""
    names = [d.name for d in node.devices]
    links = []
    for (a, b), count in sorted(pair_links.items()):
        for src, dst in ((a, b), (b, a)):
            links.append(
                Link(
                    src=names[src],
                    dst=names[dst],
                    bandwidth_gbps=NVLINK_GBPS_PER_LINK * count,
                    latency_us=NVLINK_LATENCY_US,
                    type=LinkType.NVLINK,
                    num_links=count,
                )
            )
    return links


def _pcie_default() -> LinkDefault:
    return LinkDefault(bandwidth_gbps=PCIE_GBPS, latency_us=PCIE_LATENCY_US, type=LinkType.PCIE)


def dgx1v(num_servers: int = 1, network_gbps: float = 12.5) -> ClusterSpec:
    nodes = [_node(f"dgx{s}", "gpu" if num_servers == 1 else f"dgx{s}.gpu", 8, V100) for s in range(num_servers)]
    links = [link for node in nodes for link in _nvlinks(node, DGX1V_NVLINKS)]
    name = "dgx1v" if num_servers == 1 else f"dgx1v-x{num_servers}"
    network = LinkDefault(bandwidth_gbps=network_gbps, latency_us=5.0, type=LinkType.NET) if num_servers > 1 else None
    return ClusterSpec(
        name=name,
        nodes=tuple(nodes),
        links=tuple(links),
        intra_node_default=_pcie_default(),
        inter_node_default=network,
        description=f"{num_servers} x DGX-1 (8 V100-SXM2, hybrid cube-mesh NVLink, 25 GB/s per "
        "link per direction), PCIe between GPUs without NVLink"
        + (f", {network_gbps * 8:g} Gb/s between servers" if network else ""),
    )


def mixed() -> ClusterSpec:
    a100_pairs = {(a, b): 4 for a in range(4) for b in range(a + 1, 4)}  # HGX A100 4-GPU: 4 NVLinks per pair
    v100_pairs = {pair: n for pair, n in DGX1V_NVLINKS.items() if max(pair) < 4}  # half a DGX-1V
    nodes, links = [], []
    for i in range(2):
        a100 = _node(f"a100-{i}", f"a100-{i}.gpu", 4, A100)
        v100 = _node(f"v100-{i}", f"v100-{i}.gpu", 4, V100)
        nodes += [a100, v100]
        links += _nvlinks(a100, a100_pairs) + _nvlinks(v100, v100_pairs)
    nodes += [_node(f"t4-{i}", f"t4-{i}.gpu", 4, T4) for i in range(2)]
    return ClusterSpec(
        name="mixed",
        nodes=tuple(nodes),
        links=tuple(links),
        intra_node_default=_pcie_default(),
        inter_node_default=LinkDefault(bandwidth_gbps=3.125, latency_us=25.0, type=LinkType.NET),
        description="2 x 4 A100 (NVLink all pairs), 2 x 4 V100 (half DGX-1V NVLink), 2 x 4 T4 (PCIe only), "
        "25 Gb/s Ethernet between nodes",
    )


def h100_a10g_l4() -> ClusterSpec:
    """36 GPUs of three generations (module doc): NVSwitch inside the H100 nodes, PCIe elsewhere."""
    nodes, links = [], []
    for i in range(2):
        h100 = _node(f"h100-{i}", f"h100-{i}.gpu", 8, H100)
        nodes.append(Node(name=h100.name, devices=h100.devices, switch_gbps=450.0, nic_gbps=50.0))
        links += [
            Link(src=a.name, dst=b.name, bandwidth_gbps=450.0, latency_us=2.0, type=LinkType.NVLINK, num_links=18)
            for a in h100.devices
            for b in h100.devices
            if a is not b
        ]
    for i in range(2):
        a10g = _node(f"a10g-{i}", f"a10g-{i}.gpu", 8, A10G)
        nodes.append(Node(name=a10g.name, devices=a10g.devices, nic_gbps=12.5))
    l4 = _node("l4-0", "l4-0.gpu", 4, L4)
    nodes.append(Node(name=l4.name, devices=l4.devices, nic_gbps=3.125))
    return ClusterSpec(
        name="h100-a10g-l4",
        nodes=tuple(nodes),
        links=tuple(links),
        intra_node_default=LinkDefault(bandwidth_gbps=12.0, latency_us=8.0, type=LinkType.PCIE),
        # Each pair of nodes as wide as the H100s' NICs: the narrower NICs of the others cap their links.
        inter_node_default=LinkDefault(bandwidth_gbps=50.0, latency_us=10.0, type=LinkType.NET),
        description="2 x 8 H100-SXM (NVSwitch, 450 GB/s per GPU; 400 Gb/s per node), 2 x 8 A10G (PCIe; one "
        "100 Gb/s NIC per node), 1 x 4 L4 (PCIe; one 25 Gb/s NIC)",
    )


def main() -> None:
    here = Path(__file__).resolve().parent
    for filename, spec in (
        ("dgx1v.yaml", dgx1v()),
        ("dgx1v-x2.yaml", dgx1v(2)),
        ("mixed.yaml", mixed()),
        ("h100-a10g-l4.yaml", h100_a10g_l4()),
    ):
        save(spec, here / filename)
        print(f"wrote {here / filename}")


if __name__ == "__main__":
    main()
