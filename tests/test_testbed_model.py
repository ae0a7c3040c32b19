"""``felactl profile --model --testbed`` (felactl.launcher.testbed_model) when a node's profile
fails or hangs, and the companions of the nodes done: one line naming the node and what it said,
and no process left behind. The nodes here are plain processes (the namespaces are
tests/test_testbed_jobs.py's, as root)."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import psutil
import pytest

from felactl.errors import ProfilingError
from felactl.launcher import testbed_model


@pytest.fixture
def nodes(monkeypatch):
    """Two fake nodes: ``nodes.script[name]`` is the shell line a node's profile runs (a
    companion sleeps); ``nodes.started`` records (node, argv) of every process started in one."""
    fake = SimpleNamespace(script={}, started=[])
    state = SimpleNamespace(nodes={"na": SimpleNamespace(name="na"), "nb": SimpleNamespace(name="nb")})

    def node_command(node, argv):
        fake.started.append((node.name, argv))
        companion = "felactl.profiling.in_situ" in argv
        return ["sh", "-c", "sleep 30" if companion else fake.script[node.name]]

    monkeypatch.setattr(testbed_model, "read_state", lambda name: state)
    monkeypatch.setattr(testbed_model, "node_command", node_command)
    monkeypatch.setattr(testbed_model, "node_env", lambda state, node: dict(os.environ))
    return fake


@pytest.fixture
def new_children():
    """The processes this test started that are still running (the suite's others excluded)."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    return lambda: [p for p in psutil.Process().children(recursive=True) if p.pid not in before and p.is_running()]


def _profile(timeout_s: float = 20, **options):
    return testbed_model.profile_model_on_testbed("tb", "mlp", {}, [16], repeats=1, timeout_s=timeout_s, **options)


def test_a_node_whose_profile_fails_is_named_with_its_last_words_and_the_others_are_stopped(nodes, new_children):
    nodes.script["na"] = "sleep 30"
    nodes.script["nb"] = "echo 'Traceback (most recent call last):' >&2; echo 'ValueError: no such layer' >&2; exit 3"
    started = time.monotonic()
    with pytest.raises(ProfilingError, match=r"in node nb failed \(exit 3\): .*ValueError: no such layer"):
        _profile()
    assert time.monotonic() - started < 15 and not new_children()


def test_a_node_that_outlasts_the_timeout_is_named_and_stopped(nodes, new_children):
    nodes.script["na"] = "exit 0"  # wrote no profile, but the wait ends first
    nodes.script["nb"] = "echo 'importing torch' >&2; sleep 30"
    with pytest.raises(
        ProfilingError, match=r"took over 1 s in node\(s\) nb \(--timeout\); nb last said: importing torch"
    ):
        _profile(timeout_s=1)
    assert not new_children()


def test_each_node_gets_the_profiles_flags_and_a_node_done_trains_until_all_are(nodes, new_children):
    """na's profile ends first: na then trains the model (a companion: the job runs every node at
    once) while nb's goes on; nb's failure stops both. Every node's profile gets the options."""
    nodes.script["na"] = "exit 0"
    nodes.script["nb"] = "sleep 2; exit 4"
    with pytest.raises(ProfilingError, match="in node nb failed"):
        testbed_model.profile_model_on_testbed(
            "tb", "mlp", {"hidden": 64, "act": "gelu"}, [16, 64, 256], repeats=2, matmul_size=128, timeout_s=20
        )
    profiles = [argv for _, argv in nodes.started if "profile" in argv]
    assert len(profiles) == 2 and all(
        " ".join(argv).count('--config hidden=64 --config act="gelu" --batch-sizes 16,64,256 --repetitions 2') == 1
        and argv[argv.index("--matmul-size") + 1] == "128"
        for argv in profiles
    ), profiles
    companions = [(node, argv) for node, argv in nodes.started if "felactl.profiling.in_situ" in argv]
    assert [node for node, _ in companions] == ["na"]
    assert companions[0][1][-3:] == ["mlp", "64", '{"hidden": 64, "act": "gelu"}']  # the middle batch size
    assert not new_children()
