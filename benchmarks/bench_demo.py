"""Plan vs measurement on this machine: the ``felactl demo`` pipeline, then predicted vs measured.

Runs :func:`felactl.quickstart.quickstart` (profile this machine and gpt-mini {depth 2, width
128, seq_len 64}, plan a global batch of 32 on 2 slots, train with ``bsp``), then compares the
plan's ``predicted.iteration_s`` with the measured iteration time: per step, the slowest worker's
step duration (what the step costs the job), median over the steps after ``--warmup``. It also
prints what the step was spent on (compute, wait, comm medians over workers and steps), so a gap
can be traced to the cost model's terms.

    python benchmarks/bench_demo.py [--steps 60] [--warmup 5] [--out DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path


def iteration_times(records: list[dict], warmup: int) -> dict:
    """Median over steps (after ``warmup``) of the slowest worker's step, and of its parts."""
    by_step: dict[int, list[dict]] = {}
    for r in records:
        by_step.setdefault(r["step"], []).append(r)
    steps = sorted(s for s in by_step if s >= warmup)
    if not steps:
        raise SystemExit(f"no steps after the {warmup} warm-up steps")
    part = {k: statistics.median(r[k] for s in steps for r in by_step[s]) for k in ("compute_s", "wait_s", "comm_s")}
    slowest = [max(r["duration_s"] for r in by_step[s]) for s in steps]
    ends = sorted(max(r["time"] for r in by_step[s]) for s in steps)
    cadence = [b - a for a, b in zip(ends, ends[1:])]
    return {
        "iteration_s": statistics.median(slowest),
        "cadence_s": statistics.median(cadence) if cadence else None,
        "steps": len(steps),
        **part,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="where the demo's files go (default: a temp dir)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from felactl.control.metrics import read_metrics
    from felactl.quickstart import QuickstartOptions, quickstart, too_noisy

    with tempfile.TemporaryDirectory(prefix="bench_demo.") as tmp:
        root = args.out or Path(tmp)
        options = QuickstartOptions(steps=args.steps, out_dir=root / "felactl-demo", runs_root=root / "runs")
        result = quickstart(options, say=lambda line: print(line, file=sys.stderr))
        plan = result["plan_spec"]
        measured = iteration_times(read_metrics(Path(result["summary"]["run_dir"])), args.warmup)
    predicted_s = plan.predicted.iteration_s if plan.predicted else None
    report = {
        "model": options.model,
        "model_config": options.model_config,
        "global_batch": options.global_batch,
        "workers": options.nproc,
        "sync": options.sync,
        "micro_batch": [s.micro_batch for s in plan.stages],
        "predicted_iteration_s": predicted_s,
        **{f"measured_{k}": v for k, v in measured.items()},
        "ratio": measured["iteration_s"] / predicted_s if predicted_s else None,
        "profile_untrusted": result["model_spec"].untrusted(),
    }
    if args.json:
        print(json.dumps(report))
        return
    print(
        f"felactl demo: {options.model} {options.model_config}, global batch {options.global_batch}, "
        f"{options.nproc} workers, {options.sync}, micro-batch {report['micro_batch']}"
    )
    print(f"predicted iteration : {predicted_s * 1e3:8.1f} ms" if predicted_s else "predicted iteration : -")
    print(
        f"measured iteration  : {measured['iteration_s'] * 1e3:8.1f} ms  (slowest worker's step, median of "
        f"{measured['steps']} steps after {args.warmup} warm-up)"
    )
    if measured["cadence_s"]:
        print(f"step cadence        : {measured['cadence_s'] * 1e3:8.1f} ms  (median gap between step ends)")
    print(
        f"  of which compute {measured['compute_s'] * 1e3:.1f} ms, wait {measured['wait_s'] * 1e3:.1f} ms, "
        f"comm {measured['comm_s'] * 1e3:.1f} ms (medians over workers and steps)"
    )
    if report["ratio"]:
        print(
            f"measured / predicted: {report['ratio']:.2f}  ({'within' if abs(report['ratio'] - 1) <= 0.15 else 'outside'}"
            f" 15%)"
        )
    if report["profile_untrusted"]:
        print(f"{too_noisy(result['model_spec'])}:\n  " + "\n  ".join(report["profile_untrusted"]))


if __name__ == "__main__":
    main()
