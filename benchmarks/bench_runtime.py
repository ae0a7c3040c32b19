"""Runtime throughput: felactl's sync modes on real worker processes, against plain DDP.

Two questions, one run:
1. Overhead: with no straggler, how does felactl BSP compare with ``DistributedDataParallel``
   under ``torchrun`` on the same model, data, global batch and optimizer?
2. Stragglers: with one of the workers slowed ``--factor`` x, samples/s of bsp, tokens, wbsp
   (and its overlapped variant) and sdpipe.

samples/s come from each run's ``metrics.jsonl`` (:func:`summarize`: first step start to last
step end, so process start-up is excluded for felactl); DDP times its own loop the same way.

    python benchmarks/bench_runtime.py [--steps 40] [--workers 2] [--factor 3] [--repeat 2] [--json]

The no-straggler rows give DDP and felactl BSP the same per-pass batch (each worker's share in
one micro-batch); tokens use ``--micro-batch`` sized tokens, as do the straggler rows of tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = {"input_dim": 256, "hidden": 1024, "depth": 4}


def make_plan(workers: int, mode: str, global_batch: int, micro_batch: int, overlap: bool = False):
    from felactl import models
    from felactl.spec import ModelRef, Plan, Stage, StageWorker, SyncMode, SyncSpec, Training

    num_layers = len(models.build("mlp", MODEL).layers)
    return Plan(cluster="local", model=ModelRef(name="mlp", source="mlp", config=MODEL),
                devices=tuple(f"cpu{i}" for i in range(workers)), global_batch=global_batch,
                sync=SyncSpec(mode=SyncMode(mode), overlap=overlap), training=Training(optimizer="sgd", lr=0.05),
                stages=(Stage(layer_start=0, layer_end=num_layers, micro_batch=micro_batch,
                              workers=tuple(StageWorker(device=f"cpu{i}", share=1 / workers) for i in range(workers))),))


def make_hybrid_plan(workers: int, global_batch: int, micro_batch: int):
    """Fela's flexible hybrid on the same model: the first half of the layers with ``micro_batch``
    tokens, the rest with tokens twice as large, every worker allowed on both sub-models."""
    from felactl.spec import Schedule, Stage, StageWorker, SyncMode, SyncSpec
    from dataclasses import replace

    base = make_plan(workers, "tokens", global_batch, micro_batch)
    cut = base.num_layers // 2
    workers_of = tuple(StageWorker(device=d, share=1 / workers) for d in base.devices)
    stages = (Stage(layer_start=0, layer_end=cut, micro_batch=micro_batch, workers=workers_of),
              Stage(layer_start=cut, layer_end=base.num_layers, micro_batch=2 * micro_batch, workers=workers_of))
    return replace(base, schedule=Schedule.TOKENS, sync=SyncSpec(mode=SyncMode.TOKENS), stages=stages)


def run_felactl(workdir: Path, name: str, plan, steps: int, slowdown: str) -> dict:
    from felactl.agents.worker.local import run_local
    from felactl.agents.worker.metrics import read_metrics, summarize
    from felactl.spec import save

    plan_path = save(plan, workdir / f"{name}.yaml")
    run_dir = workdir / name
    run_local(plan_path, run_dir, len(plan.devices), {"FELACTL_STEPS": str(steps), "FELACTL_SLOWDOWN": slowdown},
              timeout_s=600)
    return summarize(read_metrics(run_dir))


def ddp_worker(steps: int, global_batch: int) -> None:
    """Runs under torchrun: plain DDP, each rank its half of each global batch, SGD."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from felactl import models

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    bundle = models.build("mlp", MODEL, seed=0)
    model = DistributedDataParallel(bundle.layers)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    share = global_batch // world
    dist.barrier()
    start = time.perf_counter()
    for step in range(steps):
        base = step * global_batch + rank * share
        inputs, targets = bundle.data.batch(range(base, base + share))
        bundle.loss(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    dist.barrier()
    wall_s = time.perf_counter() - start
    if rank == 0:
        print(json.dumps({"samples_per_s": steps * global_batch / wall_s, "wall_s": wall_s}))
    dist.destroy_process_group()


def run_ddp(workers: int, steps: int, global_batch: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={workers}",
                          __file__, "--ddp-worker", "--steps", str(steps), "--global-batch", str(global_batch)],
                         env=env, capture_output=True, text=True, check=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--factor", type=float, default=3.0)
    parser.add_argument("--global-batch", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=2, help="interleaved rounds; the best of each case counts")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--ddp-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ddp_worker:
        ddp_worker(args.steps, args.global_batch)
        return
    slow = f"{args.workers - 1}={args.factor:g}"
    share = args.global_batch // args.workers
    # (name, sync mode or None for DDP, overlap, slowdown, micro-batch)
    cases = [("ddp (torchrun)", None, False, "", share), ("bsp", "bsp", False, "", share),
             ("tokens", "tokens", False, "", args.micro_batch),
             (f"bsp, {slow}", "bsp", False, slow, share), (f"tokens, {slow}", "tokens", False, slow, args.micro_batch),
             (f"wbsp, {slow}", "wbsp", False, slow, share), (f"wbsp overlap, {slow}", "wbsp", True, slow, share),
             (f"sdpipe, {slow}", "sdpipe", False, slow, share),
             (f"hybrid tokens, {slow}", "hybrid", False, slow, args.micro_batch)]
    best: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench_runtime.") as tmp:
        for attempt in range(args.repeat):  # interleaved rounds, best of each: the machine may be shared
            for i, (name, mode, overlap, slowdown, micro_batch) in enumerate(cases):
                if mode is None:
                    result = run_ddp(args.workers, args.steps, args.global_batch)
                else:
                    plan = make_hybrid_plan(args.workers, args.global_batch, micro_batch) if mode == "hybrid" else \
                        make_plan(args.workers, mode, args.global_batch, micro_batch, overlap=overlap)
                    result = run_felactl(Path(tmp), f"case{i}-{attempt}", plan, args.steps, slowdown)
                print(f"{name:28s} {result['samples_per_s']:10.1f} samples/s", file=sys.stderr)
                if name not in best or result["samples_per_s"] > best[name]["samples_per_s"]:
                    best[name] = {"case": name, "micro_batch": micro_batch, "samples_per_s": result["samples_per_s"],
                                  "final_loss": result.get("final_loss"),
                                  "compute_fraction": result.get("compute_fraction"),
                                  "samples_by_worker": [w["samples"] for w in result.get("workers", [])]}
    rows = [best[name] for name, *_ in cases]
    base = {r["case"]: r["samples_per_s"] for r in rows}
    for r in rows:
        r["vs_ddp"] = r["samples_per_s"] / base["ddp (torchrun)"]
        r["vs_bsp_slowed"] = r["samples_per_s"] / base[f"bsp, {slow}"]
    if args.json:
        print(json.dumps({"steps": args.steps, "workers": args.workers, "factor": args.factor, "rows": rows}))
        return
    print(f"{'case':28s} {'mb':>4s} {'samples/s':>10s} {'vs DDP':>7s} {'vs BSP(slow)':>12s} {'compute':>8s}  "
          f"samples/worker")
    for r in rows:
        cf = f"{r['compute_fraction']:.2f}" if r["compute_fraction"] is not None else "-"
        print(f"{r['case']:28s} {r['micro_batch']:4d} {r['samples_per_s']:10.1f} {r['vs_ddp']:7.2f} "
              f"{r['vs_bsp_slowed']:12.2f} {cf:>8s}  {r['samples_by_worker']}")


if __name__ == "__main__":
    main()
