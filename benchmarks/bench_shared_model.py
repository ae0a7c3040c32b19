"""What a node's workers hold in host memory when its zygote builds the model once and they share
it (``agents/worker/shared_model.py``), next to workers that each build their own, in one run.

``OMP_NUM_THREADS=1 python benchmarks/bench_shared_model.py [--stages 4] [--width 768] [--depth 8]
[--steps 3] [--repeat 3] [--json]``: each round trains the LLaMA example (``examples/llama.py``,
``width`` x ``depth``, AdamW) as one pipeline of ``--stages`` stages on as many CPU workers of this
machine (``run_local``, the very worker, forked from a zygote as an agent forks them), twice: with
felactl's default (the zygote builds the model, its forks share it), and with every worker exec'd
(``FELACTL_ZYGOTE=0``: each builds its own, as before the shared model and as under torchrun).

It samples the proportional set size (PSS: a page shared by k processes counts 1/k in each) of
every process the run starts, summed, every 0.2 s: the node's host memory for the job, of which
it reports the peak (start-up, when the exec'd workers each hold a whole model) and the median
over the run's last half (training). It also reports the run's wall time, building included.
Medians over rounds; ratios shared/exec'd within each round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from felactl import models  # noqa: E402
from felactl.agents.worker.local import run_local  # noqa: E402
from felactl.spec import ModelRef, Plan, Schedule, Stage, StageWorker, SyncMode, SyncSpec, Training, save  # noqa: E402

SAMPLE_S = 0.2
MODES = {"shared": "1", "exec'd": "0"}
"""Each mode's ``FELACTL_ZYGOTE``."""


def llama_pipeline(stages: int, config: dict, micro_batch: int = 2) -> Plan:
    """The LLaMA example cut into ``stages`` runs of its layers (embedding, blocks, head), one worker each."""
    layers = len(models.build("examples.llama:job", config).layers)
    cuts = [round(i * layers / stages) for i in range(stages + 1)]
    devices = tuple(f"cpu{s}" for s in range(stages))
    return Plan(
        cluster="local",
        model=ModelRef(name="llama", source="examples.llama:job", config=config),
        devices=devices,
        global_batch=micro_batch * stages * 2,
        schedule=Schedule.ONE_F_ONE_B,
        sync=SyncSpec(mode=SyncMode.BSP),
        training=Training(optimizer="adamw", lr=1e-3, seed=0),
        stages=tuple(
            Stage(
                layer_start=cuts[s],
                layer_end=cuts[s + 1],
                micro_batch=micro_batch,
                workers=(StageWorker(device=devices[s], share=1.0),),
            )
            for s in range(stages)
        ),
        pipelines=(devices,),
    )


def node_pss_bytes() -> int:
    """The summed PSS of every process this one started, and theirs (the zygote's forks)."""
    total = 0
    for proc in psutil.Process().children(recursive=True):
        try:
            total += proc.memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total


def one_run(plan_path: Path, run_dir: Path, workers: int, steps: int, mode: str) -> dict:
    os.environ["FELACTL_ZYGOTE"] = MODES[mode]  # read where run_local starts its zygote
    samples: list[int] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            samples.append(node_pss_bytes())
            time.sleep(SAMPLE_S)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        wall = run_local(plan_path, run_dir, workers, {"FELACTL_STEPS": str(steps)}, timeout_s=600)
    finally:
        done.set()
        sampler.join()
    training = samples[len(samples) // 2 :] or samples
    return {"wall_s": wall, "peak_gb": max(samples) / 1e9, "training_gb": statistics.median(training) / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    config = {"width": args.width, "depth": args.depth, "num_heads": 8}
    plan = llama_pipeline(args.stages, config)
    params = sum(p.numel() for p in models.build("examples.llama:job", config).model.parameters())
    rounds: list[dict[str, dict]] = []
    with tempfile.TemporaryDirectory() as tmp:
        plan_path = save(plan, Path(tmp) / "plan.yaml")
        for r in range(args.repeat):
            order = list(MODES) if r % 2 == 0 else list(reversed(MODES))  # drift does not favour one
            rounds.append(
                {
                    m: one_run(plan_path, Path(tmp) / f"run{r}-{i}", args.stages, args.steps, m)
                    for i, m in enumerate(order)
                }
            )
    result = {
        "model": {"source": "examples.llama:job", **config, "params": params, "fp32_gb": params * 4 / 1e9},
        "stages": args.stages,
        "rounds": rounds,
        "median": {m: {k: statistics.median(r[m][k] for r in rounds) for k in rounds[0][m]} for m in MODES},
        "ratio": {
            k: statistics.median(r["shared"][k] / r["exec'd"][k] for r in rounds)
            for k in ("peak_gb", "training_gb", "wall_s")
        },
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"examples.llama:job {config}: {params / 1e6:.1f}M parameters ({result['model']['fp32_gb']:.2f} GB fp32), "
        f"{args.stages} stages on {args.stages} CPU workers, {args.steps} steps, {args.repeat} rounds"
    )
    print(f"{'workers':<10} {'peak GB':>8} {'training GB':>12} {'wall s':>7}")
    for m in MODES:
        med = result["median"][m]
        print(f"{m:<10} {med['peak_gb']:>8.2f} {med['training_gb']:>12.2f} {med['wall_s']:>7.1f}")
    ratio = result["ratio"]
    print(f"{'shared/exec':<10} {ratio['peak_gb']:>8.2f} {ratio['training_gb']:>12.2f} {ratio['wall_s']:>7.2f}")


if __name__ == "__main__":
    main()
