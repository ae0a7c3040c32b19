"""The coordinator's side of ``felactl scale`` on the store: opening a request (signed for this job,
with a good id), answering it (signed; a request that cannot be verified gets only an unsigned
no), and refusing every request of a job that cannot be rescaled. The client's side is
:mod:`felactl.launcher.scale`; what a request changes is decided in
:mod:`felactl.launcher.membership`."""

from __future__ import annotations

import json

from felactl.control import EventKind, Forged, keys
from felactl.control.documents import ScaleReplyDoc, ScaleRequestDoc
from felactl.control.events import record
from felactl.launcher.controlplane import Coordinator
from felactl.launcher.rundir import RunDir


def open_request(coordinator: Coordinator, raw: bytes) -> tuple[str, dict | None, str]:
    """A ``felactl scale`` request: (its id, its command, "") when it is signed for this job, else
    (the id it claims, or "", None, what is wrong)."""
    try:
        opened = coordinator.seal.open(keys.SCALE_REQUESTS, raw, ScaleRequestDoc.KIND.value)
        request = ScaleRequestDoc.from_body(opened.body)
    except (Forged, ValueError) as exc:
        claimed = ""
        try:
            claimed = str(json.loads(raw)["body"]["id"])
        except (ValueError, KeyError, TypeError):
            pass
        why = exc.reason if isinstance(exc, Forged) else f"malformed ({exc})"
        if why.startswith("wrong signature"):
            why = "the scale command is not signed with this job's secret"
        return (claimed if _good_id(claimed) else ""), None, f"scale request: {why}"
    if not _good_id(request.id):
        return "", None, "scale request: a bad id"
    return request.id, request.command, ""


def _good_id(request_id: str) -> bool:
    return request_id.isalnum() and 0 < len(request_id) <= 64


def answer(coordinator: Coordinator, request_id: str, reply: dict) -> None:
    """The signed answer to request ``request_id`` (felactl scale acts on nothing else)."""
    name = keys.scale_reply(request_id)
    body = ScaleReplyDoc(
        id=request_id, ok=bool(reply.get("ok")), result=reply.get("result") or {}, error=str(reply.get("error", ""))
    ).to_body()
    coordinator.store.set(coordinator.prefix + name, coordinator.seal.seal(name, ScaleReplyDoc.KIND.value, body))


def answer_unsigned(coordinator: Coordinator, request_id: str, why: str) -> None:
    """A refusal to a request this job cannot verify: its sender may hold a wrong secret and could
    not verify a signed one. It only ever says no (felactl scale takes no unsigned success)."""
    coordinator.store.set(coordinator.prefix + keys.scale_reply(request_id), json.dumps({"ok": False, "error": why}))


def refuse_requests(coordinator: Coordinator, run: RunDir, reason: str) -> None:
    """A job that cannot be rescaled still answers ``felactl scale`` (refused, logged), never leaves it waiting."""
    store = coordinator.store
    queue = coordinator.prefix + keys.SCALE_REQUESTS
    while store.queue_len(queue) > 0:
        raw = store.queue_pop(queue, block=False)
        request_id, command, why = open_request(coordinator, raw)
        if command is None:
            coordinator.refuse(keys.SCALE_REQUESTS, why)
            if request_id:
                answer_unsigned(coordinator, request_id, why)
            continue
        record(run.events, EventKind.REFUSED, reason=reason)
        answer(coordinator, request_id, {"ok": False, "error": reason})
