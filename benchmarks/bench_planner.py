"""felactl plan: solve times at scale, and the plan's predicted speedup over each baseline.

Run: ``python benchmarks/bench_planner.py`` (add ``--skip-large`` to leave out the 512-GPU case).

Table 1 times the planner's search (building the stage-option space, Blink trees included, then
the ILP) for a 48-layer transformer on ``plans/clusters/mixed.yaml`` and a 128-layer one on a
generated 64-node x 8-GPU DGX-1V cluster, with and without a time limit; where a limit stops CBC
it prints the gap to CBC's proven lower bound. Beside wall seconds it prints CPU seconds (this
process and CBC's), which other work on a shared machine does not inflate. The last row times
``make_plan`` as a whole for the 48-layer case (baselines, both solves, simulation).

Table 2 runs ``make_plan`` (the whole of ``felactl plan``) for every shipped cluster x model: the profiled built-in models in
``plans/models/`` and two analytic ones (VGG-16-like, 48-layer transformer), and prints the
plan's predicted iteration, the simulator's, and the speedup over DP, MP, HP and no-trees, all
predicted in the same cost model. The plan's space contains DP, so "vs dp" is never below 1.

Table 3 (issue 14; ``--only-hetero`` prints it alone) plans a GPT-2-XL-like model (50 layers:
embedding, 48 blocks of width 1600, head; sequence 1024; global batch 512) and a Llama-7B-like one
(34 layers, width 4096, sequence 2048; batch 256) on ``plans/clusters/h100-a10g-l4.yaml`` (36 GPUs:
2 x 8 H100 behind NVSwitch, 2 x 8 A10G and 4 L4 each node behind one shared NIC): the whole
``make_plan`` (wall and CPU seconds), the plan, and the simulator's iteration and peak memory per
device against what the plan may fill (memory less the headroom).
"""

from __future__ import annotations

import argparse
import importlib.util
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from synthetic_models import transformer_spec, vgg_spec  # noqa: E402

from felactl.optimizer import ilp  # noqa: E402
from felactl.optimizer.cost import CostModel  # noqa: E402
from felactl.optimizer.planner import make_plan, plan_cost_model  # noqa: E402
from felactl.optimizer.space import build_space  # noqa: E402
from felactl.spec import load_cluster, load_model  # noqa: E402

GLOBAL_BATCH = 256


def generated_dgx1v(num_servers: int):
    spec = importlib.util.spec_from_file_location("generate", ROOT / "plans" / "clusters" / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    return generate.dgx1v(num_servers)


def cpu_s() -> float:
    """CPU seconds of this process and its finished children (CBC runs as one)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def time_search(name: str, cluster, model, batch: int, limit_s: float | None, **space_kw) -> dict:
    began, began_cpu = time.perf_counter(), cpu_s()
    space = build_space(CostModel(cluster, model), batch, **space_kw)
    built, built_cpu = time.perf_counter(), cpu_s()
    found = ilp.solve(space, time_limit_s=limit_s)
    done, done_cpu = time.perf_counter(), cpu_s()
    return {
        "case": name,
        "limit": "-" if limit_s is None else f"{limit_s:g} s",
        "options": len(space.options),
        "space_s": built - began,
        "ilp_s": done - built,
        "ilp_cpu_s": done_cpu - built_cpu,
        "total_s": done - began,
        "total_cpu_s": done_cpu - began_cpu,
        "status": found.status,
        "gap": found.gap,
        "iteration_s": found.objective_s,
        "stages": len(found.options),
    }


def time_make_plan(name: str, cluster, model, batch: int) -> dict:
    began, began_cpu = time.perf_counter(), cpu_s()
    plan = make_plan(cluster, model, batch)
    done, done_cpu = time.perf_counter(), cpu_s()
    return {
        "case": name,
        "limit": "-",
        "options": None,
        "space_s": None,
        "ilp_s": None,
        "ilp_cpu_s": None,
        "total_s": done - began,
        "total_cpu_s": done_cpu - began_cpu,
        "status": plan.solver.status,
        "gap": plan.solver.gap,
        "iteration_s": plan.predicted.iteration_s,
        "stages": len(plan.stages),
    }


def scale_table(skip_large: bool) -> list[dict]:
    mixed = load_cluster(ROOT / "plans" / "clusters" / "mixed.yaml")
    deep = transformer_spec(48, width=1024, seq_len=512)
    rows = [
        time_search("48-layer transformer, mixed (24 GPUs)", mixed, deep, GLOBAL_BATCH, None),
        time_search("48-layer transformer, mixed (24 GPUs)", mixed, deep, GLOBAL_BATCH, 2.0),
    ]
    if not skip_large:
        big = generated_dgx1v(64)
        deeper = transformer_spec(128, width=1024, seq_len=512)
        rows.append(
            time_search(
                "128-layer transformer, 64 x 8 DGX-1V (512 GPUs)", big, deeper, 1024, 30.0, max_stages=8, max_blocks=16
            )
        )
    rows.append(time_make_plan("make_plan: 48-layer transformer, mixed (24 GPUs)", mixed, deep, GLOBAL_BATCH))
    return rows


def render_scale(rows: list[dict]) -> str:
    def num(value, fmt=".2f") -> str:
        return "-" if value is None else format(value, fmt)

    lines = [
        "| case | time limit | stage options | space s | ILP s | ILP cpu s | total s | total cpu s | status | gap "
        "| iteration s | stages |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        gap = "0" if r["gap"] == 0 else ("n/a" if r["gap"] is None else f"{r['gap']:.1%}")
        lines.append(
            f"| {r['case']} | {r['limit']} | {num(r['options'], 'd')} | {num(r['space_s'])} | {num(r['ilp_s'])} | "
            f"{num(r['ilp_cpu_s'])} | {num(r['total_s'])} | {num(r['total_cpu_s'])} | {r['status']} | {gap} | "
            f"{r['iteration_s']:.4g} | {r['stages']} |"
        )
    return "\n".join(lines)


def models() -> list:
    found = [load_model(p) for p in sorted((ROOT / "plans" / "models").glob("*.yaml"))]
    return found + [vgg_spec(), transformer_spec(48, width=1024, seq_len=512)]


def speedup_table() -> list[dict]:
    rows = []
    for path in sorted((ROOT / "plans" / "clusters").glob("*.yaml")):
        cluster = load_cluster(path)
        for model in models():
            began = time.perf_counter()
            plan = make_plan(cluster, model, GLOBAL_BATCH)
            p = plan.predicted
            rows.append(
                {
                    "cluster": path.stem,
                    "model": model.name,
                    "iteration_s": p.iteration_s,
                    "simulated_s": p.simulated_iteration_s,
                    "stages": len(plan.stages),
                    "devices": len(plan.devices),
                    "wall_s": time.perf_counter() - began,
                    **{f"vs_{k}": v / p.iteration_s for k, v in p.baselines.items()},
                }
            )
            print(f"  planned {model.name} on {path.stem} in {rows[-1]['wall_s']:.1f} s", file=sys.stderr)
    return rows


def render_speedups(rows: list[dict]) -> str:
    names = ("dp", "mp", "hp", "no_trees")
    lines = [
        "| cluster | model | stages | devices | plan iteration s | simulated s | "
        + " | ".join(f"vs {n}" for n in names)
        + " | make_plan s |",
        "|---|---|---|---|---|---|" + "---|" * len(names) + "---|",
    ]
    for r in rows:
        ratios = " | ".join(f"{r[f'vs_{n}']:.2f}x" if f"vs_{n}" in r else "-" for n in names)
        lines.append(
            f"| {r['cluster']} | {r['model']} | {r['stages']} | {r['devices']} | {r['iteration_s']:.4g} | "
            f"{r['simulated_s']:.4g} | {ratios} | {r['wall_s']:.1f} |"
        )
    return "\n".join(lines)


def hetero_table() -> list[dict]:
    from felactl.optimizer.simulator import simulate

    cluster = load_cluster(ROOT / "plans" / "clusters" / "h100-a10g-l4.yaml")
    llama = transformer_spec(34, width=4096, seq_len=2048, vocab=32000)
    a10gs = [d for d in cluster.device_names if d.startswith("a10g")]
    cases = [  # (name, model, batch, devices (None: all), sync)
        ("GPT-2-XL-like", transformer_spec(50, width=1600, seq_len=1024, vocab=50257), 512, None, "tokens"),
        ("Llama-7B-like", llama, 256, None, "tokens"),
        ("Llama-7B-like, 16 A10G only", llama, 256, a10gs, "bsp"),  # fits only sharded (issue 32)
    ]
    rows = []
    for name, model, batch, devices, sync in cases:
        began, began_cpu = time.perf_counter(), cpu_s()
        plan = make_plan(cluster, model, batch, devices=devices, sync=sync)
        wall, cpu = time.perf_counter() - began, cpu_s() - began_cpu
        cost = plan_cost_model(plan, cluster, model, use_trees=True)
        result = simulate(plan, cost)
        fill = {d: result.peak_memory_bytes[d] / cost.usable_memory_bytes(d) for d in plan.devices}
        worst = max(fill, key=fill.get)
        rows.append(
            {
                "case": name,
                "layers": model.num_layers,
                "gpus": len(devices or cluster.device_names),
                "batch": batch,
                "wall_s": wall,
                "cpu_s": cpu,
                "status": f"{plan.solver.status} ({plan.solver.name})",
                "stages": " / ".join(
                    f"{st.layer_start}-{st.layer_end - 1} b{st.micro_batch} x{len(st.workers)}{' sharded' if st.shard else ''} "
                    f"({'+'.join(sorted({w.device.split('.')[0] for w in st.workers}))})"
                    for st in plan.stages
                ),
                "iteration_s": plan.predicted.iteration_s,
                "simulated_s": result.iteration_s,
                "peak_gb": result.peak_memory_bytes[worst] / 1e9,
                "usable_gb": cost.usable_memory_bytes(worst) / 1e9,
                "worst": worst,
                "fill": fill[worst],
                "exceeded": result.in_flight_exceeded,
                "missing": ", ".join(f"{k}: {v}" for k, v in plan.predicted.baselines_missing.items()),
            }
        )
        print(f"  planned {name} in {wall:.1f} s", file=sys.stderr)
    return rows


def render_hetero(rows: list[dict]) -> str:
    lines = [
        "| model | layers x GPUs | batch | make_plan s | cpu s | status | stages (layers, micro-batch, workers) "
        "| predicted s | simulated s | peak GB (device) | usable GB | peak / usable | in-flight limit lifted |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['layers']} x {r['gpus']} | {r['batch']} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | "
            f"{r['status']} | {r['stages']} | {r['iteration_s']:.4g} | {r['simulated_s']:.4g} | "
            f"{r['peak_gb']:.1f} ({r['worst']}) | {r['usable_gb']:.1f} | {r['fill']:.2f} | "
            f"{'yes' if r['exceeded'] else 'no'} |"
        )
    lines.append("")
    lines += [f"- {r['case']}: baselines without a plan: {r['missing'] or 'none'}" for r in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-large", action="store_true", help="Leave out the 512-GPU case.")
    parser.add_argument("--only-hetero", action="store_true", help="Only table 3 (issue 14).")
    args = parser.parse_args()
    print("## felactl plan on a mixed H100 / A10G / L4 cluster (36 GPUs)\n")
    print(render_hetero(hetero_table()))
    if args.only_hetero:
        return
    print(f"## felactl plan: search time (global batch {GLOBAL_BATCH}; 1024 for 512 GPUs)\n")
    print(render_scale(scale_table(args.skip_large)))
    print(f"\n## felactl plan: predicted speedup of the plan over each baseline (global batch {GLOBAL_BATCH})\n")
    rows = speedup_table()
    print(render_speedups(rows))
    # a plan records its baselines' times to 9 digits: a plan that is DP itself can read 0.9999999x
    worse = [r for r in rows if r.get("vs_dp", 1.0) < 1.0 - 1e-6]
    print(f"\nplans worse than DP: {len(worse)} of {len(rows)}")


if __name__ == "__main__":
    main()
