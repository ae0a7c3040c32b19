"""An emulated uneven cluster on one Linux machine: nodes as network namespaces joined by shaped
veth links, each with its own CPU share (``felactl testbed up SPEC`` / ``down`` / ``exec``)."""

from felactl.testbed.build import (
    DEFAULT_NAME,
    NodeInfo,
    TestbedState,
    down,
    exec_in_node,
    leftovers,
    list_testbeds,
    node_command,
    node_env,
    read_state,
    start_node_agents,
    up,
)
from felactl.testbed.host import Host, TestbedError, TestbedUnavailable, probe_host
from felactl.testbed.spec import TestbedLink, TestbedLinkDefault, TestbedNode, TestbedSpec, load_testbed

__all__ = [
    "DEFAULT_NAME",
    "Host",
    "NodeInfo",
    "TestbedError",
    "TestbedLink",
    "TestbedLinkDefault",
    "TestbedNode",
    "TestbedSpec",
    "TestbedState",
    "TestbedUnavailable",
    "down",
    "exec_in_node",
    "leftovers",
    "list_testbeds",
    "load_testbed",
    "node_command",
    "node_env",
    "probe_host",
    "read_state",
    "start_node_agents",
    "up",
]
