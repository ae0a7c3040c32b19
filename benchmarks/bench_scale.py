"""Scale-out pause of a live gpt-mini job (or a user's own TrainJob) on CPU workers, next to torchrun's way, and the cost of being elastic.

Three measurements in one run (``OMP_NUM_THREADS=1 python benchmarks/bench_scale.py [--job examples.lm:job
[--job-config key=value]] [--syncs bsp,tokens] [--repeat 5]``):

1. **felactl scale**: ``felactl launch`` a 2-worker data-parallel job, ``felactl scale --add 1``
   while it trains, for each sync mode of ``--syncs`` (``--repeat`` times each, the modes
   interleaved; median and min-max). The pause is read on the workers that stay, from their
   metrics: the end of their last step in the old generation to the start of their first step in
   the new one (the event's own ``pause_s`` is printed beside it).
2. **torchrun's way**: the same job (2 workers, checkpoint every 10 steps) is killed right after a
   checkpoint, 3 workers are started and load it. The pause is the last step of the old job to
   the first step of the new one (the steps redone since the checkpoint are not even counted);
   once, in the first sync mode.
3. **cost of being elastic when nothing changes**: the same plan launched ``--elastic`` and
   ``--no-elastic`` (plain loop) in ABBA rounds, in the first sync mode; per round the ratio of steady-state
   samples/s (start-up and the first 10 steps left out), its median and quartiles over rounds;
   and the CPU time of the one thing an elastic worker runs beyond the plain loop in steady state,
   its heartbeat / generation-watch thread, as a share of its wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
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

sys.path.insert(0, str(Path(__file__).parent))
from benchjob import add_job_arguments, job_config  # noqa: E402

CONFIG = {"depth": 1, "width": 256}
"""gpt-mini's, when no ``--job`` is given."""


def job_plan(source: str, config: dict, num_workers: int, sync: str = "bsp", global_batch: int = 16) -> Plan:
    """Data parallel on local CPU slots, micro-batches (tokens) of 8; a built-in trains with AdamW,
    a user's job with its own optimizer."""
    return models.local_data_parallel_plan(
        source,
        config,
        num_workers,
        global_batch=global_batch,
        micro_batch=8,
        sync=SyncSpec(mode=SyncMode(sync)),
        training=Training(optimizer="adamw", lr=3e-3, seed=0),
    )


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def _launch(root: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "felactl", "launch", *args, "--runs-root", str(root), "--json"],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )


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


def measure_felactl(root: Path, plan_path: Path, run_id: str = "elastic") -> dict:
    run = root / run_id
    proc = _launch(root, str(plan_path), "--run-id", run_id, "--steps", "100000", "--max-nproc-per-node", "3")
    try:
        _wait(lambda: _max_step(run / "metrics.jsonl") >= 20, proc=proc)
        start = time.perf_counter()
        out = subprocess.run(
            [sys.executable, "-m", "felactl", "scale", run_id, "--add", "1", "--json", "--runs-root", str(root)],
            env=_env(),
            capture_output=True,
            text=True,
            check=True,
        )
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
    return {
        "pause_s": max(gaps),
        "event_pause_s": event["pause_s"],
        "replicated_bytes": event["replicated_bytes"],
        "replicated_from": event["replicated_from"],
        "command_s": command_s,
        "step": event["step"],
        "switch_s": event["switch_s"],
    }


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
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "felactl.agents.worker"],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
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
        procs = _start_workers(
            plan3,
            new_dir,
            3,
            store.port,
            {**common, "FELACTL_STORE_PREFIX": "new/", "FELACTL_RESUME_FROM": str(checkpoint)},
        )
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


def steady_rate(metrics: Path, skip: int = 10) -> tuple[float, float]:
    """(samples/s, median step s) after the first ``skip`` steps: step ``s`` ends when its last
    worker records it; the rate is the samples of steps after ``skip`` over the time they took;
    the median step is over every worker's steps."""
    records = read_jsonl(metrics)
    ends: dict[int, float] = {}
    samples: dict[int, int] = {}
    for r in records:
        ends[r["step"]] = max(ends.get(r["step"], 0.0), r["time"])
        samples[r["step"]] = samples.get(r["step"], 0) + r["samples"]
    steps = sorted(s for s in ends if s >= skip)
    if len(steps) < 2:
        raise SystemExit(f"{metrics}: fewer than {skip + 2} steps; run more --steps")
    rate = sum(samples[s] for s in steps[1:]) / (ends[steps[-1]] - ends[steps[0]])
    durations = sorted(r["duration_s"] for r in records if r["step"] >= skip)
    return rate, durations[len(durations) // 2]


def measure_overhead(root: Path, plan_path: Path, steps: int, rounds: int) -> dict:
    """Launches of the same plan, ``--elastic`` and ``--no-elastic``, in rounds ordered ABBA (which
    of the two goes first alternates, so a drifting load falls on both alike): the per-round ratio
    of steady-state samples/s (after 10 steps), its median and quartiles over the rounds."""
    rates: dict[str, list[float]] = {"elastic": [], "no-elastic": []}
    step_s: dict[str, list[float]] = {"elastic": [], "no-elastic": []}
    heartbeat_share: list[float] = []
    for i in range(rounds):
        for mode in ("elastic", "no-elastic") if i % 2 == 0 else ("no-elastic", "elastic"):
            proc = _launch(root, str(plan_path), "--run-id", f"{mode}-{i}", "--steps", str(steps), f"--{mode}")
            out, err = proc.communicate(timeout=600)
            if proc.returncode != 0:
                raise RuntimeError(err.decode()[-2000:])
            rate, step = steady_rate(root / f"{mode}-{i}" / "metrics.jsonl")
            rates[mode].append(rate)
            step_s[mode].append(step)
            if mode == "elastic":
                for summary in (root / f"{mode}-{i}" / "workers").glob("rank*.json"):
                    worker = json.loads(summary.read_text())
                    heartbeat_share.append(100 * worker["heartbeat_cpu_s"] / worker["wall_s"])
    if not heartbeat_share:
        raise SystemExit("no elastic worker summary (workers/rank*.json) found")
    costs = sorted(100 * (1 - e / p) for e, p in zip(rates["elastic"], rates["no-elastic"]))
    step_costs = sorted(100 * (e / p - 1) for e, p in zip(step_s["elastic"], step_s["no-elastic"]))
    return {
        "rates": rates,
        "step_s": step_s,
        "cost_pct": statistics.median(costs),
        "cost_quartiles_pct": statistics.quantiles(costs, n=4)[::2] if len(costs) > 1 else costs * 2,
        "step_cost_pct": statistics.median(step_costs),
        "heartbeat_cpu_pct": statistics.median(heartbeat_share),
        "heartbeat_cpu_pct_max": max(heartbeat_share),
        "elastic_samples_per_s": statistics.median(rates["elastic"]),
        "plain_samples_per_s": statistics.median(rates["no-elastic"]),
    }


def measure_scale_outs(root: Path, plans: dict[str, Path], repeat: int) -> dict[str, list[dict]]:
    """``repeat`` scale-outs per sync mode, the modes interleaved (their order alternating by round)."""
    ours: dict[str, list[dict]] = {sync: [] for sync in plans}
    for i in range(repeat):
        for sync in list(plans) if i % 2 == 0 else list(plans)[::-1]:
            ours[sync].append(measure_felactl(root, plans[sync], run_id=f"elastic-{sync}-{i}"))
    return ours


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150, help="steps per throughput run")
    parser.add_argument("--rounds", type=int, default=3, help="ABBA rounds of the elastic cost (0: skip it)")
    parser.add_argument("--only-cost", action="store_true", help="measure only the cost of being elastic")
    parser.add_argument("--syncs", default="bsp", help="sync modes to scale out, comma-separated (bsp, tokens)")
    parser.add_argument("--repeat", type=int, default=1, help="scale-outs per sync mode (median and min-max)")
    add_job_arguments(parser)
    args = parser.parse_args()
    source, config = (args.job, job_config(args.job_config)) if args.job else ("gpt-mini", CONFIG)
    syncs = args.syncs.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        plans = {sync: save(job_plan(source, config, 2, sync), root / f"plan2-{sync}.yaml") for sync in syncs}
        plan2, plan3 = plans[syncs[0]], save(job_plan(source, config, 3, syncs[0]), root / "plan3.yaml")
        if not args.only_cost:
            ours = measure_scale_outs(root / "runs", plans, args.repeat)
            theirs = measure_torchrun_way(root, plan2, plan3)
        overhead = measure_overhead(root / "runs", plan2, args.steps, args.rounds) if args.rounds else None
    params = sum(p.numel() for p in models.build(source, config).layers.parameters())
    optimizer = "AdamW" if source == "gpt-mini" else "its own optimizer"
    print(
        f"{source} {config} ({params} parameters, {optimizer}), global batch 16, micro-batch 8, CPU, gloo, "
        f"OMP_NUM_THREADS=1"
    )
    if not args.only_cost:
        print(
            f"scale-out 2 -> 3 workers ({args.repeat} per sync mode, interleaved)\n"
            f"{'way':<34}{'pause_s':>10}{'min-max':>14}"
        )
        for sync, runs in ours.items():
            pauses = [r["pause_s"] for r in runs]
            last = runs[-1]
            print(
                f"{'felactl scale --add 1, ' + sync:<34}{statistics.median(pauses):>10.3f}"
                f"{min(pauses):>7.3f}-{max(pauses):<6.3f}  (event pause_s median "
                f"{statistics.median(r['event_pause_s'] for r in runs):.3f}; "
                f"{last['replicated_bytes'] / 1e6:.1f} MB from {len(last['replicated_from'])} senders "
                f"{last['replicated_from']}; command round trip median "
                f"{statistics.median(r['command_s'] for r in runs):.2f} s)"
            )
        print(
            f"{'stop all, restart 3, load ckpt':<34}{theirs['pause_s']:>10.3f}   (resumed at step {theirs['resumed_step']})"
        )
        print(
            f"every pause_s: {json.dumps({sync: [round(r['pause_s'], 3) for r in runs] for sync, runs in ours.items()})}"
        )
        for sync, runs in ours.items():
            print(f"ratio ({sync}): {theirs['pause_s'] / statistics.median(r['pause_s'] for r in runs):.0f}x shorter")
            print(f"per-worker switch ({sync}, last run): {json.dumps(runs[-1]['switch_s'])}")
    if overhead is None:
        return
    print(
        f"cost of being elastic when nothing changes ({args.rounds} ABBA rounds, {args.steps} steps each, "
        f"steady state after 10 steps): median over rounds of 1 - elastic/plain samples/s "
        f"{overhead['cost_pct']:+.2f}% (quartiles {overhead['cost_quartiles_pct'][0]:+.2f}% .. "
        f"{overhead['cost_quartiles_pct'][1]:+.2f}%); median step time {overhead['step_cost_pct']:+.2f}%; "
        f"medians elastic {overhead['elastic_samples_per_s']:.1f}, plain {overhead['plain_samples_per_s']:.1f} samples/s"
    )
    print(
        f"the elastic worker's heartbeat/generation-watch thread used {overhead['heartbeat_cpu_pct']:.3f}% of its "
        f"wall time in CPU (median over workers and rounds; max {overhead['heartbeat_cpu_pct_max']:.3f}%)"
    )
    print(f"all rounds (samples/s): {json.dumps({m: [round(v, 1) for v in r] for m, r in overhead['rates'].items()})}")


if __name__ == "__main__":
    main()
