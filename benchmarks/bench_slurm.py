"""Through a real Slurm and without it, on one testbed: the time from starting a two-node job to
its first step, and a live scale-out onto a second node (the time from asking to the answer, and
the pause the running worker saw).

``sudo OMP_NUM_THREADS=1 python benchmarks/bench_slurm.py [--repeat 3]`` brings up a two-node
testbed (na at 0.9 of a core, nb at 0.5, 200 MB/s) with ``--slurm`` and, each round:

- **start, Slurm**: ``sbatch --nodes=2`` of ``felactl launch --job examples.cnn:job
  --nproc-per-node 1``: from calling sbatch to the first step's record (its wall-clock ``time``);
- **start, testbed**: ``felactl launch PLAN --testbed`` of the same data-parallel plan on na and nb
  (felactl starts each node's agent in its namespace itself): from starting the command to the
  first step's record;
- **grow, Slurm**: a job on na (``sbatch --nodelist=na``) and ``felactl scale --slurm-nodes 1
  --sbatch-arg=--nodelist=nb``: Slurm grants nb, its agent starts and joins, a worker starts there;
- **grow, testbed**: a launch on na in the testbed, ``felactl agent`` started in nb (``felactl
  testbed exec``) and ``felactl scale --add 1 --node nb`` once it joined: from starting the agent
  to the answer.

Each grow's pause is what ``felactl scale`` answers (the running worker's wait for the switch).
A row is the median over rounds; the last column, Slurm over the testbed alone.
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
sys.path.insert(0, str(ROOT))
from felactl.launcher.prepare import job_plan  # noqa: E402
from felactl.launcher.rundir import read_jsonl  # noqa: E402
from felactl.spec import save  # noqa: E402
from felactl.testbed import down, probe_host, up  # noqa: E402
from felactl.testbed.slurm import client_env  # noqa: E402
from tests.testbed_fixtures import pair  # noqa: E402

PYTHON = sys.executable
JOB = ["--job", "examples.cnn:job", "--nproc-per-node", "1", "--global-batch", "16"]
TIMEOUT_S = 180.0


def env(name: str) -> dict[str, str]:
    return {**client_env(name), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def first_step_time(metrics: Path, deadline: float) -> float:
    """The wall-clock time of the first step's record in ``metrics`` (waiting for it)."""
    while True:
        records = read_jsonl(metrics) if metrics.exists() else []
        if records:
            return min(r["time"] for r in records)
        if time.monotonic() > deadline:
            raise RuntimeError(f"no step in {metrics}")
        time.sleep(0.1)


def sbatch(name: str, work: Path, header: str, command: str) -> str:
    script = work / "job.sh"
    script.write_text(
        f"#!/bin/sh\n#SBATCH --output={work}/out-%j.txt {header}\ncd {work}\n"
        f"export OMP_NUM_THREADS=1 PYTHONPATH={ROOT}\nexec {PYTHON} -m felactl {command}\n"
    )
    done = subprocess.run(["sbatch", "--parsable", str(script)], env=env(name), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"sbatch: {done.stderr.strip()}")
    return done.stdout.strip().split(";")[0]


def scancel(name: str, job: str) -> None:
    subprocess.run(["scancel", "--signal=KILL", "--full", job], env=env(name), capture_output=True)
    subprocess.run(["scancel", job], env=env(name), capture_output=True)


def start_slurm(name: str, work: Path) -> float:
    began = time.time()
    job = sbatch(name, work, "--nodes=2", f"launch {' '.join(JOB)} --steps 100000")
    try:
        return first_step_time(work / "runs" / f"slurm-{job}" / "metrics.jsonl", time.monotonic() + TIMEOUT_S) - began
    finally:
        scancel(name, job)


def launch_in_testbed(name: str, work: Path, nodes: tuple[str, ...], run_id: str) -> subprocess.Popen:
    """``felactl launch --testbed`` of the job's data-parallel plan on ``nodes``, in a session of its own."""
    plan = save(job_plan("examples.cnn:job", {}, 1, 16, None, nodes=nodes), work / f"plan-{run_id}.yaml")
    return subprocess.Popen(
        [PYTHON, "-m", "felactl", "launch", str(plan), "--testbed", name, "--run-id", run_id, "--steps", "100000"],
        cwd=work,
        env=env(name),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def start_testbed(name: str, work: Path) -> float:
    began = time.time()
    launch = launch_in_testbed(name, work, ("na", "nb"), "start")
    try:
        return first_step_time(work / "runs" / "start" / "metrics.jsonl", time.monotonic() + TIMEOUT_S) - began
    finally:
        os.killpg(launch.pid, 9)


def scale(name: str, work: Path, run: str, *args: str) -> dict:
    done = subprocess.run(
        [PYTHON, "-m", "felactl", "scale", run, "--runs-root", str(work / "runs"), "--json", *args],
        env=env(name),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    if done.returncode != 0:
        raise RuntimeError(f"felactl scale: {done.stderr.strip()}")
    return json.loads(done.stdout)


def grow_slurm(name: str, work: Path) -> tuple[float, float]:
    job = sbatch(name, work, "--nodes=1 --nodelist=na", f"launch {' '.join(JOB)} --steps 100000")
    try:
        first_step_time(work / "runs" / f"slurm-{job}" / "metrics.jsonl", time.monotonic() + TIMEOUT_S)
        began = time.monotonic()
        out = scale(name, work, f"slurm-{job}", "--slurm-nodes", "1", "--sbatch-arg=--nodelist=nb")
        return time.monotonic() - began, float(out["pause_s"])
    finally:
        subprocess.run(["scancel", "--full", f"--name=felactl-grow-slurm-{job}"], env=env(name), capture_output=True)
        scancel(name, job)


def grow_testbed(name: str, work: Path) -> tuple[float, float]:
    launch = launch_in_testbed(name, work, ("na",), "grow")
    agent = None
    try:
        run = work / "runs" / "grow"
        first_step_time(run / "metrics.jsonl", time.monotonic() + TIMEOUT_S)
        endpoint = next(e for e in read_jsonl(run / "events.jsonl") if e["kind"] == "launch")["endpoint"]
        began = time.monotonic()
        agent = subprocess.Popen(
            [PYTHON, "-m", "felactl", "testbed", "exec", "nb", "--name", name, "--", PYTHON, "-m", "felactl", "agent"]
            + ["--rdzv-endpoint", endpoint, "--secret-file", str(run / "secret"), "--job", "grow"]
            + ["--nproc-per-node", "1"],
            env=env(name),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + TIMEOUT_S
        while not any(e["kind"] == "node-joined" and e.get("node") == "nb" for e in read_jsonl(run / "events.jsonl")):
            if time.monotonic() > deadline:
                raise RuntimeError("nb's agent did not join")
            time.sleep(0.1)
        out = scale(name, work, "grow", "--add", "1", "--node", "nb")
        return time.monotonic() - began, float(out["pause_s"])
    finally:
        for proc in (launch, agent):
            if proc is not None:
                os.killpg(proc.pid, 9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--name", default="bslurm")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    host = probe_host()
    spec = pair(host, (0.9, 0.5), (0.2, 0.2))
    up(spec, "pair.yaml", name=args.name, host=host, allow_no_latency=True, slurm=True)
    rows: dict[str, list[float]] = {}
    try:
        for round_ in range(args.repeat):
            for what, measure in (
                ("start", (start_slurm, start_testbed)),
                ("grow", (grow_slurm, grow_testbed)),
            ):
                for where, fn in zip(("slurm", "testbed"), measure):
                    with tempfile.TemporaryDirectory(prefix="felactl-bench-slurm-") as tmp:
                        got = fn(args.name, Path(tmp))
                    if isinstance(got, tuple):
                        rows.setdefault(f"{what} {where} s", []).append(got[0])
                        rows.setdefault(f"{what} pause {where} s", []).append(got[1])
                    else:
                        rows.setdefault(f"{what} {where} s", []).append(got)
                    print(f"round {round_ + 1}: {what} {where}: {got}", file=sys.stderr, flush=True)
    finally:
        down(args.name)
    medians = {k: statistics.median(v) for k, v in rows.items()}
    if args.json:
        print(json.dumps({"medians": medians, "rounds": rows}))
        return
    print("| measured | through Slurm | testbed, no Slurm | Slurm / no Slurm |")
    print("|---|---:|---:|---:|")
    for label, key in (
        ("start: command to first step (s)", "start"),
        ("grow: asking to the new worker in (s)", "grow"),
        ("grow: pause of the running worker (s)", "grow pause"),
    ):
        s, t = medians[f"{key} slurm s"], medians[f"{key} testbed s"]
        print(f"| {label} | {s:.2f} | {t:.2f} | {s / t:.2f}x |")


if __name__ == "__main__":
    main()
