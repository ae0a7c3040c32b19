"""Faults injected into a testbed that is up: a node cut off, the nodes partitioned in two, a node
crashed. What is cut or partitioned is kept in the state file, so ``status`` shows it and a heal
after a crash half-way still restores every link.
"""

from __future__ import annotations

from pathlib import Path

from felactl.errors import InputError
from felactl.spec.io import from_dict
from felactl.testbed.host import run
from felactl.testbed.network import veth_name
from felactl.testbed.processes import kill, processes_in
from felactl.testbed.shaping import set_link
from felactl.testbed.spec import TestbedSpec
from felactl.testbed.state import DEFAULT_NAME, read_state, read_state_doc, state_lock, write_state


def cut_node(name: str, node: str, *, cut: bool = True) -> None:
    """Cut ``node`` off the testbed (``cut=False``: connect it again), as a lost machine or a pulled
    cable: the host's end of its veth goes down, so every packet to and from it is dropped (its
    peers and the control plane alike) and open connections hang rather than close."""
    state = read_state(name)
    info = state.node(node)
    run(["ip", "link", "set", veth_name(name, info.index), "down" if cut else "up"])
    with state_lock():
        doc = read_state_doc(name)
        if doc is not None:
            others = [n for n in doc.get("cut", []) if n != node]
            doc["cut"] = sorted([*others, node]) if cut else others
            write_state(doc)


def partition_nodes(name: str, side: list[str], *, apart: bool = True) -> list[str]:
    """Partition testbed ``name`` in two: every link between ``side`` and the other nodes drops
    every packet, both ways (as a failed switch between two racks), while every node still reaches
    the host's bridge (the control plane). ``apart=False`` heals it, each link back to the loss it
    had; ``side`` is then ignored. Returns the side cut apart (or healed)."""
    state = read_state(name)
    with state_lock():
        saved = (read_state_doc(name) or {}).get("partition")
    if not apart:
        if not saved:
            raise InputError(f"testbed {name!r} is not partitioned")
        for pair, loss in saved["loss"].items():
            src, dst = pair.split(">")
            set_link(name, src, dst, loss=loss)
        _save_partition(name, None)
        return list(saved["side"])
    if saved:
        raise InputError(
            f"testbed {name!r} is already partitioned ({', '.join(saved['side'])} apart from the rest); "
            f"heal it first: felactl testbed partition --heal --name {name}"
        )
    for node in side:
        state.node(node)
    others = [n for n in state.nodes if n not in side]
    if not side or not others:
        raise InputError(f"a partition needs nodes on both sides: give some of {', '.join(state.nodes)}, not all")
    spec = from_dict(TestbedSpec, state.spec, state.spec_path)
    pairs = [(a, b) for a in side for b in others] + [(b, a) for a in side for b in others]
    # recorded before the first link is cut, so that a heal after a crash half-way restores them all
    _save_partition(name, {"side": list(side), "loss": {f"{a}>{b}": spec.link(a, b).loss for a, b in pairs}})
    for a, b in pairs:
        set_link(name, a, b, loss=1.0)
    return list(side)


def _save_partition(name: str, partition: dict | None) -> None:
    with state_lock():
        doc = read_state_doc(name)
        if doc is not None:
            doc.pop("partition", None)
            if partition is not None:
                doc["partition"] = partition
            write_state(doc)


def partitioned(name: str = DEFAULT_NAME) -> list[str]:
    """The side of testbed ``name`` that :func:`partition_nodes` cut apart, or [] when none is."""
    doc = read_state_doc(name)
    return list((doc or {}).get("partition", {}).get("side", []))


def crash_node(name: str, node: str) -> list[int]:
    """SIGKILL every process in ``node`` (its namespace and its cgroups), as a machine that loses
    power: its agent and workers end without a word, their connections close. Returns the pids."""
    info = read_state(name).node(node)
    pids = processes_in([info.netns], [Path(c) for c in info.cgroups])
    kill(pids)
    return sorted(pids)


def cut_nodes(name: str = DEFAULT_NAME) -> list[str]:
    """The nodes of testbed ``name`` that are cut off (:func:`cut_node`)."""
    doc = read_state_doc(name)
    return list(doc.get("cut", [])) if doc else []
