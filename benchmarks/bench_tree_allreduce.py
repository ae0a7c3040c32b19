"""Trees at run time: the plan's packed trees as an allreduce (felactl.agents.worker.sync.trees)
against gloo's own allreduce, inside emulated uneven clusters.

For each testbed (``plans/testbeds/<name>.yaml``): bring it up (``--no-latency`` where the kernel
has no netem), pack the trees felactl's planner packs for all its nodes (one CPU device per node,
the testbed's configured links as the cluster's), start one process per node in its namespace and
cgroup (gloo bound to the node's interface, rendezvous through a FileStore), and time, for each
size, gloo's ``all_reduce`` and the tree allreduce on the same float32 buffer, alternating, after
one warm-up of each. Every timed call starts after a barrier and ends when the slowest rank is
done (a second barrier). Reported per size, medians of ``--repeat``:

- ``gloo s``, ``trees s`` and their ratio (the target: trees >= 1.5x gloo); and gloo's allreduce
  with the ranks in the order that makes its ring the best ring (``gloo, best order``: a second
  process group whose ranks are that order, as felactl's planner ranks a plan's devices; where
  links differ by direction, rank order alone makes gloo's ring 8x faster on the asymmetric
  testbed);
- ``trees / bound``: the trees' measured rate (bytes / s) over the bound of any allreduce on that
  graph (``felactl.optimizer.graph.allreduce_bound``: the partition bound, from the configured
  links; the target: >= 0.8). Before 2026-11-26 the bound was the smaller of the broadcast's
  min-cut from the root and the reduce's into it, which no allreduce can reach where the links
  out of the broadcast's cut also carry the reduce (the fragment: 100 MB/s, where 75 is the most);
  both are printed;
- ``predicted s``: the planner's own time for the trees (``allreduce_time_s``; since the
  thirteenth session with each node's CPU for the trees' messages at its share of a core, the
  links alone beside it);
- ``busiest CPU``: the CPU seconds per second of the busiest node's process (all its threads), to
  compare with the node's share: a node at its share is what holds the collective back.

``--end-to-end MODEL`` also trains MODEL (a built-in, e.g. gpt-mini) on every node of each testbed
with a bsp data-parallel plan, once with the packed trees (``sync.use_trees``, the collective
above) and twice without (gloo's allreduce, its ranks in node order and in its best ring's
order, as felactl's planner ranks a plan), through the real ``felactl launch --testbed``, and
reports steady samples/s of each (after ``--warmup`` steps; ``steady_rate`` of
bench_testbed_plans.py) and the per-step comm seconds the workers record.

Each testbed holds ``--lock`` (the lock of ``flock /tmp/felactl-testbed.lock CMD``) while it is up.

    sudo python benchmarks/bench_tree_allreduce.py [--testbeds dgx1v-fragment,two-servers,asymmetric]
        [--sizes-mib 16,64,256] [--repeat 3] [--end-to-end gpt-mini [--steps 40]] [--json]
"""

from __future__ import annotations

import argparse
import datetime
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
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_testbed_plans import held, parts, steady_rate  # noqa: E402
from processes import wait_all  # noqa: E402

TESTBEDS = ROOT / "plans" / "testbeds"
MIB = 1 << 20


def testbed_cluster(spec):
    """The testbed as the device graph it emulates: one CPU device per node and the configured
    link between every pair. One server: a testbed shapes each pair's link on its own (an htb
    class per destination) and has no NIC that the links of a node share, as NVLinks inside a
    server (the Cluster format's links between servers would be priced through a per-server NIC).
    Each device's model names its node's CPU share, as the profile's do, so the trees' CPU on a
    slot held to a share of a core is priced (``tree_cost.TREE_MESSAGE_CPU_S``)."""
    from felactl.spec import ClusterSpec, from_dict
    from felactl.spec.cluster import cpu_slot_model

    devices = [
        {
            "name": f"{node.name}-cpu0",
            "kind": "cpu",
            "model": cpu_slot_model("testbed", node.cpus),  # as `felactl profile --testbed` names it
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
    """The bound of any allreduce over the collective's devices (module docstring)."""
    from felactl.optimizer.graph import allreduce_bound, capacity_graph

    return allreduce_bound(capacity_graph(cluster, collective.devices))


def min_cut_bound_gbps(cluster, collective) -> float:
    """The earlier bound: the smaller of the broadcast's min-cut from the root and the reduce's into it."""
    from felactl.optimizer.collectives import plan_collective, reversed_cluster

    reduce_bound = plan_collective(reversed_cluster(cluster), collective.devices, root=collective.root).bound_gbps
    return min(collective.bound_gbps, reduce_bound)


def testbed_plan(spec, model: str, global_batch: int, *, trees: bool = True, best_order: bool = False):
    """A bsp data-parallel plan of ``model`` with one worker on every node of the testbed, its
    placement naming each node, and (``trees``) the trees ``plan_collective`` packs for them as
    the stage's collective; without, the plan syncs with the backend's allreduce, over the ranks
    in node order or (``best_order``) in the order that makes gloo's ring the best ring, as
    felactl's planner ranks a plan's devices (``ranks.rank_order``)."""
    import dataclasses

    from felactl.models import build
    from felactl.optimizer.collectives import gloo_ring, plan_collective
    from felactl.optimizer.graph import best_ring
    from felactl.spec import ModelRef, Placement, SyncMode, SyncSpec, data_parallel_plan

    devices = tuple(f"{n}-cpu0" for n in spec.node_names)
    if best_order:
        devices = tuple(gloo_ring(best_ring(testbed_cluster(spec), devices)[0]))
    collective = dataclasses.replace(plan_collective(testbed_cluster(spec), devices), group="stage0")
    plan = data_parallel_plan(
        model=ModelRef(name=model, source=model, config={}),
        num_layers=len(build(model, {}).layers),
        devices=devices,
        global_batch=global_batch,
        micro_batch=global_batch // len(devices),
        sync=SyncSpec(mode=SyncMode.BSP, use_trees=trees),
        cluster=spec.name,
    )
    placement = tuple(Placement(device=d, node=d.removesuffix("-cpu0")) for d in devices)
    return dataclasses.replace(plan, placement=placement, collectives=(collective,) if trees else ())


# --- one node's process --------------------------------------------------------------------


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from felactl.agents.worker.sync.trees import stage_trees
    from felactl.spec import load_plan

    torch.set_num_threads(1)
    store = dist.FileStore(args.store, args.world)
    dist.init_process_group("gloo", store=store, rank=args.rank, world_size=args.world)
    allreduce = stage_trees(load_plan(args.plan), 0, args.rank, dist.group.WORLD)  # as BSP's worker does
    # gloo's ring over the ranks in the order that makes it the best ring (a process group of its
    # own whose ranks are that order: felactl's planner ranks a plan's devices so)
    order = [int(i) for i in args.gloo_order.split(",")]
    timeout = datetime.timedelta(seconds=600)
    best_order = dist.ProcessGroupGloo(
        dist.PrefixStore("best-order", store), order.index(args.rank), args.world, timeout
    )
    results = []
    for size_mib in args.sizes_mib:
        flat = torch.ones(size_mib * MIB // 4)
        runs = {
            "gloo": lambda t: dist.all_reduce(t),
            "gloo_best": lambda t: best_order.allreduce([t]).wait(),
            "trees": allreduce,
        }
        timings = {name: [] for name in runs}
        cpu = {name: [] for name in runs}  # this process's CPU seconds (all its threads) per second
        for repetition in range(args.repeat + 1):  # the first is a warm-up
            for name, run in runs.items():
                flat.fill_(1.0)
                dist.barrier()
                start, start_cpu = time.perf_counter(), time.process_time()
                run(flat)
                dist.barrier()
                elapsed = time.perf_counter() - start
                if flat[0].item() != args.world or flat[-1].item() != args.world:
                    raise SystemExit(f"{name} summed wrong: {flat[0].item()} on rank {args.rank}")
                if repetition:
                    timings[name].append(elapsed)
                    cpu[name].append((time.process_time() - start_cpu) / elapsed)
        busiest = [None] * args.world
        dist.all_gather_object(busiest, {k: statistics.median(v) for k, v in cpu.items()})
        results.append(
            {
                "size_mib": size_mib,
                **{k: statistics.median(v) for k, v in timings.items()},
                **{f"{k}_cpu": max(b[k] for b in busiest) for k in cpu},
            }
        )
    if args.rank == 0:
        Path(args.out).write_text(json.dumps(results))
    dist.destroy_process_group()


# --- the driver ----------------------------------------------------------------------------


def measure_testbed(name: str, sizes_mib: list[int], repeat: int, lock: str) -> list[dict]:
    from felactl.optimizer.collectives import gloo_ring
    from felactl.optimizer.graph import best_ring
    from felactl.optimizer.tree_cost import allreduce_time_s, tree_allreduce_cost
    from felactl.spec import save
    from felactl.testbed import down, load_testbed, node_command, node_env, up

    spec = load_testbed(TESTBEDS / f"{name}.yaml")
    cluster = testbed_cluster(spec)
    plan = testbed_plan(spec, "mlp", len(spec.nodes))
    collective = plan.collectives[0]
    bound = allreduce_bound_gbps(cluster, collective)
    cost = tree_allreduce_cost(cluster, collective)
    min_cut = min_cut_bound_gbps(cluster, collective)
    order = gloo_ring(best_ring(cluster, collective.devices)[0])  # ranks whose gloo ring is the best ring
    with held(Path(lock)), tempfile.TemporaryDirectory(prefix="felactl-trees-") as tmp:
        plan_file = save(plan, Path(tmp) / "plan.yaml")
        bed = "tbtrees"
        state = up(spec, str(TESTBEDS / f"{name}.yaml"), name=bed, allow_no_latency=True)
        procs = []
        try:
            for i, node in enumerate(spec.node_names):
                info = state.node(node)
                argv = [sys.executable, __file__, "--worker", "--rank", str(i), "--world", str(len(spec.nodes))]
                argv += [
                    "--store",
                    str(Path(tmp) / "store"),
                    "--plan",
                    str(plan_file),
                    "--out",
                    str(Path(tmp) / "out.json"),
                ]
                argv += ["--repeat", str(repeat), "--sizes-mib", ",".join(map(str, sizes_mib))]
                argv += ["--gloo-order", ",".join(str(spec.node_names.index(d.removesuffix("-cpu0"))) for d in order)]
                env = node_env(state, info, {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
                procs.append(subprocess.Popen(node_command(info, argv), env=env))
            wait_all(procs, 3600, f"a node's process of {name}")
        finally:
            for proc in procs:  # where a start failed part way, wait_all never saw the ones started
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
                "nodes": len(spec.nodes),
                "num_trees": len(collective.trees),
                "num_reduce_trees": len(collective.reduce_trees),
                **row,
                "trees_over_gloo": row["gloo"] / row["trees"],
                "trees_over_gloo_best": row["gloo_best"] / row["trees"],
                "trees_over_bound": nbytes / row["trees"] / (bound * 1e9),
                "bound_MBps": bound * 1e3,
                "trees_over_min_cut": nbytes / row["trees"] / (min_cut * 1e9),
                "predicted": allreduce_time_s(cluster, collective, nbytes),
                "predicted_by_links": cost.latency_s + cost.links_seconds(nbytes),
            }
        )
    return rows


def end_to_end(name: str, model: str, steps: int, warmup: int, global_batch: int, lock: str) -> list[dict]:
    """MODEL trained with trees on and off in testbed ``name`` (module docstring)."""
    from felactl.control.metrics import read_metrics
    from felactl.spec import save
    from felactl.testbed import down, load_testbed, up

    spec = load_testbed(TESTBEDS / f"{name}.yaml")
    rows = []
    with held(Path(lock)), tempfile.TemporaryDirectory(prefix="felactl-trees-e2e-") as tmp:
        bed = "tbe2e"
        up(spec, str(TESTBEDS / f"{name}.yaml"), name=bed, allow_no_latency=True)
        try:
            for run_id in ("trees", "gloo", "gloo_best"):
                plan = testbed_plan(
                    spec, model, global_batch, trees=run_id == "trees", best_order=run_id == "gloo_best"
                )
                path = save(plan, Path(tmp) / f"plan-{run_id}.yaml")
                command = [sys.executable, "-m", "felactl", "launch", str(path), "--testbed", bed]
                command += ["--steps", str(steps), "--json", "--runs-root", str(Path(tmp) / "runs"), "--run-id", run_id]
                env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
                done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
                if done.returncode != 0:
                    raise SystemExit(f"launch of {run_id} in {name} failed: {done.stderr.strip()[-800:]}")
                records = read_metrics(Path(json.loads(done.stdout)["run_dir"]))
                rate = steady_rate(records, global_batch, warmup)
                comm = [worker["comm_s"] for worker in parts(records, warmup).values()]
                rows.append(
                    {
                        "testbed": name,
                        "model": model,
                        "sync": run_id,
                        "samples_per_s": rate["samples_per_s"],
                        "median_step_s": rate["median_step_s"],
                        "median_comm_s": statistics.median(comm),
                    }
                )
                print(f"{name} {run_id}: {rate['samples_per_s']:.1f} samples/s", file=sys.stderr, flush=True)
        finally:
            down(bed)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--testbeds", default="dgx1v-fragment,two-servers,asymmetric")
    parser.add_argument("--sizes-mib", default="16,64,256")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--lock", default="/tmp/felactl-testbed.lock")
    parser.add_argument("--end-to-end", metavar="MODEL", help="also train MODEL with trees on and off")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--skip-allreduce", action="store_true", help="only the end-to-end runs")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--rank", "--world"):
        parser.add_argument(hidden, type=int, help=argparse.SUPPRESS)
    for hidden in ("--store", "--plan", "--out", "--gloo-order"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.sizes_mib = [int(s) for s in args.sizes_mib.split(",")]
    if args.worker:
        worker(args)
        return
    rows, e2e = [], []
    for name in args.testbeds.split(","):
        if not args.skip_allreduce:
            rows += measure_testbed(name, args.sizes_mib, args.repeat, args.lock)
        if args.end_to_end:
            e2e += end_to_end(name, args.end_to_end, args.steps, args.warmup, args.global_batch, args.lock)
    if args.json:
        print(json.dumps({"allreduce": rows, "end_to_end": e2e}, indent=2))
        return
    if e2e:
        print("| testbed | model | sync | samples/s | median step s | median comm s |")
        print("|---|---|---|---|---|---|")
        for r in e2e:
            print(
                f"| {r['testbed']} | {r['model']} | {r['sync']} | {r['samples_per_s']:.1f} "
                f"| {r['median_step_s']:.3f} | {r['median_comm_s']:.3f} |"
            )
        print()
    if not rows:
        return
    print(
        "| testbed | MiB | gloo s | gloo, best order s | trees s | trees ÷ gloo (best order) | trees ÷ bound (MB/s) "
        "| ÷ old min-cut | predicted s (links alone) | busiest CPU gloo / trees |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['testbed']} ({r['nodes']} nodes, {r['num_trees']}+{r['num_reduce_trees']} trees) | {r['size_mib']} "
            f"| {r['gloo']:.2f} | {r['gloo_best']:.2f} | {r['trees']:.2f} "
            f"| {r['trees_over_gloo']:.2f}× ({r['trees_over_gloo_best']:.2f}×) "
            f"| {r['trees_over_bound']:.2f} ({r['bound_MBps']:.1f}) | {r['trees_over_min_cut']:.2f} "
            f"| {r['predicted']:.2f} ({r['predicted_by_links']:.2f}) | {r['gloo_cpu']:.2f} / {r['trees_cpu']:.2f} |"
        )


if __name__ == "__main__":
    main()
