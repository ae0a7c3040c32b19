"""Blink trees vs the min-cut bound and the best ring on every 3-8 GPU subset of a DGX-1V.

Run: ``python benchmarks/bench_collectives.py [--cluster plans/clusters/dgx1v.yaml] [--json]``

For each of the 219 subsets of 3..8 GPUs, twice (NVLink only, as Blink packs; and NVLink + the
PCIe links between the other pairs), it plans the trees from the best root and reports, per
subset size: packed rate / min-cut bound (target >= 0.98), number of trees (target <= n),
tree rate / best ring rate, the modelled allreduce time of 256 MB over the trees vs the ring,
and solve time. NVLink-only subsets whose graph is disconnected are counted, not planned.

A second table plans every device of each cluster in plans/clusters/ and of 64 DGX-1Vs (512
GPUs, Blink's three phases across servers): trees, rates, and the modelled 256 MB allreduce
over the trees and over the best ring.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

from felactl.errors import PlanInfeasible
from felactl.optimizer.collectives import plan_collective
from felactl.optimizer.ring_cost import ring_allreduce_time_s
from felactl.optimizer.tree_cost import allreduce_time_s
from felactl.spec import ClusterSpec, load_cluster

ALLREDUCE_BYTES = 256e6
CLUSTERS = Path(__file__).resolve().parent.parent / "plans" / "clusters"


def measure(cluster: ClusterSpec, devices: tuple[str, ...]) -> dict | None:
    started = time.perf_counter()
    try:
        # Blink's broadcast packing, which this table is about (its rate against the min-cut bound);
        # the trees packed for the allreduce itself are measured by bench_tree_allreduce.py.
        collective = plan_collective(cluster, devices, for_allreduce=False)
    except PlanInfeasible:
        return None
    solve_s = time.perf_counter() - started
    tree_s = allreduce_time_s(cluster, collective, ALLREDUCE_BYTES)
    ring_s = ring_allreduce_time_s(cluster, devices, ALLREDUCE_BYTES) if collective.ring_gbps > 0 else None
    return {
        "n": len(devices),
        "rate_over_bound": collective.rate_gbps / collective.bound_gbps,
        "num_trees": len(collective.trees),
        "rate_over_ring": collective.rate_gbps / collective.ring_gbps if collective.ring_gbps > 0 else float("inf"),
        "ring_s_over_tree_s": ring_s / tree_s if ring_s is not None else None,
        "solve_s": solve_s,
    }


def summarise(rows: list[dict], size: int | str, disconnected: int) -> dict:
    finite = [r["rate_over_ring"] for r in rows if r["rate_over_ring"] != float("inf")]
    speedups = [r["ring_s_over_tree_s"] for r in rows if r["ring_s_over_tree_s"] is not None]
    return {
        "n": size,
        "subsets": len(rows) + disconnected,
        "disconnected": disconnected,
        "rate/bound min": min(r["rate_over_bound"] for r in rows),
        "rate/bound median": statistics.median(r["rate_over_bound"] for r in rows),
        "trees max": max(r["num_trees"] for r in rows),
        "trees median": statistics.median(r["num_trees"] for r in rows),
        "over n": sum(r["num_trees"] > r["n"] for r in rows),
        "no ring": len(rows) - len(finite),
        "rate/ring median": statistics.median(finite) if finite else float("nan"),
        "rate/ring min": min(finite) if finite else float("nan"),
        "ring time/tree time median": statistics.median(speedups) if speedups else float("nan"),
        "solve s median": statistics.median(r["solve_s"] for r in rows),
        "solve s max": max(r["solve_s"] for r in rows),
    }


def run(cluster: ClusterSpec) -> list[dict]:
    names = cluster.device_names
    table = []
    for variant, spec in (("nvlink", dataclasses.replace(cluster, intra_node_default=None)), ("nvlink+pcie", cluster)):
        everything, all_disconnected = [], 0
        for size in range(3, len(names) + 1):
            rows, disconnected = [], 0
            for subset in itertools.combinations(names, size):
                row = measure(spec, subset)
                if row is None:
                    disconnected += 1
                else:
                    rows.append(row)
            table.append({"graph": variant, **summarise(rows, size, disconnected)})
            everything += rows
            all_disconnected += disconnected
        table.append({"graph": variant, **summarise(everything, "3-8", all_disconnected)})
    return table


def _generated_dgx1v(num_servers: int) -> ClusterSpec:
    spec = importlib.util.spec_from_file_location("generate", CLUSTERS / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    return generate.dgx1v(num_servers)


def whole_clusters() -> list[dict]:
    big = _generated_dgx1v(64)
    cases = [(path.stem, load_cluster(path)) for path in sorted(CLUSTERS.glob("*.yaml"))]
    cases += [("64 x dgx1v", big), ("64 x dgx1v nvlink only", dataclasses.replace(big, intra_node_default=None))]
    rows = []
    for name, cluster in cases:
        started = time.perf_counter()
        collective = plan_collective(cluster, cluster.device_names, for_allreduce=False)
        solve_s = time.perf_counter() - started
        rows.append(
            {
                "cluster": name,
                "devices": len(cluster.devices),
                "trees": len(collective.trees),
                "rate GB/s": collective.rate_gbps,
                "bound GB/s": collective.bound_gbps,
                "ring GB/s": collective.ring_gbps,
                "trees 256MB ms": allreduce_time_s(cluster, collective, ALLREDUCE_BYTES) * 1e3,
                "ring 256MB ms": ring_allreduce_time_s(cluster, cluster.device_names, ALLREDUCE_BYTES) * 1e3,
                "solve s": solve_s,
            }
        )
    return rows


def render(table: list[dict]) -> str:
    columns = list(table[0])
    lines = [" | ".join(columns), " | ".join("---" for _ in columns)]
    for row in table:
        lines.append(" | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in row.values()))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default=str(CLUSTERS / "dgx1v.yaml"))
    parser.add_argument("--json", action="store_true", help="print the table as JSON")
    args = parser.parse_args()
    started = time.perf_counter()
    table = run(load_cluster(args.cluster))
    clusters = whole_clusters()
    if args.json:
        print(json.dumps({"subsets": table, "clusters": clusters}))
    else:
        print(render(table))
        print()
        print(render(clusters))
        print(
            f"\n{sum(r['subsets'] for r in table if r['n'] == '3-8')} groups in {time.perf_counter() - started:.0f} s",
            file=sys.stderr,
        )


if __name__ == "__main__":
    main()
