"""Profiling a model as the workers of this machine's CPU slots will run it.

Timed alone, a model runs faster than inside a job: on the project's 2-core box the layers ran
~25% faster alone than with the other slot training beside them (the workers share the
machine's memory bandwidth and caches), and gradient sync cost ~6 ms a step where the link
profile priced it at 0.7 ms (``felactl.profiling.data_parallel``). A plan from a quiet profile
underestimates the job, so here:

1. the layers are timed in this process pinned to the first slot's cores, with as many threads,
   while every other slot's cores run the same model's training steps (as its worker will);
2. then the whole model's data-parallel step is timed on all the slots, with and without sync,
   and the difference is recorded as the model's ``data_parallel_sync`` for that group (without
   ``sync_ms``, and with a warning, where the busy machine hid it in noise).

``felactl profile --model M --cluster cluster.yaml`` and ``felactl demo`` use this.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from felactl.errors import InputError, ProfilingError
from felactl.machine import available_cores, short_hostname
from felactl.profiling.devices import pin_to_cores
from felactl.spec import ClusterSpec, Device, DeviceKind, ModelSpec

log = logging.getLogger(__name__)
COMPANION_START_TIMEOUT_S = 60.0


def local_cpu_slots(cluster: ClusterSpec, node_name: str | None = None) -> list[Device]:
    """The CPU devices of this machine's node in ``cluster``: the node named ``node_name``, else
    the one whose hostname or name is this machine's, else the only node; each slot's cores must
    be cores this process may run on."""
    nodes = cluster.nodes
    if node_name is not None:
        chosen = [n for n in nodes if n.name == node_name]
        what = f"no node named {node_name!r}"
    else:
        host, short = socket.gethostname(), short_hostname()
        chosen = [n for n in nodes if n.hostname in (host, short) or n.name == short]
        if not chosen and len(nodes) == 1:
            chosen = list(nodes)
            if nodes[0].hostname and nodes[0].hostname.split(".")[0] != short:
                log.warning(
                    "warning: cluster %r was profiled on %s, not on this machine (%s); timing its slots here",
                    cluster.name,
                    nodes[0].hostname,
                    host,
                )
        what = f"no node for this machine ({host}); name it with --node-name"
    if not chosen:
        raise InputError(f"cluster {cluster.name!r} has {what}")
    slots = [d for d in chosen[0].devices if d.kind == DeviceKind.CPU]
    if not slots:
        raise InputError(f"node {chosen[0].name!r} has no CPU slots to profile on")
    usable = set(available_cores())
    for slot in slots:
        missing = sorted(set(slot.cpu_cores) - usable)
        if missing:
            raise InputError(
                f"cluster {cluster.name!r}: slot {slot.name} is pinned to core(s) "
                f"{', '.join(map(str, missing))}, which this machine does not have (or this "
                f"process may not use): was the cluster profiled on another machine?"
            )
    return slots


def profile_model_in_situ(
    model: str,
    config: dict[str, Any],
    batch_sizes: Sequence[int],
    cluster: ClusterSpec,
    *,
    worker_batch: int | None = None,
    node_name: str | None = None,
    say: Callable[[str], None] = lambda line: None,
    **profile_options: Any,
) -> ModelSpec:
    """Steps 1 and 2 of the module doc on this machine's CPU slots in ``cluster``
    (:func:`local_cpu_slots`); ``worker_batch``: the samples of one worker's step (the companions
    train on it and the sync is measured at it; default the middle of ``batch_sizes``). A failed sync measurement is said, not fatal: the
    plan then prices sync from the link profile."""
    from felactl.models import build
    from felactl.profiling.data_parallel import Slot, measure_data_parallel_sync
    from felactl.profiling.model import middle_batch

    slots = local_cpu_slots(cluster, node_name)
    if len(slots) > 1 and build(model, config, seed=0).data is None:
        raise InputError(
            f"model {model!r} brings no data (its function returns the layers, not (layers, data)), "
            "and --cluster times it training on the other slots: profile it without --cluster"
        )
    worker_batch = worker_batch or middle_batch(batch_sizes)
    # The timings are these slots' own, as they train: nothing to scale them by (no timed_tflops).
    profile_options = {k: v for k, v in profile_options.items() if k != "matmul_size"}
    spec = _profile_beside_companions(model, config, batch_sizes, slots, worker_batch, profile_options)
    if len(slots) < 2:
        return spec
    say(f"timing a data-parallel step on {len(slots)} slots, with and without gradient sync")
    try:
        timing = measure_data_parallel_sync(
            model, config, worker_batch, [Slot(d.name, tuple(d.cpu_cores)) for d in slots], cluster=cluster.name
        )
    except ProfilingError as exc:
        say(f"(sync not measured: {exc}; the plan prices sync from the link profile)")
        return spec
    spec = replace(spec, data_parallel_sync=(timing,))
    if not timing.measured or timing.noisy:
        log.warning("warning: %s: %s; the plan prices sync from the link profile at least", model, spec.untrusted()[-1])
    return spec


def _profile_beside_companions(
    model: str,
    config: dict[str, Any],
    batch_sizes: Sequence[int],
    slots: Sequence[Device],
    batch: int,
    profile_options: dict[str, Any],
) -> ModelSpec:
    import torch

    from felactl.profiling.data_parallel import reap
    from felactl.profiling.model import profile_model

    cores = [list(d.cpu_cores) for d in slots]
    threads_before = torch.get_num_threads()
    affinity_before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    started = [ctx.Event() for _ in cores[1:]]
    companions = [
        ctx.Process(target=keep_busy, args=(model, config, batch, slot_cores, stop, ready), daemon=True)
        for slot_cores, ready in zip(cores[1:], started)
    ]
    try:
        for proc in companions:
            proc.start()
        deadline = time.monotonic() + COMPANION_START_TIMEOUT_S
        for proc, ready in zip(companions, started):
            while not ready.wait(timeout=0.2):  # set once its first training step is done
                if proc.exitcode is not None or time.monotonic() > deadline:
                    raise ProfilingError(
                        f"the companion training on another slot did not start (exit code "
                        f"{proc.exitcode}); its log is on stderr"
                    )
        pin_to_cores(cores[0])
        return profile_model(model, config, batch_sizes, **profile_options)
    finally:
        stop.set()
        reap(companions, grace_s=10.0)  # each ends after its current step
        torch.set_num_threads(threads_before)
        if affinity_before is not None:
            os.sched_setaffinity(0, affinity_before)


def keep_busy(model: str, config: dict[str, Any], batch: int, cores: list[int] | None, stop, started) -> None:
    """A stand-in for one other worker while the model is profiled: pinned to its slot's cores
    (``None``: where it runs), forward, loss, backward and AdamW steps of the whole model until
    ``stop`` is set (``started``: set after each step)."""
    import torch

    from felactl.models import build

    if cores is not None:
        pin_to_cores(cores)
    bundle = build(model, config, seed=0)
    net = bundle.model  # the user's module whole, as a data-parallel worker runs it (not its traced pieces)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-6)
    inputs, targets = bundle.data.batch(range(batch))
    while True:
        optimizer.zero_grad(set_to_none=True)
        bundle.loss(net(inputs), targets).backward()
        optimizer.step()
        started.set()
        if stop.is_set():
            return


def main() -> None:
    """``python -m felactl.profiling.in_situ MODEL BATCH CONFIG_JSON``: :func:`keep_busy` where it is
    started (a testbed node whose model profile is done, while the others' go on), until SIGTERM."""
    import json
    import signal
    import sys
    import threading

    model, batch, config = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    keep_busy(model, config, batch, None, stop, threading.Event())


__all__ = ["keep_busy", "local_cpu_slots", "profile_model_in_situ"]


if __name__ == "__main__":
    main()
