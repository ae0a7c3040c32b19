"""``felactl plan collectives``: the best allreduce trees for one group of devices.

"What is the best allreduce on the 3 GPUs my scheduler gave me?": packs Blink trees over the
group's links and shows them beside the min-cut bound and the best ring. The ``felactl plan``
command attaches this one with :func:`register_collectives`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from felactl import limits
from felactl.cli import output
from felactl.errors import InputError, PlanInfeasible
from felactl.limits import check_flag, split_items
from felactl.optimizer.collectives import allreduce_rates, plan_collective
from felactl.optimizer.graph import abbreviate_names
from felactl.optimizer.ring_cost import nccl_allreduce_line, ring_allreduce_time_s
from felactl.optimizer.tree_cost import allreduce_time_s, tree_allreduce_cost
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
        raise InputError(
            f"device index {token} is out of range: cluster {cluster.name} has {len(names)} devices "
            f"(0..{len(names) - 1})"
        )
    raise InputError(f"unknown device {token!r} (cluster {cluster.name} has {abbreviate_names(names)})")


def resolve_devices(cluster: ClusterSpec, text: str | None) -> list[str]:
    """``--devices``: comma-separated names or indices; every device of the cluster when absent."""
    if text is None:
        return list(cluster.device_names)
    tokens = split_items("--devices", text, "comma-separated device names or indices")
    names = [resolve_device(cluster, t) for t in tokens]
    twice = next((t for t, name in zip(tokens, names) if names.count(name) > 1), None)
    if twice is not None:
        raise InputError(f"--devices: device {names[tokens.index(twice)]!r} is given twice ({text!r})")
    return names


def collective_result(collective: Collective, solve_s: float, cluster: ClusterSpec | None = None) -> dict:
    """The JSON object of ``--json``: the trees, their broadcast rate beside the min-cut bound,
    the ring's; with the ``cluster``, also the rate of the allreduce over the trees beside the
    bound of any allreduce (None where the group is too large to compute it, or where the trees
    have no way back to the root) and the best ring's allreduce rate."""
    result = {
        "devices": list(collective.devices),
        "root": collective.root,
        "roots": collective.roots,
        "trees": [{"edges": [list(e) for e in tree.edges], "weight": tree.weight} for tree in collective.trees],
        "reduce_trees": [
            {"edges": [list(e) for e in tree.edges], "weight": tree.weight} for tree in collective.reduce_trees
        ],
        "rate_gbps": collective.rate_gbps,
        "bound_gbps": collective.bound_gbps,
        "ring_gbps": collective.ring_gbps,
        "solve_s": solve_s,
    }
    if cluster is not None:
        result.update(allreduce_rates(cluster, collective))
    return result


def _render(console, result: dict) -> None:
    roots = result["roots"]
    rooted = f"root {roots[0]}" if len(roots) == 1 else f"a part of the sum at each of {', '.join(roots)}"
    table = Table(title=f"allreduce trees of {len(result['devices'])} devices, {rooted}")
    for column in ("tree", "GB/s", "share", "edges (parent -> child)"):
        table.add_column(column)
    rate = result["rate_gbps"] or 1.0
    for i, tree in enumerate(result["trees"]):
        edges = ", ".join(f"{a}->{b}" for a, b in tree["edges"])
        table.add_row(str(i), f"{tree['weight']:.2f}", f"{tree['weight'] / rate:.1%}", edges)
    for i, tree in enumerate(result["reduce_trees"]):  # the data flows child -> parent
        edges = ", ".join(f"{b}->{a}" for a, b in tree["edges"])
        table.add_row(f"reduce {i}", f"{tree['weight']:.2f}", "", f"up: {edges}")
    console.print(table)
    ring, ring_allreduce, allreduce = result["ring_gbps"], result["ring_allreduce_gbps"], result["allreduce_gbps"]
    if allreduce is not None:
        versus = (
            f"{allreduce / ring_allreduce:.2f}x the best ring's" if ring > 0 else "no ring exists over direct links"
        )
        bound = result["allreduce_bound_gbps"]
        console.print(
            f"allreduce {allreduce:.2f} GB/s over the trees ({versus} {ring_allreduce:.2f})"
            + (f"; no allreduce can beat {bound:.2f} GB/s here" if bound is not None else "")
        )
    if "nccl_rings" in result:
        nccl = result["nccl_allreduce_gbps"]
        console.print(
            "on GPUs a felactl job sums over NCCL's allreduce, not these trees (they run over gloo, on "
            "CPU slots): "
            + (f"{len(result['nccl_rings'])} ring(s), {nccl:.2f} GB/s as modelled" if nccl else "no ring closes")
        )
    bounds = result.get("root_bounds_gbps") or {result["root"]: result["bound_gbps"]}
    if len(bounds) == 1:
        bound = f"min-cut bound {next(iter(bounds.values())):.2f} GB/s"
    else:
        bound = "min-cut bound of each root's part " + ", ".join(f"{r} {b:.2f}" for r, b in bounds.items()) + " GB/s"
    console.print(
        f"the trees' broadcast: rate {result['rate_gbps']:.2f} GB/s, {bound}; "
        f"best ring {ring:.2f} GB/s; solved in {result['solve_s']:.2f} s"
    )
    if "allreduce_s" in result:
        ring_s, tree_s = result["ring_allreduce_s"], result["allreduce_s"]
        ring = "no ring over direct links" if ring_s is None else f"ring {ring_s * 1e3:.3f} ms"
        trees = (
            "no allreduce over trees (no way back to the root)" if tree_s is None else f"trees {tree_s * 1e3:.3f} ms"
        )
        nccl = f", NCCL {result['nccl_allreduce_s'] * 1e3:.3f} ms" if result.get("nccl_allreduce_s") else ""
        console.print(f"allreduce of {result['size_mb']:g} MB: {trees}, {ring}{nccl}")
        if result.get("busiest_cpu") and result["allreduce_cpu_s"] > result["allreduce_links_s"]:
            console.print(
                f"the trees are bound by their pieces' CPU: {result['allreduce_cpu_s'] * 1e3:.3f} ms of messages "
                f"at {result['busiest_cpu']}, where the links take {result['allreduce_links_s'] * 1e3:.3f} ms"
            )


def collectives(
    cluster: Annotated[Path, typer.Option("--cluster", help="Cluster spec (YAML).")],
    devices: Annotated[
        str | None,
        typer.Option(
            "--devices", help="Comma-separated device names or indices into the cluster's device order [all]."
        ),
    ] = None,
    root: Annotated[
        str | None,
        typer.Option(
            "--root",
            help="Root device (name or index) [the one with the largest min-cut bound]. Where links "
            "differ by direction every device may root a part of the sum; this one comes first.",
        ),
    ] = None,
    min_share: Annotated[
        float, typer.Option("--min-share", help="Keep the fewest trees holding this share of the packed rate.")
    ] = 0.99,
    size_mb: Annotated[
        float | None,
        typer.Option("--size-mb", help="Also predict an allreduce of this many MB over the trees and over the ring."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")] = False,
) -> None:
    """Pack Blink spanning trees for an allreduce over a group of devices; compare with the ring."""
    check_flag("--min-share", min_share, limits.SHARE, above=0)
    check_flag("--size-mb", size_mb, limits.MEGABYTES, above=0)
    spec = load_cluster(cluster)
    names = resolve_devices(spec, devices)
    root_name = resolve_device(spec, root) if root is not None else None
    started = time.perf_counter()
    collective = plan_collective(spec, names, root=root_name, min_share=min_share)
    result = collective_result(collective, time.perf_counter() - started, spec)
    if size_mb is not None:
        num_bytes = size_mb * 1e6
        ring_s = ring_allreduce_time_s(spec, names, num_bytes) if collective.ring_gbps > 0 else None
        try:
            tree_s = allreduce_time_s(spec, collective, num_bytes)
        except PlanInfeasible as why:  # broadcast trees, but no way back to the root: no reduce over trees
            tree_s, result["no_allreduce"] = None, str(why)
        result.update(size_mb=size_mb, allreduce_s=tree_s, ring_allreduce_s=ring_s)
        if result.get("nccl_allreduce_gbps"):
            fixed_s, per_byte_s = nccl_allreduce_line(spec, names)
            result["nccl_allreduce_s"] = fixed_s + num_bytes * per_byte_s
        if tree_s:  # what bounds the trees: the links, or the CPU slots' messages (0 s: a group of one)
            cost = tree_allreduce_cost(spec, collective)
            device, cpu_s = cost.busiest_cpu(num_bytes)
            result.update(allreduce_links_s=cost.links_seconds(num_bytes), allreduce_cpu_s=cpu_s, busiest_cpu=device)
    output.emit(result, as_json, lambda console: _render(console, result))


def register_collectives(plan_app: typer.Typer) -> None:
    """Attach ``collectives`` to the ``felactl plan`` group."""
    plan_app.command("collectives")(collectives)
