"""Made-up device graphs for the planner's any-graph tests: explicit directed link lists, one-way
links, servers joined by one device-to-device link, seeded random strongly connected graphs."""

from __future__ import annotations

import random

from felactl.spec import ClusterSpec, Device, DeviceKind, Link, LinkType, Node


def graph_cluster(
    nodes: list[list[tuple[str, str, float]]],
    links: list[tuple[str, str, float]],
    *,
    memory_gb: float = 16.0,
    name: str = "graph",
    switch_gbps: float | None = None,
) -> ClusterSpec:
    """Nodes of devices (name, hardware model, tflops) and directed links (src, dst, GB/s), nothing
    else (``switch_gbps``: every node's devices behind a switch with ports of that rate)."""
    built = []
    for n, devs in enumerate(nodes):
        built.append(
            Node(
                name=f"n{n}",
                switch_gbps=switch_gbps,
                devices=tuple(
                    Device(name=d, kind=DeviceKind.CUDA, model=m, tflops=t, memory_gb=memory_gb, local_index=i)
                    for i, (d, m, t) in enumerate(devs)
                ),
            )
        )
    node_of = {d: n for n, devs in enumerate(nodes) for d, _, _ in devs}
    return ClusterSpec(
        name=name,
        nodes=tuple(built),
        links=tuple(
            Link(
                src=a,
                dst=b,
                bandwidth_gbps=bw,
                latency_us=2.0 if node_of[a] == node_of[b] else 10.0,
                type=LinkType.NVLINK if node_of[a] == node_of[b] else LinkType.NET,
            )
            for a, b, bw in links
        ),
    )


def random_strong_graph(seed: int) -> ClusterSpec:
    """A random strongly connected graph of 3-7 devices: a random Hamiltonian cycle (some links
    one-way) plus random extra links of random widths; a third of them are two servers joined by
    exactly one link each way between one device pair, each server strongly connected on its own;
    one in five of the others a switched node (NVSwitch-like: 450 GB/s links between all, ports of
    150-450 GB/s)."""
    rng = random.Random(seed)
    count = rng.randint(3, 7)
    if seed % 3 != 2 and seed % 5 == 4:
        names = [f"g{i}" for i in range(count)]
        return graph_cluster(
            [[(d, "H", 30.0) for d in names]],
            [(a, b, 450.0) for a in names for b in names if a != b],
            name=f"random{seed}",
            switch_gbps=rng.choice([150.0, 300.0, 450.0]),
        )
    names = [f"g{i}" for i in range(count)]
    kinds = [("H", 30.0), ("A", 10.0)]
    devs = [(d, *rng.choice(kinds)) for d in names]
    links: dict[tuple[str, str], float] = {}

    def strongly_connect(part: list[str]) -> None:
        order = part[:]
        rng.shuffle(order)
        if len(order) > 1:
            for a, b in zip(order, order[1:] + order[:1]):
                links[(a, b)] = rng.choice([12.5, 25.0, 50.0])
        for _ in range(rng.randint(0, len(part) * 2)):
            a, b = rng.sample(part, 2) if len(part) > 1 else (None, None)
            if a is not None:
                links[(a, b)] = rng.choice([12.5, 25.0, 50.0, 100.0])

    if seed % 3 == 2 and count >= 4:
        split = rng.randint(2, count - 2)
        left, right = names[:split], names[split:]
        strongly_connect(left)
        strongly_connect(right)
        a, b = rng.choice(left), rng.choice(right)
        links[(a, b)] = links[(b, a)] = rng.choice([5.0, 12.5])
        nodes = [[d for d in devs if d[0] in left], [d for d in devs if d[0] in right]]
    else:
        strongly_connect(names)
        nodes = [devs]
    return graph_cluster(nodes, [(a, b, bw) for (a, b), bw in sorted(links.items())], name=f"random{seed}")
