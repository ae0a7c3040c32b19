"""An agent's side of the control plane: join the coordinator by proving the job secret, wait for
its part of the job, report how its workers are, watch for the stop order.

The protocol (keys, documents, the join handshake's messages) is :mod:`felactl.control`'s; the
coordinator's side is :mod:`felactl.launcher.controlplane`.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from felactl.control import Reader, Seal, job_binding, keys
from felactl.control.documents import AgentStateDoc, Assignment, JobDoc, StopDoc
from felactl.control.join import HELLO_AGAIN_S, NAME_TAKEN, admit_message, join_message, refuse_message, sign, verify
from felactl.control.store import (
    DEFAULT_CONNECT_TIMEOUT_S,
    POLL_INTERVAL_S,
    connect_store,
    first_line,
    parse_endpoint,
    wait_key,
)
from felactl.errors import AuthError, ControlPlaneError, NodeNameTaken


@dataclass(frozen=True)
class StopOrder:
    reason: str
    drain_s: float = 0.0
    """Seconds the workers get to end after an agreed step and checkpoint it (the agent sends them
    SIGINT) before they are killed; 0: stop them at once."""


class AgentSession:
    """An agent's side of the control plane: join, wait for the job, report state, watch for stop."""

    def __init__(
        self,
        endpoint: str,
        secret: str,
        *,
        job: str | None = "job",
        generation: int = 0,
        timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
    ):
        """``job`` None: the job the coordinator at ``endpoint`` runs (:data:`keys.JOB_NAME`)."""
        self.host, self.port = parse_endpoint(endpoint)
        self.secret = secret
        self.timeout_s = timeout_s
        self.store = connect_store(self.host, self.port, timeout_s)
        if job is None:
            job = wait_key(
                self.store, keys.JOB_NAME, time.monotonic() + timeout_s, "the coordinator's job name"
            ).decode()
        self.job = job
        self.prefix = keys.job_prefix(job, generation)
        self.agent_id = ""
        self.session = ""
        self.reader: Reader | None = None

    def join(self, node_name: str, num_slots: int, info: dict | None = None) -> str:
        """Prove the secret and join. Only a reply signed with the secret counts: an unsigned or
        forged refusal is ignored, so nobody without the secret can lock this agent out. Until
        ``timeout_s`` a spoiled attempt (no answer, a signed refusal) is followed by a fresh hello;
        then AuthError when no reply could be verified (the secret), else ControlPlaneError."""
        deadline = time.monotonic() + self.timeout_s
        agent_id = f"{node_name}-{uuid.uuid4().hex[:8]}"
        payload = json.dumps(
            {"node_name": node_name, "num_slots": num_slots, "hostname": socket.gethostname(), "info": info or {}},
            sort_keys=True,
        )
        tally = _JoinTally(f"{self.host}:{self.port}")
        while time.monotonic() < deadline:
            session = self._try_join(agent_id, payload, min(deadline, time.monotonic() + HELLO_AGAIN_S), tally)
            if session is not None:
                break
        else:
            raise tally.failure(self.timeout_s)
        self.agent_id, self.session = agent_id, session
        self.reader = Reader(
            Seal(self.secret, job_binding(self.job, self.session)), self.store, self.prefix, on_refused=_say_refused
        )
        return agent_id

    def _try_join(self, agent_id: str, payload: str, until: float, tally: _JoinTally) -> str | None:
        """One hello, challenge and join; the launch's session once admitted, None to try again."""
        client_nonce = secrets.token_hex(8)
        queue = self.prefix + keys.JOIN_REQUESTS
        self.store.queue_push(queue, json.dumps({"op": "hello", "agent_id": agent_id, "client_nonce": client_nonce}))
        challenge_name = keys.join_challenge(agent_id, client_nonce)
        nonce = None
        while nonce is None:
            # The challenge's proof is not checked: an agent with a wrong secret could not tell its
            # coordinator's from a forgery. A forged one only gets this attempt refused.
            raw = self._poll(challenge_name, until)
            if raw is None:
                tally.unanswered()
                return None
            try:
                nonce = str(json.loads(raw)["nonce"])
            except (ValueError, KeyError, TypeError):
                time.sleep(POLL_INTERVAL_S)
        proof = sign(self.secret, join_message(self.job, agent_id, client_nonce, nonce, payload))
        self.store.queue_push(
            queue, json.dumps({"agent_id": agent_id, "client_nonce": client_nonce, "payload": payload, "proof": proof})
        )
        reply_name = keys.join_reply(agent_id, client_nonce)
        last = None
        while (raw := self._poll(reply_name, until + HELLO_AGAIN_S, unlike=last)) is not None:
            last = raw
            try:
                reply = json.loads(raw)
                admitted, proof = reply.get("admitted"), str(reply.get("proof", ""))
                session, reason = str(reply.get("session", "")), str(reply.get("reason", ""))
            except (ValueError, AttributeError):
                tally.unverified(reply_name)
                continue
            if admitted is True and verify(
                self.secret, admit_message(self.job, agent_id, client_nonce, nonce, session), proof
            ):
                return session
            if admitted is False and verify(
                self.secret, refuse_message(self.job, agent_id, client_nonce, reason), proof
            ):
                if reason.startswith(NAME_TAKEN):  # what this agent asked for: trying again changes nothing
                    raise NodeNameTaken(f"the coordinator at {self.host}:{self.port} refused this agent: {reason}")
                tally.refused(reason)
                return None
            tally.unverified(reply_name)  # not from the coordinator, or this agent's secret is not the job's
        return None

    def _poll(self, name: str, until: float, unlike: bytes | None = None) -> bytes | None:
        """The value of ``name`` once set (and other than ``unlike``), None at ``until``."""
        key = self.prefix + name
        while time.monotonic() < until:
            try:
                if self.store.check([key]) and (value := self.store.get(key)) != unlike:
                    return value
            except RuntimeError as exc:
                raise ControlPlaneError(f"lost the coordinator while joining: {first_line(exc)}") from exc
            time.sleep(POLL_INTERVAL_S)
        return None

    def read_signed(self, name: str, kind: str) -> dict | None:
        """The valid signed document ``name`` if published; None when absent or forged (said once)."""
        opened = self.reader.read(name, kind)
        return None if opened is None else opened.body

    def wait_assignment(self, timeout_s: float, alive=None, attempt: int = 0) -> Assignment:
        """This agent's place in the job document of ``attempt``. An agent that joins a running job
        may read the document before the coordinator has added it (``_admit_agent``): it waits for
        its place until ``timeout_s``, as for the document itself."""
        deadline = time.monotonic() + timeout_s
        name = keys.job_document(attempt)
        while True:
            wait_key(self.store, self.prefix + name, deadline, "the job", alive)
            body = self.read_signed(name, JobDoc.KIND.value)
            if body is not None:
                try:
                    found = JobDoc.from_body(body).assignments.get(self.agent_id)
                    mine = None if found is None else dict(found)
                except (TypeError, ValueError):
                    raise ControlPlaneError(f"the job has no place for agent {self.agent_id}") from None
                if mine is not None:
                    break
            if alive is not None:
                alive()
            if time.monotonic() > deadline:
                if body is None:
                    raise ControlPlaneError("timed out waiting for the job (only forged job documents came)")
                raise ControlPlaneError(f"the job has no place for agent {self.agent_id}")
            time.sleep(POLL_INTERVAL_S)
        mine["args"] = tuple(mine.get("args", ()))
        return Assignment(**mine)

    def wait_attempt(self, attempt: int, timeout_s: float) -> Assignment | None:
        """This agent's part of the job's ``attempt``, or None once the coordinator stops the job."""

        class _Stopped(Exception):
            pass

        def alive() -> None:
            if self.stop_requested() is not None:
                raise _Stopped

        try:
            return self.wait_assignment(timeout_s, alive=alive, attempt=attempt)
        except _Stopped:
            return None

    def attempt_stopped(self, attempt: int) -> StopOrder | None:
        """The coordinator's order to stop ``attempt``'s workers (the agent stays for the next)."""
        return self.stop_requested(keys.attempt_stop(attempt))

    def attempt_published(self, attempt: int) -> bool:
        """Whether the coordinator published (a valid document for) the job's ``attempt``."""
        return self.read_signed(keys.job_document(attempt), JobDoc.KIND.value) is not None

    def stop_requested(self, name: str = keys.STOP) -> StopOrder | None:
        """The coordinator's stop order, if it gave one (a forged one is ignored); ControlPlaneError
        if the store is gone. ``name``: the job's (default) or one attempt's
        (:func:`~felactl.control.keys.attempt_stop`)."""
        try:
            document = self.read_signed(name, StopDoc.KIND.value)
        except RuntimeError as exc:
            raise ControlPlaneError(f"lost the coordinator at {self.host}:{self.port}: {first_line(exc)}") from exc
        if document is None:
            return None
        try:
            stop = StopDoc.from_body(document)
        except ValueError:
            return None
        return StopOrder(stop.reason, float(stop.drain_s))

    def report(self, state: str, **details: Any) -> None:
        name = keys.agent_state(self.agent_id)
        self.store.set(
            self.prefix + name,
            self.reader.seal.seal(
                name, AgentStateDoc.KIND.value, AgentStateDoc(state, json.loads(json.dumps(details))).to_body()
            ),
        )

    @contextlib.contextmanager
    def beating(self) -> Iterator[None]:
        """Say every :data:`~felactl.control.keys.AGENT_BEAT_S` that this agent is alive, from a
        thread and a store client of its own, while the block runs: an elastic job's coordinator
        stops sending work to a silent agent, and a restart counts a silent agent's node lost
        without waiting out :data:`~felactl.launcher.restarts.LOST_AFTER_S`. A thread, so that an
        agent busy stopping its workers (or waiting for the next attempt) is not taken for gone."""
        stop = threading.Event()
        store = connect_store(self.host, self.port, self.timeout_s)
        name = self.prefix + keys.agent_beat(self.agent_id)

        def beat() -> None:
            while not stop.is_set():
                try:
                    store.add(name, 1)
                except RuntimeError:  # a timeout, a reset: the next beat tries again
                    pass
                stop.wait(keys.AGENT_BEAT_S)

        thread = threading.Thread(target=beat, name="felactl-agent-beat", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(timeout=2 * keys.AGENT_BEAT_S)  # not a beat held up by a coordinator gone

    def worker_env(self) -> dict[str, str]:
        """What felactl's own workers need to verify and sign documents: the secret (in their
        environment, never on the store) and the launch's session."""
        return {"FELACTL_SECRET": self.secret, "FELACTL_SESSION": self.session, "FELACTL_JOB": self.job}


class _JoinTally:
    """What a joining agent saw, to say at its join timeout why it was not admitted."""

    def __init__(self, coordinator: str):
        self.coordinator = coordinator
        self.num_unanswered = 0
        self.num_unverified = 0
        self.refusals: list[str] = []

    def unanswered(self) -> None:
        self.num_unanswered += 1
        if self.num_unanswered == 1:
            print(
                f"felactl agent: no answer from the coordinator at {self.coordinator} to this agent's join "
                "request (the coordinator is busy, or someone on the store takes requests off its queue); "
                "trying again until --join-timeout",
                file=sys.stderr,
            )

    def unverified(self, key: str) -> None:
        self.num_unverified += 1
        if self.num_unverified == 1:
            _say_refused(key, "a reply not signed with this agent's secret")

    def refused(self, reason: str) -> None:
        self.refusals.append(reason)
        print(f"felactl agent: the coordinator refused this attempt ({reason}); trying again", file=sys.stderr)

    def failure(self, timeout_s: float) -> ControlPlaneError:
        within = f"within {timeout_s:g} s (--join-timeout)"
        if self.refusals:
            return ControlPlaneError(
                f"the coordinator at {self.coordinator} did not admit this agent {within}: it refused "
                f"{len(self.refusals)} attempt(s) ({self.refusals[-1]}): someone on the store may be altering "
                "join requests"
            )
        if self.num_unverified:
            return AuthError(
                f"the coordinator at {self.coordinator} refused this agent: wrong job secret (check --secret-file): "
                f"none of {self.num_unverified} replies {within} was signed with this agent's secret"
            )
        return ControlPlaneError(
            f"no answer from the coordinator at {self.coordinator} to {self.num_unanswered} join request(s) "
            f"{within}: it is busy or gone, or someone on the store takes its requests"
        )


def _say_refused(key: str, reason: str) -> None:
    print(f"felactl agent: ignored a forged {key}: {reason}", file=sys.stderr)
