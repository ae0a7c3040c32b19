"""Runtime throughput: felactl's sync modes on real worker processes, against plain DDP.

Three tables, one run (interleaved rounds: every case once per round, ``--repeat`` rounds; each
number is the median over rounds, because the machine may be shared):

1. Overhead, no straggler: felactl ``bsp`` against ``DistributedDataParallel`` under ``torchrun``
   on the same TrainJob (model, data, loss, optimizer, LR scheduler, clipping) and global batch
   (each worker's half in one micro-batch), for ``mlp`` and ``gpt-mini``, or for a user's own job
   (``--job examples.lm:job``, which replaces the built-ins in every table).
2. One worker ``--factor`` x slower (an injected sleep of ``factor - 1`` times each compute, in
   DDP too): DDP, bsp, tokens, wbsp (+ overlap), sdpipe, the flexible hybrid.
3. Straggler patterns ``roundrobin:S`` and ``prob:P:S`` (bsp, tokens, wbsp, sdpipe).

samples/s come from each run's ``metrics.jsonl`` (first step start to last step end, so process
start-up is excluded); DDP times its own loop the same way. Per felactl run also: the
*capacity bound* (each worker's own rate, samples / its compute seconds with injected sleeps,
summed: what perfect balancing with free synchronisation would reach), ``compute_fraction``,
the loss over the last 10% of the samples, and the wall seconds to reach the loss bsp ends with
(within 5% of bsp's loss reduction; ``t/t_bsp`` is that time over bsp's own, ``-`` if never reached).

    python benchmarks/bench_runtime.py [--steps 40] [--repeat 3] [--factor 3] [--tables 1,2,3]
        [--straggler-models mlp,gpt-mini] [--pattern-models mlp] [--global-batch N|MODEL=N] [--json]
        [--job examples.lm:job [--job-config seq_len=64 --job-config '{"width": 128}']]
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
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from benchjob import add_job_arguments, job_config  # noqa: E402

MODELS = {
    "mlp": ("mlp", {"input_dim": 256, "hidden": 1024, "depth": 4}, 128),
    "gpt-mini": ("gpt-mini", {"depth": 2, "width": 128, "seq_len": 64}, 64),
}
"""name -> (source, config, global batch)."""
JOB_GLOBAL_BATCH = 32
BATCH_ENV, JOB_ENV = "BENCH_GLOBAL_BATCH", "BENCH_JOB"
"""``--global-batch mlp=512`` and ``--job`` (``{"source": ..., "config": ...}``) travel here, so the
torchrun DDP workers (this file again) see them too."""


def _apply_overrides() -> None:
    """``--job``: the user's job is the one model of every table (named by its source);
    ``--global-batch``: ``MODEL=N`` for one model, a bare ``N`` for all."""
    if os.environ.get(JOB_ENV):
        job = json.loads(os.environ[JOB_ENV])
        MODELS.clear()
        MODELS[job["source"]] = (job["source"], job["config"], JOB_GLOBAL_BATCH)
    for item in filter(None, os.environ.get(BATCH_ENV, "").split(",")):
        name, _, size = item.rpartition("=")
        names = [name] if name else list(MODELS)
        if any(n not in MODELS for n in names) or not size.isdigit() or int(size) < 1:
            raise SystemExit(f"--global-batch {item!r}: expected N or MODEL=N with MODEL one of {', '.join(MODELS)}")
        for n in names:
            source, config, _ = MODELS[n]
            MODELS[n] = (source, config, int(size))


_apply_overrides()
LOSS_TOLERANCE = 0.05
"""Time to bsp's loss: the first moment the smoothed loss is within this fraction of bsp's own
loss reduction (first to last smoothed value) of bsp's final smoothed loss."""


def make_plan(model: str, workers: int, mode: str, micro_batch: int, overlap: bool = False, trees: bool = False):
    """A data-parallel plan; ``trees``: with one packed broadcast tree (a star from cpu0) for
    the group, so BSP sums along it instead of gloo's allreduce."""
    import dataclasses

    from felactl.models import local_data_parallel_plan
    from felactl.spec import Collective, SyncMode, SyncSpec, Training, Tree

    source, config, global_batch = MODELS[model]
    plan = local_data_parallel_plan(
        source,
        config,
        workers,
        global_batch=global_batch,
        micro_batch=micro_batch,
        sync=SyncSpec(mode=SyncMode(mode), overlap=overlap),
        training=Training(optimizer="sgd", lr=0.05),
    )
    devices = plan.devices
    if not trees:
        return plan
    star = Tree(edges=tuple(("cpu0", d) for d in devices[1:]), weight=1.0)
    return dataclasses.replace(
        plan,
        collectives=(
            Collective(
                group="stage0",
                devices=tuple(devices),
                root="cpu0",
                trees=(star,),
                rate_gbps=1.0,
                bound_gbps=1.0,
                ring_gbps=0.0,
            ),
        ),
    )


def make_hybrid_plan(model: str, workers: int, micro_batch: int):
    """Fela's flexible hybrid: the first half of the layers with ``micro_batch`` tokens, the rest
    with tokens twice as large, every worker allowed on both sub-models."""
    from felactl.spec import Schedule, Stage, StageWorker, SyncMode, SyncSpec

    base = make_plan(model, workers, "tokens", micro_batch)
    cut = base.num_layers // 2
    workers_of = tuple(StageWorker(device=d, share=1 / workers) for d in base.devices)
    stages = (
        Stage(layer_start=0, layer_end=cut, micro_batch=micro_batch, workers=workers_of),
        Stage(layer_start=cut, layer_end=base.num_layers, micro_batch=2 * micro_batch, workers=workers_of),
    )
    return replace(base, schedule=Schedule.TOKENS, sync=SyncSpec(mode=SyncMode.TOKENS), stages=stages)


def analyse(records: list[dict]) -> dict:
    """samples/s, compute fraction, capacity bound, the loss over the last 10% of samples and
    the loss curve (seconds since start, smoothed loss) of one run's metrics records."""
    from felactl.control.metrics import summarize

    summary = summarize(records)
    capacity = sum(w["samples"] / w["compute_s"] for w in summary["workers"] if w["compute_s"] > 0)
    ordered = sorted((r for r in records if r.get("loss") is not None and r["samples"]), key=lambda r: r["time"])
    start = min(r["time"] - r["duration_s"] for r in records)
    total = sum(r["samples"] for r in ordered)
    curve, window, seen, tail = [], [], 0, []
    for r in ordered:
        seen += r["samples"]
        window = (window + [(r["loss"], r["samples"])])[-10:]
        curve.append((r["time"] - start, sum(l * n for l, n in window) / sum(n for _, n in window)))
        if seen > 0.9 * total:
            tail.append((r["loss"], r["samples"]))
    return {
        "samples_per_s": summary["samples_per_s"],
        "compute_fraction": summary["compute_fraction"],
        "capacity": capacity,
        "tail_loss": sum(l * n for l, n in tail) / sum(n for _, n in tail),
        "samples_by_worker": [w["samples"] for w in summary["workers"]],
        "curve": curve,
    }


def time_to_loss(curve: list[tuple[float, float]], target: float) -> float | None:
    return next((t for t, loss in curve if loss <= target), None)


def run_felactl(workdir: Path, name: str, plan, steps: int, env: dict[str, str]) -> dict:
    from felactl.agents.worker.local import run_local
    from felactl.control.metrics import read_metrics
    from felactl.spec import save

    plan_path = save(plan, workdir / f"{name}.yaml")
    run_dir = workdir / name
    run_local(plan_path, run_dir, len(plan.devices), {"FELACTL_STEPS": str(steps), **env}, timeout_s=600)
    return analyse(read_metrics(run_dir))


def ddp_worker(model: str, steps: int, slow_rank: int, factor: float) -> None:
    """Runs under torchrun: the model's TrainJob in a plain torch DDP loop, each rank its half of
    each global batch: the job's data, loss, optimizer (a built-in's: the plan's SGD, as felactl
    runs it), LR scheduler and gradient clipping. Rank ``slow_rank`` sleeps ``factor - 1`` times
    each compute, as felactl's ``--slowdown`` does."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from felactl import models
    from felactl.agents.worker.engine import make_optimizer

    source, config, global_batch = MODELS[model]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    share = global_batch // world
    plan = make_plan(model, world, "bsp", share)
    job = models.build(source, config, seed=plan.training.seed).job
    ddp = DistributedDataParallel(job.model)
    optimizer = make_optimizer(plan, ddp.parameters(), job)
    scheduler = job.lr_scheduler(optimizer) if job.lr_scheduler is not None else None
    dist.barrier()
    start = time.perf_counter()
    for step in range(steps):
        compute_start = time.perf_counter()
        base = step * global_batch + rank * share
        inputs, targets = job.batch(range(base, base + share))
        job.loss_fn(ddp(inputs), targets).backward()
        if rank == slow_rank:
            time.sleep((factor - 1) * (time.perf_counter() - compute_start))
        if job.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), job.max_grad_norm)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad()
    dist.barrier()
    wall_s = time.perf_counter() - start
    if rank == 0:
        checksum = float(sum(p.detach().double().sum() for p in job.model.parameters()))
        print(
            json.dumps({"samples_per_s": steps * global_batch / wall_s, "wall_s": wall_s, "param_checksum": checksum})
        )
    dist.destroy_process_group()


def run_ddp(model: str, workers: int, steps: int, slow_rank: int = -1, factor: float = 1.0) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={workers}",
            __file__,
            "--ddp-worker",
            "--model",
            model,
            "--steps",
            str(steps),
            "--slow-rank",
            str(slow_rank),
            "--factor",
            str(factor),
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def cases(args) -> list[dict]:
    """Every case: table, scenario (rows of a scenario compare with its bsp), name, how to run it."""
    slow = f"{args.workers - 1}={args.factor:g}"
    share = {m: MODELS[m][2] // args.workers for m in MODELS}
    out = []
    for model in MODELS:
        out += [
            dict(table=1, scenario=model, name="ddp (torchrun)", model=model, mode="ddp", mb=share[model]),
            dict(table=1, scenario=model, name="bsp", model=model, mode="bsp", mb=share[model]),
            dict(table=1, scenario=model, name="bsp (trees)", model=model, mode="bsp", mb=share[model], trees=True),
        ]
    straggler = {"FELACTL_SLOWDOWN": slow}
    for model in args.straggler_models:
        gb, sc = MODELS[model][2], f"{model} {slow}"
        hybrid = (
            [dict(table=2, scenario=sc, name="hybrid tokens", model=model, mode="hybrid", mb=gb // 8, env=straggler)]
            if _splittable(model)
            else []
        )  # one layer: no sub-models to split
        out += [
            dict(table=2, scenario=sc, name="ddp (torchrun)", model=model, mode="ddp", mb=share[model]),
            dict(table=2, scenario=sc, name="bsp", model=model, mode="bsp", mb=share[model], env=straggler),
            dict(table=2, scenario=sc, name="tokens", model=model, mode="tokens", mb=gb // 4, env=straggler),
            dict(table=2, scenario=sc, name="tokens", model=model, mode="tokens", mb=gb // 8, env=straggler),
            dict(table=2, scenario=sc, name="wbsp", model=model, mode="wbsp", mb=share[model], env=straggler),
            dict(
                table=2,
                scenario=sc,
                name="wbsp overlap",
                model=model,
                mode="wbsp",
                mb=share[model],
                overlap=True,
                env=straggler,
            ),
            dict(table=2, scenario=sc, name="sdpipe", model=model, mode="sdpipe", mb=share[model], env=straggler),
            *hybrid,
        ]
    for model in args.pattern_models.split(","):
        gb = MODELS[model][2]
        for pattern in (f"roundrobin:{args.roundrobin_s:g}", f"prob:{args.prob:g}:{args.prob_s:g}"):
            env = {"FELACTL_STRAGGLER": pattern}
            out += [
                dict(table=3, scenario=f"{model} {pattern}", name=mode, model=model, mode=mode, mb=mb, env=env)
                for mode, mb in (
                    ("bsp", share[model]),
                    ("tokens", gb // 4),
                    ("wbsp", share[model]),
                    ("sdpipe", share[model]),
                )
            ]
    return [c for c in out if c["table"] in args.tables]


def _splittable(model: str) -> bool:
    from felactl import models

    source, config, _ = MODELS[model]
    return len(models.build(source, config).layers) > 1


def run_case(case: dict, args, workdir: Path, tag: str) -> dict:
    if case["mode"] == "ddp":
        slowed = case["table"] == 2
        return run_ddp(
            case["model"], args.workers, args.steps, args.workers - 1 if slowed else -1, args.factor if slowed else 1.0
        )
    plan = (
        make_hybrid_plan(case["model"], args.workers, case["mb"])
        if case["mode"] == "hybrid"
        else make_plan(
            case["model"],
            args.workers,
            case["mode"],
            case["mb"],
            overlap=case.get("overlap", False),
            trees=case.get("trees", False),
        )
    )
    return run_felactl(workdir, tag, plan, args.steps, case.get("env", {}))


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def aggregate(all_cases: list[dict], rounds: list[list[dict]]) -> list[dict]:
    """Per case: medians over rounds; ratios against the scenario's ddp and bsp (same round)."""
    rows = []
    for i, case in enumerate(all_cases):
        runs = [r[i] for r in rounds]
        ref = {
            c["name"]: j
            for j, c in enumerate(all_cases)
            if c["scenario"] == case["scenario"] and c["name"] in ("ddp (torchrun)", "bsp")
        }
        row = {k: case[k] for k in ("table", "scenario", "name", "model", "mb")}
        row["samples_per_s"] = _median(r["samples_per_s"] for r in runs)
        row["spread"] = [min(r["samples_per_s"] for r in runs), max(r["samples_per_s"] for r in runs)]
        for key in ("capacity", "compute_fraction", "tail_loss"):
            row[key] = _median(r.get(key) for r in runs)
        row["of_capacity"] = row["samples_per_s"] / row["capacity"] if row["capacity"] else None
        row["samples_by_worker"] = runs[-1].get("samples_by_worker")
        for label, j in (("vs_ddp", ref.get("ddp (torchrun)")), ("vs_bsp", ref.get("bsp"))):
            row[label] = (
                _median(r[i]["samples_per_s"] / r[j]["samples_per_s"] for r in rounds) if j is not None else None
            )
        j = ref.get("bsp")
        row["time_to_bsp_loss"] = None
        if j is not None and "curve" in runs[0]:
            ratios = []
            for r in rounds:
                first, last = r[j]["curve"][0][1], r[j]["curve"][-1][1]
                target = last + LOSS_TOLERANCE * (first - last)
                mine, theirs = time_to_loss(r[i]["curve"], target), time_to_loss(r[j]["curve"], target)
                ratios.append(mine / theirs if mine is not None and theirs else None)
            row["time_to_bsp_loss"] = _median(ratios)
            row["reached_bsp_loss"] = sum(x is not None for x in ratios)
        rows.append(row)
    return rows


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(rows: list[dict], args) -> None:
    titles = {
        1: "1. overhead, no straggler (2 workers, vs DDP of the same model)",
        2: f"2. worker {args.workers - 1} slowed {args.factor:g}x",
        3: "3. straggler patterns",
    }
    for table in args.tables:
        print(f"\n{titles[table]}")
        print(
            f"{'scenario':20s} {'case':16s} {'mb':>3s} {'samples/s':>9s} {'min-max':>11s} {'vs DDP':>6s} "
            f"{'vs BSP':>6s} {'capacity':>8s} {'of cap':>6s} {'compute':>7s} {'tail loss':>9s} {'t/t_bsp':>7s}"
        )
        for r in (r for r in rows if r["table"] == table):
            print(
                f"{r['scenario']:20s} {r['name']:16s} {r['mb']:3d} {r['samples_per_s']:9.0f} "
                f"{r['spread'][0]:5.0f}-{r['spread'][1]:<5.0f} {_fmt(r['vs_ddp'], '6.2f')} "
                f"{_fmt(r['vs_bsp'], '6.2f')} {_fmt(r['capacity'], '8.0f')} {_fmt(r['of_capacity'], '6.2f')} "
                f"{_fmt(r['compute_fraction'], '7.2f')} {_fmt(r['tail_loss'], '9.4f')} "
                f"{_fmt(r['time_to_bsp_loss'], '7.2f')}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--factor", type=float, default=3.0)
    parser.add_argument("--roundrobin-s", type=float, default=0.05)
    parser.add_argument("--prob", type=float, default=0.1)
    parser.add_argument("--prob-s", type=float, default=0.3)
    parser.add_argument("--repeat", type=int, default=3, help="interleaved rounds; medians over rounds")
    parser.add_argument(
        "--straggler-models", default=None, help="models of table 2 (default: all; with --job, the job)"
    )
    parser.add_argument("--pattern-models", default=None, help="models of table 3 (default: mlp; with --job, the job)")
    parser.add_argument("--tables", default="1,2,3", help="which tables: 1 overhead, 2 slowdown, 3 patterns")
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--global-batch",
        default="",
        help=f"N or MODEL=N[,MODEL=N]: another global batch (default mlp 128, gpt-mini 64, a --job {JOB_GLOBAL_BATCH})",
    )
    add_job_arguments(parser)
    parser.add_argument("--ddp-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="mlp", help=argparse.SUPPRESS)
    parser.add_argument("--slow-rank", type=int, default=-1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job and not args.ddp_worker:
        os.environ[JOB_ENV] = json.dumps({"source": args.job, "config": job_config(args.job_config)})
    if args.global_batch:
        os.environ[BATCH_ENV] = args.global_batch
    _apply_overrides()
    if args.ddp_worker:
        ddp_worker(args.model, args.steps, args.slow_rank, args.factor)
        return
    args.tables = [int(t) for t in args.tables.split(",")]
    args.straggler_models = args.straggler_models.split(",") if args.straggler_models else list(MODELS)
    args.pattern_models = args.pattern_models or ("mlp" if "mlp" in MODELS else next(iter(MODELS)))
    all_cases = cases(args)
    rounds = []
    with tempfile.TemporaryDirectory(prefix="bench_runtime.") as tmp:
        for attempt in range(args.repeat):
            results = []
            for i, case in enumerate(all_cases):
                result = run_case(case, args, Path(tmp), f"case{i}-{attempt}")
                print(
                    f"round {attempt}: {case['scenario']:20s} {case['name']:16s} mb {case['mb']:3d} "
                    f"{result['samples_per_s']:8.0f} samples/s",
                    file=sys.stderr,
                )
                results.append(result)
            rounds.append(results)
    rows = aggregate(all_cases, rounds)
    if args.json:
        print(
            json.dumps(
                {
                    "steps": args.steps,
                    "workers": args.workers,
                    "factor": args.factor,
                    "repeat": args.repeat,
                    "rows": rows,
                }
            )
        )
        return
    print(
        f"{args.steps} steps, {args.workers} gloo workers, OMP_NUM_THREADS=1, medians of {args.repeat} "
        f"interleaved rounds; " + ", ".join(f"{name} {config} batch {gb}" for name, (_, config, gb) in MODELS.items())
    )
    print_table(rows, args)


if __name__ == "__main__":
    main()
