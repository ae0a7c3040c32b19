"""The join handshake's messages: what an agent signs to prove the job secret, and what the
coordinator signs to admit it (see :mod:`felactl.launcher.controlplane` for the protocol)."""

from __future__ import annotations

import hmac
import json

from felactl.control.seal import mac

NAME_TAKEN = "node name taken"
"""How a refusal that ends the agent begins: its (signed) request names a node another agent of
the job has joined as. Other refusals spoil one attempt (a request replayed or altered on the
store); this one says what the agent itself asked for, which trying again cannot change."""

HELLO_AGAIN_S = 2.0
"""A joining agent that has seen no valid challenge or reply this long says hello again."""


def sign(secret: str, message: str | bytes) -> str:
    """HMAC-SHA256 of ``message`` under the job secret, hex."""
    return mac(secret, message.encode("utf-8") if isinstance(message, str) else message)


def verify(secret: str, message: str | bytes, signature: str) -> bool:
    """True when ``signature`` is ``sign(secret, message)``; constant-time."""
    return hmac.compare_digest(sign(secret, message), str(signature))


def join_message(job: str, agent_id: str, client_nonce: str, nonce: str, payload: str) -> str:
    return f"join|{job}|{agent_id}|{client_nonce}|{nonce}|{payload}"


def admit_message(job: str, agent_id: str, client_nonce: str, nonce: str, session: str) -> str:
    return f"admit|{job}|{agent_id}|{client_nonce}|{nonce}|{session}"


def refuse_message(job: str, agent_id: str, client_nonce: str, reason: str) -> str:
    return f"refuse|{job}|{agent_id}|{client_nonce}|{reason}"


def refuse_reply(secret: str, job: str, agent_id: str, client_nonce: str, reason: str) -> str:
    """A refusal of one join attempt, signed: only the coordinator can refuse. An agent that
    verifies it holds the job's secret, so the attempt was spoiled (replayed, or altered on the
    store), never "wrong secret"; an agent that cannot verify it cannot tell it from a forgery."""
    return json.dumps(
        {
            "admitted": False,
            "reason": reason,
            "proof": sign(secret, refuse_message(job, agent_id, client_nonce, reason)),
        }
    )


def admit_reply(secret: str, job: str, agent_id: str, client_nonce: str, nonce: str, session: str) -> str:
    """The admission: its proof binds the agent's challenge (the agent knows the coordinator holds
    the secret) and the launch's session (which the agent's documents are bound to from now on)."""
    return json.dumps(
        {
            "admitted": True,
            "session": session,
            "proof": sign(secret, admit_message(job, agent_id, client_nonce, nonce, session)),
        }
    )
