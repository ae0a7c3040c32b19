"""What one token costs the tokens runtime beyond its compute: ``cost.TOKEN_OVERHEAD_S``, measured.

Launches one plan (whose every stage syncs by ``tokens``) at several micro-batches, everything
else alike, and reads each worker's per-step time outside compute, gradient sum and waiting
(``duration - compute - comm - wait``, median over the steps after ``--warmup``). A smaller
micro-batch means more tokens a step for the same samples; the least-squares slope of that
non-compute time over the tokens a worker ran is what a token costs it (claiming it through the
store, its indices and inputs, publishing its output). The planner prices it at
``TOKEN_OVERHEAD_S`` of host CPU per token; this prints the measured slope beside it.

    python benchmarks/bench_token_overhead.py PLAN.yaml [--micro-batches 4,16,64] [--steps 60]
        [--warmup 10] [--out DIR] [--json]

The micro-batches must divide the plan's global batch. On a GPU the compute is asynchronous
(the loop synchronizes where it times a token), so the slope is the host's work per token.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml


def least_squares_slope(xs: list[float], ys: list[float]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var > 0 else float("nan")


def per_rank(records: list[dict], warmup: int) -> dict[int, dict]:
    """Per rank, medians over its steps from ``warmup`` on: tokens a step, compute, non-compute."""
    out = {}
    for rank in sorted({r["rank"] for r in records}):
        rows = [r for r in records if r["rank"] == rank and r["step"] >= warmup]
        if not rows:
            raise SystemExit(f"rank {rank} has no steps after the {warmup} warm-up steps")

        def med(key: str, rows: list[dict] = rows) -> float:
            return statistics.median(r[key] for r in rows)

        out[rank] = {
            "tokens": statistics.median(r.get("tokens", 0) for r in rows),
            "duration_s": med("duration_s"),
            "compute_s": med("compute_s"),
            "non_compute_s": statistics.median(
                r["duration_s"] - r["compute_s"] - r["comm_s"] - r["wait_s"] for r in rows
            ),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plan", type=Path)
    parser.add_argument("--micro-batches", default="4,16,64")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None, help="where plans and runs go (default: a temp dir)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from felactl.control.metrics import read_metrics
    from felactl.optimizer.cost import TOKEN_OVERHEAD_S

    plan = yaml.safe_load(args.plan.read_text())
    global_batch = int(plan["global_batch"])
    sizes = [int(x) for x in args.micro_batches.split(",")]
    if any(global_batch % b for b in sizes):
        raise SystemExit(f"every micro-batch must divide the plan's global batch {global_batch}: {sizes}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_tokens.") as tmp:
        root = args.out or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        for b in sizes:
            for stage in plan["stages"]:
                stage["micro_batch"] = b
            plan_path = root / f"plan-mb{b}.yaml"
            plan_path.write_text(yaml.safe_dump(plan, sort_keys=False))
            run_id = f"tokens-mb{b}"
            cmd = [sys.executable, "-m", "felactl", "launch", str(plan_path), "--sync", "tokens",
                   "--steps", str(args.steps), "--runs-root", str(root / "runs"), "--run-id", run_id, "--json"]  # fmt: skip
            print(f"== micro-batch {b}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
            log = root / f"{run_id}.log"
            with log.open("w") as out:
                done = subprocess.run(
                    cmd, stdout=subprocess.DEVNULL, stderr=out, env={**os.environ, "PYTHONUNBUFFERED": "1"}
                )
            if done.returncode:
                raise SystemExit(f"launch at micro-batch {b} failed ({done.returncode}):\n{log.read_text()[-2000:]}")
            for rank, m in per_rank(read_metrics(root / "runs" / run_id), args.warmup).items():
                rows.append({"micro_batch": b, "rank": rank, **m})

    slopes = {}
    for rank in sorted({r["rank"] for r in rows}):
        mine = [r for r in rows if r["rank"] == rank]
        slopes[rank] = least_squares_slope([r["tokens"] for r in mine], [r["non_compute_s"] for r in mine])
    if args.json:
        print(json.dumps({"rows": rows, "slope_s_per_token": slopes, "priced_s": TOKEN_OVERHEAD_S}))
        return
    print("| micro-batch | rank | tokens a step | step s | compute s | non-compute s |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['micro_batch']} | {r['rank']} | {r['tokens']:g} | {r['duration_s']:.4f} | {r['compute_s']:.4f} | {r['non_compute_s']:.4f} |"
        )
    for rank, slope in slopes.items():
        print(
            f"rank {rank}: {slope * 1e3:.2f} ms of non-compute per token (priced: {TOKEN_OVERHEAD_S * 1e3:.2f} ms of host CPU)"
        )


if __name__ == "__main__":
    main()
