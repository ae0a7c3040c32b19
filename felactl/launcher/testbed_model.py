"""``felactl profile --model M --testbed NAME``: the model timed inside every node of a testbed.

A node held to a tenth of a core is not a tenth of the host: mlp's step took 1.4x longer there
than its host timings scaled by the two matmul rates (BENCHMARKS.md, issue 15 item 4), so the
DP plans of the testbeds with such a node measured 0.70 of their prediction. Here each node runs
``felactl profile --model`` in its own namespace and cgroup, all nodes at once (as a job runs
them), and the profiles become one (:func:`felactl.profiling.merge.merge_device_profiles`),
each node's timings keyed by its device model: the CPU and the node's quota
(``Intel Xeon @ 0.1 cores``), as its cluster profile names its devices.

A node whose profile is done trains the model on (a companion,
:func:`felactl.profiling.in_situ.keep_busy`) until every node's is: the fast nodes finish first,
and the tenth-of-a-core node of three-speeds, profiled the rest of its minute alone on the core
it shares with another node, read faster than it runs in the job, where both nodes compute at
once. With companions three-speeds' DP plan measured 0.75 of its prediction, without 0.68 (one
run each; the rest was the sum's CPU, ``CostModel.quota_sync_cpu_s``; BENCHMARKS.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from felactl.errors import ProfilingError
from felactl.machine import stop_processes
from felactl.profiling.merge import merge_device_profiles
from felactl.profiling.model import middle_batch
from felactl.spec import ModelSpec, load_model
from felactl.testbed import node_command, node_env, read_state

DEFAULT_TIMEOUT_S = 600.0
"""``felactl profile``'s ``--timeout``: a node at a tenth of a core took 66 s to import torch and
profile mlp (the timings' blocks last at least 0.1 s of wall time each there)."""


def profile_model_on_testbed(
    testbed: str,
    model: str,
    config: dict[str, Any],
    batch_sizes: Sequence[int],
    *,
    repeats: int,
    matmul_size: int | None = None,
    input_shape: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    say: Callable[[str], None] = lambda line: None,
) -> ModelSpec:
    """``felactl profile --model MODEL`` with these options in every node of ``testbed`` at once;
    one profile of them all. A model that brings its data (not ``input_shape``) trains on the
    middle batch size in each node done until all are (module doc)."""
    flags = [f for key, value in config.items() for f in ("--config", f"{key}={json.dumps(value)}")]
    flags += ["--batch-sizes", ",".join(map(str, batch_sizes)), "--repetitions", str(repeats)]
    flags += ["--input-shape", input_shape] if input_shape else []
    flags += ["--matmul-size", str(matmul_size)] if matmul_size else []
    companion_batch = None if input_shape else middle_batch(batch_sizes)
    state = read_state(testbed)
    with tempfile.TemporaryDirectory(prefix="felactl-testbed-model.") as tmp:
        work = Path(tmp)
        procs: dict[str, subprocess.Popen] = {}
        companions: list[subprocess.Popen] = []

        def start(name: str, argv: list[str], log_name: str) -> subprocess.Popen:
            node = state.nodes[name]
            with (work / log_name).open("w") as log:
                return subprocess.Popen(
                    node_command(node, argv),
                    env=node_env(state, node),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=log,
                )

        def keep_busy(name: str) -> None:
            if companion_batch is not None:
                argv = [sys.executable, "-m", "felactl.profiling.in_situ", model, str(companion_batch)]
                companions.append(start(name, [*argv, json.dumps(config)], f"{name}.companion.log"))

        try:
            for name in state.nodes:
                argv = [sys.executable, "-m", "felactl", "profile", "--model", model, *flags]
                procs[name] = start(name, [*argv, "--device", "cpu", "-o", str(work / f"{name}.yaml")], f"{name}.log")
            _wait(procs, work, timeout_s, say, done=keep_busy)
        finally:
            stop_processes([*procs.values(), *companions])
        return merge_device_profiles({name: load_model(work / f"{name}.yaml") for name in procs})


def _wait(
    procs: dict[str, subprocess.Popen],
    work: Path,
    timeout_s: float,
    say: Callable[[str], None],
    done: Callable[[str], None] = lambda node: None,
) -> None:
    """Until every node's profile has ended; ``done(node)`` for each that succeeded while others run."""
    deadline = time.monotonic() + timeout_s
    running = dict(procs)
    while running:
        for name, proc in list(running.items()):
            code = proc.poll()
            if code is None:
                continue
            del running[name]
            if code != 0:
                raise ProfilingError(f"profiling the model in node {name} failed (exit {code}): {_said(work, name)}")
            say(f"node {name}: profiled ({len(procs) - len(running)} of {len(procs)})")
            if running:
                done(name)
        if running and time.monotonic() > deadline:
            late = sorted(running)
            raise ProfilingError(
                f"profiling the model took over {timeout_s:g} s in node(s) {', '.join(late)} (--timeout); "
                f"{late[0]} last said: {_said(work, late[0])}"
            )
        time.sleep(0.2)


def _said(work: Path, node: str, lines: int = 3) -> str:
    """The last lines a node's profile wrote to stderr, joined (its log goes with the temp dir)."""
    said = (work / f"{node}.log").read_text(errors="replace").strip().splitlines()
    return " | ".join(line.strip() for line in said[-lines:] if line.strip()) or "nothing"


__all__ = ["DEFAULT_TIMEOUT_S", "profile_model_on_testbed"]
