"""``felactl plan collectives``: the best allreduce trees for one group of devices.

"What is the best allreduce on the 3 GPUs my scheduler gave me?": packs Blink trees over the
group's links and shows them beside the min-cut bound and the best ring. The ``felactl plan``
command attaches this one with :func:`register_collectives`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from felactl.cli import output
from felactl.errors import InputError
from felactl.optimizer.collectives import allreduce_time_s, plan_collective, ring_allreduce_time_s
from felactl.optimizer.graph import abbreviate_names
from felactl.spec import ClusterSpec, Collective, load_cluster


def resolve_device(cluster: ClusterSpec, token: str) -> str:
    """A device name, or an index into the cluster's device order (names win over indices)."""
    token = token.strip()
    if cluster.has_device(token):
        return token
    names = cluster.device_names
    if token.isdigit():
        if int(token) < len(names):
            return names[int(token)]
        raise InputError(f"device index {token} is out of range: cluster {cluster.name} has {len(names)} devices "
                         f"(0..{len(names) - 1})")
    raise InputError(f"unknown device {token!r} (cluster {cluster.name} has {abbreviate_names(names)})")


def resolve_devices(cluster: ClusterSpec, text: str | None) -> list[str]:
    """``--devices``: comma-separated names or indices; every device of the cluster when absent."""
    if text is None:
        return list(cluster.device_names)
    tokens = [t for t in text.split(",") if t.strip()]
    if not tokens:
        raise InputError("--devices: expected comma-separated device names or indices, got nothing")
    return [resolve_device(cluster, t) for t in tokens]


def collective_result(collective: Collective, solve_s: float) -> dict:
    """The JSON object of ``--json``."""
    return {
        "devices": list(collective.devices),
        "root": collective.root,
        "trees": [{"edges": [list(e) for e in tree.edges], "weight": tree.weight} for tree in collective.trees],
        "rate_gbps": collective.rate_gbps,
        "bound_gbps": collective.bound_gbps,
        "ring_gbps": collective.ring_gbps,
        "solve_s": solve_s,
    }


def _render(console, result: dict) -> None:
    table = Table(title=f"allreduce trees of {len(result['devices'])} devices, root {result['root']}")
    for column in ("tree", "GB/s", "share", "edges (parent -> child)"):
        table.add_column(column)
    rate = result["rate_gbps"] or 1.0
    for i, tree in enumerate(result["trees"]):
        edges = ", ".join(f"{a}->{b}" for a, b in tree["edges"])
        table.add_row(str(i), f"{tree['weight']:.2f}", f"{tree['weight'] / rate:.1%}", edges)
    console.print(table)
    ring = result["ring_gbps"]
    versus = f"{result['rate_gbps'] / ring:.2f}x the ring" if ring > 0 else "no ring exists over direct links"
    console.print(f"rate {result['rate_gbps']:.2f} GB/s, min-cut bound {result['bound_gbps']:.2f} GB/s, "
                  f"best ring {ring:.2f} GB/s ({versus}); solved in {result['solve_s']:.2f} s")
    if "allreduce_s" in result:
        console.print(f"allreduce of {result['size_mb']:g} MB: trees {result['allreduce_s'] * 1e3:.3f} ms, "
                      f"ring {result['ring_allreduce_s'] * 1e3:.3f} ms")


def collectives(
    cluster: Annotated[Path, typer.Option("--cluster", help="Cluster spec (YAML).")],
    devices: Annotated[Optional[str], typer.Option(
        "--devices", help="Comma-separated device names or indices into the cluster's device order [all].")] = None,
    root: Annotated[Optional[str], typer.Option(
        "--root", help="Root device (name or index) [the one with the largest min-cut bound].")] = None,
    min_share: Annotated[float, typer.Option(
        "--min-share", help="Keep the fewest trees holding this share of the packed rate.")] = 0.99,
    size_mb: Annotated[Optional[float], typer.Option(
        "--size-mb", help="Also predict an allreduce of this many MB over the trees and over the ring.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")] = False,
) -> None:
    """Pack Blink spanning trees for an allreduce over a group of devices; compare with the ring."""
    spec = load_cluster(cluster)
    names = resolve_devices(spec, devices)
    root_name = resolve_device(spec, root) if root is not None else None
    started = time.perf_counter()
    collective = plan_collective(spec, names, root=root_name, min_share=min_share)
    result = collective_result(collective, time.perf_counter() - started)
    if size_mb is not None:
        if size_mb <= 0:
            raise InputError(f"--size-mb must be > 0, got {size_mb:g}")
        num_bytes = size_mb * 1e6
        result.update(size_mb=size_mb, allreduce_s=allreduce_time_s(spec, collective, num_bytes),
                      ring_allreduce_s=ring_allreduce_time_s(spec, names, num_bytes))
    output.emit(result, as_json, lambda console: _render(console, result))


def register_collectives(plan_app: typer.Typer) -> None:
    """Attach ``collectives`` to the ``felactl plan`` group."""
    plan_app.command("collectives")(collectives)
