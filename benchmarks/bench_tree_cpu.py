"""What a tree allreduce costs a worker's CPU per message: the figures the planner prices a slot
held to a share of a core by (``felactl.optimizer.tree_cost.TREE_MESSAGE_CPU_S`` and
``TREE_CPU_S_PER_BYTE``).

Three local gloo processes (one core's thread each, ``OMP_NUM_THREADS=1``) run the real tree
allreduce (``felactl.agents.worker.sync.trees.TreeAllreduce``) over the chain 0 -> 1 -> 2 rooted
at 0, for buffers whose pieces (``spec.plan.tree_piece_bytes``) run from 64 KiB to 1 MiB. Each
rank times the CPU seconds of its whole process (``time.process_time``: every thread, gloo's
included) per call, median of ``--repeat``, and divides by its messages: per piece a rank sends or
receives once over each of its edges going up and again coming down (the root and the leaf 2,
the middle rank 4). A least-squares line through (piece bytes, CPU per message) of all ranks and
sizes gives the fixed CPU of a message and its CPU per byte (which includes the reduce's add).

    OMP_NUM_THREADS=1 python benchmarks/bench_tree_cpu.py [--sizes-mib 1,4,16,64,256] [--repeat 5]
"""

from __future__ import annotations

import argparse
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
from processes import wait_all  # noqa: E402

MIB = 1 << 20
WORLD = 3
EDGES = {0: 1, 1: 2, 2: 1}
"""Each rank's edges in the chain 0 -> 1 -> 2."""


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from felactl.agents.worker.sync.trees import TreeAllreduce, _Tree
    from felactl.spec.plan import tree_piece_bytes

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(args.store, WORLD), rank=args.rank, world_size=WORLD)
    parent = {0: None, 1: 0, 2: 1}[args.rank]
    children = {0: (1,), 1: (2,), 2: ()}[args.rank]
    allreduce = TreeAllreduce([_Tree(1.0, parent, children, 0)], None, WORLD)
    rows = []
    for size_mib in args.sizes_mib:
        flat = torch.ones(size_mib * MIB // 4)
        cpu = []
        for repetition in range(args.repeat + 1):  # the first is a warm-up
            flat.fill_(1.0)
            dist.barrier()
            start = time.process_time()
            allreduce(flat)
            spent = time.process_time() - start
            if flat[0].item() != WORLD or flat[-1].item() != WORLD:
                raise SystemExit(f"summed wrong on rank {args.rank}")
            if repetition:
                cpu.append(spent)
        piece = tree_piece_bytes(size_mib * MIB, 1)
        messages = -(-size_mib * MIB // piece) * 2 * EDGES[args.rank]
        rows.append({"size_mib": size_mib, "piece_bytes": piece, "rank": args.rank, "cpu_s": statistics.median(cpu)})
        rows[-1]["cpu_us_per_message"] = rows[-1]["cpu_s"] / messages * 1e6
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, rows)
    if args.rank == 0:
        Path(args.out).write_text(json.dumps([r for rs in gathered for r in rs]))
    dist.destroy_process_group()


def fit(rows: list[dict]) -> tuple[float, float]:
    """Least squares CPU per message = a + b * piece bytes: (a in s, b in s per byte)."""
    xs = [r["piece_bytes"] for r in rows]
    ys = [r["cpu_us_per_message"] * 1e-6 for r in rows]
    slope, intercept = statistics.linear_regression(xs, ys)
    return intercept, slope


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", default="1,4,16,64,256")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.sizes_mib = [int(s) for s in str(args.sizes_mib).split(",")]
    if args.worker:
        worker(args)
        return
    from felactl.spec.plan import tree_piece_bytes

    if len({tree_piece_bytes(size * MIB, 1) for size in args.sizes_mib}) < 2:
        parser.error("--sizes-mib: the fit needs buffers cut into two piece sizes at least (e.g. 1,256)")
    with tempfile.TemporaryDirectory(prefix="felactl-tree-cpu-") as tmp:
        out = Path(tmp) / "out.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        argv = [sys.executable, __file__, "--worker", "--store", str(Path(tmp) / "store"), "--out", str(out)]
        argv += ["--sizes-mib", ",".join(map(str, args.sizes_mib)), "--repeat", str(args.repeat)]
        wait_all([subprocess.Popen([*argv, "--rank", str(r)], env=env) for r in range(WORLD)], 1800, "a worker")
        rows = json.loads(out.read_text())
    fixed_s, per_byte_s = fit(rows)
    if args.json:
        print(json.dumps({"rows": rows, "message_cpu_s": fixed_s, "cpu_s_per_byte": per_byte_s}, indent=2))
        return
    print("| MiB | piece KiB | rank (edges) | CPU ms per call | CPU µs per message | fit µs |")
    print("|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r["size_mib"], r["rank"])):
        print(
            f"| {r['size_mib']} | {r['piece_bytes'] >> 10} | {r['rank']} ({EDGES[r['rank']]}) | {r['cpu_s'] * 1e3:.1f} "
            f"| {r['cpu_us_per_message']:.1f} | {(fixed_s + per_byte_s * r['piece_bytes']) * 1e6:.1f} |"
        )
    print(f"\nper message: {fixed_s * 1e6:.1f} µs + {per_byte_s * 1e9:.3f} ns per byte of its piece (full core)")


if __name__ == "__main__":
    main()
