"""The control plane: a TCPStore hosted by the coordinator, joined by agents that prove the job secret.

The coordinator hosts torch.distributed's ``TCPStore`` (``is_master=True``) on a socket it binds
itself, so it listens on loopback unless an endpoint is given, and a busy port is a clear
:class:`InputError`. Every key lives under ``felactl/<job>/<generation>/``: a later generation
(a rescale) re-forms its process groups under a fresh prefix on the same store.

Joining is an HMAC-SHA256 challenge-response. The coordinator publishes a random nonce; an agent
pushes ``{agent_id, payload, proof=hmac(secret, join|nonce|agent_id|payload)}`` onto a queue; the
coordinator verifies the proof with ``hmac.compare_digest`` and answers under a key only that
request can name, with its own proof (``admit|nonce|agent_id``) so the agent knows the coordinator
holds the secret too. Refused attempts are logged and change nothing. Documents the coordinator
publishes afterwards (the job, the stop signal) are signed with :func:`sign` and checked with
:func:`verify`. The store itself is plain TCP: the secret keeps strangers out of the membership and
stops forged commands, it does not encrypt traffic (use a private network, as torchrun does).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from felactl.errors import AuthError, ControlPlaneError, InputError
from felactl.fsutil import atomic_write_text

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_CONNECT_TIMEOUT_S = 30.0
SECRET_BYTES = 32
POLL_INTERVAL_S = 0.05


# --- the secret -------------------------------------------------------------------------------
def new_secret() -> str:
    return secrets.token_hex(SECRET_BYTES)


def write_secret_file(path: str | os.PathLike, secret: str | None = None) -> str:
    """Write a (new) job secret to ``path`` atomically with mode 0600, and return it."""
    secret = secret or new_secret()
    atomic_write_text(path, secret + "\n", mode=0o600)
    return secret


def read_secret_file(path: str | os.PathLike) -> str:
    """The secret in ``path`` (``-`` reads one line from stdin, so ssh can pass it without a file)."""
    if str(path) == "-":
        text = sys.stdin.readline()
        where = "<stdin>"
    else:
        p = Path(path)
        if not p.is_file():
            raise InputError(f"{p}: no such secret file")
        text = p.read_text(encoding="utf-8", errors="replace")
        where = str(p)
    secret = text.strip()
    if len(secret) < 32 or any(c not in "0123456789abcdef" for c in secret.lower()):
        raise InputError(f"{where}: not a felactl job secret (expected at least 32 hex digits)")
    return secret


def sign(secret: str, message: str | bytes) -> str:
    """HMAC-SHA256 of ``message`` under the job secret, hex."""
    data = message.encode("utf-8") if isinstance(message, str) else message
    return hmac.new(bytes.fromhex(secret), data, hashlib.sha256).hexdigest()


def verify(secret: str, message: str | bytes, signature: str) -> bool:
    """True when ``signature`` is ``sign(secret, message)``; constant-time."""
    return hmac.compare_digest(sign(secret, message), str(signature))


def signed_envelope(secret: str, name: str, document: dict) -> str:
    """A document for the store with its signature; the name is signed too, so one cannot pose as another."""
    text = json.dumps(document, sort_keys=True)
    return json.dumps({"document": text, "signature": sign(secret, f"{name}|{text}")})


def open_envelope(secret: str, name: str, raw: bytes | str) -> dict:
    """The document in an envelope; AuthError unless it is signed with ``secret`` under ``name``."""
    try:
        envelope = json.loads(raw)
        text, signature = str(envelope["document"]), str(envelope["signature"])
    except (ValueError, KeyError, TypeError):
        raise AuthError(f"the {name} document on the control plane is not signed with this job's secret") from None
    if not verify(secret, f"{name}|{text}", signature):
        raise AuthError(f"the {name} document on the control plane is not signed with this job's secret")
    return json.loads(text)


# --- endpoints and stores ----------------------------------------------------------------------
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
            raise InputError(f"cannot reach the coordinator at {host}:{port}: cannot resolve {host!r} "
                             f"({exc.strerror})") from None
        except OSError as exc:
            if time.monotonic() >= deadline:
                why = "timed out" if isinstance(exc, socket.timeout) else (exc.strerror or type(exc).__name__)
                raise ControlPlaneError(f"cannot reach the coordinator at {host}:{port} within {timeout_s:g} s: "
                                        f"{why}") from None
            time.sleep(0.2)
    try:
        return dist.TCPStore(host, port, is_master=False,
                             timeout=timedelta(seconds=max(1.0, deadline - time.monotonic())))
    except (RuntimeError, ValueError) as exc:
        raise ControlPlaneError(f"cannot reach the coordinator at {host}:{port} within {timeout_s:g} s: "
                                f"{_first_line(exc)}") from exc


def _first_line(exc: BaseException) -> str:
    """c10d errors carry a C++ backtrace after the first line; the user needs only the first."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def job_prefix(job: str, generation: int) -> str:
    return f"felactl/{job}/{generation}/"


JOB_NAME_KEY = "felactl/job"
"""Unprefixed: the name of the job this store's coordinator runs (not a secret), so an agent
started without ``--job`` finds it."""


def _get_json(store, key: str) -> Any:
    return json.loads(store.get(key).decode("utf-8"))


def _wait_key(store, key: str, deadline: float, what: str, alive=None) -> bytes:
    """Poll for ``key`` until ``deadline`` (monotonic); a broken store is a ControlPlaneError.

    TCPStore's ``set`` does not wait for the server, so a key set on one connection shows up on
    another a little later: readers poll, they never assume.
    """
    while True:
        try:
            if store.check([key]):
                return store.get(key)
        except RuntimeError as exc:
            raise ControlPlaneError(f"lost the coordinator while waiting for {what}: {_first_line(exc)}") from exc
        if alive is not None:
            alive()
        if time.monotonic() > deadline:
            raise ControlPlaneError(f"timed out waiting for {what}")
        time.sleep(POLL_INTERVAL_S)


# --- membership ---------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class Member:
    """An admitted agent: one node's worth of worker slots."""

    agent_id: str
    node_name: str
    num_slots: int
    hostname: str
    info: dict = field(default_factory=dict)
    """Whatever the agent tells about its node (cores, memory); opaque to the control plane."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Assignment:
    """What one agent runs in a job: its slots' global ranks and the worker module."""

    rank_offset: int
    world_size: int
    module: str
    args: tuple[str, ...] = ()
    env: dict = field(default_factory=dict)
    local_indices: tuple[int, ...] = ()
    """Each slot's device index on the node (its LOCAL_RANK: the CUDA ordinal); empty: 0, 1, ..."""
    num_workers: int | None = None
    """Workers to start at once: None, one per slot; 0, a node joining a running elastic job,
    whose workers come later with the coordinator's ``add`` commands."""


class Coordinator:
    """Hosts the store, admits agents that prove the secret, publishes signed job documents."""

    def __init__(self, secret: str, *, endpoint: str | None = None, job: str = "job", generation: int = 0):
        import torch.distributed as dist

        host, port = parse_endpoint(endpoint) if endpoint else (DEFAULT_HOST, 0)
        sock = _bind(host, port)
        self.host = host
        self.port = sock.getsockname()[1]
        self.secret = secret
        self.job, self.generation = job, generation
        self.prefix = job_prefix(job, generation)
        self.members: dict[str, Member] = {}
        self.refused: list[str] = []
        try:
            # The store's server takes the bound socket over (and closes it when it stops).
            self.store = dist.TCPStore(host, self.port, is_master=True, wait_for_workers=False,
                                       master_listen_fd=sock.fileno(), timeout=timedelta(seconds=30))
        except RuntimeError as exc:
            try:
                sock.close()
            except OSError:
                pass  # the store had already taken the socket over
            raise ControlPlaneError(f"cannot start the store on {host}:{self.port}: {exc}") from exc
        sock.detach()
        self.store.set(JOB_NAME_KEY, job)
        self.nonce = secrets.token_hex(16)
        self.store.set(self.prefix + "auth/nonce", self.nonce)

    @property
    def endpoint(self) -> str:
        """Where agents connect: the bound address, or this host's name when bound to every address."""
        host = socket.getfqdn() if self.host in ("0.0.0.0", "::", "") else self.host
        return f"{host}:{self.port}"

    def poll_joins(self) -> list[Member]:
        """Handle every pending join request; return the newly admitted members."""
        admitted = []
        queue = self.prefix + "join/requests"
        while self.store.queue_len(queue) > 0:
            raw = self.store.queue_pop(queue, block=False)
            member = self._handle_join(raw)
            if member is not None:
                admitted.append(member)
        return admitted

    def _handle_join(self, raw: bytes) -> Member | None:
        try:
            request = json.loads(raw.decode("utf-8"))
            agent_id, payload, proof = str(request["agent_id"]), str(request["payload"]), str(request["proof"])
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            log.warning("control plane: refused a malformed join request")
            self.refused.append("<malformed>")
            return None
        reply_key = f"{self.prefix}join/reply/{agent_id}/{proof[:32]}"
        if not verify(self.secret, f"join|{self.nonce}|{agent_id}|{payload}", proof) or agent_id in self.members:
            log.warning("control plane: refused agent %r: wrong job secret or duplicate id", agent_id)
            self.refused.append(agent_id)
            self.store.set(reply_key, json.dumps({"admitted": False}))
            return None
        data = json.loads(payload)
        member = Member(agent_id=agent_id, node_name=str(data["node_name"]), num_slots=int(data["num_slots"]),
                        hostname=str(data.get("hostname", "")), info=dict(data.get("info", {})))
        self.members[agent_id] = member
        self.store.set(reply_key, json.dumps({"admitted": True,
                                              "proof": sign(self.secret, f"admit|{self.nonce}|{agent_id}")}))
        log.info("control plane: admitted %s (%d slots)", member.node_name, member.num_slots)
        return member

    def wait_members(self, num_agents: int, timeout_s: float, alive=None) -> list[Member]:
        """Admit agents until ``num_agents`` have joined; ``alive()`` may raise to give up early."""
        deadline = time.monotonic() + timeout_s
        while len(self.members) < num_agents:
            self.poll_joins()
            if alive is not None:
                alive()
            if time.monotonic() > deadline:
                raise ControlPlaneError(f"only {len(self.members)} of {num_agents} agents joined "
                                        f"{self.endpoint} within {timeout_s:g} s")
            time.sleep(POLL_INTERVAL_S)
        return list(self.members.values())

    def publish_signed(self, name: str, document: dict) -> None:
        """Set ``name`` to the document and its signature in one value, so no reader sees one without the other."""
        self.store.set(self.prefix + name, signed_envelope(self.secret, name, document))

    def publish_assignments(self, assignments: dict[str, Assignment]) -> None:
        self.publish_signed("job", {agent_id: asdict(a) for agent_id, a in assignments.items()})

    def stop(self, reason: str) -> None:
        """Tell every agent to stop its workers (signed, so nobody else can)."""
        self.publish_signed("stop", {"reason": reason})

    def agent_state(self, agent_id: str) -> dict | None:
        key = f"{self.prefix}agents/{agent_id}/state"
        return _get_json(self.store, key) if self.store.check([key]) else None

    def close(self) -> None:
        self.store = None  # the server (and its socket) stops when the last reference goes


def agent_beat_key(prefix: str, agent_id: str) -> str:
    return f"{prefix}agents/{agent_id}/beat"


class AgentSession:
    """An agent's side of the control plane: join, wait for the job, report state, watch for stop."""

    def __init__(self, endpoint: str, secret: str, *, job: str | None = "job", generation: int = 0,
                 timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S):
        """``job`` None: the job the coordinator at ``endpoint`` runs (:data:`JOB_NAME_KEY`)."""
        self.host, self.port = parse_endpoint(endpoint)
        self.secret = secret
        self.timeout_s = timeout_s
        self.store = connect_store(self.host, self.port, timeout_s)
        if job is None:
            job = _wait_key(self.store, JOB_NAME_KEY, time.monotonic() + timeout_s, "the coordinator's job name").decode()
        self.job = job
        self.prefix = job_prefix(job, generation)
        self.agent_id = ""

    def join(self, node_name: str, num_slots: int, info: dict | None = None) -> str:
        """Prove the secret and join; AuthError when the coordinator refuses."""
        deadline = time.monotonic() + self.timeout_s
        nonce = _wait_key(self.store, self.prefix + "auth/nonce", deadline, "the coordinator's nonce").decode()
        agent_id = f"{node_name}-{uuid.uuid4().hex[:8]}"
        payload = json.dumps({"node_name": node_name, "num_slots": num_slots, "hostname": socket.gethostname(),
                              "info": info or {}}, sort_keys=True)
        proof = sign(self.secret, f"join|{nonce}|{agent_id}|{payload}")
        self.store.queue_push(self.prefix + "join/requests",
                              json.dumps({"agent_id": agent_id, "payload": payload, "proof": proof}))
        reply_key = f"{self.prefix}join/reply/{agent_id}/{proof[:32]}"
        reply = json.loads(_wait_key(self.store, reply_key, deadline, "the coordinator to admit this agent"))
        if not reply.get("admitted"):
            raise AuthError(f"the coordinator at {self.host}:{self.port} refused this agent: wrong job secret "
                            "(check --secret-file)")
        if not verify(self.secret, f"admit|{nonce}|{agent_id}", reply.get("proof", "")):
            raise AuthError(f"the coordinator at {self.host}:{self.port} does not hold this job's secret")
        self.agent_id = agent_id
        return agent_id

    def read_signed(self, name: str) -> dict | None:
        """The signed document ``name`` if published; AuthError if its signature is wrong."""
        key = self.prefix + name
        if not self.store.check([key]):
            return None
        return open_envelope(self.secret, name, self.store.get(key))

    def wait_assignment(self, timeout_s: float, alive=None) -> Assignment:
        deadline = time.monotonic() + timeout_s
        _wait_key(self.store, self.prefix + "job", deadline, "the job", alive)
        document = self.read_signed("job")
        mine = document.get(self.agent_id)
        if mine is None:
            raise ControlPlaneError(f"the job has no place for agent {self.agent_id}")
        mine["args"] = tuple(mine.get("args", ()))
        return Assignment(**mine)

    def stop_requested(self) -> str | None:
        """The coordinator's stop reason, if it asked; ControlPlaneError if the store is gone."""
        try:
            document = self.read_signed("stop")
        except RuntimeError as exc:
            raise ControlPlaneError(f"lost the coordinator at {self.host}:{self.port}: {_first_line(exc)}") from exc
        return None if document is None else str(document.get("reason", "stopped"))

    def report(self, state: str, **details: Any) -> None:
        self.store.set(f"{self.prefix}agents/{self.agent_id}/state", json.dumps({"state": state, **details}))

    def beat(self) -> None:
        """Say this agent is alive (an elastic job's coordinator stops sending work to a silent one)."""
        self.store.add(agent_beat_key(self.prefix, self.agent_id), 1)
