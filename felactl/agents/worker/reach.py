"""Whom a worker can reach, for the coordinator's answer to a network partition.

When a collective fails and every member is still alive and heartbeating (they all reach the
coordinator), the cause may be a partition between the members themselves: re-forming the same
members would fail again, for ever. So each worker listens on a TCP port of its own (published in
its ``arrived`` document) and, after a failed step, tries a connection to every other member's;
whom it could not reach goes into its ``stuck`` report, and the coordinator keeps the largest
group of members that all reach one another (:func:`felactl.launcher.membership.signs_of_life.reachable_group`).

A probe is a plain TCP handshake, which the kernel completes from the listen backlog: it needs no
CPU time of the peer's Python, so a busy peer is not mistaken for a lost one.

The other way round, a worker whose step failed closes its own connections to its peers at once
(:func:`sever_peer_connections`), so that those still blocked on it fail now, not at a timeout.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

PROBE_TIMEOUT_S = 1.0
"""How long a connection attempt may take: what a partition adds to the collective timeout before
the coordinator hears of it. A lost SYN is sent again only after 1 s, so each peer gets
``PROBE_ATTEMPTS`` attempts at once and one that opens is enough (a link with 1% loss fails all
three one time in a million)."""
PROBE_ATTEMPTS = 3


def local_address(store_host: str, store_port: int) -> str:
    """The address peers can reach this worker at: that of gloo's interface when
    ``GLOO_SOCKET_IFNAME`` names one (as in a testbed node), else the one this host routes to the
    control-plane store from (no packet is sent)."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
    if ifname:
        import psutil

        for addr in psutil.net_if_addrs().get(ifname, []):
            if addr.family == socket.AF_INET:
                return addr.address
    family, _, _, _, where = socket.getaddrinfo(store_host, store_port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as udp:
        udp.connect(where)
        return udp.getsockname()[0]


class ProbeListener(threading.Thread):
    """Accepts connections on an ephemeral port of ``host`` and closes them at once."""

    def __init__(self, host: str):
        super().__init__(name="felactl-probe", daemon=True)
        self.sock = socket.create_server((host, 0), backlog=128)
        self.address = f"{host}:{self.sock.getsockname()[1]}"
        """``host:port``, what peers probe."""
        self.start()

    def run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            conn.close()

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def reaches(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether a TCP connection to ``host:port`` opens within ``timeout_s``."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def unreachable(peers: Mapping[int, str], timeout_s: float = PROBE_TIMEOUT_S) -> list[int]:
    """Of ``peers`` (worker id -> probe address), those this process cannot reach: every attempt
    to every peer at once, so the answer takes ``timeout_s`` at most (for up to 32 peers)."""
    attempts = [(w, a) for w, a in peers.items() for _ in range(PROBE_ATTEMPTS)]
    if not attempts:
        return []
    with ThreadPoolExecutor(max_workers=min(len(attempts), 96), thread_name_prefix="felactl-probe") as pool:
        answers = list(pool.map(lambda wa: (wa[0], reaches(wa[1], timeout_s)), attempts))
    reached = {w for w, ok in answers if ok}
    return sorted(set(peers) - reached)


def sever_peer_connections(store_port: int) -> None:
    """Shut down this process's TCP connections to its peers (all but the store's): a survivor
    blocked in a collective waiting on *this* worker then fails at once instead of after the
    collective timeout. Destroying the group alone does not do it while gloo still holds the
    pairs of the failed operation."""
    import psutil

    for conn in psutil.Process().net_connections(kind="tcp"):
        if conn.status != psutil.CONN_ESTABLISHED or not conn.raddr or conn.raddr.port == store_port:
            continue
        if conn.laddr and conn.laddr.port == store_port:
            continue
        try:
            sock = socket.socket(fileno=os.dup(conn.fd))
            try:
                sock.shutdown(socket.SHUT_RDWR)
            finally:
                sock.close()
        except OSError:
            pass
