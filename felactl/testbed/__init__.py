"""An emulated uneven cluster on one Linux machine: nodes as network namespaces joined by shaped
veth links, each with its own CPU share (``felactl testbed up SPEC`` / ``down`` / ``exec``)."""

from felactl.testbed.build import down, leftovers, list_testbeds, up
from felactl.testbed.host import Host, TestbedError, TestbedUnavailable, probe_host
from felactl.testbed.processes import exec_in_node, node_command, node_env, start_node_agents
from felactl.testbed.spec import TestbedLink, TestbedLinkDefault, TestbedNode, TestbedSpec, load_testbed
from felactl.testbed.state import DEFAULT_NAME, NodeInfo, TestbedState, read_state

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
