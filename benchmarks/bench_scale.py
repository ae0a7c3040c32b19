"""Scale-out pause of a live gpt-mini job on CPU workers, next to torchrun's way, and the cost of being elastic.

Three measurements in one run (``OMP_NUM_THREADS=1 python benchmarks/bench_scale.py``):

1. **felactl scale**: ``felactl launch`` a 2-worker data-parallel gpt-mini job, ``felactl scale --add 1``
   while it trains. The pause is read on the workers that stay, from their metrics: the end of
   their last step in the old generation to the start of their first step in the new one (the
   event's own ``pause_s`` is printed beside it).
2. **torchrun's way**: the same job (2 workers, checkpoint every 10 steps) is killed right after a
   checkpoint, 3 workers are started and load it. The pause is the last step of the old job to
   the first step of the new one (the steps redone since the checkpoint are not even counted).
3. **cost of being elastic when nothing changes**: the same plan launched ``--elastic`` and
   ``--no-elastic`` (plain BSP loop), interleaved rounds: best samples/s of each, the median of
   the paired rounds, and the median step time (less sensitive to a shared machine's load).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from felactl import models
from felactl.agents.worker.local import worker_env
from felactl.launcher.rundir import read_jsonl
from felactl.spec import Plan, SyncMode, SyncSpec, Training, save

CONFIG = {"depth": 1, "width": 256}


def gpt_plan(num_workers: int, global_batch: int = 16) -> Plan:
    return models.local_data_parallel_plan("gpt-mini", CONFIG, num_workers, global_batch=global_batch,
                                           micro_batch=8, sync=SyncSpec(mode=SyncMode.BSP),
                                           training=Training(optimizer="adamw", lr=3e-3, seed=0))


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def _launch(root: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "felactl", "launch", *args, "--runs-root", str(root), "--json"],
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def _wait(predicate, timeout_s: float = 120.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the job ended early: {proc.stderr.read().decode()[-2000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError("timed out")
        time.sleep(0.05)


def _max_step(metrics: Path) -> int:
    return max((r["step"] for r in read_jsonl(metrics)), default=-1)


def measure_felactl(root: Path, plan_path: Path) -> dict:
    run = root / "elastic"
    proc = _launch(root, str(plan_path), "--run-id", "elastic", "--steps", "100000", "--max-nproc-per-node", "3")
    try:
        _wait(lambda: _max_step(run / "metrics.jsonl") >= 20, proc=proc)
        start = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "felactl", "scale", "elastic", "--add", "1", "--json",
                              "--runs-root", str(root)], env=_env(), capture_output=True, text=True, check=True)
        command_s = time.perf_counter() - start
        event = json.loads(out.stdout)
        _wait(lambda: any(r["rank"] == 2 for r in read_jsonl(run / "metrics.jsonl")), proc=proc)
        time.sleep(1.0)
    finally:
        _kill_job(proc, run)
    records = read_jsonl(run / "metrics.jsonl")
    gaps = []
    for wid in (0, 1):
        before = [r for r in records if r["rank"] == wid and r["generation"] == 0]
        after = [r for r in records if r["rank"] == wid and r["generation"] == event["generation"]]
        last, first = max(before, key=lambda r: r["step"]), min(after, key=lambda r: r["step"])
        gaps.append(first["time"] - first["duration_s"] - last["time"])
    return {"pause_s": max(gaps), "event_pause_s": event["pause_s"], "replicated_bytes": event["replicated_bytes"],
            "replicated_from": event["replicated_from"], "command_s": command_s, "step": event["step"],
            "switch_s": event["switch_s"]}


def _kill_job(proc: subprocess.Popen, run: Path) -> None:
    """The launcher's session, then every worker it started (each worker leads its own session)."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for pid in {r["pid"] for r in read_jsonl(run / "metrics.jsonl") if "pid" in r}:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _start_workers(plan_path: Path, run_dir: Path, n: int, store_port: int, extra: dict) -> list[subprocess.Popen]:
    run_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    for rank in range(n):
        env = worker_env(rank, n, store_port=store_port, plan_path=plan_path, run_dir=run_dir, extra=extra)
        with open(run_dir / f"worker{rank}.log", "ab") as log:
            procs.append(subprocess.Popen([sys.executable, "-m", "felactl.agents.worker"], env=env, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True))
    return procs


def measure_torchrun_way(root: Path, plan2: Path, plan3: Path) -> dict:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    old_dir, new_dir = root / "restart-old", root / "restart-new"
    common = {"FELACTL_ELASTIC": "1", "FELACTL_STEPS": "100000", "FELACTL_CHECKPOINT_EVERY": "10"}
    procs = _start_workers(plan2, old_dir, 2, store.port, {**common, "FELACTL_STORE_PREFIX": "old/"})
    checkpoint = old_dir / "checkpoints" / "step000030" / "stage0.pt"
    try:
        _wait(checkpoint.exists)
        for p in procs:  # stop all
            os.killpg(p.pid, signal.SIGKILL)
        for p in procs:
            p.wait()
        last_step_end = max(r["time"] for r in read_jsonl(old_dir / "metrics.jsonl"))
        procs = _start_workers(plan3, new_dir, 3, store.port, {**common, "FELACTL_STORE_PREFIX": "new/",
                                                               "FELACTL_RESUME_FROM": str(checkpoint)})
        _wait(lambda: len({r["rank"] for r in read_jsonl(new_dir / "metrics.jsonl")}) == 3)
        first = min(read_jsonl(new_dir / "metrics.jsonl"), key=lambda r: r["time"] - r["duration_s"])
        return {"pause_s": first["time"] - first["duration_s"] - last_step_end, "resumed_step": first["step"]}
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def measure_overhead(root: Path, plan_path: Path, steps: int, rounds: int) -> dict:
    """Interleaved launches of the same plan, elastic then plain; best of each, and the median of
    each round's paired ratio (the machine's load drifts between rounds, less within one)."""
    runs: dict[str, list[float]] = {"elastic": [], "no-elastic": []}
    medians: dict[str, list[float]] = {"elastic": [], "no-elastic": []}
    for i in range(rounds):
        for mode in ("elastic", "no-elastic"):
            proc = _launch(root, str(plan_path), "--run-id", f"{mode}-{i}", "--steps", str(steps), f"--{mode}")
            out, err = proc.communicate(timeout=600)
            if proc.returncode != 0:
                raise RuntimeError(err.decode()[-2000:])
            runs[mode].append(json.loads(out)["samples_per_s"])
            durations = sorted(r["duration_s"] for r in read_jsonl(root / f"{mode}-{i}" / "metrics.jsonl")
                               if r["rank"] == 0 and r["step"] >= 10)
            medians[mode].append(durations[len(durations) // 2])
    paired = sorted(100 * (1 - e / p) for e, p in zip(runs["elastic"], runs["no-elastic"]))
    best_e, best_p = max(runs["elastic"]), max(runs["no-elastic"])
    return {"elastic_samples_per_s": best_e, "plain_samples_per_s": best_p, "cost_pct": 100 * (1 - best_e / best_p),
            "paired_median_cost_pct": paired[len(paired) // 2], "runs": runs,
            "step_ms": {m: 1000 * min(v) for m, v in medians.items()},
            "step_cost_pct": 100 * (min(medians["elastic"]) / min(medians["no-elastic"]) - 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150, help="steps per throughput run")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved throughput rounds")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        plan2, plan3 = save(gpt_plan(2), root / "plan2.yaml"), save(gpt_plan(3), root / "plan3.yaml")
        ours = measure_felactl(root / "runs", plan2)
        theirs = measure_torchrun_way(root, plan2, plan3)
        overhead = measure_overhead(root / "runs", plan2, args.steps, args.rounds)
    params = sum(p.numel() for p in models.build("gpt-mini", CONFIG).layers.parameters())
    print(f"gpt-mini {CONFIG} ({params} parameters, AdamW), CPU, gloo, OMP_NUM_THREADS=1; scale-out 2 -> 3 workers")
    print(f"{'way':<34}{'pause_s':>10}")
    print(f"{'felactl scale --add 1':<34}{ours['pause_s']:>10.3f}   (event pause_s {ours['event_pause_s']:.3f}; "
          f"{ours['replicated_bytes'] / 1e6:.1f} MB from {len(ours['replicated_from'])} senders "
          f"{ours['replicated_from']}; command round trip {ours['command_s']:.2f} s)")
    print(f"{'stop all, restart 3, load ckpt':<34}{theirs['pause_s']:>10.3f}   (resumed at step {theirs['resumed_step']})")
    print(f"ratio: {theirs['pause_s'] / ours['pause_s']:.0f}x shorter")
    print(f"per-worker switch: {json.dumps(ours['switch_s'])}")
    print(f"throughput when nothing changes (best of {args.rounds}, {args.steps} steps): elastic "
          f"{overhead['elastic_samples_per_s']:.1f} samples/s, plain {overhead['plain_samples_per_s']:.1f} samples/s, "
          f"cost {overhead['cost_pct']:+.2f}% (median of paired rounds {overhead['paired_median_cost_pct']:+.2f}%)")
    print(f"median step time (rank 0, best round): elastic {overhead['step_ms']['elastic']:.2f} ms, plain "
          f"{overhead['step_ms']['no-elastic']:.2f} ms, cost {overhead['step_cost_pct']:+.2f}%")
    print(f"all rounds (samples/s): {json.dumps(overhead['runs'])}")


if __name__ == "__main__":
    main()
