"""Assembling a cluster profile: the profiling workers' results become a ClusterSpec.

The workers (:mod:`felactl.profiling.worker`) run as a launcher job
(:mod:`felactl.launcher.profile`); each reports its device and its links to every other rank.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

from felactl.spec import ClusterSpec, Device, DeviceKind, Link, LinkType, Node


class JoinedNode(Protocol):
    """What assembling needs of a node whose agent joined the profile (the launcher's ``Member``)."""

    node_name: str
    hostname: str
    num_slots: int
    info: dict[str, Any]


def device_name(node_name: str, kind: str, local_rank: int) -> str:
    return f"{node_name}-{'gpu' if kind == 'cuda' else 'cpu'}{local_rank}"


def assemble_cluster(name: str, members: Sequence[JoinedNode], results: dict[int, dict]) -> ClusterSpec:
    """Nodes in ``members`` order (ranks follow it), their devices from each rank's result, every link."""
    nodes, names, node_of_rank, rank = [], {}, {}, 0
    for member in members:
        devices = []
        for local_rank in range(member.num_slots):
            found = results[rank]["device"]
            names[rank] = device_name(member.node_name, found["kind"], local_rank)
            node_of_rank[rank] = member.node_name
            devices.append(
                Device(
                    name=names[rank],
                    kind=DeviceKind(found["kind"]),
                    model=found["model"],
                    tflops=_sig(found["tflops"]),
                    memory_gb=found["memory_gb"],
                    bf16_tflops=_sig(found.get("bf16_tflops")),
                    local_index=local_rank,
                    cpu_cores=tuple(found["cpu_cores"]) if found.get("cpu_cores") else None,
                )
            )
            rank += 1
        nodes.append(
            Node(
                name=member.node_name,
                hostname=member.info.get("hostname") or member.hostname or None,
                num_cpu_cores=member.info.get("num_cpu_cores"),
                memory_gb=member.info.get("memory_gb"),
                devices=tuple(devices),
            )
        )
    topology = {node_of_rank[r]: res.get("topology", {}) for r, res in results.items() if res.get("topology")}
    links = []
    measured_links = sorted(
        (m for res in results.values() for m in res["links"]), key=lambda m: (m["src_rank"], m["dst_rank"])
    )
    for measured in measured_links:
        src, dst = measured["src_rank"], measured["dst_rank"]
        link_type, num_links = _link_type(src, dst, node_of_rank, results, topology)
        links.append(
            Link(
                src=names[src],
                dst=names[dst],
                bandwidth_gbps=_sig(measured["bandwidth_gbps"]),
                latency_us=_sig(measured["latency_us"]),
                type=link_type,
                num_links=num_links,
            )
        )
    return ClusterSpec(
        name=name,
        nodes=tuple(nodes),
        links=tuple(links),
        description=f"measured by felactl profile on {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
    )


def _sig(value: float | None, digits: int = 4) -> float | None:
    """Round to significant digits: a measurement's noise is far above the 4th digit."""
    return None if value is None else float(f"{value:.{digits}g}")


def _link_type(src: int, dst: int, node_of_rank: dict, results: dict, topology: dict) -> tuple[LinkType, int]:
    if node_of_rank[src] != node_of_rank[dst]:
        return LinkType.NET, 1
    if results[src]["device"]["kind"] != "cuda":
        return LinkType.LOOPBACK, 1
    pair = f"{results[src]['local_rank']},{results[dst]['local_rank']}"
    found = topology.get(node_of_rank[src], {}).get(pair, {"type": "pcie", "num_links": 1})
    return LinkType(found["type"]), int(found["num_links"])


def peer_copies(results: dict[int, dict]) -> dict[str, float]:
    """``<src device> -> <dst device>`` -> GB/s of the direct GPU peer copies each node measured."""
    out = {}
    for result in results.values():
        node = result.get("node_name", "")
        for pair, gbps in result.get("peer_copy_gbps", {}).items():
            i, j = (int(x) for x in pair.split(","))
            out[f"{device_name(node, 'cuda', i)} -> {device_name(node, 'cuda', j)}"] = gbps
    return out
