"""This machine's agent: its default configuration, and running it beside the coordinator.

``felactl profile`` and ``felactl launch`` without hosts start the coordinator and this machine's
agent in one process, the agent in a thread, so a laptop runs exactly the code path a cluster runs.
"""

from __future__ import annotations

import socket
import threading
from pathlib import Path

from felactl.agents.agent import NodeAgentConfig, run_node_agent, split_cores
from felactl.profiling.devices import available_cores, node_info


def local_agent_config(endpoint: str, secret: str, *, nproc: int, node_name: str | None, log_dir: Path,
                       join_timeout_s: float, job: str | None) -> NodeAgentConfig:
    """The agent of this machine: CPU slots are pinned to disjoint shares of its cores."""
    info = node_info()
    affinity = None if info["num_gpus"] >= nproc else split_cores(available_cores(), nproc)
    return NodeAgentConfig(endpoint=endpoint, secret=secret, node_name=node_name or short_hostname(),
                           nproc=nproc, log_dir=log_dir, node_info=info, cpu_affinity=affinity, job=job,
                           join_timeout_s=join_timeout_s)


def short_hostname() -> str:
    return socket.gethostname().split(".")[0] or "localhost"


class AgentThread(threading.Thread):
    """The agent of this machine inside the coordinator's process (local profile and launch): the
    same protocol as a remote ``felactl agent``; its error is kept for the coordinator's thread."""

    def __init__(self, config: NodeAgentConfig):
        super().__init__(name="felactl-local-agent", daemon=True)
        self.config = config
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            run_node_agent(self.config)
        except BaseException as exc:  # handed to the coordinator's thread, which raises it
            self.error = exc

    def check(self) -> None:
        if self.error is not None:
            raise self.error
