"""``felactl testbed`` for real: namespaces, shaped links, CPU shares, and a ``down`` that leaves
nothing, also after ``up`` is SIGKILLed half-way. Needs root; skips with the reason elsewhere.

Each test builds its own small testbed under a name no other test (or person) uses, and removes it.
The commands run in this process (typer's CliRunner, :func:`_felactl`), where only their own
output is asserted: a command's process would spend a second or more importing felactl each
time. ``up`` killed half-way and ``exec``, whose command's output is asserted, run as processes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from felactl.cli.main import app
from felactl.spec.io import from_dict
from felactl.testbed import (
    TestbedSpec,
    TestbedUnavailable,
    down,
    leftovers,
    node_command,
    node_env,
    probe_host,
    read_state,
    up,
)
from felactl.testbed.state import state_path

ROOT = Path(__file__).resolve().parent.parent
PROBE = str(ROOT / "tests" / "_testbed_probe.py")


@pytest.fixture(scope="module")
def host():
    try:
        return probe_host()
    except TestbedUnavailable as exc:
        pytest.skip(str(exc))


_count = iter(range(1000))


@pytest.fixture
def name(host):
    """A testbed name of this test alone, removed afterwards whatever happened."""
    tag = f"t{os.getpid() % 100000}{next(_count)}"[:8]
    yield tag
    down(tag)


def _spec(nodes: list[dict], links: list[dict], default: dict | None = None) -> TestbedSpec:
    data = {"kind": "Testbed", "schema_version": 1, "name": "test", "nodes": nodes, "links": links}
    if default is not None:
        data["default_link"] = default
    return from_dict(TestbedSpec, data, "test.yaml")


def _popen(state, node: str, *args: str, **kwargs) -> subprocess.Popen:
    info = state.node(node)
    return subprocess.Popen(
        node_command(info, [sys.executable, PROBE, *args]),
        env=node_env(state, info),
        stdout=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def _felactl(*args: str):
    """``felactl ARGS`` run in this process: its exit code, stdout and stderr (typer's CliRunner
    keeps them apart), as a user typing it would see them."""
    return CliRunner().invoke(app, list(args))


def _run(state, node: str, *args: str, timeout: float = 30) -> dict:
    proc = _popen(state, node, *args)
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out
    return json.loads(out.strip().splitlines()[-1])


def _tcp_rate(state, src: str, dst: str, seconds: float, port: int = 5001) -> float:
    """Bytes per second a TCP stream src -> dst gets, timed at the receiver."""
    addr = state.node(dst).address
    receiver = _popen(state, dst, "tcp-recv", addr, str(port))
    assert receiver.stdout.readline().strip() == "ready"
    sender = _popen(state, src, "tcp-send", addr, str(port), str(seconds))
    sender.communicate(timeout=seconds + 30)
    out, _ = receiver.communicate(timeout=30)
    got = json.loads(out.strip().splitlines()[-1])
    return got["bytes"] / got["seconds"]


def _host_view(name: str) -> dict:
    """What the host shows of testbed ``name``: namespaces, links, qdiscs on its links, cgroups."""
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    qdiscs = subprocess.run(["tc", "qdisc", "show"], capture_output=True, text=True).stdout
    roots = [Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup/cpuset")]
    return {
        "netns": [l for l in netns.splitlines() if l.startswith(f"felactl-{name}-")],
        "links": [l for l in links.splitlines() if f"flv-{name}-" in l or f"flbr-{name}" in l],
        "qdiscs": [l for l in qdiscs.splitlines() if f"flv-{name}-" in l or f"flbr-{name}" in l],
        "cgroups": [str(r / f"felactl-{name}") for r in roots if (r / f"felactl-{name}").exists()],
        "state": state_path(name).exists(),
    }


NOTHING = {"netns": [], "links": [], "qdiscs": [], "cgroups": [], "state": False}


def test_up_then_down_leaves_nothing(host, name) -> None:
    spec = _spec(
        [{"name": "a", "cpus": 0.5, "cores": [host.cores[0]]}, {"name": "b"}, {"name": "c", "cpus": 0.2}],
        [{"src": "a", "dst": "b", "bandwidth_gbps": 0.02, "loss": 0.1}],
        {"bandwidth_gbps": 0.01},
    )
    state = up(spec, "test.yaml", name=name, host=host)
    seen = _host_view(name)
    assert len(seen["netns"]) == 3 and len(seen["links"]) == 4 and seen["state"]
    assert seen["cgroups"] and len(state.nodes) == 3
    qdiscs = subprocess.run(
        ["tc", "-n", state.node("b").netns, "qdisc", "show", "dev", "fl0"], capture_output=True, text=True
    ).stdout
    assert "htb 1:" in qdiscs and "ingress ffff:" in qdiscs  # loss a -> b is dropped at b
    # a process left running in a node does not keep anything alive: down kills it
    sleeper = subprocess.Popen(node_command(state.node("a"), ["sleep", "60"]))
    time.sleep(0.3)
    removed = down(name)
    assert sleeper.wait(timeout=5) == -signal.SIGKILL
    assert str(sleeper.pid) in removed["processes"]
    assert _host_view(name) == NOTHING and leftovers(name) == []
    assert down(name) == {"processes": [], "links": [], "netns": [], "cgroups": [], "slurm": []}  # idempotent


def test_down_after_up_is_killed_midway(host, name, tmp_path) -> None:
    nodes = [{"name": f"n{i}", "cpus": 0.1} for i in range(12)]
    path = tmp_path / "big.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "kind": "Testbed",
                "schema_version": 1,
                "name": "big",
                "nodes": nodes,
                "default_link": {"bandwidth_gbps": 0.01, "loss": 0.01},
            }
        )
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "felactl", "testbed", "up", str(path), "--name", name, "--no-latency"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    made = 0
    deadline = time.monotonic() + 30
    while made < 8 and time.monotonic() < deadline and proc.poll() is None:
        try:
            made = len(json.loads(state_path(name).read_text())["made"])
        except (OSError, ValueError):
            pass
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    doc = json.loads(state_path(name).read_text())
    assert not doc["complete"], "up finished before it could be killed"
    assert _host_view(name) != NOTHING
    result = _felactl("testbed", "down", "--name", name, "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["removed"][name]["netns"]
    assert _host_view(name) == NOTHING
    # a second up under that name works again
    from felactl.testbed import load_testbed

    up(load_testbed(path), str(path), name=name, host=host, allow_no_latency=True)
    assert len(_host_view(name)["netns"]) == 12


def test_bandwidth_is_shaped_per_direction(host, name) -> None:
    spec = _spec(
        [{"name": "a"}, {"name": "b"}],
        [{"src": "a", "dst": "b", "bandwidth_gbps": 0.02}, {"src": "b", "dst": "a", "bandwidth_gbps": 0.005}],
    )
    state = up(spec, "test.yaml", name=name, host=host)
    fast = _tcp_rate(state, "a", "b", 2.0)
    slow = _tcp_rate(state, "b", "a", 2.0)
    assert fast == pytest.approx(20e6, rel=0.1), f"a -> b {fast / 1e6:.2f} MB/s, configured 20"
    assert slow == pytest.approx(5e6, rel=0.1), f"b -> a {slow / 1e6:.2f} MB/s, configured 5"


def test_loss_drops_that_fraction_one_way(host, name) -> None:
    spec = _spec(
        [{"name": "a"}, {"name": "b"}],
        [{"src": "a", "dst": "b", "bandwidth_gbps": 0.05, "loss": 0.3}],
        {"bandwidth_gbps": 0.05},
    )
    state = up(spec, "test.yaml", name=name, host=host)
    for src, dst, expected in (("a", "b", 0.7), ("b", "a", 1.0)):
        receiver = _popen(state, dst, "udp-recv", state.node(dst).address, "5002")
        assert receiver.stdout.readline().strip() == "ready"
        _popen(state, src, "udp-send", state.node(dst).address, "5002", "2000").communicate(timeout=30)
        out, _ = receiver.communicate(timeout=30)
        got = json.loads(out.strip().splitlines()[-1])["received"] / 2000
        assert got == pytest.approx(expected, abs=0.05), f"{src} -> {dst}: {got:.3f} arrived"


def test_latency_is_added_per_direction(host, name) -> None:
    if not host.netem:
        pytest.skip("this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM): latency cannot be emulated")
    spec = _spec(
        [{"name": "a"}, {"name": "b"}],
        [{"src": "a", "dst": "b", "bandwidth_gbps": 0.05, "latency_us": 4000}],
        {"bandwidth_gbps": 0.05, "latency_us": 1000},
    )
    state = up(spec, "test.yaml", name=name, host=host)
    echo = _popen(state, "b", "echo", state.node("b").address, "5003")
    assert echo.stdout.readline().strip() == "ready"
    rtt = _run(state, "a", "rtt", state.node("b").address, "5003", "50")["rtt_s"]
    echo.wait(timeout=10)
    assert rtt == pytest.approx(0.005, abs=0.0015), f"round trip {rtt * 1e3:.2f} ms, configured 4 + 1 ms"


def test_cpu_share_caps_a_busy_loop(host, name) -> None:
    core = host.cores[-1]
    spec = _spec(
        [{"name": "quarter", "cpus": 0.25, "cores": [core]}, {"name": "free", "cores": [core]}],
        [],
        {"bandwidth_gbps": 0.01},
    )
    state = up(spec, "test.yaml", name=name, host=host)
    got = _run(state, "quarter", "busy", "2")["cpu_fraction"]
    assert got == pytest.approx(0.25, abs=0.05), f"a node with cpus 0.25 got {got:.3f} of a core"
    info = state.node("quarter")
    assert set(info.cores) == {core}


def test_exec_runs_in_the_node(host, name) -> None:
    spec = _spec([{"name": "a", "cpus": 0.5}, {"name": "b"}], [], {"bandwidth_gbps": 0.01})
    state = up(spec, "test.yaml", name=name, host=host)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    felactl = [sys.executable, "-m", "felactl", "testbed"]
    script = (
        "echo $(ls /sys/class/net) $GLOO_SOCKET_IFNAME $FELACTL_TESTBED_NODE $FELACTL_TESTBED_ADDR; "
        "grep -c felactl /proc/self/cgroup; exit 7"
    )
    result = subprocess.run(
        [*felactl, "exec", "b", "--name", name, "--", "sh", "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 7, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["fl0", "lo", "fl0", "b", state.node("b").address]  # its own interfaces only
    assert state.node("b").address.startswith("198.18.") and state.node("b").address.endswith(".2")
    assert int(lines[1]) >= 1  # in the node's cgroup(s)
    result = _felactl("testbed", "exec", "nosuch", "--name", name, "--", "true")
    assert result.exit_code == 2 and "has no node 'nosuch'" in result.stderr
    result = _felactl("testbed", "up", str(ROOT / "plans/testbeds/one-slow.yaml"), "--name", name, "--no-latency")
    assert result.exit_code == 2 and "is up already" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert read_state(name).nodes["a"].cpus == 0.5


def test_two_testbeds_at_once_are_apart_and_reach_the_host(host, name) -> None:
    spec = _spec([{"name": "a"}, {"name": "b"}], [], {"bandwidth_gbps": 0.01})
    first = up(spec, "test.yaml", name=name, host=host)
    other = f"{name[:7]}x"
    try:
        second = up(spec, "test.yaml", name=other, host=host)
        assert first.host_address.rsplit(".", 1)[0] != second.host_address.rsplit(".", 1)[0]
        import socket

        with socket.create_server((first.host_address, 0)) as server:  # a coordinator on the host
            port = server.getsockname()[1]
            probe = (
                "import socket,sys\n"
                "socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5).close()\n"
                "try:\n    socket.create_connection((sys.argv[3], 9), timeout=2)\n"
                "except OSError as e:\n    print(e.errno)\n"
            )
            out = subprocess.run(
                node_command(
                    first.node("a"),
                    [sys.executable, "-c", probe, first.host_address, str(port), second.node("b").address],
                ),
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert out.returncode == 0, out.stderr
            import errno

            assert int(out.stdout) == errno.ENETUNREACH  # no route out of its own /24
    finally:
        down(other)


def test_a_link_is_cut_healed_and_reshaped_while_up(host, name) -> None:
    spec = _spec([{"name": "a"}, {"name": "b"}], [], {"bandwidth_gbps": 0.02})
    state = up(spec, "test.yaml", name=name, host=host)

    def arrived(src: str, dst: str) -> float:
        receiver = _popen(state, dst, "udp-recv", state.node(dst).address, "5004")
        assert receiver.stdout.readline().strip() == "ready"
        _popen(state, src, "udp-send", state.node(dst).address, "5004", "500").communicate(timeout=30)
        out, _ = receiver.communicate(timeout=30)
        return json.loads(out.strip().splitlines()[-1])["received"] / 500

    def link(*args: str):
        return _felactl("testbed", "link", *args, "--name", name, "--json")

    cut = link("a", "b", "--loss", "1")
    assert cut.exit_code == 0, cut.stderr
    assert json.loads(cut.stdout)["loss"] == 1.0
    assert arrived("a", "b") == 0.0 and arrived("b", "a") == 1.0  # one direction only
    assert link("a", "b", "--loss", "0").exit_code == 0
    assert arrived("a", "b") == 1.0
    assert link("a", "b", "--bandwidth-gbps", "0.005").exit_code == 0
    assert _tcp_rate(read_state(name), "a", "b", 1.5) == pytest.approx(5e6, rel=0.1)
    assert read_state(name).spec["links"] == [
        {"src": "a", "dst": "b", "bandwidth_gbps": 0.005, "latency_us": 0.0, "loss": 0.0}
    ]
    bad = link("a", "b", "--loss", "2")
    assert bad.exit_code == 2 and "--loss must be at most 1" in bad.stderr


def test_a_partition_keeps_the_sides_apart_and_the_host_reachable_and_heals(host, name) -> None:
    """`felactl testbed partition a` (issue 15 item 6's partition between two halves): a and {b, c}
    lose every packet between them, both ways; inside a side and to the host everything passes;
    `--heal` puts back the loss each link had (a -> c had 0.25 of its own)."""
    spec = _spec(
        [{"name": "a"}, {"name": "b"}, {"name": "c"}],
        [{"src": "a", "dst": "c", "bandwidth_gbps": 0.02, "loss": 0.25}],
        {"bandwidth_gbps": 0.02},
    )
    state = up(spec, "test.yaml", name=name, host=host)

    def felactl(*args: str):
        return _felactl("testbed", *args, "--name", name)

    def reaches(src: str, address: str, port: int = 9) -> bool:
        """Whether a TCP connection from src to address opens (or is refused: it got there)."""
        probe = (
            "import socket,sys\n"
            "try:\n    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1).close()\n"
            "except ConnectionRefusedError:\n    pass\n"
            "except OSError:\n    sys.exit(1)\n"
        )
        command = node_command(state.node(src), [sys.executable, "-c", probe, address, str(port)])
        return subprocess.run(command, capture_output=True, timeout=30).returncode == 0

    made = felactl("partition", "a")
    assert made.exit_code == 0, made.stderr
    assert "a: apart from the other nodes" in made.stderr
    addr = {n: state.node(n).address for n in "abc"}
    assert not reaches("a", addr["b"]) and not reaches("b", addr["a"]) and not reaches("c", addr["a"])
    assert reaches("b", addr["c"]) and reaches("c", addr["b"])
    import socket

    with socket.create_server((state.host_address, 0)) as server:  # the control plane, on the host
        assert all(reaches(n, state.host_address, server.getsockname()[1]) for n in "abc")
    status = json.loads(felactl("status", "--json").stdout)
    assert status["partitioned"] == ["a"]
    assert {(l["src"], l["dst"]) for l in status["links"] if l["loss"] == 1.0} == {
        ("a", "b"),
        ("a", "c"),
        ("b", "a"),
        ("c", "a"),
    }
    again = felactl("partition", "b")
    assert again.exit_code == 2 and "already partitioned" in again.stderr
    assert felactl("partition", "a,b,c").exit_code == 2  # a side and no other
    assert felactl("partition", "a,zz").exit_code == 2  # no such node
    healed = felactl("partition", "--heal", "--json")
    assert healed.exit_code == 0, healed.stderr
    assert json.loads(healed.stdout) == {"side": ["a"], "partitioned": False}
    assert reaches("a", addr["b"]) and reaches("b", addr["a"])
    losses = {(l["src"], l["dst"]): l["loss"] for l in json.loads(felactl("status", "--json").stdout)["links"]}
    assert losses[("a", "c")] == 0.25 and losses[("a", "b")] == 0.0 and losses[("c", "a")] == 0.0
    assert felactl("partition", "--heal").exit_code == 2  # nothing to heal


def test_cut_heal_and_crash_say_what_they_did_as_json(host, name) -> None:
    """The failure commands a chaos script drives, each with --json as every felactl command has."""
    state = up(_spec([{"name": "a"}, {"name": "b"}], [], {"bandwidth_gbps": 0.02}), "test.yaml", name=name, host=host)

    def felactl(*args: str) -> dict:
        done = _felactl("testbed", *args, "--name", name, "--json")
        assert done.exit_code == 0, done.stderr
        return json.loads(done.stdout)

    assert felactl("cut", "a") == {"node": "a", "cut": True}
    assert felactl("status")["cut"] == ["a"]
    assert felactl("heal", "a") == {"node": "a", "cut": False}
    sleeper = subprocess.Popen(node_command(state.node("b"), ["sleep", "60"]))
    try:
        deadline = time.monotonic() + 10
        crashed = felactl("crash", "b")
        while not crashed["killed"] and time.monotonic() < deadline:  # until sleep runs in the node
            time.sleep(0.2)
            crashed = felactl("crash", "b")
        assert crashed["node"] == "b" and crashed["killed"], crashed
        assert sleeper.wait(timeout=10) == -signal.SIGKILL
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
            sleeper.wait()


def test_a_machine_without_iproute2_is_told_so_in_one_line(tmp_path, monkeypatch):
    """The host probe runs ip and tc through testbed.host.run: a missing tool is exit 2 and one
    line, never a FileNotFoundError."""
    import os

    from felactl.testbed import TestbedUnavailable, probe_host

    if os.geteuid() != 0:
        pytest.skip("the probe stops at 'needs root' first")
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no ip, no tc
    with pytest.raises(TestbedUnavailable, match="iproute2"):
        probe_host()
