"""What one FSDP2 unit's gather costs the host beyond its bytes: the constant the cost model
prices every gather of a sharded stage by (``optimizer/cost.py:FSDP_GATHER_CPU_S``).

Two gloo processes on this machine (each pinned to one core where it has two) train a stack of
``--units`` small blocks, each its own ``fully_shard`` unit as felactl shards a model's blocks,
and the same stack whole without sharding; micro-batches of one sample, gradients accumulated
without a reduce (``set_requires_gradient_sync(False)``), as the runtime runs all but a step's
last. The difference of their seconds per micro-batch, over the gathers a micro-batch makes (one
per unit forward, one backward), is a gather's cost; the blocks' weights are a few KB, so it is
the host's work (hooks, copies, the collective's call), not transfer. Printed in full-core
seconds: a CPU slot under a quota pays it over its quota (``CostModel.host_slowdown``).

    OMP_NUM_THREADS=1 python benchmarks/bench_fsdp_gather.py --repeat 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


def _stack(units: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(units)])


def _seconds_per_micro_batch(model: nn.Module, width: int, micro_batches: int) -> float:
    x = torch.randn(1, width)
    for _ in range(3):  # warm up (the first gathers allocate)
        model(x).sum().backward()
    start = time.perf_counter()
    for _ in range(micro_batches):
        model(x).sum().backward()
    return (time.perf_counter() - start) / micro_batches


def _worker(rank: int, store_path: str, args, out) -> None:
    if hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) >= 2:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank]})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    plain = _stack(args.units, args.width)
    sharded = _stack(args.units, args.width)
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    for block in sharded:
        fully_shard(block, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    sharded.set_requires_gradient_sync(False)
    rows = []
    for _ in range(args.repeat):
        dist.barrier()
        whole = _seconds_per_micro_batch(plain, args.width, args.micro_batches)
        dist.barrier()
        split = _seconds_per_micro_batch(sharded, args.width, args.micro_batches)
        rows.append((whole, split))
    if rank == 0:
        out.put(rows)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--units", type=int, default=8)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--micro-batches", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_worker, args=(r, os.path.join(tmp, "store"), args, out)) for r in range(2)]
        for p in procs:
            p.start()
        rows = out.get(timeout=600)
        for p in procs:
            p.join(timeout=60)
    gathers = 2 * args.units  # each block, forward and backward (the root holds no weight)
    per_gather = [(split - whole) / gathers for whole, split in rows]
    print(
        f"{args.units} units of Linear({args.width}, {args.width}), 2 gloo processes, {args.micro_batches} micro-batches x {args.repeat}"
    )
    print("| repetition | plain ms / micro-batch | sharded ms / micro-batch | ms per gather |")
    print("|---:|---:|---:|---:|")
    for i, ((whole, split), gather) in enumerate(zip(rows, per_gather), start=1):
        print(f"| {i} | {whole * 1e3:.3f} | {split * 1e3:.3f} | {gather * 1e3:.3f} |")
    print(f"median: {statistics.median(per_gather) * 1e3:.3f} ms per gather (full-core seconds)")


if __name__ == "__main__":
    main()
