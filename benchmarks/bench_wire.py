"""What one message between neighbouring pipeline stages costs on the same node (loopback, gloo):
felactl's wire (``agents/worker/wire.py``: a fixed-size header, then the tensors) next to the
framing it replaced (the header's size sent ahead of the header: one operation more), in one run.

``OMP_NUM_THREADS=1 python benchmarks/bench_wire.py [--rounds 2000] [--repeat 5] [--seq 32]
[--width 64] [--micro-batch 1] [--json]``: two processes, each pinned to a core of its own as a
node's slots are, exchange what a split LM's stages do at a boundary, ``--rounds`` times: rank 0
sends a forward message (the hidden states ``[micro-batch, seq, width]``, two rotary tables and
a number: four values), rank 1 answers with the gradient (one tensor), through the very
``_Link`` a pipeline stage sends and receives with (``agents/worker/pipeline.py``). Each round
is one message each way, which each process handles (one sent, one received), so a process's CPU
seconds over ``2 x rounds`` is its host CPU per message: what ``cost.LOCAL_MESSAGE_CPU_S`` prices (0.22 ms, from this; 0.28 before, measured on the old framing). The
two framings alternate within each repetition; medians over repetitions, and the old framing's
over the new within each.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FRAMINGS = ("fixed header (felactl)", "size ahead (before)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def size_ahead(wire):
    """The framing before the fixed header, as ``wire`` had it: the header's size, the header, the
    tensors (three operations for a one-tensor message). Returns (encode, decode). Its encode
    cuts the old header out of the fixed one (a copy of a few hundred bytes more than the old
    code made, a few microseconds of the ~0.3 ms a message costs)."""
    import torch

    fixed_header = wire.encode  # kept: the returned encode replaces wire.encode

    def encode(value):
        fixed, *tensors = fixed_header(value)
        items = 1 if isinstance(value, torch.Tensor) else len(value)
        size = 1 + wire.FIELDS * items
        return [torch.tensor([size], dtype=torch.long), fixed[:size].clone(), *tensors]

    def decode(recv, device):
        size = torch.zeros(1, dtype=torch.long)
        recv(size)
        header = torch.zeros(int(size.item()), dtype=torch.long)
        recv(header)
        return wire.read_values(header, recv, device)

    return encode, decode


def worker(rank: int, port: int, rounds: int, framing: str, seq: int, width: int, micro_batch: int) -> None:
    """One side of the exchange; prints its CPU seconds and the wall of its rounds as JSON."""
    import torch
    import torch.distributed as dist

    from felactl.agents.worker import pipeline, wire

    os.sched_setaffinity(0, [rank % os.cpu_count()])
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    if framing != FRAMINGS[0]:
        wire.encode, wire.decode = size_ahead(wire)  # the _Link below sends and receives through these
    link = pipeline._Link(1 - rank, torch.device("cpu"))
    forward = (torch.randn(micro_batch, seq, width), torch.randn(seq, width // 4), torch.randn(seq, width // 4), seq)
    gradient = torch.randn(micro_batch, seq, width)

    def one_round() -> None:
        if rank == 0:
            link.send(forward, tag=0)
            link.flush()
            link.recv(tag=1)
        else:
            link.recv(tag=0)
            link.send(gradient, tag=1)
            link.flush()

    for _ in range(50):  # warm-up: gloo's pairs connect, buffers are allocated
        one_round()
    dist.barrier()
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(rounds):
        one_round()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    dist.barrier()
    print(json.dumps({"rank": rank, "cpu_s": cpu, "wall_s": wall}), flush=True)
    dist.destroy_process_group()


def one_run(args, framing: str) -> dict:
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--worker",
                str(rank),
                "--port",
                str(port),
                "--framing",
                framing,
                "--rounds",
                str(args.rounds),
                "--seq",
                str(args.seq),
                "--width",
                str(args.width),
                "--micro-batch",
                str(args.micro_batch),
            ],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for rank in range(2)
    ]
    try:
        outputs = [json.loads(p.communicate(timeout=300)[0].strip().splitlines()[-1]) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode for p in procs):
        raise SystemExit(f"{framing}: a worker failed")
    messages = 2 * args.rounds
    return {
        "round_trip_ms": max(o["wall_s"] for o in outputs) / args.rounds * 1e3,
        "cpu_ms_per_message": [o["cpu_s"] / messages * 1e3 for o in outputs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--framing", default=FRAMINGS[0], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.port, args.rounds, args.framing, args.seq, args.width, args.micro_batch)
        return
    runs = []
    for r in range(args.repeat):
        order = FRAMINGS if r % 2 == 0 else tuple(reversed(FRAMINGS))  # drift does not favour one
        runs.append({f: one_run(args, f) for f in order})
    median = {
        f: {
            "round_trip_ms": statistics.median(run[f]["round_trip_ms"] for run in runs),
            "cpu_ms_per_message": [
                statistics.median(run[f]["cpu_ms_per_message"][k] for run in runs) for k in range(2)
            ],
        }
        for f in FRAMINGS
    }
    ratio = statistics.median(run[FRAMINGS[1]]["round_trip_ms"] / run[FRAMINGS[0]]["round_trip_ms"] for run in runs)
    result = {"runs": runs, "median": median, "before_over_felactl_round_trip": ratio}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"forward [{args.micro_batch}, {args.seq}, {args.width}] + 2 tables + a number, gradient back; "
          f"{args.rounds} rounds, {args.repeat} repetitions (medians)")  # fmt: skip
    print(f"{'framing':<24} {'round trip ms':>14} {'CPU ms/message rank 0':>22} {'rank 1':>7}")
    for f in FRAMINGS:
        m = median[f]
        print(
            f"{f:<24} {m['round_trip_ms']:>14.3f} {m['cpu_ms_per_message'][0]:>22.3f} {m['cpu_ms_per_message'][1]:>7.3f}"
        )
    print(f"round trip, before / felactl (within each repetition): {ratio:.2f}x")


if __name__ == "__main__":
    main()
