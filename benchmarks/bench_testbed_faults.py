"""Nodes that fail for real, inside an emulated cluster: how soon felactl notices, and what is lost.

Run (root, Linux): ``OMP_NUM_THREADS=1 python benchmarks/bench_testbed_faults.py [--faults cut,kill,partition]``

Three nodes (na, nb, nc; 45% of a core each, 200 MB/s links) run an elastic bsp job of the
built-in mlp, one worker per node, under ``felactl launch --testbed``. Once it trains, one fault:

* ``cut``: nb's cable is pulled (``felactl testbed cut nb``: every packet to and from it dropped;
  its connections hang rather than close);
* ``kill``: every process in nb's namespace is killed with SIGKILL (its agent and its worker);
* ``partition``: na and {nb, nc} can no longer reach each other (``felactl testbed partition na``:
  loss 1 both ways), while all of them still reach the coordinator.

Per fault: seconds from the fault to the coordinator's ``failure`` event (detected), the
survivors' pause, the steps the job then made, and steps lost (a step number missing from the
surviving rank's sequence) or done twice. The job is stopped with SIGINT some seconds after
the fault was handled (or given up on: ``--give-up-s``).
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
from pathlib import Path

import yaml

from felactl.spec.io import from_dict
from felactl.testbed import TestbedSpec, TestbedUnavailable, down, probe_host, up
from felactl.testbed.faults import crash_node, cut_node, partition_nodes

ROOT = Path(__file__).resolve().parent.parent
FELACTL = [sys.executable, "-m", "felactl"]
NODES = ("na", "nb", "nc")
MLP = {"name": "mlp", "source": "mlp", "config": {"input_dim": 256, "hidden": 512, "depth": 4, "num_classes": 10}}
HEARTBEAT_TIMEOUT_S, COLLECTIVE_TIMEOUT_S = 3.0, 5.0


def testbed_spec(host) -> TestbedSpec:
    cores = host.cores
    return from_dict(
        TestbedSpec,
        {
            "kind": "Testbed",
            "schema_version": 1,
            "name": "faults",
            "nodes": [{"name": n, "cpus": 0.45, "cores": [cores[i % len(cores)]]} for i, n in enumerate(NODES)],
            "default_link": {"bandwidth_gbps": 0.2},
        },
        "faults",
    )


def plan_doc() -> dict:
    devices = [f"{n}-cpu0" for n in NODES]
    return {
        "kind": "Plan",
        "schema_version": 1,
        "cluster": "faults",
        "model": MLP,
        "devices": devices,
        "global_batch": 12,
        "schedule": "tokens",
        "sync": {"mode": "bsp"},
        "stages": [
            {
                "layer_start": 0,
                "layer_end": 5,
                "micro_batch": 4,
                "workers": [{"device": d, "share": round(1 / 3, 6)} for d in devices],
            }
        ],
        "placement": [{"device": d, "node": n, "kind": "cpu", "local_index": 0} for d, n in zip(devices, NODES)],
    }


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def inject(fault: str, name: str) -> None:
    if fault == "cut":
        cut_node(name, "nb")
    elif fault == "kill":
        crash_node(name, "nb")
    elif fault == "partition":
        partition_nodes(name, ["na"])
    else:
        raise ValueError(fault)


def run_fault(fault: str, host, give_up_s: float) -> dict:
    name = f"f{os.getpid() % 100000}"
    up(testbed_spec(host), "faults", name=name, host=host, allow_no_latency=True)
    work = Path(tempfile.mkdtemp(prefix="felactl-faults-"))
    plan = work / "plan.yaml"
    plan.write_text(yaml.safe_dump(plan_doc()))
    runs = work / "runs"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    launch = subprocess.Popen(
        [
            *FELACTL,
            "launch",
            str(plan),
            "--testbed",
            name,
            "--steps",
            "1000000",
            "--run-id",
            "fault",
            "--runs-root",
            str(runs),
            "--elastic",
            "--heartbeat-timeout",
            str(HEARTBEAT_TIMEOUT_S),
            "--collective-timeout",
            str(COLLECTIVE_TIMEOUT_S),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    run = runs / "fault"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(_lines(run / "metrics.jsonl")) < 60:
            time.sleep(0.2)
        fault_at = time.time()
        inject(fault, name)
        failure = None
        give_up = time.monotonic() + give_up_s
        while time.monotonic() < give_up and failure is None:
            failure = next(
                (e for e in _lines(run / "events.jsonl") if e["kind"] == "failure" and e["time"] >= fault_at), None
            )
            time.sleep(0.1)
        time.sleep(10)  # the survivors train on
    finally:
        launch.send_signal(signal.SIGINT)
        try:
            launch.wait(timeout=90)
        except subprocess.TimeoutExpired:
            launch.kill()
            launch.wait()
        down(name)
    metrics = _lines(run / "metrics.jsonl")
    # a worker that trained before and after the fault (the partition drops na's worker 0)
    stayed = failure["members_after"][0] if failure is not None else 0
    survivor = [m["step"] for m in metrics if m["rank"] == stayed]
    after = [m["step"] for m in metrics if m["rank"] == stayed and m["time"] >= fault_at]
    steps = sorted(set(survivor))
    lost = len(set(range(steps[0], steps[-1] + 1)) - set(steps)) if steps else None
    return {
        "fault": fault,
        "detected_s": None if failure is None else round(failure["time"] - fault_at, 2),
        "pause_s": None if failure is None else failure.get("pause_s"),
        "reason": None if failure is None else failure.get("reason"),
        "steps_after_fault": len(set(after)),
        "steps_lost": lost,
        "steps_done_twice": len(survivor) - len(set(survivor)),
        "launch_exit": launch.returncode,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", default="cut,kill,partition")
    parser.add_argument("--give-up-s", type=float, default=60.0, help="how long to wait for the failure to be handled")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    try:
        host = probe_host()
    except TestbedUnavailable as exc:
        print(f"bench_testbed_faults: {exc}", file=sys.stderr)
        return 2
    results = []
    for fault in args.faults.split(","):
        results.append(run_fault(fault, host, args.give_up_s))
        print(json.dumps(results[-1]), file=sys.stderr)
    if args.json:
        print(json.dumps(results, indent=1))
        return 0
    print(
        f"heartbeat timeout {HEARTBEAT_TIMEOUT_S:g} s, collective timeout {COLLECTIVE_TIMEOUT_S:g} s; "
        f"load average {os.getloadavg()[0]:.1f}\n"
    )
    print(
        "| fault | detected in s | survivors' pause s | steps after the fault | steps lost | steps done twice | "
        "launch exit | reason |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        detected = "not within the give-up time" if r["detected_s"] is None else f"{r['detected_s']:.1f}"
        pause = "-" if r["pause_s"] is None else f"{r['pause_s']:.2f}"
        print(
            f"| {r['fault']} | {detected} | {pause} | {r['steps_after_fault']} | {r['steps_lost']} | "
            f"{r['steps_done_twice']} | {r['launch_exit']} | {r['reason'] or '-'} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
