"""The main job on one machine, with defaults: profile -> plan -> launch, as ``felactl demo`` runs it.

Each step is the library call its own command makes (``felactl profile``, ``felactl profile
--model``, ``felactl plan``, ``felactl launch``), and each writes the file that command would, so
the demo leaves exactly what a user doing it by hand would have: ``<out>/cluster.yaml``,
``<out>/model.yaml``, ``<out>/plan.yaml`` and ``runs/<id>/``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from felactl.errors import InputError
from felactl.spec import save

Say = Callable[[str], None]
Show = Callable[[str, Any], None]


@dataclass(frozen=True, kw_only=True)
class QuickstartOptions:
    nproc: int = 2
    model: str = "gpt-mini"
    model_config: dict[str, Any] = field(default_factory=lambda: {"depth": 2, "width": 128, "seq_len": 64})
    global_batch: int = 32
    steps: int = 300
    sync: str = "bsp"
    out_dir: Path = Path("felactl-demo")
    runs_root: Path = Path("runs")
    run_id: str | None = None

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise InputError(f"--nproc-per-node must be >= 1, got {self.nproc}")
        if self.steps < 1:
            raise InputError(f"--steps must be >= 1, got {self.steps}")


def quickstart(options: QuickstartOptions, say: Say, show: Show = lambda what, result: None,
               on_update=lambda state: None) -> dict[str, Any]:
    """Profile this machine and the model, plan, train; return the files made and the run's summary.

    ``say`` announces each step; ``show("cluster" | "model" | "plan", result)`` hands over each
    step's result as soon as it exists; ``on_update`` follows the training (see launch)."""
    from felactl.launcher.launch import LaunchOptions, launch
    from felactl.optimizer.planner import make_plan
    from felactl.profiling.cluster import profile_cluster
    from felactl.profiling.model import profile_model

    out = options.out_dir
    say(f"1/4 profiling this machine: {options.nproc} worker slot(s), every link between them")
    profiled = profile_cluster(nproc_per_node=options.nproc, log_dir=out / "profile-logs")
    cluster = profiled.cluster
    save(cluster, out / "cluster.yaml")
    show("cluster", profiled)
    say(f"2/4 profiling {options.model} layer by layer")
    model = _profile_model_like_a_slot(profile_model, options, cluster)
    model = _with_measured_sync(model, options, cluster, say)
    save(model, out / "model.yaml")
    show("model", model)
    say(f"3/4 planning a global batch of {options.global_batch} on {len(cluster.devices)} device(s)")
    plan = make_plan(cluster, model, options.global_batch, sync=options.sync)
    save(plan, out / "plan.yaml")
    show("plan", plan)
    say(f"4/4 training {options.steps} steps")
    summary = launch(LaunchOptions(plan_path=out / "plan.yaml", run_id=options.run_id, runs_root=options.runs_root,
                                   steps=options.steps, cluster_path=out / "cluster.yaml",
                                   model_path=out / "model.yaml"), on_update=on_update)
    return {"cluster": str(out / "cluster.yaml"), "model": str(out / "model.yaml"), "plan": str(out / "plan.yaml"),
            "profile": profiled, "model_spec": model, "plan_spec": plan, "summary": summary}


def _profile_model_like_a_slot(profile_model, options: QuickstartOptions, cluster):
    """Time the model as a worker will run: pinned to slot 0's cores with as many threads, while
    every other slot's cores run the same model's training steps (as the other workers will).

    Profiled alone, the layers ran ~25% faster than inside the job: the workers share the
    machine's memory bandwidth and caches, and a plan from a quiet profile underestimates them."""
    import multiprocessing
    import os

    import torch

    cores = [list(d.cpu_cores) for d in cluster.devices]
    threads_before = torch.get_num_threads()
    affinity_before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    batch = max(1, options.global_batch // max(1, len(cluster.devices)))
    started = [ctx.Event() for _ in cores[1:]]
    companions = [ctx.Process(target=_keep_busy, args=(options.model, options.model_config, batch, slot_cores,
                                                        stop, ready), daemon=True)
                  for slot_cores, ready in zip(cores[1:], started)]
    try:
        for proc in companions:
            proc.start()
        for ready in started:
            ready.wait(timeout=60)  # its first training step is done
        if cores[0] and affinity_before is not None:
            os.sched_setaffinity(0, cores[0])
        torch.set_num_threads(max(1, len(cores[0])) if cores[0] else threads_before)
        return profile_model(options.model, options.model_config, [1, 4, 8, 16, 32])
    finally:
        stop.set()
        for proc in companions:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        torch.set_num_threads(threads_before)
        if affinity_before is not None:
            os.sched_setaffinity(0, affinity_before)


def _with_measured_sync(model, options: QuickstartOptions, cluster, say: Say):
    """The model profile plus its gradient sync measured on this machine's CPU slots (see
    ``felactl.profiling.data_parallel``), which the link profile prices at a fraction of its cost.
    If the measurement fails, the plan falls back on the link-based estimate: said, not fatal."""
    from dataclasses import replace

    from felactl.errors import ProfilingError
    from felactl.profiling.data_parallel import Slot, measure_data_parallel_sync
    from felactl.spec import DeviceKind

    devices = cluster.devices
    if len(devices) < 2 or any(d.kind != DeviceKind.CPU for d in devices):
        return model
    say(f"    timing a data-parallel step on the {len(devices)} slots, with and without gradient sync")
    try:
        timing = measure_data_parallel_sync(options.model, options.model_config,
                                            max(1, options.global_batch // len(devices)),
                                            [Slot(d.name, tuple(d.cpu_cores)) for d in devices])
    except ProfilingError as exc:
        say(f"    (skipped: {exc}; the plan prices sync from the link profile)")
        return model
    return replace(model, data_parallel_sync=(timing,))


def _keep_busy(model: str, config: dict[str, Any], batch: int, cores: list[int], stop, started) -> None:
    """A stand-in for one other worker while the model is profiled: pinned to its slot's cores,
    forward, loss, backward and AdamW steps of the whole model until ``stop`` is set."""
    import os

    import torch

    from felactl.models import build

    if cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)
    torch.set_num_threads(max(1, len(cores)) if cores else 1)
    bundle = build(model, config, seed=0)
    optimizer = torch.optim.AdamW(bundle.layers.parameters(), lr=1e-6)
    inputs, targets = bundle.data.batch(range(batch))
    while True:
        optimizer.zero_grad(set_to_none=True)
        bundle.loss(bundle.layers(inputs), targets).backward()
        optimizer.step()
        started.set()
        if stop.is_set():
            return


def as_dict(result: dict[str, Any]) -> dict[str, Any]:
    """The JSON view of :func:`quickstart`'s result (file paths and the run's summary)."""
    plan = result["plan_spec"]
    return {"cluster": result["cluster"], "model": result["model"], "plan": result["plan"],
            "predicted_iteration_s": plan.predicted.iteration_s if plan.predicted else None,
            "summary": result["summary"]}


