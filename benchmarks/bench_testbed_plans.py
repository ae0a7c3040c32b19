"""Measured plan quality on emulated uneven clusters: felactl's plan and the DP and hybrid
baselines it compares against, each run inside a testbed, measured samples/s next to predicted.

For each testbed (``plans/testbeds/<name>.yaml``): ``felactl testbed up --no-latency``, ``felactl
profile --testbed`` (the cluster as the nodes' namespaces and CPU shares give it), ``felactl plan``
(felactl's plan) and ``felactl plan --baseline dp|hp`` (the baselines' own runnable plans, whose
predictions are the ones ``--compare`` prints), ``felactl launch --testbed`` of each, ``down`` (always).
The model is profiled in every node of the testbed at once (``felactl profile --model --testbed``,
``--model-profile nodes``, the default), just after the cluster profile: each node's timings are
keyed by its CPU share, as the cluster profile names its device. With ``--model-profile host`` it
is profiled on this machine's CPU (one thread) instead, and the planner scales those timings by
each node's matmul rate over the host's (``--matmul-size`` as the cluster profile), once per
testbed, just before its cluster profile, so both matmul references see the machine in the same
minutes: that scaling priced a tenth-of-a-core node 1.4x too fast (BENCHMARKS.md).

Measured samples/s: the global batch times the steps after ``--warmup``, over the time from the
end of the last warm-up step to the end of the last step (each step ends when its last worker
records it). With ``--repeat N`` the three plans are launched in turn N times (rounds) on the one
profile; a row reports its median round, the rounds' spread, and "vs DP" as the median of the
ratios within each round: this VM's speed moves between minutes (one-slow's DP measured 0.90,
0.78 and 0.92 of one price in three single runs). Each testbed holds ``--lock`` (flock, the same lock as ``flock /tmp/felactl-testbed.lock
CMD``) from ``up`` to ``down``, so no two testbeds measure at once on a shared machine.

Its agents import felactl from the tree this script sits in: run it from a worktree (``git worktree
add /tmp/benchtree HEAD``) while editing, or an edit reaches a run half made.

    sudo python benchmarks/bench_testbed_plans.py [--testbeds one-slow,three-speeds,two-servers]
        [--model mlp] [--config hidden=512] [--global-batch 2048] [--seconds 20] [--warmup 3] [--repeat 3]
        [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FELACTL = [sys.executable, "-m", "felactl"]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
PLANS = ("felactl", "dp", "hp")


def felactl(*args: str, timeout: float = 900) -> str:
    """Run ``felactl ARGS``; its stdout (the ``--json`` object); raise with its stderr on failure."""
    done = subprocess.run([*FELACTL, *args], env=ENV, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"felactl {' '.join(args)} exited {done.returncode}: {done.stderr.strip()[-1500:]}")
    return done.stdout


@contextlib.contextmanager
def held(lock: Path):
    with open(lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def steady_rate(records: list[dict], global_batch: int, warmup: int) -> dict:
    """Samples/s after ``warmup`` steps (module doc), and the median step cadence."""
    ends: dict[int, float] = {}
    for r in records:
        ends[r["step"]] = max(ends.get(r["step"], 0.0), r["time"])
    steps = sorted(ends)
    if len(steps) < warmup + 2:
        raise RuntimeError(f"only {len(steps)} steps recorded: too few after {warmup} warm-up steps")
    kept = [ends[s] for s in steps[warmup - 1 :]] if warmup > 0 else [ends[s] for s in steps]
    gaps = sorted(b - a for a, b in zip(kept, kept[1:]))
    span = kept[-1] - kept[0]
    return {
        "samples_per_s": global_batch * (len(kept) - 1) / span,
        "steps": len(kept) - 1,
        "median_step_s": gaps[len(gaps) // 2],
    }


def parts(records: list[dict], warmup: int) -> dict:
    """Per worker: median compute, comm and wait seconds of a step after the warm-up."""
    by_rank: dict[int, list[dict]] = {}
    for r in records:
        if r["step"] >= warmup:
            by_rank.setdefault(r["rank"], []).append(r)
    out = {}
    for rank, rs in sorted(by_rank.items()):

        def med(key, rs=rs):
            values = sorted(x[key] for x in rs)
            return values[len(values) // 2]

        out[rank] = {k: round(med(k), 4) for k in ("compute_s", "comm_s", "wait_s", "duration_s")}
        out[rank]["samples"] = sorted(x["samples"] for x in rs)[len(rs) // 2]
    return out


def profile_model(model_yaml: Path, args, testbed: str | None = None) -> Path:
    """``felactl profile --model`` on this machine's CPU, just before the testbed's cluster profile;
    with ``testbed`` (``--model-profile nodes``), in every node of it, just after.

    On the host, every node's timings are the host's scaled by host matmul ÷ node matmul, so the two matmul
    rates must see the same machine: this shared VM's speed moves by up to a fifth between runs
    (the host's matmul read 0.0599 TFLOP/s in one run, 0.0503 in the next), and a model profiled
    once at the start of a 20-minute run scaled the later testbeds by a reference taken minutes
    before their own."""
    if not model_yaml.exists():
        config = [c for kv in args.config for c in ("--config", kv)]
        felactl(
            "profile",
            "--model",
            args.model,
            *config,
            "--batch-sizes",
            args.batch_sizes,
            "--matmul-size",
            str(args.matmul_size),
            *(["--testbed", testbed] if testbed else []),
            "-o",
            str(model_yaml),
            "--json",
            timeout=1200,
        )
    return model_yaml


def run_testbed(name: str, args, work: Path) -> list[dict]:
    from felactl.control.metrics import read_metrics

    spec = ROOT / "plans" / "testbeds" / f"{name}.yaml"
    bed = f"q{os.getpid() % 100000}"[:8]
    rows = []
    out = work / name
    out.mkdir(parents=True, exist_ok=True)
    with held(args.lock):
        felactl("testbed", "down", "--name", bed, timeout=120)
        if args.model_profile == "host":
            model_yaml = profile_model(out / "model.yaml", args)
        try:
            felactl("testbed", "up", str(spec), "--name", bed, "--no-latency", timeout=120)
            cluster = out / "cluster.yaml"
            felactl(
                "profile",
                "--testbed",
                bed,
                "-o",
                str(cluster),
                "--json",
                "--matmul-size",
                str(args.matmul_size),
                "--message-bytes",
                str(8 * 2**20),
                "--join-timeout",
                "60",
                "--timeout",
                "300",
                timeout=400,
            )
            if args.model_profile == "nodes":
                model_yaml = profile_model(out / "model.yaml", args, bed)
            plans = make_plans(cluster, model_yaml, args, out)
            runs: dict[str, list[tuple[dict, list[dict], float]]] = {name: [] for name in plans}
            for round_ in range(args.repeat):  # the plans in turn, round after round: a slow minute hits all
                for plan_name, (path, plan) in plans.items():
                    predicted = plan.predicted.samples_per_s
                    steps = args.warmup + max(args.min_steps, math.ceil(args.seconds * predicted / args.global_batch))
                    steps = min(steps, args.max_steps)
                    began = time.time()
                    # A node at a tenth of a core takes ~10 s to import torch: the first broadcast may wait
                    # that long for it (the elastic default of 10 s failed one start in three-speeds).
                    summary = json.loads(
                        felactl(
                            "launch",
                            str(path),
                            "--testbed",
                            bed,
                            "--steps",
                            str(steps),
                            "--json",
                            "--runs-root",
                            str(out / "runs"),
                            "--run-id",
                            plan_name if args.repeat == 1 else f"{plan_name}-{round_}",
                            "--collective-timeout",
                            "120",
                            timeout=900,
                        )
                    )
                    records = read_metrics(Path(summary["run_dir"]))
                    measured = steady_rate(records, args.global_batch, args.warmup)
                    runs[plan_name].append((measured, records, round(time.time() - began, 1)))
                    print(
                        f"{name} {plan_name} (round {round_ + 1} of {args.repeat}): predicted {predicted:.1f} "
                        f"measured {measured['samples_per_s']:.1f} samples/s ({measured['steps']} steps)",
                        file=sys.stderr,
                        flush=True,
                    )
            for plan_name, (_, plan) in plans.items():
                rates = [m["samples_per_s"] for m, _, _ in runs[plan_name]]
                middle = sorted(range(len(rates)), key=rates.__getitem__)[len(rates) // 2]
                measured, records, wall_s = runs[plan_name][middle]
                rows.append(
                    {
                        "testbed": name,
                        "plan": plan_name,
                        "predicted_samples_per_s": plan.predicted.samples_per_s,
                        "predicted_iteration_s": plan.predicted.iteration_s,
                        "simulated_iteration_s": plan.predicted.simulated_iteration_s,
                        "measured_samples_per_s": measured["samples_per_s"],  # the median round's
                        "measured_runs": rates,  # round by round
                        "measured_median_step_s": measured["median_step_s"],
                        "steps": measured["steps"],
                        "wall_s": wall_s,
                        "stages": [
                            {
                                "layers": [s.layer_start, s.layer_end],
                                "micro_batch": s.micro_batch,
                                "shares": {w.device: round(w.share, 3) for w in s.workers},
                            }
                            for s in plan.stages
                        ],
                        "sync": plan.sync.mode.value,
                        "workers": parts(records, args.warmup),
                        "devices": {d.name: d.tflops for n in load_cluster_nodes(cluster) for d in n.devices},
                    }
                )
        finally:
            felactl("testbed", "down", "--name", bed, timeout=120)
    return rows


def make_plans(cluster: Path, model_yaml: Path, args, out: Path) -> dict:
    """Each of ``--plans`` planned on the profiles: felactl's, and the baselines' own (``felactl
    plan --baseline NAME``). With ``--memory-fraction F`` every device's memory is capped at F of
    the model's training state (:func:`cap_memory`), so felactl's plan must pipeline or shard the
    model; ``dp`` is still planned on the uncapped profile: what data parallel would do if the
    model fit (the emulated nodes hold it)."""
    from felactl.spec import load_plan

    def plan(name: str, on: Path) -> tuple[Path, object]:
        path = out / f"{name}.yaml"
        common = ["--cluster", str(on), "--model", str(model_yaml), "--global-batch", str(args.global_batch)]
        extra = [] if name == "felactl" else ["--baseline", name]
        extra += ["--sync", args.sync] if args.sync else []
        felactl("plan", *common, *extra, "--json", "-o", str(path), timeout=300)
        return path, load_plan(path)

    names = args.plans.split(",")
    capped = cluster if not args.memory_fraction else cap_memory(cluster, model_yaml, args, out)
    plans = {name: plan(name, cluster if name == "dp" else capped) for name in names if name != TOKENS_CHAIN}
    if TOKENS_CHAIN in names:
        chain = as_tokens(plans["felactl"][1], out / f"{TOKENS_CHAIN}.yaml", capped, model_yaml)
        if chain is None:
            print(f"{TOKENS_CHAIN}: felactl's plan here is no chain of 1F1B pipelines: not run", file=sys.stderr)
        else:
            plans[TOKENS_CHAIN] = chain
    return plans


TOKENS_CHAIN = "felactl-tokens"
"""``--plans`` name of felactl's plan run by the tokens runtime, where the planner wrote chains of
devices (one, or R side by side) as static 1F1B pipelines (``optimizer/one_chain.py``): the same
stages, shares, in-flight limits and ranks, schedule ``tokens``: what the planner wrote before,
measured beside it."""


def as_tokens(plan, path: Path, cluster: Path, model_yaml: Path) -> tuple[Path, object] | None:
    """felactl's static pipelines on the tokens runtime, predicted by their own simulation (the
    tokens runtime's price, with each token's wait for rank 0's answer), not the pipelines'."""
    from felactl.optimizer.cost import CostModel
    from felactl.optimizer.simulator import simulate
    from felactl.spec import Schedule, load_cluster, load_model, save

    if plan.schedule is Schedule.TOKENS or not plan.pipelines or any(st.shard for st in plan.stages):
        return None
    flexible = dataclasses.replace(plan, schedule=Schedule.TOKENS, pipelines=())
    cost = CostModel(load_cluster(cluster), load_model(model_yaml), ring_order=flexible.devices)
    iteration_s = simulate(flexible, cost).iteration_s
    predicted = dataclasses.replace(
        plan.predicted,
        iteration_s=iteration_s,
        samples_per_s=plan.global_batch / iteration_s,
        simulated_iteration_s=iteration_s,
    )
    flexible = dataclasses.replace(flexible, predicted=predicted)
    return save(flexible, path), flexible


def cap_memory(cluster: Path, model_yaml: Path, args, out: Path) -> Path:
    """The cluster profile with every device's memory at ``--memory-fraction`` of the model's
    training state as the planner counts it (weights, gradients, AdamW's two moments: no replica
    fits at any micro-batch), as far as the planner may fill it (a tenth is headroom)."""
    from felactl.optimizer.cost import stage_memory_bytes
    from felactl.spec import load_cluster, load_model, save

    model = load_model(model_yaml)
    state = stage_memory_bytes(model, 0, model.num_layers, micro_batch=0, in_flight=0)
    memory_gb = state * args.memory_fraction / 0.9 / 1e9
    spec = load_cluster(cluster)
    nodes = tuple(
        dataclasses.replace(n, devices=tuple(dataclasses.replace(d, memory_gb=memory_gb) for d in n.devices))
        for n in spec.nodes
    )
    print(
        f"memory capped at {memory_gb * 1e3:.1f} MB per device ({args.memory_fraction:g} of the model's "
        f"training state, {state / 1e6:.1f} MB)",
        file=sys.stderr,
        flush=True,
    )
    return save(dataclasses.replace(spec, nodes=nodes), out / "cluster-capped.yaml")


def load_cluster_nodes(path: Path):
    from felactl.spec import load_cluster

    return load_cluster(path).nodes


def versus_dp(row: dict, base: dict) -> float:
    """Measured samples/s over DP's: the median over rounds of the ratio within each round (a round
    runs the plans one after the other, so a slow minute of the machine touches both)."""
    ratios = sorted(a / b for a, b in zip(row["measured_runs"], base["measured_runs"]))
    return ratios[len(ratios) // 2]


def table(rows: list[dict]) -> str:
    dp = {r["testbed"]: r for r in rows if r["plan"] == "dp"}
    lines = [
        "| testbed | plan | predicted samples/s | measured samples/s | measured ÷ predicted | rounds (min–max) "
        "| measured vs DP | predicted vs DP |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        base = dp.get(r["testbed"])
        ratio = r["measured_samples_per_s"] / r["predicted_samples_per_s"]
        runs = r["measured_runs"]
        spread = f"{len(runs)} ({min(runs):.0f}–{max(runs):.0f})"
        vs_m = f"{versus_dp(r, base):.2f}x" if base else "-"
        vs_p = f"{r['predicted_samples_per_s'] / base['predicted_samples_per_s']:.2f}x" if base else "-"
        lines.append(
            f"| {r['testbed']} | {r['plan']} | {r['predicted_samples_per_s']:.0f} | "
            f"{r['measured_samples_per_s']:.0f} | {ratio:.2f} | {spread} | {vs_m} | {vs_p} |"
        )
    return "\n".join(lines)


def verdicts(rows: list[dict]) -> list[str]:
    out = []
    dp = {r["testbed"]: r for r in rows if r["plan"] == "dp"}
    for r in rows:
        ratio = r["measured_samples_per_s"] / r["predicted_samples_per_s"]
        out.append(
            f"{r['testbed']} {r['plan']}: measured / predicted {ratio:.2f} "
            f"({'within' if abs(ratio - 1) <= 0.2 else 'OUTSIDE'} 20%)"
        )
        base = dp.get(r["testbed"])
        if r["plan"] == "felactl" and base:
            p = r["predicted_samples_per_s"] / base["predicted_samples_per_s"]
            m = versus_dp(r, base)
            if p >= 1.5:
                out.append(
                    f"{r['testbed']}: predicts {p:.2f}x DP, measures {m:.2f}x ({'>=' if m >= 1.3 else 'BELOW'} 1.3x)"
                )
            else:
                out.append(
                    f"{r['testbed']}: predicts {p:.2f}x DP (< 1.5x: the 1.3x target does not apply), measures {m:.2f}x"
                )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--testbeds", default="one-slow,three-speeds,two-servers")
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--config", action="append", default=[], help="model config key=value (repeat)")
    parser.add_argument("--batch-sizes", default="16,64,256,1024")
    parser.add_argument(
        "--model-profile",
        choices=("nodes", "host"),
        default="nodes",
        help="time the model in every testbed node (felactl profile --model --testbed), or on the host only",
    )
    parser.add_argument("--global-batch", type=int, default=2048)
    parser.add_argument("--matmul-size", type=int, default=128)
    parser.add_argument("--seconds", type=float, default=20.0, help="predicted seconds of steady steps per run")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--min-steps", type=int, default=8)
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument(
        "--repeat", type=int, default=1, help="rounds: each plan launched this many times in turn; medians reported"
    )
    parser.add_argument(
        "--plans",
        default=",".join(PLANS),
        help=f"felactl and baselines (dp, hp, fsdp, ...); {TOKENS_CHAIN}: felactl's one-chain pipeline as tokens",
    )
    parser.add_argument("--sync", default=None, help="the plans' sync mode (default: the planner's)")
    parser.add_argument(
        "--memory-fraction",
        type=float,
        default=None,
        help="cap each device's memory at this fraction of the model's training state: the plans must pipeline or shard",
    )
    parser.add_argument("--lock", type=Path, default=Path("/tmp/felactl-testbed.lock"))
    parser.add_argument("--out", type=Path, default=None, help="keep the profiles, plans and runs here")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench_testbed.") as tmp:
        work = args.out or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        rows = []
        for name in args.testbeds.split(","):
            rows += run_testbed(name, args, work)
            (work / "rows.json").write_text(json.dumps(rows, indent=1))
    load = os.getloadavg()
    if args.json:
        print(json.dumps({"rows": rows, "loadavg": load}))
        return
    print(
        f"{args.model} {args.config}, global batch {args.global_batch}; load average {load[0]:.2f} {load[1]:.2f} "
        f"{load[2]:.2f}"
    )
    print(table(rows))
    print("\n".join(verdicts(rows)))


if __name__ == "__main__":
    main()
