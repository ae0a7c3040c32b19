"""The model a node's workers start with, built once by the node's zygote and shared by its forks.

Without it every worker builds the user's whole model on the CPU (its function runs once per
worker) and keeps it while it trains only its part: a node of 8 GPU workers of a 7B model holds
8 x 28 GB of host memory at start-up, and a CPU pipeline of n stages keeps n whole models. The
zygote (``zygote.py``) instead builds the model before it forks the node's first worker, and each
fork starts with it: the kernel shares its pages copy-on-write, so a node holds one model, plus
what each worker changes (its own stage, once it steps) or moves to its GPU. The zygote keeps its
copy for the job's restarts and newcomers, which start with it without building it again (on a
GPU node that one host copy stays, where workers that built their own freed theirs once on the
GPU).

A forked worker takes the model it would have built (:func:`take`): the same function, config and
seed (``models.build``, which leaves the global random generators as it found them), never run
in the zygote before, with what the build did to the environment and the working directory done
again in the worker. The build runs with the agent's environment: a worker's own variables
(``RANK``, ``LOCAL_RANK``) are not set, as the model every worker shares is no one worker's.

What the user's code leaves in the zygote, every later fork inherits. So only a build that left
nothing a fork could not share is used; after any other, the zygote forks no more (it answers
every request with an error, the agent execs every worker from then on, and the zygote leaves
once it has no child, taking what the build left with it):

- it left a file, socket or pipe open: forks would move one offset for each other (a file it
  memory-mapped, as ``np.memmap`` and Arrow keep theirs, is read through the map: fine);
- it started a thread (a fork copies none, and a lock one held stays held), or touched CUDA
  (a child of a process that initialised it cannot use it);
- it took more than :data:`BUILD_BUDGET_S`, or failed (the workers build it again and say why).

A plan that keeps the whole model in every worker's host memory (one replicated stage on CPUs)
gains nothing, and would hold one copy more: no model is built for it.

The zygote imports the user's module to build the model: a restarted worker runs the code of the
job's first start, as its model is that start's (a change to the module takes a new launch).
"""

from __future__ import annotations

import ctypes
import dataclasses
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

BUILD_BUDGET_S = 60.0
"""The longest the zygote spends building a model; the agent waits at most ``START_TIMEOUT_S``
(120 s) for its answer to the first worker, and the alarm is heard only between the build's
Python lines. A model that takes longer is built by each worker."""

SWITCH = "FELACTL_SHARED_MODEL"
"""Set to ``0`` where an agent starts, its zygote builds no model: each worker builds its own, as
before (a way out, should a build hold something the checks below do not see; and a benchmark's
baseline), while workers are still forked."""

NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"
"""Set in the zygote: ``torch.cuda.is_available()``, which user code and libraries call as they
import, then asks NVML instead of initialising the CUDA driver, which no fork could then use."""


@dataclasses.dataclass
class Built:
    """A model the zygote built, and what its build did that a worker's own would have done to itself."""

    key: str
    bundle: models.ModelBundle
    environ: dict[str, str | None]
    """Variables the build set (a value) or removed (None)."""
    cwd: str | None
    """The directory the build moved to, where it moved."""


_built: Built | None = None
"""Inherited by every fork; the first :func:`take` in a worker takes it."""


class Unforkable(RuntimeError):
    """The build left the zygote unable to fork a worker that would run as an exec'd one.
    ``quiet``: nothing to tell the user (the build failed: each worker says why)."""

    def __init__(self, message: str, quiet: bool = False):
        super().__init__(message)
        self.quiet = quiet


def model_key(plan: Plan) -> str:
    """What the model a plan trains is built from: its source, config and seed."""
    return json.dumps([plan.model.source, plan.model.config, plan.training.seed], sort_keys=True, default=str)


def worth_sharing(plan: Plan) -> bool:
    """Whether a worker keeps less than the whole model in host memory: a part of it (several
    stages, or a sharded one) or none (on a GPU, over NCCL)."""
    return len(plan.stages) > 1 or any(s.shard for s in plan.stages) or plan_backend(plan) == "nccl"


def prepare(env: Mapping[str, str]) -> None:
    """In the zygote, before it forks the worker of ``env``: build the model of the plan it names
    (``FELACTL_PLAN``) where that is worth it and not done. Raises :class:`Unforkable`."""
    global _built
    try:
        plan = load_plan(Path(env["FELACTL_PLAN"]))
    except Exception:  # noqa: BLE001 - a bad or missing plan is the worker's to report
        return
    key = model_key(plan)
    if os.environ.get(SWITCH, "1") == "0" or not worth_sharing(plan) or (_built is not None and _built.key == key):
        return
    _built = None  # a model the job no longer trains (a re-plan changed it) is dropped first
    _built = _build_guarded(key, plan)


def take(plan: Plan) -> models.ModelBundle | None:
    """In a worker: the model its zygote built for ``plan``, once (a second build in the same
    worker, of a model already trained on, is a fresh one), with what its build did to the
    environment and the working directory done here too. None where none was built."""
    global _built
    if _built is None or _built.key != model_key(plan):
        return None
    built, _built = _built, None
    for name, value in built.environ.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    if built.cwd is not None:
        os.chdir(built.cwd)
    return built.bundle


class _OutOfTime(BaseException):
    """Raised by the alarm inside the user's build: not an Exception, which their code (or
    ``models.build``, which words a failing function's error) may catch."""


def _build_guarded(key: str, plan: Plan) -> Built:
    """Build ``plan``'s model with the zygote's output kept off its protocol (the user's function
    may print), its time bounded, and what it changes in the zygote's own process put back; then
    check it left nothing a fork would share unsafely (:class:`Unforkable`)."""
    threads, files, environ, cwd = _tasks(), _open_fds(), dict(os.environ), os.getcwd()
    handlers = {s: signal.getsignal(s) for s in _catchable_signals()}
    protocol = os.dup(1)
    os.dup2(2, 1)  # fd 1 is the zygote's answers to the agent: a print would corrupt one
    signal.signal(signal.SIGALRM, _out_of_time)
    signal.setitimer(signal.ITIMER_REAL, BUILD_BUDGET_S)
    source, failed = plan.model.source, None
    try:
        bundle = models.build(source, plan.model.config, seed=plan.training.seed)
    except _OutOfTime:
        failed = Unforkable(f"building {source} took over {BUILD_BUDGET_S:g} s; each worker builds its own")
    except BaseException:  # noqa: BLE001 - the workers build it again and say why
        failed = Unforkable(f"building {source} failed", quiet=True)
    finally:
        signal.signal(signal.SIGALRM, signal.SIG_IGN)  # an alarm due now must not escape
        signal.setitimer(signal.ITIMER_REAL, 0)
        for number, handler in handlers.items():  # the zygote reaps and stops as it did
            signal.signal(number, handler if handler is not None else signal.SIG_DFL)
        sys.stdout.flush()
        os.dup2(protocol, 1)
        os.close(protocol)
    moved_to = os.getcwd()
    os.chdir(cwd)
    changed = {k: os.environ.get(k) for k in environ.keys() | os.environ.keys() if os.environ.get(k) != environ.get(k)}
    os.environ.clear()
    os.environ.update(environ)
    if torch.cuda.is_initialized() or _cuda_driver_initialized():
        raise Unforkable(f"building {source} initialised CUDA, which a forked worker could not use")
    if _tasks() > threads:
        raise Unforkable(f"building {source} started a thread, which a forked worker would lack")
    if failed is not None:
        raise failed
    if opened := _read_through_offsets(_open_fds() - files):
        raise Unforkable(f"building {source} left {', '.join(opened)} open, which forked workers would share")
    return Built(key, bundle, changed, moved_to if moved_to != cwd else None)


def _out_of_time(signum, frame) -> None:
    raise _OutOfTime


def _catchable_signals() -> list[signal.Signals]:
    return [
        s
        for s in signal.valid_signals()
        if s not in (signal.SIGKILL, signal.SIGSTOP) and signal.getsignal(s) is not None
    ]


def _cuda_driver_initialized() -> bool:
    """Whether this process initialised the CUDA driver (``cuInit``), which torch does not
    always say (``torch.cuda.is_available()`` inits it, ``is_initialized()`` stays False):
    ``cuDeviceGetCount`` answers CUDA_ERROR_NOT_INITIALIZED (3) until then. False without a
    driver."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    count = ctypes.c_int()
    return driver.cuDeviceGetCount(ctypes.byref(count)) != 3


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
