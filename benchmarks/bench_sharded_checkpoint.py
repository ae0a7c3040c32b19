"""What checkpointing a sharded stage costs each of its workers: felactl's way (each worker writes
its own shards with torch.distributed.checkpoint, ``agents/worker/checkpoint.py:save_shards``)
against gathering the stage's whole state first (``get_model_state_dict`` /
``get_optimizer_state_dict`` with ``full_state_dict=True``, then one ``torch.save``: felactl's
way before, and the common FSDP practice), on every worker or, with ``cpu_offload``, on the first
alone.

``OMP_NUM_THREADS=1 python benchmarks/bench_sharded_checkpoint.py [--workers 2] [--width 1024]
[--depth 8] [--repeat 3] [--json]``: each round starts ``--workers`` fresh gloo processes per way,
builds the LLaMA example (``examples/llama.py``) at that size, shards it over them with felactl's
own ``shard`` (FSDP2, each block a unit), takes one AdamW step (so the optimizer has its state),
then writes one checkpoint the way under test and reads it back into a fresh sharded model. Each
process reports the wall time of the write and of the read, and how far its resident memory rose
above where it stood before the write (sampled every 5 ms: what the checkpoint itself needed on
top of the training state). Medians over rounds; the slowest worker's times, the largest rise.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WAYS = ("shards", "gathered on every worker", "gathered on the first (cpu_offload)")


class Peak:
    """The most this process's resident set rose above where it stood at the start, sampled."""

    def __init__(self, every_s: float = 0.005):
        self.process, self.every_s = psutil.Process(), every_s
        self.start = self.highest = self.process.memory_info().rss
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        while not self.done.wait(self.every_s):
            self.highest = max(self.highest, self.process.memory_info().rss)

    def stop(self) -> int:
        self.done.set()
        self.thread.join()
        self.highest = max(self.highest, self.process.memory_info().rss)
        return self.highest - self.start


def _worker(rank: int, workers: int, port: int, way: str, config: dict, out: str, results) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    from felactl import models
    from felactl.agents.worker.checkpoint import load_shards, save_shards
    from felactl.parallel.fsdp import shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=workers)
    try:
        group = dist.new_group(list(range(workers)))
        bundle = models.build("examples.llama:job", config)
        module = shard(bundle.model, group, torch.device("cpu"), units=[f"layers.{i}" for i in range(config["depth"])])
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
        ids, targets = bundle.job.batch(range(2))
        bundle.loss(module(ids), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
        dist.barrier()
        stage_file = Path(out) / "stage0.pt"
        peak = Peak()
        started = time.perf_counter()
        if way == "shards":
            save_shards(stage_file, module, optimizer)
        else:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
                get_optimizer_state_dict,
            )

            options = StateDictOptions(full_state_dict=True, cpu_offload=way != "gathered on every worker")
            state = {
                "model": get_model_state_dict(module, options=options),
                "optimizer": get_optimizer_state_dict(module, optimizer, options=options),
            }
            if rank == 0:
                torch.save(state, stage_file)
            del state
        dist.barrier()
        write_s = time.perf_counter() - started
        grew = peak.stop()
        fresh = shard(models.build("examples.llama:job", config).model, group, torch.device("cpu"))
        fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
        started = time.perf_counter()
        if way == "shards":
            load_shards(next(Path(out).glob("stage0.*.shards")), fresh, fresh_optimizer)
        else:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_model_state_dict,
                set_optimizer_state_dict,
            )

            state = torch.load(stage_file, weights_only=False, mmap=True)
            options = StateDictOptions(full_state_dict=True)
            set_model_state_dict(fresh, state["model"], options=options)
            set_optimizer_state_dict(fresh, fresh_optimizer, state["optimizer"], options=options)
        dist.barrier()
        read_s = time.perf_counter() - started
        same = all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(module.parameters(), fresh.parameters()))
        results.put((rank, write_s, read_s, max(grew, 0), same))
    finally:
        dist.destroy_process_group()


def one_round(way: str, workers: int, config: dict) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as out:
        procs = [
            ctx.Process(target=_worker, args=(r, workers, port, way, config, out, results)) for r in range(workers)
        ]
        for p in procs:
            p.start()
        got = [results.get(timeout=600) for _ in range(workers)]
        for p in procs:
            p.join(timeout=60)
        written = sum(f.stat().st_size for f in Path(out).rglob("*") if f.is_file())
    assert all(g[4] for g in got), f"{way}: the state read back differs from the state written"
    return {
        "write_s": max(g[1] for g in got),
        "read_s": max(g[2] for g in got),
        "peak_growth_gb": max(g[3] for g in got) / 1e9,
        "written_gb": written / 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    config = {"width": args.width, "depth": args.depth, "num_heads": 8, "seq_len": 32}
    rounds: dict[str, list[dict]] = {way: [] for way in WAYS}
    for r in range(args.repeat):
        for way in WAYS:
            rounds[way].append(one_round(way, args.workers, config))
            print(f"round {r + 1} {way}: {rounds[way][-1]}", file=sys.stderr, flush=True)
    medians = {way: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for way, rs in rounds.items()}
    if args.json:
        print(json.dumps({"config": config, "workers": args.workers, "medians": medians, "rounds": rounds}))
        return
    print(
        f"| way ({args.workers} workers, width {args.width}, depth {args.depth}) | write s | read s | "
        "largest worker's peak rise GB | written GB | rise / the stage's state | write vs shards |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for way, m in medians.items():
        print(
            f"| {way} | {m['write_s']:.2f} | {m['read_s']:.2f} | {m['peak_growth_gb']:.3f} | "
            f"{m['written_gb']:.3f} | {m['peak_growth_gb'] / m['written_gb']:.3f} | "
            f"{m['write_s'] / medians['shards']['write_s']:.2f}x |"
        )


if __name__ == "__main__":
    main()
