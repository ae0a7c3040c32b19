"""The model a node's workers start with, built once by the node's zygote and shared by its forks.

Without it every worker builds the user's whole model on the CPU (its function runs once per
worker) and keeps it while it trains only its part: a node of 8 GPU workers of a 7B model holds
8 x 28 GB of host memory at start-up, and a CPU pipeline of n stages keeps n whole models. The
zygote (``zygote.py``) instead builds the model before it forks the node's first worker, and each
fork starts with it: the kernel shares its pages copy-on-write, so a node holds one model, plus
what each worker changes (its own stage, once it steps) or moves to its GPU. A restart's or a
newcomer's worker starts with it too, without building it again.

A forked worker takes the model it would have built (:func:`take`): the same function, config and
seed (``models.build``), never run in the zygote before. Where sharing could make a run differ
from one whose workers each build their own, the zygote does not share, and says so:

- a plan that keeps the whole model in every worker's host memory (one replicated stage on CPUs)
  gains nothing, and would hold one copy more: not built;
- a build that leaves a file or socket open (forks would share its offset; a memory-mapped file,
  read through its map, is fine), or takes more than :data:`BUILD_BUDGET_S`: dropped, and each
  worker builds its own;
- a build that starts a thread or touches CUDA leaves the zygote unable to fork safely: it
  answers every request with an error, the agent execs every worker from then on, and the zygote
  leaves once it has no child (what the build holds goes with it).

The zygote imports the user's module to build the model: a restarted worker runs the code of the
job's first start, as its model is that start's (a change to the module takes a new launch).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Mapping
from pathlib import Path

import torch

from felactl import models
from felactl.spec import Plan, load_plan
from felactl.spec.executable import plan_backend

BUILD_BUDGET_S = 90.0
"""The longest the zygote spends building a model; the agent waits at most ``START_TIMEOUT_S``
(120 s) for its answer to the first worker. A model that takes longer is built by each worker."""

_built: tuple[str, models.ModelBundle] | None = None
"""The model the zygote built (its key, the bundle), inherited by every fork; the first
:func:`take` in a worker takes it."""

_given_up: set[str] = set()
"""Models the zygote will not try again (a build that failed, ran long or left files open)."""


class Unforkable(RuntimeError):
    """The build left the zygote unable to fork a worker safely (a thread, a CUDA context)."""


def model_key(plan: Plan) -> str:
    """What the model a plan trains is built from: its source, config and seed."""
    return json.dumps([plan.model.source, plan.model.config, plan.training.seed], sort_keys=True, default=str)


def worth_sharing(plan: Plan) -> bool:
    """Whether a worker keeps less than the whole model in host memory: a part of it (several
    stages, or a sharded one) or none (on a GPU, over NCCL)."""
    return len(plan.stages) > 1 or any(s.shard for s in plan.stages) or plan_backend(plan) == "nccl"


def prepare(env: Mapping[str, str]) -> str | None:
    """In the zygote, before it forks the worker of ``env``: build the model of the plan it names
    (``FELACTL_PLAN``) where that is worth it and not done. Returns why a model worth sharing
    is not shared (for the zygote's log), or None. Raises :class:`Unforkable`."""
    global _built
    try:
        plan = load_plan(Path(env["FELACTL_PLAN"]))
    except Exception:  # noqa: BLE001 - a bad or missing plan is the worker's to report
        return None
    key = model_key(plan)
    if not worth_sharing(plan) or key in _given_up or (_built is not None and _built[0] == key):
        return None
    _built = None  # a model the job no longer trains (a re-plan changed it) is dropped first
    bundle, why_not = _build_guarded(plan)
    if bundle is None:
        _given_up.add(key)
        # a build that failed is the workers' to report, as they build it again: said here too,
        # it would come first, and read as the cause
        return f"{plan.model.source}: {why_not}; each worker builds its own" if why_not else None
    _built = (key, bundle)
    return None


def take(plan: Plan) -> models.ModelBundle | None:
    """In a worker: the model its zygote built for ``plan``, once (a second build in the same
    worker, of a model already trained on, is a fresh one). None where none was built."""
    global _built
    if _built is None or _built[0] != model_key(plan):
        return None
    bundle, _built = _built[1], None
    return bundle


class _OutOfTime(BaseException):
    """Raised by the alarm inside the user's build: not an Exception, which their code (or
    ``models.build``, which words a failing function's error) may catch."""


def _build_guarded(plan: Plan) -> tuple[models.ModelBundle | None, str]:
    """Build ``plan``'s model with the zygote's output kept off its protocol (the user's function
    may print) and its time bounded; then check it left nothing a fork would share unsafely.
    Returns the model, or None and why not ("" where building it failed)."""
    threads, files = _tasks(), _open_fds()
    protocol = os.dup(1)
    os.dup2(2, 1)  # fd 1 is the zygote's answers to the agent: a print would corrupt one
    previous = signal.signal(signal.SIGALRM, _out_of_time)
    signal.setitimer(signal.ITIMER_REAL, BUILD_BUDGET_S)
    bundle, why_not = None, ""
    try:
        bundle = models.build(plan.model.source, plan.model.config, seed=plan.training.seed)
    except _OutOfTime:
        why_not = f"building it took over {BUILD_BUDGET_S:g} s"
    except (Exception, SystemExit):  # noqa: BLE001 - the worker builds it again and reports it
        pass
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        sys.stdout.flush()
        os.dup2(protocol, 1)
        os.close(protocol)
    if torch.cuda.is_initialized() or _tasks() > threads:
        raise Unforkable(f"building {plan.model.source} started a thread or touched CUDA; workers are exec'd")
    if bundle is not None and (opened := _read_through_offsets(_open_fds() - files)):
        bundle, why_not = None, f"building it left {', '.join(opened)} open, which forks would share"
    return bundle, why_not


def _out_of_time(signum, frame) -> None:
    raise _OutOfTime


def _tasks() -> int:
    return len(os.listdir("/proc/self/task"))


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd")) - {"0", "1", "2"}


def _read_through_offsets(fds: set[str]) -> list[str]:
    """What ``fds`` are open on, but for files this process has memory-mapped: a dataset that
    keeps a map (``np.memmap``, Arrow's) keeps its file open too, and reads it through the map,
    which forks share safely. Any other file, socket or pipe is read at an offset the forks would
    move for each other. (The listing's own descriptor, in every listing, is gone by now.)"""
    targets = []
    for fd in sorted(fds, key=int):
        try:
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
    with open("/proc/self/maps") as maps:
        mapped = {line.split(maxsplit=5)[5].strip() for line in maps if "/" in line}  # the lines with a path
    return [t for t in targets if t not in mapped]
