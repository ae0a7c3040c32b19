"""A pipeline of a large-vocabulary LM on this machine's two CPU slots, measured against two
profiles' prices: this felactl's (every layer and the loss timed in sequence, the loss on the
last layer) and another.

The model is a LLaMA-shaped LM of ``examples/llama.py`` over words of Python's own sources, with
a vocabulary of a few thousand: its head and its cross-entropy outweigh its small blocks, as a
real tokenizer's 32-50k vocabulary does a model's first layers. The script profiles it on this
machine (``felactl profile --model``) and the local CPU slots (``felactl profile
--nproc-per-node 2``). The second profile is ``--compare-profile`` (one made otherwise: an
older felactl's, whose layers were timed alone and the loss spread over them), or else this one
with its loss spread over every layer by the whole model's scale. On two slots it cuts the model
as a 1F1B chain balanced by each profile (``bench_pipeline_chain.chain_plan``: the planner's
chain) and launches each cut ``--repeat`` times in turn. It prints, per cut, the measured
samples/s and the simulator's under each profile. A profile moves by a third between runs on a
shared machine: compare cuts within one run.

    OMP_NUM_THREADS=1 python benchmarks/bench_loss_stage.py [--vocab 4096] [--width 64]
        [--depth 6] [--micro-batch 4] [--global-batch 64] [--steps 40] [--repeat 3] [--out DIR]
        [--compare-profile OLD.yaml]
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from felactl import TrainJob  # noqa: E402

SOURCES = ("argparse", "collections", "json.decoder", "textwrap", "inspect", "typing", "dataclasses")
"""Python's own modules whose source text the words come from."""


class Words(torch.utils.data.Dataset):
    """Windows of ``seq_len + 1`` word ids over Python's sources; the ``vocab - 1`` most common
    words have ids of their own, the rest share the last."""

    def __init__(self, vocab: int, seq_len: int):
        import collections
        import importlib

        text = "\n".join(inspect.getsource(importlib.import_module(name)) for name in SOURCES)
        words = re.findall(r"\w+|[^\w\s]", text)
        common = [w for w, _ in collections.Counter(words).most_common(vocab - 1)]
        index = {w: i for i, w in enumerate(common)}
        self.tokens = torch.tensor([index.get(w, vocab - 1) for w in words])
        self.seq_len, self.vocab = seq_len, vocab

    def __len__(self) -> int:
        return (len(self.tokens) - self.seq_len - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.tokens[i * self.seq_len : (i + 1) * self.seq_len + 1]
        return window[:-1], window[1:]


def job(vocab: int = 4096, seq_len: int = 32, width: int = 64, depth: int = 6, num_heads: int = 4) -> TrainJob:
    """The LLaMA example's model (untied head) on :class:`Words`."""
    from examples.llama import Llama, next_char_loss

    data = Words(vocab, seq_len)
    return TrainJob(
        model=Llama(vocab, seq_len, width, depth, num_heads, True, False), dataset=data, loss_fn=next_char_loss
    )


def spread_loss(model):
    """``model`` with its loss spread over every layer by the whole model's scale, as profiles
    did before ``loss_ms``: the loss taken off the last layer and every layer scaled so that they
    sum to the whole model again (the loss's split between forward and backward taken as the last
    layer's own)."""
    layers = list(model.layers)
    last = layers[-1]
    timings = []
    for t in last.timings:
        loss = model.loss_ms[str(t.micro_batch)]
        own = t.fwd_ms + t.bwd_ms
        keep = (own - loss) / own
        timings.append(dataclasses.replace(t, fwd_ms=t.fwd_ms * keep, bwd_ms=t.bwd_ms * keep))
    layers[-1] = dataclasses.replace(last, timings=tuple(timings))

    def total(layer_list, t) -> float:
        return sum(u.fwd_ms + u.bwd_ms for layer in layer_list for u in layer.timings if u.micro_batch == t.micro_batch)

    scaled = []
    for layer in layers:
        row = []
        for t in layer.timings:
            factor = total(model.layers, t) / total(layers, t)  # the whole model again
            row.append(dataclasses.replace(t, fwd_ms=t.fwd_ms * factor, bwd_ms=t.bwd_ms * factor))
        scaled.append(dataclasses.replace(layer, timings=tuple(row)))
    return dataclasses.replace(model, layers=tuple(scaled), loss_ms={})


def felactl(*args: str, env: dict) -> str:
    done = subprocess.run([sys.executable, "-m", "felactl", *args], capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"felactl {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return done.stdout


def main() -> int:
    from benchmarks.bench_pipeline_chain import chain_plan
    from benchmarks.bench_testbed_plans import steady_rate
    from felactl.control.metrics import read_metrics
    from felactl.optimizer.cost import CostModel
    from felactl.optimizer.simulator import simulate
    from felactl.spec import load_cluster, load_model, save

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("vocab", 4096), ("width", 64), ("depth", 6), ("micro-batch", 4), ("global-batch", 64)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--compare-profile",
        type=Path,
        default=None,
        help="a model profile of the same job made otherwise (an older felactl's), in place of the loss spread",
    )
    args = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="bench_loss.") as tmp:
        out = args.out or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        config = [f"--config={k}={v}" for k, v in (("vocab", args.vocab), ("width", args.width), ("depth", args.depth))]
        batches = f"{args.micro_batch},{2 * args.micro_batch}"
        felactl("profile", "--model", "benchmarks.bench_loss_stage:job", *config, "--batch-sizes", batches,
                "-o", str(out / "model.yaml"), env=env)  # fmt: skip
        felactl("profile", "--nproc-per-node", "2", "-o", str(out / "cluster.yaml"), env=env)
        cluster, model = load_cluster(out / "cluster.yaml"), load_model(out / "model.yaml")
        other = load_model(args.compare_profile) if args.compare_profile else spread_loss(model)
        profiles = {
            "loss on the last layer": model,
            "loss spread" if not args.compare_profile else "given profile": other,
        }
        order = list(cluster.device_names[:2])
        plans = {}
        for name, profile in profiles.items():
            plan = chain_plan(cluster, profile, order, args.micro_batch, args.global_batch)
            plans[name] = (save(plan, out / f"plan-{name.replace(' ', '-')}.yaml"), plan)
        measured: dict[str, list[float]] = {name: [] for name in plans}
        for round_ in range(args.repeat):
            for name, (path, _) in plans.items():
                run_id = f"{name.replace(' ', '-')}-{round_}"
                felactl("launch", str(path), "--steps", str(args.steps), "--runs-root", str(out / "runs"),
                        "--run-id", run_id, "--json", env=env)  # fmt: skip
                rate = steady_rate(read_metrics(out / "runs" / run_id), args.global_batch, args.warmup)
                measured[name].append(rate["samples_per_s"])
                print(f"{name} round {round_ + 1}: {rate['samples_per_s']:.1f} samples/s", file=sys.stderr, flush=True)
    rows = []
    for name, (_, plan) in plans.items():
        cuts = [(st.layer_start, st.layer_end) for st in plan.stages]
        sims = {
            p: args.global_batch / simulate(plan, CostModel(cluster, prof)).iteration_s for p, prof in profiles.items()
        }
        rows.append({"cut by": name, "stages": cuts, "measured": measured[name], "simulated": sims})
    print(json.dumps({"loss_ms": model.loss_ms, "rows": rows}, indent=1), file=sys.stderr)
    first, second = profiles
    print("| cut by the profile with | stages (layers) | measured samples/s (median; runs) | "
          f"simulated, {first} (measured ÷) | simulated, {second} (measured ÷) |")  # fmt: skip
    print("|---|---|---:|---:|---:|")
    for row in rows:
        m = statistics.median(row["measured"])
        on_last, spread = (row["simulated"][name] for name in profiles)
        runs = ", ".join(f"{x:.0f}" for x in row["measured"])
        print(f"| {row['cut by']} | {row['stages']} | {m:.1f} ({runs}) | {on_last:.1f} ({m / on_last:.2f}) "
              f"| {spread:.1f} ({m / spread:.2f}) |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
