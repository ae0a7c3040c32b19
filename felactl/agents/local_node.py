"""This machine's agent: its default configuration, and running it beside the coordinator.

``felactl profile`` and ``felactl launch`` without hosts start the coordinator and this machine's
agent in one process, the agent in a thread, so a laptop runs exactly the code path a cluster runs.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from felactl.agents.agent import RunResult, split_cores
from felactl.agents.node import NodeAgentConfig, run_node_agent
from felactl.control.documents import WorkerState
from felactl.machine import available_cores, default_node_name, node_info


def local_agent_config(
    endpoint: str,
    secret: str,
    *,
    nproc: int,
    node_name: str | None,
    log_dir: Path,
    join_timeout_s: float,
    job: str | None,
) -> NodeAgentConfig:
    """The agent of this machine: CPU slots are pinned to disjoint shares of its cores."""
    info = node_info()
    affinity = None if info["num_gpus"] >= nproc else split_cores(available_cores(), nproc)
    return NodeAgentConfig(
        endpoint=endpoint,
        secret=secret,
        # in a testbed node (felactl testbed exec), the node's name: scale --node finds it by that
        node_name=node_name or default_node_name(),
        nproc=nproc,
        log_dir=log_dir,
        node_info=info,
        cpu_affinity=affinity,
        job=job,
        join_timeout_s=join_timeout_s,
        name_given=node_name is not None,
    )


def run_joining_agent(
    config: NodeAgentConfig, *, temp_logs: bool, on_joined: Callable[[str], None] = lambda agent_id: None
) -> tuple[RunResult, Path | None]:
    """``felactl agent``: run this node's agent; returns how its workers ended and where their
    logs are. ``temp_logs``: ``config.log_dir`` is a temp dir nobody asked for, removed when every
    worker here succeeded (None is returned then), kept and named otherwise."""
    result = run_node_agent(config, on_joined=on_joined)
    if temp_logs and result.state is WorkerState.SUCCEEDED and not result.failures:
        shutil.rmtree(config.log_dir, ignore_errors=True)
        return result, None
    return result, config.log_dir


def temp_log_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="felactl-agent-"))


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
