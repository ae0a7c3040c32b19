"""A worker killed in two pipelines: the restart goes on from what the survivors hold, against the
newest regular checkpoint it went on from before, in one run; and what stepping together costs.

``OMP_NUM_THREADS=1 python benchmarks/bench_survivors.py [--repeat 3]``: each round launches (CPU,
gloo) the mlp as 2 stages x 2 pipelines with ``--checkpoint-every 20``, SIGKILLs the worker of
stage 0 in pipeline 1 once step 30 is trained, and lets the run end. From its summary and metrics:

* the step the restart went on from and the steps it redid (felactl: the survivors' state of the
  last step every worker summed), next to the steps a restart from the newest regular checkpoint
  (felactl before ``agents/worker/survivors.py``, torchrun's ``--max-restarts``) redoes: the
  steps recorded past it, and their time at the run's median step;
* the pause (last step recorded before the restart to the first after it);
* the price of stepping together (``StepCommit``): per step, the commit seconds of the worker that
  arrived last (its store round trips, on the critical path; the others' wait is time their stage
  would wait anyway), next to the median step. Medians over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from _worker_helpers import pipeline_plan  # noqa: E402

from benchmarks.bench_restart_rescale import launched, wait_for_step  # noqa: E402
from felactl.launcher.rundir import read_jsonl  # noqa: E402
from felactl.spec import save  # noqa: E402

EVERY = 20
KILL_AFTER = 30
STEPS = 60


def one_round(root: Path, plan_path: Path, run_id: str) -> dict[str, float]:
    runs = root / "runs"
    flags = ("--checkpoint-every", str(EVERY), "--straggler", "roundrobin:0.02")
    launch = launched(runs, plan_path, run_id, STEPS, *flags)
    try:
        wait_for_step(runs, run_id, KILL_AFTER, launch, timeout_s=180)
        _worker(launch.pid, rank=2).send_signal(signal.SIGKILL)
        launch.wait(timeout=300)
    finally:
        if launch.poll() is None:
            os.killpg(launch.pid, 9)
            launch.wait()
    return _measured(runs / run_id)


def _worker(launch_pid: int, rank: int) -> psutil.Process:
    for proc in psutil.Process(launch_pid).children(recursive=True):
        if proc.name() == f"felactl-w{rank}":  # each worker names itself (agents/worker/__main__.py)
            return proc
    raise RuntimeError(f"no worker of rank {rank}")


def _measured(run: Path) -> dict[str, float]:
    summary = json.loads((run / "summary.json").read_text())
    (restart,) = summary["restarts"]
    records = read_jsonl(run / "metrics.jsonl")
    first = [r for r in records if not r.get("generation")]
    last_before = max(r["step"] for r in first)
    regular = max((k for k in range(0, last_before + 1, EVERY) if k <= last_before), default=0)
    step_s = statistics.median(r["duration_s"] for r in records if r["step"] >= 3)
    by_step: dict[tuple[int, int], list[float]] = {}
    for r in records:
        if "commit_s" in r:
            by_step.setdefault((r.get("generation", 0), r["step"]), []).append(r["commit_s"])
    return {
        "from_step": restart["from_step"],
        "redone": restart["redone_steps"],
        "redone_from_regular": last_before + 1 - regular,
        "redone_from_regular_s": (last_before + 1 - regular) * step_s,
        "pause_s": restart["pause_s"],
        "step_s": step_s,
        "commit_s": statistics.median(min(v) for v in by_step.values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    rounds = []
    with tempfile.TemporaryDirectory(prefix="bench_survivors.") as tmp:
        root = Path(tmp)
        plan = save(pipeline_plan([0, 2, 3], num_replicas=2, optimizer="adamw", lr=0.01), root / "plan.yaml")
        for round_ in range(args.repeat):
            rounds.append(one_round(root, plan, f"k{round_}"))
            print(f"round {round_ + 1}: {rounds[-1]}", flush=True)
    load = os.getloadavg()
    print(f"\nload average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {args.repeat} round(s)\n")

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rounds)

    print("| what | felactl (survivors' state) | from the newest regular checkpoint |")
    print("|---|---:|---:|")
    print(f"| steps redone after the kill, median | {med('redone'):g} | {med('redone_from_regular'):g} |")
    print(f"| their time at the median step, s | 0 | {med('redone_from_regular_s'):.2f} |")
    print(f"| pause, s (median) | {med('pause_s'):.2f} | |")
    print(
        f"| stepping together: last arrival's commit per step | {1000 * med('commit_s'):.2f} ms "
        f"({med('commit_s') / med('step_s'):.2%} of the {1000 * med('step_s'):.0f} ms step) | 0 |"
    )


if __name__ == "__main__":
    main()
