"""The main job on one machine, with defaults: profile -> plan -> launch, as ``felactl demo`` runs it.

Each step is the library call its own command makes (``felactl profile``, ``felactl profile
--model``, ``felactl plan``, ``felactl launch``), and each writes the file that command would, so
the demo leaves exactly what a user doing it by hand would have: ``<out>/cluster.yaml``,
``<out>/model.yaml``, ``<out>/plan.yaml`` and ``runs/<id>/``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from felactl.errors import InputError
from felactl.launcher.rundir import DEFAULT_RUNS_ROOT
from felactl.spec import ModelSpec, save

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
    runs_root: Path = DEFAULT_RUNS_ROOT
    run_id: str | None = None

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise InputError(f"--nproc-per-node must be >= 1, got {self.nproc}")
        if self.steps < 1:
            raise InputError(f"--steps must be >= 1, got {self.steps}")


def quickstart(
    options: QuickstartOptions, say: Say, show: Show = lambda what, result: None, on_update=lambda state: None
) -> dict[str, Any]:
    """Profile this machine and the model, plan, train; return the files made and the run's summary.

    ``say`` announces each step; ``show("cluster" | "model" | "plan", result)`` hands over each
    step's result as soon as it exists; ``on_update`` follows the training (see launch)."""
    from felactl.launcher.launch import launch
    from felactl.launcher.prepare import LaunchOptions
    from felactl.launcher.profile import profile_cluster
    from felactl.optimizer.planner import make_plan
    from felactl.profiling.in_situ import profile_model_in_situ

    out = options.out_dir
    say(f"1/4 profiling this machine: {options.nproc} worker slot(s), every link between them")
    profiled = profile_cluster(nproc_per_node=options.nproc, log_dir=out / "profile-logs")
    cluster = profiled.cluster
    save(cluster, out / "cluster.yaml")
    show("cluster", profiled)
    say(f"2/4 profiling {options.model} layer by layer")
    model = profile_model_in_situ(
        options.model,
        options.model_config,
        [1, 4, 8, 16, 32],
        cluster,
        worker_batch=max(1, options.global_batch // len(cluster.devices)),
        say=lambda line: say(f"    {line}"),
    )
    save(model, out / "model.yaml")
    show("model", model)
    if model.untrusted():
        say(f"    {too_noisy(model)}")
    say(f"3/4 planning a global batch of {options.global_batch} on {len(cluster.devices)} device(s)")
    plan = make_plan(cluster, model, options.global_batch, sync=options.sync)
    save(plan, out / "plan.yaml")
    show("plan", plan)
    say(f"4/4 training {options.steps} steps")
    summary = launch(
        LaunchOptions(
            plan_path=out / "plan.yaml",
            run_id=options.run_id,
            runs_root=options.runs_root,
            steps=options.steps,
            cluster_path=out / "cluster.yaml",
            model_path=out / "model.yaml",
        ),
        on_update=on_update,
    )
    return {
        "cluster": str(out / "cluster.yaml"),
        "model": str(out / "model.yaml"),
        "plan": str(out / "plan.yaml"),
        "profile": profiled,
        "model_spec": model,
        "plan_spec": plan,
        "summary": summary,
    }


def too_noisy(model: ModelSpec) -> str:
    """What the demo says of a profile with timings the machine was too busy to trust."""
    untrusted = model.untrusted()
    return (
        f"the profile was too noisy to trust ({len(untrusted)} timing(s) did not settle, see `noisy` and "
        f"`data_parallel_sync` in model.yaml): the prediction may be off"
    )


def as_dict(result: dict[str, Any]) -> dict[str, Any]:
    """The JSON view of :func:`quickstart`'s result (file paths, what of the profile not to trust,
    and the run's summary)."""
    plan = result["plan_spec"]
    return {
        "cluster": result["cluster"],
        "model": result["model"],
        "plan": result["plan"],
        "predicted_iteration_s": plan.predicted.iteration_s if plan.predicted else None,
        "profile_untrusted": result["model_spec"].untrusted(),
        "summary": result["summary"],
    }
