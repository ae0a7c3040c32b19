"""Two "nodes" on one machine: a coordinator (``felactl profile --rdzv-endpoint``) and two
``felactl agent`` processes with distinct node names, all as real subprocesses. The links between
the nodes are measured in the same global gloo world as the links inside a node.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

from felactl.launcher.controlplane import write_secret_file
from felactl.spec import load_cluster

FELACTL = [sys.executable, "-m", "felactl"]
SMALL = ["--matmul-size", "128", "--message-bytes", "262144", "--repetitions", "3"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(args: list[str], log_path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log_path, "wb") as log:
        return subprocess.Popen(FELACTL + args, stdout=subprocess.PIPE, stderr=log, env=env, start_new_session=True)


def _kill_all(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


@pytest.mark.multiprocess
def test_two_agents_as_two_nodes_measure_every_pair(tmp_path):
    secret = tmp_path / "secret"
    write_secret_file(secret)
    endpoint = f"127.0.0.1:{_free_port()}"
    out = tmp_path / "cluster.yaml"
    procs: list[subprocess.Popen] = []
    started = time.monotonic()
    try:
        coordinator = _start(
            [
                "profile",
                "--rdzv-endpoint",
                endpoint,
                "--nnodes",
                "2",
                "--secret-file",
                str(secret),
                "--name",
                "two",
                "-o",
                str(out),
                "--json",
                "--join-timeout",
                "25",
                "--timeout",
                "40",
                *SMALL,
            ],
            tmp_path / "coordinator.log",
        )
        procs.append(coordinator)
        for node, slots in (("nodeA", "2"), ("nodeB", "1")):
            procs.append(
                _start(
                    [
                        "agent",
                        "--rdzv-endpoint",
                        endpoint,
                        "--secret-file",
                        str(secret),
                        "--node-name",
                        node,
                        "--nproc-per-node",
                        slots,
                        "--log-dir",
                        str(tmp_path / node),
                        "--join-timeout",
                        "25",
                    ],
                    tmp_path / f"{node}.log",
                )
            )
        stdout, _ = coordinator.communicate(timeout=50)
        assert coordinator.returncode == 0, (tmp_path / "coordinator.log").read_text()[-2000:]
        for agent in procs[1:]:
            assert agent.wait(timeout=20) == 0
    finally:
        _kill_all(procs)
    assert time.monotonic() - started < 60

    data = json.loads(stdout)
    assert [n["name"] for n in data["nodes"]] == ["nodeA", "nodeB"]
    names = [d["name"] for n in data["nodes"] for d in n["devices"]]
    assert names == ["nodeA-cpu0", "nodeA-cpu1", "nodeB-cpu0"]
    links = {(l["src"], l["dst"]): l for l in data["links"]}
    assert set(links) == {(a, b) for a in names for b in names if a != b}
    assert all(l["bandwidth_gbps"] > 0 and l["latency_us"] > 0 for l in links.values())
    assert links[("nodeA-cpu0", "nodeA-cpu1")]["type"] == "loopback"
    assert links[("nodeB-cpu0", "nodeA-cpu1")]["type"] == "net"
    assert links[("nodeA-cpu1", "nodeB-cpu0")]["type"] == "net"
    assert out.exists()


@pytest.mark.multiprocess
def test_a_second_agent_of_a_node_name_is_refused_at_once_and_the_profile_waits_for_the_right_one(tmp_path):
    """Two agents on one host take its name: the second is refused at once (exit 2), told to give
    --node-name; the coordinator waits on, and an agent with a name of its own completes it."""
    secret = tmp_path / "secret"
    write_secret_file(secret)
    endpoint = f"127.0.0.1:{_free_port()}"
    procs: list[subprocess.Popen] = []

    def agent(name: str, log: str) -> subprocess.Popen:
        argv = ["agent", "--rdzv-endpoint", endpoint, "--secret-file", str(secret), "--node-name", name]
        procs.append(_start([*argv, "--nproc-per-node", "1", "--join-timeout", "25"], tmp_path / log))
        return procs[-1]

    try:
        profile = ["profile", "--rdzv-endpoint", endpoint, "--nnodes", "2", "--secret-file", str(secret)]
        coordinator = _start(
            [*profile, "-o", str(tmp_path / "c.yaml"), "--join-timeout", "25", *SMALL], tmp_path / "coordinator.log"
        )
        procs.append(coordinator)
        agent("same", "agent0.log")
        deadline = time.monotonic() + 30  # the first is in before the second asks
        while "joined as" not in (tmp_path / "agent0.log").read_text():
            assert time.monotonic() < deadline, (tmp_path / "agent0.log").read_text()
            time.sleep(0.1)
        second = agent("same", "agent1.log")
        assert second.wait(timeout=30) == 2
        said = (tmp_path / "agent1.log").read_text()
        assert "refused this agent: node name taken: 'same' is agent" in said and "--node-name" in said, said
        agent("other", "agent2.log")
        assert coordinator.wait(timeout=60) == 0, (tmp_path / "coordinator.log").read_text()[-2000:]
        assert "node name taken" in (tmp_path / "coordinator.log").read_text()
    finally:
        _kill_all(procs)
    assert [n.name for n in load_cluster(tmp_path / "c.yaml").nodes] == ["other", "same"]


@pytest.mark.multiprocess
def test_hostfile_starts_an_agent_on_each_host_over_ssh(tmp_path):
    """``felactl profile --hostfile``: one agent per listed host, started with ssh (a stand-in
    that runs the remote command here, so the two hosts are two nodes on this machine)."""
    from tests._worker_helpers import fake_ssh

    (tmp_path / "hosts").write_text("nodeA slots=1\nnodeB slots=1\n")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "FAKE_SSH_LOG": str(tmp_path / "ssh.log"),
        "PATH": f"{fake_ssh(tmp_path / 'bin')}{os.pathsep}{os.environ['PATH']}",
    }
    out = tmp_path / "cluster.yaml"
    proc = subprocess.Popen(
        FELACTL
        + [
            "profile",
            "--hostfile",
            str(tmp_path / "hosts"),
            "--rdzv-endpoint",
            f"127.0.0.1:{_free_port()}",
            "--name",
            "two",
            "-o",
            str(out),
            "--json",
            "--join-timeout",
            "25",
            "--timeout",
            "40",
            *SMALL,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=80)
    finally:
        _kill_all([proc])
    assert proc.returncode == 0, stderr.decode()[-3000:]
    cluster = json.loads(stdout)
    assert sorted(n["name"] for n in cluster["nodes"]) == ["nodeA", "nodeB"]
    assert len(cluster["links"]) == 2  # one slot each: both directions between the nodes
    calls = [json.loads(line) for line in (tmp_path / "ssh.log").read_text().splitlines()]
    assert sorted(c["host"] for c in calls) == ["nodeA", "nodeB"] and all(c["stdin"].strip() for c in calls)
