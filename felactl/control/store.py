"""The control-plane store: its server, bound to the address it is given (loopback unless told
otherwise), and the client side every room uses to reach it.

A plain ``TCPStore(host, port, is_master=True)`` listens on every address whatever ``host`` says;
here the socket is bound first, to ``host`` only, and handed to the store (``master_listen_fd``).
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta

from felactl.errors import ControlPlaneError, InputError

DEFAULT_HOST = "127.0.0.1"
DEFAULT_CONNECT_TIMEOUT_S = 30.0
POLL_INTERVAL_S = 0.05
"""How often a reader polls for a key (TCPStore has no notifications)."""


def _bind(host: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise InputError(f"cannot resolve {host!r}: {exc.strerror}") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(512)
    except OSError as exc:
        sock.close()
        if exc.errno == 98:  # EADDRINUSE
            raise InputError(f"port {port} on {host} is already in use; pick another with --rdzv-endpoint") from None
        raise InputError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


def serve_store(host: str, port: int = 0):
    """A TCPStore server on ``host:port`` (0: a free port) bound here, so a busy port is an
    InputError; returns the store and its port."""
    import torch.distributed as dist

    sock = _bind(host, port)
    port = sock.getsockname()[1]
    try:
        # The store's server takes the bound socket over (and closes it when it stops).
        store = dist.TCPStore(
            host,
            port,
            is_master=True,
            wait_for_workers=False,
            master_listen_fd=sock.fileno(),
            timeout=timedelta(seconds=30),
        )
    except RuntimeError as exc:
        try:
            sock.close()
        except OSError:
            pass  # the store had already taken the socket over
        raise ControlPlaneError(f"cannot start the store on {host}:{port}: {exc}") from exc
    sock.detach()
    return store, port


def generation_store(store, store_prefix: str, generation: int):
    """``store`` seen as one generation's (an attempt's) workers see it: their process groups meet
    there, and their own agreements live there (:func:`felactl.control.keys.generation_namespace`)."""
    import torch.distributed as dist

    from felactl.control import keys

    return dist.PrefixStore(keys.generation_namespace(store_prefix, generation), store)


def parse_endpoint(endpoint: str, default_port: int | None = None) -> tuple[str, int]:
    """``HOST:PORT`` (or ``HOST`` when a default port is given) -> (host, port)."""
    host, sep, port_text = endpoint.rpartition(":")
    if not sep:
        host, port_text = endpoint, ""
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host  # [::1]:29500
    if not port_text and default_port is not None:
        return host or DEFAULT_HOST, default_port
    if not host or not port_text.isdigit() or not 0 <= int(port_text) < 65536:
        raise InputError(f"endpoint {endpoint!r}: expected HOST:PORT with a port in 0..65535")
    return host, int(port_text)


def connect_store(host: str, port: int, timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S):
    """A TCPStore client of the store at ``host:port``; ControlPlaneError when it cannot be reached.

    The address is first tried with a plain socket until it answers (the coordinator may start
    after its agents): c10d's own failed connects print screens of C++ log and backtrace to
    stderr, which a user who mistyped an address should not have to read."""
    import torch.distributed as dist

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=max(0.1, min(1.0, deadline - time.monotonic()))).close()
            break
        except socket.gaierror as exc:  # a mistyped name, not a coordinator that is still starting
            raise InputError(
                f"cannot reach the coordinator at {host}:{port}: cannot resolve {host!r} ({exc.strerror})"
            ) from None
        except OSError as exc:
            if time.monotonic() >= deadline:
                why = "timed out" if isinstance(exc, socket.timeout) else (exc.strerror or type(exc).__name__)
                raise ControlPlaneError(
                    f"cannot reach the coordinator at {host}:{port} within {timeout_s:g} s: {why}"
                ) from None
            time.sleep(0.2)
    try:
        return dist.TCPStore(
            host, port, is_master=False, timeout=timedelta(seconds=max(1.0, deadline - time.monotonic()))
        )
    except (RuntimeError, ValueError) as exc:
        raise ControlPlaneError(
            f"cannot reach the coordinator at {host}:{port} within {timeout_s:g} s: {first_line(exc)}"
        ) from exc


def first_line(exc: BaseException) -> str:
    """c10d errors carry a C++ backtrace after the first line; the user needs only the first."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def wait_key(store, key: str, deadline: float, what: str, alive=None) -> bytes:
    """Poll for ``key`` until ``deadline`` (monotonic); a broken store is a ControlPlaneError.

    TCPStore's ``set`` does not wait for the server, so a key set on one connection shows up on
    another a little later: readers poll, they never assume.
    """
    while True:
        try:
            if store.check([key]):
                return store.get(key)
        except RuntimeError as exc:
            raise ControlPlaneError(f"lost the coordinator while waiting for {what}: {first_line(exc)}") from exc
        if alive is not None:
            alive()
        if time.monotonic() > deadline:
            raise ControlPlaneError(f"timed out waiting for {what}")
        time.sleep(POLL_INTERVAL_S)
