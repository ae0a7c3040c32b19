"""``felactl profile --model M --testbed NAME``: the model timed inside every node of a testbed.

A node held to a tenth of a core is not a tenth of the host: mlp's step took 1.4x longer there
than its host timings scaled by the two matmul rates (BENCHMARKS.md, issue 15 item 4), so the
DP plans of the testbeds with such a node measured 0.70 of their prediction. Here each node runs
``felactl profile --model`` in its own namespace and cgroup, all nodes at once (as a job runs
them), and the profiles become one (:func:`felactl.profiling.merge.merge_device_profiles`),
each node's timings keyed by its device model: the CPU and the node's quota
(``Intel Xeon @ 0.1 cores``), as its cluster profile names its devices.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from felactl.errors import ProfilingError
from felactl.machine import stop_processes
from felactl.profiling.merge import merge_device_profiles
from felactl.spec import ModelSpec, load_model
from felactl.testbed import node_command, node_env, read_state

DEFAULT_TIMEOUT_S = 600.0
"""``felactl profile``'s ``--timeout``: a node at a tenth of a core took 66 s to import torch and
profile mlp (the timings' blocks last at least 0.1 s of wall time each there)."""


def profile_model_on_testbed(
    testbed: str,
    model: str,
    profile_args: Sequence[str],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    say: Callable[[str], None] = lambda line: None,
) -> ModelSpec:
    """``felactl profile --model MODEL PROFILE_ARGS`` in every node of ``testbed`` at once; one
    profile of them all. ``profile_args``: the model profile's own flags (config, batch sizes,
    matmul size, repetitions), passed on as given."""
    state = read_state(testbed)
    with tempfile.TemporaryDirectory(prefix="felactl-testbed-model.") as tmp:
        work = Path(tmp)
        procs: dict[str, subprocess.Popen] = {}
        try:
            for name, node in state.nodes.items():
                argv = [sys.executable, "-m", "felactl", "profile", "--model", model, *profile_args]
                argv += ["--device", "cpu", "-o", str(work / f"{name}.yaml")]
                with (work / f"{name}.log").open("w") as log:
                    procs[name] = subprocess.Popen(
                        node_command(node, argv),
                        env=node_env(state, node),
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.DEVNULL,
                        stderr=log,
                    )
            _wait(procs, work, timeout_s, say)
        finally:
            stop_processes(list(procs.values()))
        return merge_device_profiles({name: load_model(work / f"{name}.yaml") for name in procs})


def _wait(procs: dict[str, subprocess.Popen], work: Path, timeout_s: float, say: Callable[[str], None]) -> None:
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
