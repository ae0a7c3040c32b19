"""The pause of rescaling a job that cannot rescale live (a two-stage pipeline), which restarts its
workers from a checkpoint it drains to, next to a data-parallel job's live rescale, in one run.

``OMP_NUM_THREADS=1 python benchmarks/bench_restart_rescale.py [--repeat 3]``: each round launches
(CPU, gloo) the mlp as a two-stage pipeline on 2 workers and ``felactl scale --add 2`` (two
pipelines), and the same mlp data-parallel on 2 workers and ``felactl scale --add 1``
(``--model SOURCE --config K=V``: that model instead, cut in two halves, global batch 8). The pause
is what ``felactl scale`` answers: from the last step before the change to the first after it
(the restart's includes draining to the agreed step, starting the workers and restoring the
checkpoint; the live rescale's, the members' switch). The pipeline's restart runs three times a
round: its workers forked from the agent's zygote (torch imported once and the model built once,
felactl's default), forked but each building its own model (``FELACTL_SHARED_MODEL=0``, felactl
before the shared model), and exec'd each with its own import of torch (``FELACTL_ZYGOTE=0``,
felactl before the zygote and how torchrun starts workers). Medians over rounds.
"""

from __future__ import annotations

import argparse
import dataclasses
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
import yaml  # noqa: E402
from _worker_helpers import dp_plan, pipeline_plan  # noqa: E402

from felactl.launcher.rundir import read_jsonl  # noqa: E402
from felactl.spec import ModelRef, save  # noqa: E402

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
    parser.add_argument("--model", default=None, help="a model source for both jobs instead of the mlp")
    parser.add_argument("--config", action="append", default=[], metavar="KEY=VALUE", help="its config")
    args = parser.parse_args()
    cuts = [0, 2, 3]
    if args.model is not None:  # the layers cut in two halves
        from felactl import models

        config = {k: yaml.safe_load(v) for k, v in (c.split("=", 1) for c in args.config)}
        layers = len(models.build(args.model, config).layers)
        cuts = [0, layers // 2, layers]
    pauses: dict[str, list[float]] = {
        "pipeline (restart)": [],
        "pipeline (restart), each worker builds the model": [],
        "pipeline (restart), workers exec'd": [],
        "data parallel (live)": [],
    }
    with tempfile.TemporaryDirectory(prefix="bench_restart.") as tmp:
        root = Path(tmp)
        pipe_plan, dp = pipeline_plan(cuts, optimizer="adamw", lr=0.01), dp_plan(2, "bsp", optimizer="adamw", lr=0.01)
        if args.model is not None:
            model = ModelRef(name=args.model, source=args.model, config=config)
            pipe_plan, dp = (dataclasses.replace(p, model=model, global_batch=8) for p in (pipe_plan, dp))
        pipe = save(pipe_plan, root / "pipeline.yaml")
        dp = save(dp, root / "dp.yaml")
        for round_ in range(args.repeat):  # interleaved: a slow minute of the machine hits each
            pauses["pipeline (restart)"].append(pause_of(root, pipe, f"pipe{round_}", 2))
            own = pause_of(root, pipe, f"own{round_}", 2, env={"FELACTL_SHARED_MODEL": "0"})
            pauses["pipeline (restart), each worker builds the model"].append(own)
            exec_d = pause_of(root, pipe, f"exec{round_}", 2, env={"FELACTL_ZYGOTE": "0"})
            pauses["pipeline (restart), workers exec'd"].append(exec_d)
            pauses["data parallel (live)"].append(pause_of(root, dp, f"dp{round_}", 1))
            print(f"round {round_ + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in pauses.items()), flush=True)
    load = os.getloadavg()
    print(f"\nload average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {args.repeat} round(s)\n")
    print("| job | scale | pause s, median | min–max |")
    print("|---|---|---:|---:|")
    hows = ("--add 2 (1x2 -> 2x2)", "--add 2, FELACTL_SHARED_MODEL=0", "--add 2, FELACTL_ZYGOTE=0", "--add 1 (2 -> 3)")
    for (name, values), how in zip(pauses.items(), hows):
        print(f"| {name} | {how} | {statistics.median(values):.2f} | {min(values):.2f}–{max(values):.2f} |")


if __name__ == "__main__":
    main()
