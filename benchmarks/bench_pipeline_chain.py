"""A static 1F1B chain through a testbed's nodes in a given order: measured vs simulated, and what
each node's CPU did (its cgroup's use of its quota).

The planner writes a chain (one device a stage, each device in one stage) as one static 1F1B
pipeline (``optimizer/one_chain.py``); whether it does so on a given day's profile depends on the
profile. This forces one, on profiles a ``bench_testbed_plans.py --out DIR`` run kept (its
``DIR/<testbed>/cluster.yaml`` and ``model.yaml``): the layers cut where the chain's devices balance
them (``baselines.balanced_cuts``), the price the simulator's (``optimizer/simulator.py``), the run
``felactl launch --testbed``. While it runs, every 0.25 s, each node's cgroup ``cpu.stat``
(periods, throttled periods) and the CPU ticks of its processes are read: per node, over the steady
steps, the cores it used and the share of its CFS periods it was throttled in. A node that used
all of its quota and was throttled in nearly every period is the chain's bottleneck, and then the
price of its host work is what the prediction hangs on (``PIPELINE_MESSAGE_CPU_S``).

    sudo OMP_NUM_THREADS=1 python benchmarks/bench_pipeline_chain.py --testbed one-slow \\
        --profiles /tmp/q1/one-slow --order fast0-cpu0,fast1-cpu0,slow-cpu0,fast2-cpu0 \\
        --micro-batch 1 --global-batch 64 --steps 14 --repeat 2

Run it from a worktree (the agents import felactl from this tree, as ``bench_testbed_plans.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_testbed_plans import felactl, parts, steady_rate  # noqa: E402
from felactl.control.metrics import read_metrics  # noqa: E402
from felactl.optimizer import baselines  # noqa: E402
from felactl.optimizer.cost import CostModel  # noqa: E402
from felactl.optimizer.one_chain import as_static_pipelines  # noqa: E402
from felactl.optimizer.simulator import simulate  # noqa: E402
from felactl.spec import (  # noqa: E402
    ModelRef,
    Plan,
    Schedule,
    Stage,
    StageWorker,
    SyncMode,
    SyncSpec,
    load_cluster,
    load_model,
    save,
)
from felactl.spec.stages import placements_from  # noqa: E402
from felactl.testbed.cgroups import cgroup_dirs  # noqa: E402
from felactl.testbed.host import find_cgroups  # noqa: E402

TICKS_PER_S = 100  # /proc/<pid>/stat's utime and stime, in clock ticks (USER_HZ)


def chain_plan(cluster, model, order: list[str], micro_batch: int, global_batch: int) -> Plan:
    """One 1F1B pipeline over ``order``, one device a stage, cut where the devices balance: the
    flexible chain the ILP would write, made static as the planner makes it
    (``one_chain.as_static_pipelines``)."""
    cost = CostModel(cluster, model)
    times = [[cost.per_sample_s(layer, layer + 1, d, micro_batch) for layer in range(model.num_layers)] for d in order]
    cuts = baselines.balanced_cuts(times, len(order))
    stages = tuple(
        Stage(
            layer_start=cuts[s],
            layer_end=cuts[s + 1],
            micro_batch=micro_batch,
            workers=(StageWorker(device=d, share=1.0),),
        )
        for s, d in enumerate(order)
    )
    flexible = Plan(
        cluster=cluster.name,
        model=ModelRef(name=model.name, source=model.source, config=model.config),
        devices=tuple(order),
        global_batch=global_batch,
        schedule=Schedule.TOKENS,
        sync=SyncSpec(mode=SyncMode.BSP, use_trees=False),
        stages=stages,
    )
    plan = as_static_pipelines(flexible, cost)
    if plan is flexible:
        raise SystemExit(f"the chain {', '.join(order)} is no static pipeline here: 1F1B's activations do not fit")
    return dataclasses.replace(plan, placement=placements_from(cluster, plan.devices))


class CgroupSampler(threading.Thread):
    """Reads testbed ``bed``'s nodes' ``cpu.stat`` (its CPU controller's cgroup, v1 or v2) and
    their processes' CPU ticks until stopped."""

    def __init__(self, bed: str, nodes: list[str]):
        super().__init__(daemon=True)
        layout = find_cgroups()
        self.dirs = {node: [d for d in cgroup_dirs(layout, bed, node) if (d / "cpu.stat").exists()] for node in nodes}
        self.nodes, self.samples, self.stopped = nodes, [], threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            for node, dirs in self.dirs.items():
                for base in dirs[:1]:
                    try:
                        stat = dict(line.split() for line in (base / "cpu.stat").read_text().splitlines())
                        pids = (base / "cgroup.procs").read_text().split()
                    except OSError:
                        continue
                    self.samples.append(
                        (time.time(), node, _ticks(pids), int(stat["nr_periods"]), int(stat["nr_throttled"]))
                    )
            time.sleep(0.25)

    def per_node(self, start: float, end: float) -> dict[str, dict]:
        """Per node between ``start`` and ``end``: cores used, and the share of periods throttled."""
        out = {}
        for node in self.nodes:
            seen = [s for s in self.samples if s[1] == node and start <= s[0] <= end]
            if len(seen) > 1:
                first, last = seen[0], seen[-1]
                wall = last[0] - first[0]
                periods = max(1, last[3] - first[3])
                out[node] = {
                    "cores": round((last[2] - first[2]) / TICKS_PER_S / wall, 3),
                    "throttled": round((last[4] - first[4]) / periods, 3),
                }
        return out


def _ticks(pids: list[str]) -> int:
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # it ended
            continue
        total += int(fields[11]) + int(fields[12])
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--testbed", default="one-slow", help="plans/testbeds/<name>.yaml")
    parser.add_argument("--profiles", required=True, help="a bench_testbed_plans --out DIR/<testbed> folder")
    parser.add_argument("--order", required=True, help="the chain's devices, comma-separated")
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--out", default="/tmp/felactl-bench-chain")
    args = parser.parse_args()
    out, profiles = Path(args.out), Path(args.profiles)
    out.mkdir(parents=True, exist_ok=True)
    cluster, model = load_cluster(profiles / "cluster.yaml"), load_model(profiles / "model.yaml")
    plan = chain_plan(cluster, model, args.order.split(","), args.micro_batch, args.global_batch)
    predicted = args.global_batch / simulate(plan, CostModel(cluster, model)).iteration_s
    path = save(plan, out / "chain.yaml")
    cuts = [st.layer_start for st in plan.stages] + [plan.stages[-1].layer_end]
    print(f"chain {args.order}, cuts {cuts}, micro-batch {args.micro_batch}: predicted {predicted:.1f} samples/s")
    bed = f"ch{int(time.time()) % 100000}"
    nodes = sorted({cluster.node_of(d).name for d in plan.devices})
    rounds = []
    try:
        felactl(
            "testbed", "up", str(ROOT / "plans" / "testbeds" / f"{args.testbed}.yaml"), "--name", bed, "--no-latency"
        )
        for r in range(args.repeat):
            sampler = CgroupSampler(bed, nodes)
            sampler.start()
            launched = felactl(
                "launch", str(path), "--testbed", bed, "--steps", str(args.steps), "--json",
                "--runs-root", str(out / "runs"), "--run-id", f"{bed}-{r}", "--collective-timeout", "120",
            )  # fmt: skip
            sampler.stopped.set()
            records = read_metrics(Path(json.loads(launched)["run_dir"]))
            rate = steady_rate(records, args.global_batch, args.warmup)
            steady = [x["time"] for x in records if x["step"] >= args.warmup]
            cpu = sampler.per_node(min(steady), max(steady))
            rounds.append(rate["samples_per_s"])
            print(
                f"round {r}: measured {rate['samples_per_s']:.1f} samples/s, {rate['samples_per_s'] / predicted:.2f} "
                f"of predicted; nodes {json.dumps(cpu)}; workers {json.dumps(parts(records, args.warmup))}",
                flush=True,
            )
    finally:
        felactl("testbed", "down", "--name", bed)
    median = statistics.median(rounds)
    print(f"median of {len(rounds)}: {median:.1f} samples/s, measured / predicted {median / predicted:.2f}")


if __name__ == "__main__":
    main()
