"""``felactl scale``'s client: a command signed with the job secret, sent to the running job's coordinator.

The run directory says where the coordinator listens and its launch's session (the newest
``launch``/``resume`` event) and holds the secret (``runs/<id>/secret``, mode 0600). The command
goes onto the store queue ``<job>elastic/scale/requests`` as a signed :class:`ScaleRequestDoc`;
the coordinator answers under ``scale/reply/<id>`` with a signed :class:`ScaleReplyDoc` once the
job has switched (or refused, changing nothing). An answer that is not signed for this request is
ignored (and recorded as ``refused``): the only unsigned answer taken is a refusal, which the
coordinator gives to a request it cannot verify (a wrong secret). A request nobody answers in a
while is sent again (someone may have taken it off the queue); the coordinator answers a request
it has seen with the answer it gave, doing nothing twice.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

from felactl.control import Reader, Seal, job_binding, keys
from felactl.control.documents import ScaleReplyDoc, ScaleRequestDoc
from felactl.control.events import RefusalLog
from felactl.control.store import POLL_INTERVAL_S, connect_store, first_line, parse_endpoint
from felactl.errors import ControlPlaneError, InputError
from felactl.launcher.controlplane import read_secret_file
from felactl.launcher.rundir import DEFAULT_RUNS_ROOT, RESUME_HINT, RunDir, RunState


def coordinator_endpoint(run: RunDir) -> str:
    """Where the run's coordinator listens; an InputError when the run has no live launch (a run
    whose liveness is ``unknown``, from an older felactl, is tried: its coordinator may answer)."""
    state = run.run_state()
    if state.name == "finished":
        raise InputError(f"run {run.run_id} has finished; there is no job to scale")
    if state.name == "lost":
        raise InputError(
            f"run {run.run_id} is lost: {state.reason}, so nothing can rescale it; "
            + RESUME_HINT.format(run=run.run_id)
        )
    if state.name not in ("running", "unknown"):
        raise InputError(f"run {run.run_id} is not running (it is {state.name})")
    return str(run.last_start_or_end()["endpoint"])


RESEND_S = 5.0
"""A request not answered this long is pushed again (the same id: nothing is done twice)."""


def request_scale(
    run: str,
    command: dict,
    *,
    runs_root: Path = DEFAULT_RUNS_ROOT,
    secret_file: Path | None = None,
    timeout_s: float = 120.0,
) -> dict:
    """Send ``command`` (op add/remove/to) to the job; its answer, or InputError when refused."""
    rundir = RunDir.find(run, root=runs_root)
    host, port = parse_endpoint(coordinator_endpoint(rundir))
    secret = read_secret_file(secret_file or rundir.secret)
    session = str(rundir.last_start_or_end().get("session", ""))
    store = connect_store(host, port, timeout_s=10.0)
    seal = Seal(secret, job_binding(rundir.run_id, session))
    request_id = uuid.uuid4().hex
    request = seal.seal(
        keys.SCALE_REQUESTS,
        ScaleRequestDoc.KIND.value,
        ScaleRequestDoc(id=request_id, command={**command, "issued": time.time()}).to_body(),
    )
    reader = Reader(
        seal, store, keys.job_prefix(rundir.run_id, 0), on_refused=RefusalLog(rundir.events, by="felactl scale")
    )
    try:
        reply = _exchange(store, reader, request, request_id, timeout_s)
    except ControlPlaneError as exc:
        ended = _ended(rundir)
        if ended.name == "finished":
            raise InputError(
                f"run {rundir.run_id} finished its last step before the change could take effect; nothing changed"
            ) from exc
        if ended.name == "lost":
            raise ControlPlaneError(
                f"run {rundir.run_id} was lost under the request: {ended.reason}; "
                + RESUME_HINT.format(run=rundir.run_id)
            ) from exc
        raise ControlPlaneError(f"run {rundir.run_id}: {exc}") from exc
    if not reply.ok:
        raise InputError(f"refused: {reply.error or 'no reason given'}")
    return reply.result


def _exchange(store, reader: Reader, request: str, request_id: str, timeout_s: float) -> ScaleReplyDoc:
    """Push ``request`` and wait for its signed answer, pushing it again every :data:`RESEND_S`."""
    name = keys.scale_reply(request_id)
    deadline = time.monotonic() + timeout_s
    sent_at = -RESEND_S
    try:
        while time.monotonic() < deadline:
            if time.monotonic() - sent_at >= RESEND_S:
                store.queue_push(reader.prefix + keys.SCALE_REQUESTS, request)
                sent_at = time.monotonic()
            raw = reader.raw(name)
            if raw is not None:
                refusal = _unsigned_refusal(raw)
                if refusal is not None:
                    return refusal
                opened = reader.open(name, raw, ScaleReplyDoc.KIND.value)
                if opened is not None:
                    try:
                        reply = ScaleReplyDoc.from_body(opened.body)
                    except ValueError:
                        reply = None
                    if reply is not None and reply.id == request_id:
                        return reply
            time.sleep(POLL_INTERVAL_S)
    except RuntimeError as exc:
        raise ControlPlaneError(
            f"lost the coordinator while waiting for the coordinator's answer: {first_line(exc)}"
        ) from exc
    raise ControlPlaneError("timed out waiting for the coordinator's answer")


def _unsigned_refusal(raw: bytes) -> ScaleReplyDoc | None:
    """The coordinator's unsigned "no" to a request it could not verify (ok: false, and nothing else)."""
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    if isinstance(value, dict) and set(value) == {"ok", "error"} and value["ok"] is False:
        return ScaleReplyDoc(
            id="",
            ok=False,
            error=f"{value['error']} (an unsigned answer: the coordinator could not verify the request)",
        )
    return None


def _ended(run: RunDir, wait_s: float = 5.0) -> RunState:
    """The run's state once its coordinator went away under a request: a job that ends closes
    its store, possibly before it saw the request, and records how it ended just after, so give
    it a moment to leave ``running`` (or ``unknown``, for a run without evidence of life)."""
    deadline = time.monotonic() + wait_s
    while (state := run.run_state()).name in ("running", "unknown") and time.monotonic() < deadline:
        time.sleep(0.1)
    return state
