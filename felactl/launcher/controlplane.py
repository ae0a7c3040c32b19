"""The control plane's coordinator: a TCPStore it hosts, joined by agents that prove the job secret
(their side: :mod:`felactl.agents.session`).

The coordinator hosts torch.distributed's ``TCPStore`` (``is_master=True``) on a socket it binds
itself, so it listens on loopback unless an endpoint is given, and a busy port is a clear
:class:`InputError`. Every key lives under ``felactl/<job>/<generation>/``: a later generation
(a rescale) re-forms its process groups under a fresh prefix on the same store.

Joining is an HMAC-SHA256 challenge-response with a challenge per agent: an agent pushes a hello
``{agent_id, client_nonce}`` onto a queue; the coordinator answers under
``join/challenge/<agent_id>/<client_nonce>`` with a fresh nonce; the agent pushes
``{agent_id, client_nonce, payload, proof=hmac(secret, join|job|agent_id|client_nonce|nonce|payload)}``;
the coordinator verifies the proof with ``hmac.compare_digest`` against the challenge it gave
that agent (once: a challenge is used up) and answers under ``join/reply/<agent_id>/<client_nonce>``
with a signed reply: an admission that carries the launch's session (so the agent knows the
coordinator holds the secret too), or a refusal with its reason. No key is shared by the agents
that join, so nobody can lock every agent out by writing one. An unsigned or forged reply is
ignored: an agent with the right secret is never told its secret is wrong by someone without it.
An agent says hello again when an attempt gets no answer in a while, or a signed refusal (its
request was replayed or altered on the store), until its join timeout; it then says whether no
reply came at all (its requests vanished) or none it could verify (most likely a wrong secret).
Refused attempts are logged and change nothing. Every document afterwards is
sealed with :mod:`felactl.control.seal` (bound to the job, the launch's session, the key, the
generation and a sequence number) and verified by its reader: a forgery is ignored and recorded. The
store itself is plain TCP: the secret keeps strangers out of the membership and stops forged
commands, it does not encrypt traffic (use a private network, as torchrun does).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from felactl.control import EventKind, Reader, Seal, job_binding, keys
from felactl.control.documents import AgentStateDoc, Assignment, JobDoc, StopDoc
from felactl.control.events import RefusalLog, record
from felactl.control.join import NAME_TAKEN, admit_reply, join_message, refuse_reply, verify
from felactl.control.store import DEFAULT_HOST, POLL_INTERVAL_S, parse_endpoint, serve_store
from felactl.errors import ControlPlaneError, InputError
from felactl.fsutil import atomic_write_text

log = logging.getLogger(__name__)

SECRET_BYTES = 32


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


MAX_PENDING_CHALLENGES = 1024
"""Challenges given and not yet answered; beyond it the oldest is forgotten (a flood of hellos
costs memory no more than this)."""
AUDIT_S = 0.2
"""How often the coordinator checks the keys it owns (deleted or changed: written back)."""


class Coordinator:
    """Hosts the store, admits agents that prove the secret, publishes signed job documents."""

    def __init__(
        self,
        secret: str,
        *,
        endpoint: str | None = None,
        job: str = "job",
        generation: int = 0,
        events: Path | None = None,
    ):
        host, port = parse_endpoint(endpoint) if endpoint else (DEFAULT_HOST, 0)
        self.store, self.port = serve_store(host, port)
        self.host = host
        self.secret = secret
        self.job, self.generation = job, generation
        self.prefix = keys.job_prefix(job, generation)
        self.session = secrets.token_hex(8)
        """This launch's id: documents signed for an earlier launch of the same run are refused."""
        self.seal = Seal(secret, job_binding(job, self.session))
        self.events = events
        """The run's events.jsonl, where refusals and repairs are recorded (None: logged only)."""
        self.refusals = RefusalLog(events)
        self.reader = Reader(self.seal, self.store, self.prefix, on_refused=self.refuse)
        self.members: dict[str, Member] = {}
        self.refused: list[str] = []
        self.challenges: dict[tuple[str, str], str] = {}
        self.states: dict[str, dict] = {}
        self.owned: dict[str, str] = {}
        """Keys this coordinator wrote and must find unchanged: name -> the value it wrote."""
        self.audited_at = 0.0
        self.names_taken: list[str] = []
        self.gathering = False
        """While the job's first agents gather (:meth:`wait_members`): a node name joins once. (An
        elastic job's agent that rejoins later, its node's name again, replaces the lost one.)"""
        self.store.set(keys.JOB_NAME, job)

    @property
    def endpoint(self) -> str:
        """Where agents connect: the bound address, or this host's name when bound to every address."""
        host = socket.getfqdn() if self.host in ("0.0.0.0", "::", "") else self.host
        return f"{host}:{self.port}"

    def refuse(self, key: str, reason: str) -> None:
        """A forgery (or a bad request) at ``key``: ignored, and recorded."""
        self.refusals(key, reason)

    # --- joining ----------------------------------------------------------------------------------
    def poll_joins(self) -> list[Member]:
        """Handle every pending hello and join request; return the newly admitted members."""
        admitted = []
        queue = self.prefix + keys.JOIN_REQUESTS
        while self.store.queue_len(queue) > 0:
            raw = self.store.queue_pop(queue, block=False)
            member = self._handle_join(raw)
            if member is not None:
                admitted.append(member)
        self.audit()
        return admitted

    def _handle_join(self, raw: bytes) -> Member | None:
        try:
            request = json.loads(raw.decode("utf-8"))
            agent_id, client_nonce = str(request["agent_id"]), str(request["client_nonce"])
            hello = request.get("op") == "hello"
            if not hello:
                payload, proof = str(request["payload"]), str(request["proof"])
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
            log.warning("control plane: refused a malformed join request")
            self.refused.append("<malformed>")
            self.refuse(keys.JOIN_REQUESTS, "a malformed join request")
            return None
        if not _safe_id(agent_id) or not _safe_id(client_nonce):
            self.refused.append("<malformed>")
            self.refuse(keys.JOIN_REQUESTS, "a join request with a bad agent id or nonce")
            return None
        if hello:
            nonce = secrets.token_hex(16)
            self.challenges[(agent_id, client_nonce)] = nonce
            while len(self.challenges) > MAX_PENDING_CHALLENGES:
                self.challenges.pop(next(iter(self.challenges)))
            self.store.set(self.prefix + keys.join_challenge(agent_id, client_nonce), json.dumps({"nonce": nonce}))
            return None
        nonce = self.challenges.pop((agent_id, client_nonce), None)
        reply_name = keys.join_reply(agent_id, client_nonce)
        message = join_message(self.job, agent_id, client_nonce, nonce or "", payload)
        if nonce is None:
            reason = "no challenge was given to it (replayed or stale)"
        elif agent_id in self.members:
            reason = "duplicate id"
        elif not verify(self.secret, message, proof):
            reason = "wrong job secret"
        else:
            reason = ""
        if reason:
            self.refused.append(agent_id)
            return self._refuse_agent(agent_id, client_nonce, reason)
        try:
            data = json.loads(payload)
            member = Member(
                agent_id=agent_id,
                node_name=str(data["node_name"]),
                num_slots=int(data["num_slots"]),
                hostname=str(data.get("hostname", "")),
                info=dict(data.get("info", {})),
            )
        except (ValueError, KeyError, TypeError):
            self.refuse(keys.JOIN_REQUESTS, f"agent {agent_id!r}: a malformed join payload")
            return None
        if (reason := self._name_taken(member.node_name)) is not None:
            return self._refuse_agent(agent_id, client_nonce, reason)
        self.members[agent_id] = member
        self.store.set(
            self.prefix + reply_name, admit_reply(self.secret, self.job, agent_id, client_nonce, nonce, self.session)
        )
        log.info("control plane: admitted %s (%d slots)", member.node_name, member.num_slots)
        return member

    def _refuse_agent(self, agent_id: str, client_nonce: str, reason: str) -> None:
        """Refuse a join: recorded, logged, and told to the agent (signed, so that it believes it)."""
        log.warning("control plane: refused agent %r: %s", agent_id, reason)
        self.refuse(keys.JOIN_REQUESTS, f"agent {agent_id!r}: {reason}")
        reply = refuse_reply(self.secret, self.job, agent_id, client_nonce, reason)
        self.store.set(self.prefix + keys.join_reply(agent_id, client_nonce), reply)

    def _name_taken(self, node_name: str) -> str | None:
        """Why a joining agent named ``node_name`` is refused while the job gathers: a member has
        that name (None: it has not, or the job runs and a lost node's agent may come back)."""
        taken = next((m.agent_id for m in self.members.values() if m.node_name == node_name), None)
        if not self.gathering or taken is None:
            return None
        self.names_taken.append(node_name)
        return (
            f"{NAME_TAKEN}: {node_name!r} is agent {taken}'s in this job: start this agent with --node-name "
            "NAME, the plan's name of its node (an agent is named after its host by default)"
        )

    def wait_members(self, num_agents: int, timeout_s: float, alive=None) -> list[Member]:
        """Admit agents until ``num_agents`` have joined, one per node name (a second agent that
        takes a name already in is refused, saying so: two agents on one host both take its
        name); ``alive()`` may raise to give up early."""
        deadline = time.monotonic() + timeout_s
        self.gathering = True
        try:
            while len(self.members) < num_agents:
                self.poll_joins()
                if alive is not None:
                    alive()
                if time.monotonic() > deadline:
                    taken = f"; refused {', '.join(self.names_taken)} (a node name taken)" if self.names_taken else ""
                    raise ControlPlaneError(
                        f"only {len(self.members)} of {num_agents} agents joined {self.endpoint} within "
                        f"{timeout_s:g} s{taken}"
                    )
                time.sleep(POLL_INTERVAL_S)
        finally:
            self.gathering = False
        return list(self.members.values())

    # --- documents ---------------------------------------------------------------------------------
    def publish(self, name: str, kind: str, body: dict, *, generation: int = 0) -> None:
        """Seal ``body`` and set ``name`` to it (one value: no reader sees a document without its
        signature); the coordinator keeps it, to write it back if someone deletes or changes it."""
        value = self.seal.seal(name, kind, body, generation=generation)
        self.owned[name] = value
        self.store.set(self.prefix + name, value)

    def own(self, name: str, value: str) -> None:
        """Set an unsigned key whose value the coordinator decides (a hint), and keep it so."""
        self.owned[name] = value
        self.store.set(self.prefix + name, value)

    def publish_assignments(self, assignments: dict[str, Assignment], attempt: int = 0) -> None:
        self.publish(
            keys.job_document(attempt),
            JobDoc.KIND.value,
            JobDoc({agent_id: asdict(a) for agent_id, a in assignments.items()}).to_body(),
        )

    def stop(self, reason: str, drain_s: float = 0.0) -> None:
        """Tell every agent to stop its workers (signed, so nobody else can); ``drain_s`` > 0: a
        graceful stop (see :class:`StopOrder`)."""
        self.publish(keys.STOP, StopDoc.KIND.value, StopDoc(reason, float(drain_s)).to_body())

    def audit(self, force: bool = False) -> None:
        """Find the keys this coordinator owns as it wrote them: a key deleted or changed is written
        back (``repaired``, or ``refused`` when a forgery stood there), and a stop order it never
        gave is removed. At most every :data:`AUDIT_S`, unless ``force``."""
        now = time.monotonic()
        if not force and now - self.audited_at < AUDIT_S:
            return
        self.audited_at = now
        for name, value in list(self.owned.items()):
            raw = self.reader.raw(name)
            if raw is not None and raw.decode("utf-8", "replace") == value:
                continue
            self.store.set(self.prefix + name, value)
            if raw is None:
                record(self.events, EventKind.REPAIRED, key=name, reason="deleted; written back")
                continue
            record(
                self.events,
                EventKind.REPAIRED if name == keys.GENERATION else EventKind.REFUSED,
                key=name,
                reason=f"changed to {raw[:60]!r}; written back",
            )
            if name == keys.GENERATION:
                self._remove_forged_generation(raw)
        if keys.STOP not in self.owned:
            raw = self.reader.raw(keys.STOP)
            if raw is not None:
                self.refuse(keys.STOP, "a stop order the coordinator never gave; removed")
                self.store.delete_key(self.prefix + keys.STOP)

    def _remove_forged_generation(self, raw: bytes) -> None:
        """The document a forged generation number points to, if the coordinator never published it:
        refused and removed (whether or not a worker had read it before the number was written back)."""
        try:
            name = keys.generation_document(int(raw))
        except ValueError:
            return
        if name not in self.owned and self.reader.raw(name) is not None:
            self.refuse(name, "a generation document the coordinator never published; removed")
            self.store.delete_key(self.prefix + name)

    def agent_beat(self, agent_id: str) -> str | None:
        """The agent's beat counter as it stands (unsigned: a forged beat can only delay the
        verdict that an agent is gone, to the deadline every wait for a report has)."""
        raw = self.reader.raw(keys.agent_beat(agent_id))
        return None if raw is None else raw.decode("utf-8", "replace")

    def agent_state(self, agent_id: str) -> dict | None:
        """The agent's newest valid report (a forged or replayed one is refused and ignored)."""
        name = keys.agent_state(agent_id)
        opened = self.reader.read(name, AgentStateDoc.KIND.value)
        if opened is not None:
            try:
                self.states[agent_id] = AgentStateDoc.from_body(opened.body).as_dict()
            except ValueError as exc:
                self.refuse(name, f"malformed report ({exc})")
        return self.states.get(agent_id)

    def close(self) -> None:
        self.store = None  # the server (and its socket) stops when the last reference goes
        self.reader.store = None


def _safe_id(text: str) -> bool:
    return 0 < len(text) <= 128 and all(c.isalnum() or c in "-_." for c in text)
