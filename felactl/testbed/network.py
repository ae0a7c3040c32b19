"""A testbed's network: its namespaces, veth pairs, bridge and addresses.

Every node is a network namespace ``felactl-<name>-<node>`` holding one end (``fl0``) of a veth
pair; the other end (``flv-<name>-<i>``) is a port of the bridge ``flbr-<name>``. Each testbed
takes one /24 of 198.18.0.0/15 (reserved for benchmarking networks): node ``i`` is ``.<i+1>``, the
bridge itself ``.254`` (where nodes reach the host: a coordinator listens there). A node has no
route beyond its /24, so its traffic never leaves the namespaces, the bridge and the host.
How the links between nodes are shaped is :mod:`felactl.testbed.shaping`.
"""

from __future__ import annotations

from felactl.errors import InputError
from felactl.testbed.host import run
from felactl.testbed.state import NAME, PREFIX, read_state_doc, state_dir

IFNAME = "fl0"
"""The node's interface inside its namespace (what GLOO_SOCKET_IFNAME names)."""
PREFIX_LEN = 24
MAX_TESTBEDS = 512
"""Testbeds up at once: each takes one /24 of 198.18.0.0/15."""
HOST_OCTET = 254
"""The bridge's own address in each testbed's /24: where a node reaches the host (the control plane)."""
MTU = 1500


def netns_name(name: str, node: str) -> str:
    return f"{PREFIX}-{name}-{node}"


def bridge_name(name: str) -> str:
    return f"flbr-{name}"


def veth_name(name: str, index: int) -> str:
    return f"flv-{name}-{index}"


def subnet(k: int) -> str:
    """The k-th /24 of 198.18.0.0/15, without its last octet."""
    return f"198.{18 + k // 256}.{k % 256}"


def node_address(k: int, index: int) -> str:
    return f"{subnet(k)}.{index + 1}"


def free_subnet(name: str) -> int:
    """The first /24 that no other testbed's state file holds and no interface here has."""
    taken: set[str] = set()
    if state_dir().is_dir():
        for path in state_dir().glob("*.json"):
            doc = read_state_doc(path.stem) if NAME.match(path.stem) and path.stem != name else None
            if doc and isinstance(doc.get("subnet"), str):
                taken.add(doc["subnet"])
    addrs = run(["ip", "-o", "-4", "addr", "show"], check=False).stdout
    for k in range(MAX_TESTBEDS):
        if subnet(k) not in taken and f" {subnet(k)}." not in addrs:
            return k
    raise InputError(f"all {MAX_TESTBEDS} subnets of 198.18.0.0/15 are taken: felactl testbed down --all")


def add_bridge(bridge: str, host_address: str) -> None:
    """The bridge every node's veth is a port of, with the host's address on it."""
    run(["ip", "link", "add", bridge, "type", "bridge"])
    run(["ip", "link", "set", bridge, "addrgenmode", "none"])
    run(["ip", "addr", "add", f"{host_address}/{PREFIX_LEN}", "dev", bridge])
    run(["ip", "link", "set", bridge, "up"])


def add_netns(ns: str) -> None:
    run(["ip", "netns", "add", ns])
    run(["ip", "-n", ns, "link", "set", "lo", "up"])


def add_node_link(veth: str, bridge: str, ns: str, address: str) -> None:
    """The veth pair that joins namespace ``ns`` (its end ``fl0`` at ``address``) to the bridge."""
    peer = ["peer", "name", IFNAME, "mtu", str(MTU), "netns", ns]
    run(["ip", "link", "add", veth, "mtu", str(MTU), "type", "veth", *peer])
    run(["ip", "link", "set", veth, "addrgenmode", "none"])
    run(["ip", "link", "set", veth, "master", bridge, "up"])
    run(["ip", "-n", ns, "link", "set", IFNAME, "addrgenmode", "none"])
    run(["ip", "-n", ns, "addr", "add", f"{address}/{PREFIX_LEN}", "dev", IFNAME])
    run(["ip", "-n", ns, "link", "set", IFNAME, "up"])


def netns_list() -> list[str]:
    proc = run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def link_list() -> list[str]:
    proc = run(["ip", "-o", "link", "show"], check=False)
    names = []
    for line in proc.stdout.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            names.append(parts[1].strip().split("@")[0])
    return names
