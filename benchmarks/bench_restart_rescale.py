"""The pause of rescaling a job that cannot rescale live (a two-stage pipeline), which restarts its
workers from a checkpoint it drains to, next to a data-parallel job's live rescale, in one run.

``OMP_NUM_THREADS=1 python benchmarks/bench_restart_rescale.py [--repeat 3]``: each round launches
(CPU, gloo) the mlp as a two-stage pipeline on 2 workers and ``felactl scale --add 2`` (two
pipelines), and the same mlp data-parallel on 2 workers and ``felactl scale --add 1``. The pause
is what ``felactl scale`` answers: from the last step before the change to the first after it
(the restart's includes draining to the agreed step, starting the workers and restoring the
checkpoint; the live rescale's, the members' switch). The pipeline's restart runs twice a round:
its workers forked from the agent's zygote (torch imported once, felactl's default), and exec'd
each with its own import of torch (``FELACTL_ZYGOTE=0``, felactl before the zygote and how
torchrun starts workers). Medians over rounds.
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
sys.path.insert(0, str(ROOT / "tests"))
from _worker_helpers import dp_plan, pipeline_plan  # noqa: E402

from felactl.launcher.rundir import read_jsonl  # noqa: E402
from felactl.spec import save  # noqa: E402

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def felactl(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "felactl", *args], env=ENV, capture_output=True, text=True, **kwargs)


def launched(
    runs: Path, plan_path: Path, run_id: str, steps: int, *flags: str, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """``felactl launch`` of ``plan_path`` in the background, in a session of its own (to kill whole)."""
    args = ["launch", str(plan_path), "--run-id", run_id, "--steps", str(steps), "--runs-root", str(runs)]
    return subprocess.Popen(
        [sys.executable, "-m", "felactl", *args, "--max-nproc-per-node", "4", *flags],
        env={**ENV, **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def wait_for_step(runs: Path, run_id: str, step: int, launch: subprocess.Popen, timeout_s: float = 120) -> None:
    """Until the run's metrics hold step ``step`` (AssertionError when the launch ended first or it times out)."""
    deadline = time.monotonic() + timeout_s
    while not any(r["step"] >= step for r in read_jsonl(runs / run_id / "metrics.jsonl")):
        assert time.monotonic() < deadline and launch.poll() is None, f"{run_id}: no step {step}"
        time.sleep(0.05)


def pause_of(root: Path, plan_path: Path, run_id: str, add: int, env: dict[str, str] | None = None) -> float:
    """Launch ``plan_path``, scale it out by ``add`` once it trains, return the pause it answers."""
    runs = root / "runs"
    launch = launched(runs, plan_path, run_id, 100000, "--straggler", "roundrobin:0.02", env=env)
    try:
        wait_for_step(runs, run_id, 10, launch)
        done = felactl("scale", run_id, "--add", str(add), "--runs-root", str(runs), "--json", timeout=180)
        if done.returncode != 0:
            raise RuntimeError(f"felactl scale {run_id}: {done.stderr.strip()}")
        return float(json.loads(done.stdout)["pause_s"])
    finally:
        os.killpg(launch.pid, 9)
        launch.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    pauses: dict[str, list[float]] = {
        "pipeline (restart)": [],
        "pipeline (restart), workers exec'd": [],
        "data parallel (live)": [],
    }
    with tempfile.TemporaryDirectory(prefix="bench_restart.") as tmp:
        root = Path(tmp)
        pipe = save(pipeline_plan([0, 2, 3], optimizer="adamw", lr=0.01), root / "pipeline.yaml")
        dp = save(dp_plan(2, "bsp", optimizer="adamw", lr=0.01), root / "dp.yaml")
        for round_ in range(args.repeat):  # interleaved: a slow minute of the machine hits both
            pauses["pipeline (restart)"].append(pause_of(root, pipe, f"pipe{round_}", 2))
            exec_d = pause_of(root, pipe, f"exec{round_}", 2, env={"FELACTL_ZYGOTE": "0"})
            pauses["pipeline (restart), workers exec'd"].append(exec_d)
            pauses["data parallel (live)"].append(pause_of(root, dp, f"dp{round_}", 1))
            print(f"round {round_ + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in pauses.items()), flush=True)
    load = os.getloadavg()
    print(f"\nload average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {args.repeat} round(s)\n")
    print("| job | scale | pause s, median | min–max |")
    print("|---|---|---:|---:|")
    hows = ("--add 2 (1x2 -> 2x2)", "--add 2, FELACTL_ZYGOTE=0", "--add 1 (2 -> 3)")
    for (name, values), how in zip(pauses.items(), hows):
        print(f"| {name} | {how} | {statistics.median(values):.2f} | {min(values):.2f}–{max(values):.2f} |")


if __name__ == "__main__":
    main()
