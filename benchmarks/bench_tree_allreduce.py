"""Trees at run time: the plan's packed trees as an allreduce (felactl.agents.worker.sync.trees)
against gloo's own allreduce, inside emulated uneven clusters.

For each testbed (``plans/testbeds/<name>.yaml``): bring it up (``--no-latency`` where the kernel
has no netem), pack the trees felactl's planner packs for all its nodes (one CPU device per node,
the testbed's configured links as the cluster's), start one process per node in its namespace and
cgroup (gloo bound to the node's interface, rendezvous through a FileStore), and time, for each
size, gloo's ``all_reduce`` and the tree allreduce on the same float32 buffer, alternating, after
one warm-up of each. Every timed call starts after a barrier and ends when the slowest rank is
done (a second barrier). Reported per size, medians of ``--repeat``:

- ``gloo s``, ``trees s`` and their ratio (the target: trees >= 1.5x gloo);
- ``trees / bound``: the trees' measured rate (bytes / s) over the min-cut bound of an allreduce on
  that graph (the smaller of the broadcast bound from the root and the reduce bound into it, from
  the configured links; the target: >= 0.8);
- ``predicted s``: the planner's own time for the trees (``allreduce_time_s``).

Each testbed holds ``--lock`` (the lock of ``flock /tmp/felactl-testbed.lock CMD``) while it is up.

    sudo python benchmarks/bench_tree_allreduce.py [--testbeds dgx1v-fragment,two-servers,asymmetric]
        [--sizes-mib 16,64,256] [--repeat 3] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TESTBEDS = ROOT / "plans" / "testbeds"
MIB = 1 << 20


def testbed_cluster(spec):
    """The testbed as the device graph it emulates: one CPU device per node and the configured
    link between every pair. One server: a testbed shapes each pair's link on its own (an htb
    class per destination) and has no NIC that the links of a node share, as NVLinks inside a
    server (the Cluster format's links between servers would be priced through a per-server NIC)."""
    from felactl.spec import ClusterSpec, from_dict

    devices = [
        {
            "name": f"{node.name}-cpu0",
            "kind": "cpu",
            "model": "testbed",
            "tflops": 0.01 * (node.cpus or 1.0),
            "memory_gb": 1.0,
            "local_index": i,
        }
        for i, node in enumerate(spec.nodes)
    ]
    links = [
        {
            "src": f"{link.src}-cpu0",
            "dst": f"{link.dst}-cpu0",
            "bandwidth_gbps": link.bandwidth_gbps,
            "latency_us": link.latency_us,
            "type": "net",
        }
        for link in spec.all_links()
    ]
    cluster = {"kind": "Cluster", "schema_version": 1, "name": spec.name, "links": links}
    cluster["nodes"] = [{"name": "testbed", "devices": devices}]
    return from_dict(ClusterSpec, cluster, f"testbed {spec.name}")


def allreduce_bound_gbps(cluster, collective) -> float:
    """The min-cut bound of an allreduce rooted at the collective's root: every byte of the sum
    leaves the root to each device (broadcast) and arrives at it from each device (reduce)."""
    from felactl.optimizer.collectives import plan_collective, reversed_cluster

    reduce_bound = plan_collective(reversed_cluster(cluster), collective.devices, root=collective.root).bound_gbps
    return min(collective.bound_gbps, reduce_bound)


# --- one node's process --------------------------------------------------------------------


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from felactl.agents.worker.sync.trees import TreeAllreduce, _Tree

    torch.set_num_threads(1)
    store = dist.FileStore(args.store, args.world)
    dist.init_process_group("gloo", store=store, rank=args.rank, world_size=args.world)
    plan = json.loads(Path(args.trees).read_text())
    built = []
    for packed in (plan["trees"], plan["reduce_trees"]):
        trees = []
        for tree in packed:
            me = args.rank
            parent = next((a for a, b in tree["edges"] if b == me), None)
            trees.append(_Tree(tree["weight"], parent, tuple(b for a, b in tree["edges"] if a == me)))
        built.append(trees)
    allreduce = TreeAllreduce(built[0], dist.group.WORLD, args.world, reduce_trees=built[1] or None)
    results = []
    for size_mib in args.sizes_mib:
        flat = torch.ones(size_mib * MIB // 4)
        timings = {"gloo": [], "trees": []}
        for repetition in range(args.repeat + 1):  # the first is a warm-up
            for name, run in (("gloo", lambda t: dist.all_reduce(t)), ("trees", allreduce)):
                flat.fill_(1.0)
                dist.barrier()
                start = time.perf_counter()
                run(flat)
                dist.barrier()
                elapsed = time.perf_counter() - start
                if flat[0].item() != args.world or flat[-1].item() != args.world:
                    raise SystemExit(f"{name} summed wrong: {flat[0].item()} on rank {args.rank}")
                if repetition:
                    timings[name].append(elapsed)
        results.append({"size_mib": size_mib, **{k: statistics.median(v) for k, v in timings.items()}})
    if args.rank == 0:
        Path(args.out).write_text(json.dumps(results))
    dist.destroy_process_group()


# --- the driver ----------------------------------------------------------------------------


@contextlib.contextmanager
def held(lock_path: str):
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def measure_testbed(name: str, sizes_mib: list[int], repeat: int, lock: str) -> list[dict]:
    from felactl.optimizer.collectives import allreduce_time_s, plan_collective
    from felactl.testbed import down, load_testbed, node_command, node_env, up

    spec = load_testbed(TESTBEDS / f"{name}.yaml")
    cluster = testbed_cluster(spec)
    devices = tuple(f"{n}-cpu0" for n in spec.node_names)
    collective = plan_collective(cluster, devices)
    rank = {d: i for i, d in enumerate(devices)}
    bound = allreduce_bound_gbps(cluster, collective)
    with held(lock), tempfile.TemporaryDirectory(prefix="felactl-trees-") as tmp:
        trees_file = Path(tmp) / "trees.json"
        trees_file.write_text(
            json.dumps(
                {
                    key: [
                        {"weight": t.weight, "edges": [[rank[a], rank[b]] for a, b in t.edges]}
                        for t in getattr(collective, key)
                    ]
                    for key in ("trees", "reduce_trees")
                }
            )
        )
        bed = "tbtrees"
        state = up(spec, str(TESTBEDS / f"{name}.yaml"), name=bed, allow_no_latency=True)
        procs = []
        try:
            for i, node in enumerate(spec.node_names):
                info = state.node(node)
                argv = [sys.executable, __file__, "--worker", "--rank", str(i), "--world", str(len(devices))]
                argv += [
                    "--store",
                    str(Path(tmp) / "store"),
                    "--trees",
                    str(trees_file),
                    "--out",
                    str(Path(tmp) / "out.json"),
                ]
                argv += ["--repeat", str(repeat), "--sizes-mib", ",".join(map(str, sizes_mib))]
                env = node_env(state, info, {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
                procs.append(subprocess.Popen(node_command(info, argv), env=env))
            for proc in procs:
                if proc.wait(timeout=3600) != 0:
                    raise SystemExit(f"a node's process of {name} failed (exit {proc.returncode})")
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            down(bed)
        measured = json.loads((Path(tmp) / "out.json").read_text())
    rows = []
    for row in measured:
        nbytes = row["size_mib"] * MIB
        rows.append(
            {
                "testbed": name,
                "nodes": len(devices),
                "num_trees": len(collective.trees),
                "num_reduce_trees": len(collective.reduce_trees),
                **row,
                "trees_over_gloo": row["gloo"] / row["trees"],
                "trees_over_bound": nbytes / row["trees"] / (bound * 1e9),
                "bound_MBps": bound * 1e3,
                "predicted": allreduce_time_s(cluster, collective, nbytes),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--testbeds", default="dgx1v-fragment,two-servers,asymmetric")
    parser.add_argument("--sizes-mib", default="16,64,256")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--lock", default="/tmp/felactl-testbed.lock")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--rank", "--world"):
        parser.add_argument(hidden, type=int, help=argparse.SUPPRESS)
    for hidden in ("--store", "--trees", "--out"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.sizes_mib = [int(s) for s in args.sizes_mib.split(",")]
    if args.worker:
        worker(args)
        return
    rows = []
    for name in args.testbeds.split(","):
        rows += measure_testbed(name, args.sizes_mib, args.repeat, args.lock)
        if not args.json:
            print(f"{name}: done", file=sys.stderr)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print("| testbed | MiB | gloo s | trees s | trees ÷ gloo | trees ÷ bound | predicted s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['testbed']} ({r['nodes']} nodes, {r['num_trees']}+{r['num_reduce_trees']} trees) | {r['size_mib']} "
            f"| {r['gloo']:.2f} | {r['trees']:.2f} | {r['trees_over_gloo']:.2f}× | {r['trees_over_bound']:.2f} "
            f"| {r['predicted']:.2f} |"
        )


if __name__ == "__main__":
    main()
