"""``felactl profile --model --testbed`` (felactl.launcher.testbed_model) when a node's profile
fails or hangs: one line naming the node and what it said, and no process left behind. The nodes
here are plain processes (the namespaces are tests/test_testbed_jobs.py's, as root)."""

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
    """Two fake nodes whose 'profile' is the shell line each is given in ``scripts``."""
    scripts: dict[str, str] = {}
    state = SimpleNamespace(nodes={"na": SimpleNamespace(name="na"), "nb": SimpleNamespace(name="nb")})
    monkeypatch.setattr(testbed_model, "read_state", lambda name: state)
    started: list[tuple[str, list[str]]] = []

    def node_command(node, argv):
        started.append((node.name, argv))
        companion = "felactl.profiling.in_situ" in argv
        return ["sh", "-c", "sleep 30" if companion else scripts[node.name]]

    scripts["started"] = started
    monkeypatch.setattr(testbed_model, "node_command", node_command)
    monkeypatch.setattr(testbed_model, "node_env", lambda state, node: dict(os.environ))
    return scripts


@pytest.fixture
def new_children():
    """The processes this test started that are still running (the suite's others excluded)."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    return lambda: [p for p in psutil.Process().children(recursive=True) if p.pid not in before and p.is_running()]


def test_a_node_whose_profile_fails_is_named_with_its_last_words_and_the_others_are_stopped(nodes, new_children):
    nodes["na"] = "sleep 30"
    nodes["nb"] = "echo 'Traceback (most recent call last):' >&2; echo 'ValueError: no such layer' >&2; exit 3"
    started = time.monotonic()
    with pytest.raises(ProfilingError, match=r"in node nb failed \(exit 3\): .*ValueError: no such layer"):
        testbed_model.profile_model_on_testbed("tb", "mlp", [], timeout_s=20)
    assert time.monotonic() - started < 15 and not new_children()


def test_a_node_that_outlasts_the_timeout_is_named_and_stopped(nodes, new_children):
    nodes["na"] = "exit 0"  # wrote no profile, but the wait ends first
    nodes["nb"] = "echo 'importing torch' >&2; sleep 30"
    with pytest.raises(
        ProfilingError, match=r"took over 1 s in node\(s\) nb \(--timeout\); nb last said: importing torch"
    ):
        testbed_model.profile_model_on_testbed("tb", "mlp", [], timeout_s=1)
    assert not new_children()


def test_a_node_done_trains_the_model_until_all_are_and_is_stopped(nodes, new_children):
    """na's profile ends first: na then trains the model (a companion: the job runs every node at
    once) while nb's goes on; nb's failure stops both."""
    nodes["na"] = "exit 0"
    nodes["nb"] = "sleep 2; exit 4"
    with pytest.raises(ProfilingError, match="in node nb failed"):
        testbed_model.profile_model_on_testbed("tb", "mlp", [], config={"hidden": 64}, companion_batch=16, timeout_s=20)
    companions = [(node, argv) for node, argv in nodes["started"] if "felactl.profiling.in_situ" in argv]
    assert [node for node, _ in companions] == ["na"]
    assert companions[0][1][-3:] == ["mlp", "16", '{"hidden": 64}']
    assert not new_children()
