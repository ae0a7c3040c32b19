"""Made-up testbeds for the tests and benchmarks that run jobs in one (no root needed to make the spec)."""

from __future__ import annotations

import contextlib
import fcntl
from pathlib import Path

from felactl.spec.io import from_dict
from felactl.testbed import TestbedSpec


def pair(host, cpus: tuple[float, float], gbps: tuple[float, float], *, one_core: bool = False) -> TestbedSpec:
    """Two nodes na and nb with ``cpus`` of a core each, on one core of ``host`` (``one_core``) or
    on its first and last, and links of ``gbps`` na -> nb and back."""
    return from_dict(
        TestbedSpec,
        {
            "kind": "Testbed",
            "schema_version": 1,
            "name": "pair",
            "nodes": [
                {"name": "na", "cpus": cpus[0], "cores": [host.cores[0]]},
                {"name": "nb", "cpus": cpus[1], "cores": [host.cores[0 if one_core else -1]]},
            ],
            "links": [
                {"src": "na", "dst": "nb", "bandwidth_gbps": gbps[0]},
                {"src": "nb", "dst": "na", "bandwidth_gbps": gbps[1]},
            ],
        },
        "pair.yaml",
    )


JOBS_LOCK = Path("/tmp/felactl-testbed.lock")
"""Held while a test module runs jobs in testbeds (the lock ``bench_testbed_plans.py`` measures under)."""


@contextlib.contextmanager
def jobs_alone():
    """Run one module's testbed jobs at a time: two such modules side by side (the suite's two
    workers) starve each other's half-core nodes, and a worker started there took over 150 s to
    be ready (the job tests beside the Slurm tests)."""
    with open(JOBS_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
