"""``felactl scale``'s client: a command signed with the job secret, sent to the running job's coordinator.

The run directory says where the coordinator listens (the newest ``launch``/``resume`` event) and
holds the secret (``runs/<id>/secret``, mode 0600). The command goes onto the store queue
``<job>elastic/scale/requests`` as ``{id, command, signature}``; the coordinator answers under
``scale/reply/<id>`` once the job has switched (or refused, changing nothing).
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

from felactl.errors import ControlPlaneError, InputError
from felactl.launcher.controlplane import (_wait_key, connect_store, job_prefix, parse_endpoint, read_secret_file,
                                           sign)
from felactl.launcher.rundir import RunDir


def coordinator_endpoint(run: RunDir) -> str:
    state = run.state()
    if state == "finished":
        raise InputError(f"run {run.run_id} has finished; there is no job to scale")
    if state != "running":
        raise InputError(f"run {run.run_id} is not running (it is {state})")
    return str(run.last_start_or_end()["endpoint"])


def request_scale(run: str, command: dict, *, runs_root: Path = Path("runs"), secret_file: Path | None = None,
                  timeout_s: float = 120.0) -> dict:
    """Send ``command`` (op add/remove/to) to the job; its answer, or InputError when refused."""
    rundir = RunDir.find(run, root=runs_root)
    secret = read_secret_file(secret_file or rundir.secret)
    host, port = parse_endpoint(coordinator_endpoint(rundir))
    store = connect_store(host, port, timeout_s=10.0)
    prefix = job_prefix(rundir.run_id, 0) + "elastic/"
    request_id = uuid.uuid4().hex
    text = json.dumps({**command, "issued": time.time()}, sort_keys=True)
    store.queue_push(prefix + "scale/requests", json.dumps(
        {"id": request_id, "command": text, "signature": sign(secret, f"scale|{request_id}|{text}")}))
    try:
        reply = json.loads(_wait_key(store, f"{prefix}scale/reply/{request_id}", time.monotonic() + timeout_s,
                                     "the coordinator's answer"))
    except ControlPlaneError as exc:
        if _ended(rundir) == "finished":
            raise InputError(f"run {rundir.run_id} finished its last step before the change could take effect; "
                             "nothing changed") from exc
        raise ControlPlaneError(f"run {rundir.run_id}: {exc}") from exc
    if not reply.get("ok"):
        raise InputError(f"refused: {reply.get('error', 'no reason given')}")
    return reply["result"]


def _ended(run: RunDir, wait_s: float = 5.0) -> str:
    """The run's state once its coordinator went away under a request: a job that ends closes
    its store, possibly before it saw the request, and records how it ended just after, so give
    it a moment to leave ``running``."""
    deadline = time.monotonic() + wait_s
    while (state := run.state()) == "running" and time.monotonic() < deadline:
        time.sleep(0.1)
    return state
