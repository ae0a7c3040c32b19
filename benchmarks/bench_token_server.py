"""What the flexible hybrid's token server costs: the host CPU rank 0 spends per token it hands out,
and how long a worker waits for its reply, with no compute around them.

The flexible hybrid (``agents/worker/flexible.py``) claims every token of a pipeline's stage
through rank 0's :class:`~felactl.agents.worker.flexible.TokenService`: the worker pushes its
request (the token it finished) to a queue in the job's store and pops its reply; rank 0's server
thread pops the request, updates its :class:`~felactl.agents.worker.sync.token_policy.TokenServer`
and pushes the reply. This runs that very service and the workers' very request loop
(``FlexibleWorker.iteration``, its compute left out) on a real ``TCPStore`` hosted by this process,
as the launcher hosts it: the server in a process of its own, as rank 0's thread is; each worker in
its own. It reports the server's CPU seconds per request (its process's, over every request it
served: ``cost.TOKEN_SERVER_CPU_S`` prices it) and each worker's wall and CPU per token.

    OMP_NUM_THREADS=1 python benchmarks/bench_token_server.py [--stages 2] [--replicas 2]
        [--global-batch 64] [--steps 20] [--repeat 3] [--json]

The plan is ``--stages`` stages of ``--replicas`` workers each at micro-batch 1, as the
two-servers testbed's two chains of two (BENCHMARKS.md). Workers with nothing to compute ask as
fast as the server answers, so the wall per token is the server's pace, not a pipeline's.

``--server-main python`` keeps the server process's main thread busy in Python, as rank 0's own
token handling is at times: the server then waits for the GIL, up to the switch interval twice a
request (40 ms a token at Python's 5 ms). ``--switch-interval-ms`` shortens it there. Workers keep
Python's default: on the two-servers testbed a 0.1 ms interval left each token's wait as it was
(3.0-3.2 ms, a throttled node's wake-ups) and ran 0.91-1.00 of the default's speed in four pairs
of runs (BENCHMARKS.md, "What a pipeline token's claim waits for").
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from felactl.control import keys  # noqa: E402
from felactl.control.store import connect_store, serve_store  # noqa: E402
from felactl.spec import ModelRef, Plan, Schedule, Stage, StageWorker, SyncMode, SyncSpec, Training  # noqa: E402


def token_plan(stages: int, replicas: int, global_batch: int) -> Plan:
    """``stages`` stages of the two-servers kind: ``replicas`` workers each, micro-batch 1."""
    devices = [f"cpu{s * replicas + r}" for s in range(stages) for r in range(replicas)]
    return Plan(
        cluster="local",
        model=ModelRef(name="mlp", source="mlp", config={"depth": stages}),
        devices=tuple(devices),
        global_batch=global_batch,
        schedule=Schedule.TOKENS,
        sync=SyncSpec(mode=SyncMode.TOKENS),
        training=Training(optimizer="sgd", lr=0.1, seed=0),
        stages=tuple(
            Stage(
                layer_start=s,
                layer_end=s + 1,
                micro_batch=1,
                workers=tuple(
                    StageWorker(device=f"cpu{s * replicas + r}", share=1 / replicas) for r in range(replicas)
                ),
            )
            for s in range(stages)
        ),
    )


def busy_python(until) -> None:
    """Pure Python, as a worker's own token handling (indices, pytree walks, json): holds the GIL."""
    while not until():
        sum(i * i for i in range(2000))


def busy_torch(until) -> None:
    """Matmuls, as a worker's compute: torch lets the GIL go inside each."""
    import torch

    a = torch.randn(256, 256)
    while not until():
        a = torch.tanh(a @ a)


def serve(port: int, plan: Plan, steps: int, main: str, switch_interval_ms: float | None, out) -> None:
    """Rank 0's server thread in this process, its main thread ``main`` ("idle", or busy as a
    worker's: "python", "torch"); with ``main`` idle its CPU seconds are the server's."""
    from felactl.agents.worker.flexible import TokenService

    if switch_interval_ms is not None:
        sys.setswitchinterval(switch_interval_ms / 1e3)
    store = connect_store("127.0.0.1", port)
    service = TokenService(store, plan, range(steps))
    cpu, wall = time.process_time(), time.perf_counter()
    service.thread.start()
    until = lambda: not service.thread.is_alive()  # noqa: E731
    {"idle": lambda until: service.thread.join(), "python": busy_python, "torch": busy_torch}[main](until)
    service.thread.join()
    out.put(
        {
            "server_cpu_s": time.process_time() - cpu,
            "server_wall_s": time.perf_counter() - wall,
            "error": repr(service.error) if service.error else None,
        }
    )


def work(port: int, rank: int, steps: int, out) -> None:
    """A worker's request loop, as ``FlexibleWorker.iteration`` runs it, with no compute."""
    store = connect_store("127.0.0.1", port)
    replies = connect_store("127.0.0.1", port)
    tokens, cpu, wall = 0, time.process_time(), time.perf_counter()
    for step in range(steps):
        done = None
        while True:
            store.queue_push(keys.flexible_requests(step), json.dumps({"rank": rank, "done": done}))
            reply = json.loads(replies.queue_pop(keys.flexible_reply(step, rank), True))
            if reply.get("end"):
                break
            done, tokens = reply["token"], tokens + 1
    out.put({"rank": rank, "tokens": tokens, "cpu_s": time.process_time() - cpu, "wall_s": time.perf_counter() - wall})


def run_once(plan: Plan, steps: int, main: str = "idle", switch_interval_ms: float | None = None) -> dict:
    store, port = serve_store("127.0.0.1")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=serve, args=(port, plan, steps, main, switch_interval_ms, out))]
    procs += [ctx.Process(target=work, args=(port, rank, steps, out)) for rank in range(len(plan.devices))]
    try:
        for p in procs:
            p.start()
        results = [out.get(timeout=300) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    server = next(r for r in results if "server_cpu_s" in r)
    if server["error"]:
        raise SystemExit(f"the token server failed: {server['error']}")
    workers = sorted((r for r in results if "rank" in r), key=lambda r: r["rank"])
    requests = sum(w["tokens"] for w in workers) + len(workers) * steps  # and each worker's last ask
    del store
    return {
        "requests": requests,
        "server_cpu_ms_per_request": 1e3 * server["server_cpu_s"] / requests,
        "worker_wall_ms_per_token": statistics.median(1e3 * w["wall_s"] / w["tokens"] for w in workers),
        "worker_cpu_ms_per_token": statistics.median(1e3 * w["cpu_s"] / w["tokens"] for w in workers),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--server-main",
        choices=("idle", "python", "torch"),
        default="idle",
        help="what the server process's main thread does, as rank 0's worker would",
    )
    ap.add_argument(
        "--switch-interval-ms",
        type=float,
        default=None,
        help="the server process's sys.setswitchinterval (Python's default: 5 ms)",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    plan = token_plan(args.stages, args.replicas, args.global_batch)
    runs = [run_once(plan, args.steps, args.server_main, args.switch_interval_ms) for _ in range(args.repeat)]
    summary = {key: statistics.median(r[key] for r in runs) for key in runs[0] if key != "requests"}
    summary["requests_per_run"] = runs[0]["requests"]
    if args.json:
        print(json.dumps({"runs": runs, "median": summary}, indent=1))
        return 0
    print(
        f"{args.stages} stages x {args.replicas} workers, micro-batch 1, global batch {args.global_batch}, "
        f"{args.steps} steps, {args.repeat} runs (median; each run's in brackets); the server's main "
        f"thread {args.server_main}, switch interval {args.switch_interval_ms or 5} ms"
    )
    for key, value in summary.items():
        each = ", ".join(f"{r[key]:.3f}" for r in runs) if key in runs[0] else ""
        print(f"  {key:30s} {value:8.3f}  [{each}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
