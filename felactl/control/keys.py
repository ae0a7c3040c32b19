"""Every key of a job on the control-plane store, by name relative to the job's prefix.

A job's keys live under ``felactl/<job>/<generation>/`` (:func:`job_prefix`); the names here are
relative to it. The signature of a document binds the relative name (so a document cannot be
moved to another key) and the job. Worker-side code that holds a ``PrefixStore`` of the elastic
namespace uses the part after :data:`ELASTIC` (:func:`in_elastic`).
"""

from __future__ import annotations

JOB_NAME = "felactl/job"
"""Unprefixed: the name of the job this store's coordinator runs (not a secret), so an agent
started without ``--job`` finds it. A hint: an agent that reads a wrong one fails to join."""

ELASTIC = "elastic/"


def job_prefix(job: str, generation: int) -> str:
    return f"felactl/{job}/{generation}/"


# --- the coordinator's documents -------------------------------------------------------------
STOP = "stop"


def job_document(attempt: int) -> str:
    """The assignments of a job's ``attempt`` (0: ``job``)."""
    return "job" if attempt == 0 else f"job.{attempt}"


def attempt_stop(attempt: int) -> str:
    """A stop order for one attempt's workers (a job rescaled by a restart drains them; its agents stay)."""
    return f"{STOP}/attempt{attempt}"


# --- joining (per agent: no key is shared by every joining agent) ------------------------------
JOIN_REQUESTS = "join/requests"


def join_challenge(agent_id: str, client_nonce: str) -> str:
    return f"join/challenge/{agent_id}/{client_nonce}"


def join_reply(agent_id: str, client_nonce: str) -> str:
    return f"join/reply/{agent_id}/{client_nonce}"


# --- agents ---------------------------------------------------------------------------------------
def agent_state(agent_id: str) -> str:
    return f"agents/{agent_id}/state"


def agent_beat(agent_id: str) -> str:
    return f"agents/{agent_id}/beat"


AGENT_BEAT_S = 0.5
"""How often an agent of an elastic job adds to its :func:`agent_beat` counter (the coordinator
judges its silence by it)."""


def agent_commands(agent_id: str) -> str:
    return f"agents/{agent_id}/commands"


def command_queue(prefix: str, agent_id: str) -> str:
    """The store queue (a full name: ``prefix`` is the job's) where the coordinator puts its signed
    commands to agent ``agent_id``."""
    return prefix + agent_commands(agent_id)


# --- elastic membership ---------------------------------------------------------------------------
GENERATION = ELASTIC + "generation"
"""A hint: the newest generation number. Only a signed :func:`generation_document` makes it real."""
SCALE_REQUESTS = ELASTIC + "scale/requests"


def generation_document(generation: int) -> str:
    return f"{ELASTIC}gen/{generation}"


def scale_reply(request_id: str) -> str:
    return f"{ELASTIC}scale/reply/{request_id}"


def heartbeat(worker_id: int) -> str:
    return f"{ELASTIC}hb/{worker_id}"


def ready(worker_id: int) -> str:
    return f"{ELASTIC}ready/{worker_id}"


def done(worker_id: int) -> str:
    return f"{ELASTIC}done/{worker_id}"


def switched(generation: int, worker_id: int) -> str:
    return f"{ELASTIC}switched/{generation}/{worker_id}"


def stuck(generation: int, worker_id: int) -> str:
    return f"{ELASTIC}stuck/{generation}/{worker_id}"


def left(generation: int, worker_id: int) -> str:
    return f"{ELASTIC}left/{generation}/{worker_id}"


def arrived(generation: int, rank: int) -> str:
    """Member ``rank`` of ``generation`` is here (the barrier before its process group forms)."""
    return f"{ELASTIC}arrived/{generation}/{rank}"


def switch_agreement(generation: int) -> str:
    """Where the members of ``generation`` agree on the step to switch at (modes without a lockstep)."""
    return f"{ELASTIC}switch/{generation}"


# --- the workers' own agreements ------------------------------------------------------------------
LAST_STEP = "drain/last_step"
"""A graceful stop's agreed last step (felactl.agents.worker.drain): on the job's store, as an
elastic job's drain reaches every generation; a job of fixed members agrees on one per attempt."""


def last_step(generation: int | None) -> str:
    """The key of the agreed last step: the job's (None), or one attempt's generation's."""
    return LAST_STEP if generation is None else f"{LAST_STEP}/{generation}"


DATA_NEXT = "data/next"
"""A counter: the next sample index (workers at their own pace claim samples from it)."""


def in_elastic(name: str) -> str:
    """``name`` (one of the elastic keys above) relative to the elastic namespace."""
    if not name.startswith(ELASTIC):
        raise ValueError(f"internal: {name!r} is not an elastic key")
    return name[len(ELASTIC) :]


# --- the data plane (not signed: see felactl.control's docstring) ----------------------------------
def generation_namespace(store_prefix: str, generation: int) -> str:
    """Where generation ``generation``'s process groups meet (``PrefixStore``; its ``pg/`` rendezvous)."""
    return f"{store_prefix}/gen{generation}"


ATTEMPT_FAILED = "failed"
"""Set in an attempt's store by its first worker to fail, in a job whose survivors keep their
state (:mod:`felactl.agents.worker.survivors`): the others stop waiting to step together."""


def step_commit(step: int) -> str:
    """A counter: the workers that summed step ``step``'s gradients (:mod:`felactl.agents.worker.survivors`)."""
    return f"commit/{step}"


def step_committed(step: int) -> str:
    """Set by the last worker to sum step ``step``'s gradients: every worker may step its optimizer."""
    return f"commit/{step}/all"


def kept_stage(steps: int, stage: int) -> str:
    """A counter: the survivors of a failure that offered to write stage ``stage``'s state after
    ``steps`` steps; the first one writes it."""
    return f"kept/{steps}/{stage}"


def token(step: int, name: str) -> str:
    """The token bucket's key ``name`` of iteration ``step``."""
    return f"tok/{step}/{name}"


def token_speed(rank: int) -> str:
    return f"tok/speed/{rank}"


TOKEN_GROUPS = "tok/groups/count"


def token_group(bits: int) -> str:
    """Marks a member group (a bit set of workers) the job has formed."""
    return f"tok/groups/{bits}"


def token_bucket(rank: int) -> str:
    """(Relative to :func:`token`) the counter of ``rank``'s sub-bucket."""
    return f"b/{rank}"


def token_helpers(rank: int) -> str:
    """(Relative to :func:`token`) how many workers help ``rank``."""
    return f"helpers/{rank}"


def token_sum(piece: int) -> str:
    """(Relative to :func:`token`) piece ``piece`` of an iteration's summed gradients."""
    return f"sum/{piece}"


def flexible_requests(step: int) -> str:
    return f"fx/{step}/requests"


def flexible_reply(step: int, rank: int) -> str:
    return f"fx/{step}/reply/{rank}"


def sdpipe_stage(stage: int) -> str:
    """The prefix of one stage's SDPipe scheduler keys (the names below are relative to it)."""
    return f"sd/s{stage}/"


SDPIPE_TICKETS = "tickets"
"""The counter that orders the stage's arrivals."""


def sdpipe_arrival(ticket: int) -> str:
    """``rank:kind`` of the ``ticket``-th arrival (a worker ready for a group, or leaving)."""
    return f"arrival/{ticket}"


def sdpipe_group(rank: int, round_: int) -> str:
    """The group ``rank`` averages in at its ``round_``-th sync."""
    return f"group/{rank}/{round_}"


PROFILE_PROGRESS = "profile/progress"


def profile_result(rank: int) -> str:
    return f"profile/result/{rank}"
