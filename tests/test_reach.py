"""Whom a worker can reach (felactl.agents.worker.reach): the probes behind the coordinator's answer
to a network partition. The partition itself, in a testbed: tests/test_testbed_jobs.py."""

from __future__ import annotations

import socket
import time

from felactl.agents.worker.reach import ProbeListener, local_address, reaches, unreachable


def test_a_listening_peer_is_reached_and_a_closed_one_is_not() -> None:
    listener = ProbeListener("127.0.0.1")
    assert reaches(listener.address)
    assert reaches(listener.address)  # accepted and closed, again and again
    listener.close()
    assert not reaches(listener.address)


def test_unreachable_names_only_the_peers_that_cannot_be_reached_within_the_timeout() -> None:
    here = ProbeListener("127.0.0.1")
    gone = ProbeListener("127.0.0.1")
    gone.close()
    # a port nobody listens on behind a filtered address: no answer at all, the attempt times out
    peers = {0: here.address, 1: gone.address, 2: "192.0.2.1:9", 3: "not an address"}
    start = time.monotonic()
    assert unreachable(peers, timeout_s=0.5) == [1, 2, 3]
    assert time.monotonic() - start < 5  # all at once, not one after another
    assert unreachable({}) == []
    here.close()


def test_the_probe_address_is_gloos_interface_or_the_route_to_the_store(monkeypatch) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert local_address("127.0.0.1", 29500) == "127.0.0.1"
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    assert local_address("localhost", 29500) in ("127.0.0.1", "::1")
    socket.inet_pton(socket.AF_INET, local_address("127.0.0.1", 29500))
