"""Make and remove a testbed: ``up`` builds its network (:mod:`~felactl.testbed.network`), shapes
its links (:mod:`~felactl.testbed.shaping`) and gives each node its CPU share
(:mod:`~felactl.testbed.cgroups`); ``down`` kills what runs in its nodes and removes it all.

Crash safety: before each step that makes something, the state file
(``/run/felactl/testbeds/<name>.json``, written atomically; :mod:`~felactl.testbed.state`) records
it; :func:`down` removes what the state file lists and anything else named with this testbed's
prefix, so a testbed whose ``up`` was killed half-way is removed as completely as a finished one.
``down`` is idempotent.
"""

from __future__ import annotations

import os
import re
import time
from functools import partial
from pathlib import Path
from typing import Any

from felactl.errors import InputError, SpecError
from felactl.spec.codec import encode
from felactl.testbed import slurm as slurm_daemons
from felactl.testbed.cgroups import cgroup_dirs, cgroup_name, make_cgroup_parent, make_node_cgroup, remove_cgroup
from felactl.testbed.host import Host, TestbedError, probe_host, require_root, run
from felactl.testbed.network import (
    HOST_OCTET,
    IFNAME,
    add_bridge,
    add_netns,
    add_node_link,
    bridge_name,
    free_subnet,
    link_list,
    netns_list,
    netns_name,
    node_address,
    subnet,
    veth_name,
)
from felactl.testbed.processes import kill, processes_in
from felactl.testbed.shaping import shape_node
from felactl.testbed.spec import TestbedSpec
from felactl.testbed.state import (
    DEFAULT_NAME,
    NAME,
    PREFIX,
    STATE_VERSION,
    TestbedState,
    check_name,
    read_state,
    read_state_doc,
    state_dir,
    state_lock,
    state_path,
    write_state,
)


def list_testbeds() -> list[str]:
    """Names of the testbeds that have a state file or leave anything behind."""
    names = {p.stem for p in state_dir().glob("*.json") if NAME.match(p.stem)} if state_dir().is_dir() else set()
    for ns in netns_list():
        m = re.match(rf"^{PREFIX}-([a-z][a-z0-9]{{0,7}})-", ns)
        if m:
            names.add(m.group(1))
    for link in link_list():
        m = re.match(r"^fl(?:v|br)-([a-z][a-z0-9]{0,7})(?:-\d+)?$", link)
        if m:
            names.add(m.group(1))
    try:
        from felactl.testbed.host import find_cgroups

        for root in find_cgroups().roots():
            for d in root.glob(f"{PREFIX}-*"):
                m = re.match(rf"^{PREFIX}-([a-z][a-z0-9]{{0,7}})$", d.name)
                if m and d.is_dir():
                    names.add(m.group(1))
    except InputError:
        pass
    return sorted(names)


# --- up ----------------------------------------------------------------------------------


def _check_fits_host(spec: TestbedSpec, where: str, host: Host, allow_no_latency: bool) -> None:
    for i, node in enumerate(spec.nodes):
        for j, core in enumerate(node.cores or ()):
            if core not in host.cores:
                raise SpecError(
                    where,
                    f"nodes[{i}].cores[{j}]",
                    f"core {core} is not one this machine lets felactl use ({', '.join(map(str, host.cores))})",
                )
        usable = len(node.cores) if node.cores else len(host.cores)
        if node.cpus is not None and node.cpus > usable:
            raise SpecError(
                where,
                f"nodes[{i}].cpus",
                f"{node.cpus:g} cores' worth of CPU time is more than the {usable} core(s) this machine gives it",
            )
    if not host.netem and not allow_no_latency:
        for link in spec.all_links():
            if link.latency_us > 0:
                raise SpecError(
                    where,
                    "links",
                    f"{link.src} -> {link.dst} has latency_us {link.latency_us:g}, but "
                    "this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM) to add "
                    "latency; give --no-latency to build it without latency",
                )


def up(
    spec: TestbedSpec,
    spec_path: str,
    *,
    name: str = DEFAULT_NAME,
    allow_no_latency: bool = False,
    host: Host | None = None,
    slurm: bool = False,
) -> TestbedState:
    """Build testbed ``name`` from ``spec`` (``slurm``: with a Slurm cluster of its nodes,
    :mod:`~felactl.testbed.slurm`). On a failure, what was made is removed again."""
    check_name(name)
    host = host or probe_host()
    _check_fits_host(spec, spec_path, host, allow_no_latency)
    if slurm:
        slurm_daemons.require_slurm()
    with state_lock():  # two ups at once: one name, one subnet each
        if read_state_doc(name) is not None or name in list_testbeds():
            raise InputError(
                f"testbed {name!r} is up already (or was left half-made): "
                f"felactl testbed down --name {name} first, or give another --name"
            )
        doc = _new_state_doc(spec, spec_path, name, host, free_subnet(name))
        write_state(doc)
    try:
        _make(doc, spec, host)
        if slurm:
            slurm_daemons.start(doc, partial(_record, doc))
        doc["complete"] = True
        write_state(doc)
    except BaseException:
        try:
            down(name)
        except Exception:  # the first error is the news; the state file still lets down finish later
            pass
        raise
    return read_state(name)


def _new_state_doc(spec: TestbedSpec, spec_path: str, name: str, host: Host, k: int) -> dict[str, Any]:
    """The state file of testbed ``name`` before anything is made, in the ``k``-th /24."""
    layout = host.cgroup
    nodes = []
    for i, node in enumerate(spec.nodes):
        nodes.append(
            {
                "name": node.name,
                "index": i,
                "netns": netns_name(name, node.name),
                "address": node_address(k, i),
                "ifname": IFNAME,
                "cgroups": [str(p) for p in cgroup_dirs(layout, name, node.name)],
                "cpus": node.cpus,
                "cores": list(node.cores or host.cores),
            }
        )
    return {
        "version": STATE_VERSION,
        "name": name,
        "spec_path": str(spec_path),
        "spec": encode(spec),
        "complete": False,
        "pid": os.getpid(),
        "subnet": subnet(k),
        "host_address": f"{subnet(k)}.{HOST_OCTET}",
        "netem": host.netem,
        "latency_emulated": host.netem,
        "cgroup_version": layout.version,
        "cgroup_roots": [str(r) for r in layout.roots()],
        "nodes": nodes,
        "made": [],
    }


def _make(doc: dict[str, Any], spec: TestbedSpec, host: Host) -> None:
    """Make what ``doc`` describes, each thing recorded in the state file before it is made."""
    name, nodes, layout = doc["name"], doc["nodes"], host.cgroup

    step = partial(_record, doc)
    step("cgroup", cgroup_name(name))
    make_cgroup_parent(layout, name)
    bridge = bridge_name(name)
    step("link", bridge)
    add_bridge(bridge, doc["host_address"])
    for info in nodes:
        ns, veth = info["netns"], veth_name(name, info["index"])
        step("netns", ns)
        add_netns(ns)
        step("link", veth)
        add_node_link(veth, bridge, ns, info["address"])
    by_name = {info["name"]: info for info in nodes}
    for info in nodes:
        shape_node(spec, info, by_name, host.netem)
    for info in nodes:
        step("cgroup", f"{cgroup_name(name)}/{info['name']}")
        make_node_cgroup(layout, name, info["name"], info["cpus"], tuple(info["cores"]))


def _record(doc: dict[str, Any], kind: str, what: str) -> None:
    """Record in the state file what is about to be made."""
    doc["made"].append({"kind": kind, "name": what})
    write_state(doc)


# --- down --------------------------------------------------------------------------------


def down(name: str = DEFAULT_NAME) -> dict[str, list[str]]:
    """Remove testbed ``name``: kill the processes in its namespaces and cgroups, delete its veth
    pairs, bridge, namespaces and cgroups, and its state file. Nothing there: nothing to do.
    Returns what was removed, by kind."""
    check_name(name)
    if leftovers(name):
        require_root()
    doc = read_state_doc(name) or {}
    ns_prefix = f"{PREFIX}-{name}-"
    namespaces = sorted(
        {m["name"] for m in doc.get("made", []) if m.get("kind") == "netns"}
        | {ns for ns in netns_list() if ns.startswith(ns_prefix)}
    )
    existing = set(netns_list())
    namespaces = [ns for ns in namespaces if ns in existing]
    links = [link for link in link_list() if link == bridge_name(name) or link.startswith(f"flv-{name}-")]
    from felactl.testbed.host import find_cgroups

    try:
        roots = find_cgroups().roots()
    except InputError:
        roots = [Path(r) for r in doc.get("cgroup_roots", [])]
    cgroups = [root / cgroup_name(name) for root in roots if (root / cgroup_name(name)).is_dir()]
    removed: dict[str, list[str]] = {"processes": [], "links": [], "netns": [], "cgroups": [], "slurm": []}
    removed["slurm"] = slurm_daemons.stop(doc or {"name": name})
    # processes first: a process inside a namespace keeps it (and its veth) alive
    removed["processes"] = _kill_all(name, namespaces, cgroups)
    for link in sorted(links, key=lambda link: link.startswith("flbr-")):  # ports before the bridge
        proc = run(["ip", "link", "del", link], check=False)
        if proc.returncode == 0:
            removed["links"].append(link)
    for ns in namespaces:
        run(["ip", "netns", "del", ns])
        removed["netns"].append(ns)
    for cg in cgroups:
        remove_cgroup(name, cg)
        removed["cgroups"].append(str(cg))
    try:
        state_path(name).unlink()
    except FileNotFoundError:
        pass
    left = leftovers(name)
    if left:
        raise TestbedError(f"testbed {name!r}: still there after down: {', '.join(left)}")
    return removed


def _kill_all(name: str, namespaces: list[str], cgroups: list[Path]) -> list[str]:
    """SIGKILL the processes in these namespaces and cgroups until none is left; the pids killed."""
    killed: list[str] = []
    deadline = time.monotonic() + 10.0
    while True:
        pids = processes_in(namespaces, cgroups)
        if not pids:
            return killed
        killed += [str(p) for p in sorted(pids) if str(p) not in killed]
        if time.monotonic() > deadline:
            raise TestbedError(
                f"testbed {name!r}: processes {sorted(pids)} do not die; remove them and run "
                f"felactl testbed down --name {name} again"
            )
        kill(pids)
        time.sleep(0.05)


def leftovers(name: str) -> list[str]:
    """Everything of testbed ``name`` that exists now (empty after a complete ``down``)."""
    out = [f"netns {ns}" for ns in netns_list() if ns.startswith(f"{PREFIX}-{name}-")]
    out += [f"link {link}" for link in link_list() if link == bridge_name(name) or link.startswith(f"flv-{name}-")]
    try:
        from felactl.testbed.host import find_cgroups

        out += [
            f"cgroup {root / cgroup_name(name)}"
            for root in find_cgroups().roots()
            if (root / cgroup_name(name)).exists()
        ]
    except InputError:
        pass
    if slurm_daemons.slurm_dir(name).exists():
        out.append(f"Slurm directory {slurm_daemons.slurm_dir(name)}")
    if state_path(name).exists():
        out.append(f"state file {state_path(name)}")
    return out
