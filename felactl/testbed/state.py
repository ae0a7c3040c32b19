"""A testbed's name and its state file: what ``up`` made and where each node lives.

The state file (``/run/felactl/testbeds/<name>.json``, written atomically under a lock) records
each thing before ``up`` makes it, so :func:`felactl.testbed.build.down` can remove a testbed whose
``up`` was killed half-way; once complete it says where each node lives (:class:`NodeInfo`), what
``exec``, ``status`` and the launcher read, and the faults injected since (cut nodes, a partition).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from felactl.errors import InputError
from felactl.fsutil import atomic_write_text

PREFIX = "felactl"
NAME = re.compile(r"^[a-z][a-z0-9]{0,7}$")
"""A testbed's name: short, because interface names have at most 15 characters."""
DEFAULT_NAME = "tb"
STATE_VERSION = 1


def state_dir() -> Path:
    return Path(os.environ.get("FELACTL_TESTBED_DIR", "/run/felactl/testbeds"))


def check_name(name: str) -> str:
    if not NAME.match(name):
        raise InputError(
            f"--name {name!r}: must be a lower-case letter then up to 7 letters or digits "
            "(it is part of interface names, which have at most 15 characters)"
        )
    return name


@contextlib.contextmanager
def state_lock():
    state_dir().mkdir(parents=True, exist_ok=True)
    fd = os.open(state_dir() / ".lock", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@dataclass(frozen=True)
class NodeInfo:
    """Where one node of a testbed that is up lives: what ``exec`` and the launcher need."""

    name: str
    index: int
    netns: str
    address: str
    ifname: str
    cgroups: tuple[str, ...]
    """The node's cgroup directories (one on cgroup v2, cpu and cpuset on v1)."""
    cpus: float | None
    cores: tuple[int, ...]


@dataclass(frozen=True)
class TestbedState:
    __test__ = False  # not a pytest class, whatever its name

    name: str
    spec_path: str
    spec: dict
    complete: bool
    netem: bool
    cgroup_version: int
    host_address: str
    """The bridge's address: the host as the nodes reach it (a coordinator listens here)."""
    nodes: dict[str, NodeInfo]
    made: tuple[dict, ...]
    slurm_conf: str | None = None
    """With ``--slurm``: its Slurm's ``slurm.conf`` (``SLURM_CONF`` for the client commands)."""

    def node(self, node: str) -> NodeInfo:
        if node not in self.nodes:
            raise InputError(f"testbed {self.name!r} has no node {node!r} (it has: {', '.join(self.nodes)})")
        return self.nodes[node]


def state_path(name: str) -> Path:
    return state_dir() / f"{name}.json"


def write_state(doc: dict) -> None:
    atomic_write_text(state_path(doc["name"]), json.dumps(doc, indent=1) + "\n", mode=0o600)


def read_state_doc(name: str) -> dict | None:
    try:
        doc = json.loads(state_path(name).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return None  # damaged: down still finds everything by its prefix
    return doc if isinstance(doc, dict) else None


def read_state(name: str = DEFAULT_NAME) -> TestbedState:
    """The testbed ``name`` that is up, or :class:`InputError` when there is none."""
    check_name(name)
    doc = read_state_doc(name)
    if doc is None:
        raise InputError(f"no testbed {name!r} is up (felactl testbed up SPEC --name {name})")
    if not doc.get("complete"):
        raise InputError(f"testbed {name!r} was left half-made; remove it with: felactl testbed down --name {name}")
    nodes = {
        n["name"]: NodeInfo(
            name=n["name"],
            index=n["index"],
            netns=n["netns"],
            address=n["address"],
            ifname=n["ifname"],
            cgroups=tuple(n["cgroups"]),
            cpus=n["cpus"],
            cores=tuple(n["cores"]),
        )
        for n in doc["nodes"]
    }
    return TestbedState(
        name=doc["name"],
        spec_path=doc["spec_path"],
        spec=doc["spec"],
        complete=True,
        netem=doc["netem"],
        cgroup_version=doc["cgroup_version"],
        host_address=doc["host_address"],
        nodes=nodes,
        made=tuple(doc["made"]),
        slurm_conf=str(Path(doc["slurm"]["dir"]) / "slurm.conf") if doc.get("slurm") else None,
    )
