"""The membership decision's vocabulary: what the coordinator knows (:class:`State`), what it saw
since its last look (:class:`Seen`), and the actions :func:`felactl.launcher.membership.decide.decide`
asks for. Frozen dataclasses only: a test builds any state and sighting by hand."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from felactl.launcher.scale_plan import ScalingPolicy


# --- what the coordinator knows ------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Rules:
    """The job's fixed terms: timeouts, slots, where logs are. The timeouts have no defaults here:
    the launch's settings (:class:`felactl.launcher.elastic.ElasticSettings`) give every one."""

    heartbeat_timeout_s: float
    ready_timeout_s: float
    switch_timeout_s: float
    agent_gone_s: float
    """An agent this long silent when its worker goes silent is taken for gone with it (two
    missed agent beats, and a half for a busy machine)."""
    min_nodes: int = 1
    """Nodes the job needs to start on (torchrun's ``--nnodes MIN:MAX``): a node whose workers
    cannot start fails the job unless this many others are left, which go on without it."""
    max_nproc_per_node: int | None = None
    profile: Mapping[str, tuple[str, ...]] | None = None
    """Node -> its devices in the run's cluster profile; None when the run has no profile (the
    planner can place a newcomer only on a profiled device)."""
    logs: str = "logs"
    run_id: str = "run"
    device_prefix: str = "cpu"
    """How a newcomer's device is named without a profile (``cpu3``; ``cuda3`` in a GPU job)."""


@dataclass(frozen=True)
class Worker:
    """A worker process the coordinator started or launched (a member, a newcomer, or one that
    left: its id is never reused). ``beat`` is its newest heartbeat seen and ``since`` when that
    changed (or when the worker was started)."""

    node: str
    device: str
    agent_id: str
    beat: str | None = None
    since: float = 0.0


@dataclass(frozen=True)
class Agent:
    """A node's agent, its worker slots (when neither a profile nor --max-nproc-per-node says
    otherwise) and its own beat, followed like a worker's."""

    agent_id: str
    slots: int
    beat: str | None = None
    since: float = 0.0


@dataclass(frozen=True)
class Request:
    """A ``felactl scale`` request as opened: its command, or None with ``problem`` when it is
    not signed for this job or malformed."""

    id: str
    command: Mapping | None
    problem: str = ""


@dataclass(frozen=True)
class Starting:
    """Newcomers started for ``request``, joining once all are ``ready``."""

    request: Request
    policy: ScalingPolicy | None
    node: str
    newcomers: tuple[int, ...]
    deadline: float
    ready: frozenset[int] = frozenset()


@dataclass(frozen=True)
class Switching:
    """A published generation waiting for every member's ``switched`` report."""

    generation: int
    kind: str
    members: tuple[int, ...]
    before: tuple[int, ...]
    deadline: float
    if_finished: tuple[int, ...]
    """The members should the workers that stay finish their last step before switching (the
    change is moot): the old members, or for a failure the survivors (the dead never finish)."""
    request_id: str | None = None
    reported: frozenset[int] = frozenset()

    @property
    def stayers(self) -> tuple[int, ...]:
        return tuple(w for w in self.members if w in self.before)


@dataclass(frozen=True, kw_only=True)
class State:
    rules: Rules
    generation: int
    members: tuple[int, ...]
    workers: Mapping[int, Worker]
    agents: Mapping[str, Agent]
    """Node -> its agent, in the order the nodes came (the first is where ``--add`` goes by default)."""
    next_id: int
    done: frozenset[int] = frozenset()
    stuck_since: float | None = None
    starting: Starting | None = None
    switching: Switching | None = None
    deferred: tuple[Request, ...] = ()
    """Requests that came while a change was under way, served in order once it is done."""
    answered: frozenset[str] = frozenset()
    reformed_after: frozenset[tuple[int, str]] = frozenset()
    """The failed steps the newest generation was re-formed after, as (step, the failure's line):
    the same failure on the same step again is the job's, not a worker's."""
    launching: bool = False
    """No member has started yet (built its model and formed its group): a member lost now is a
    node that could not start."""

    @property
    def busy(self) -> bool:
        return self.starting is not None or self.switching is not None


# --- what it saw -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Exit:
    code: int
    failure: str | None = None


@dataclass(frozen=True)
class Stuck:
    """A member's report that its step failed: which step, why (one line), and the members it
    then could not reach."""

    unreachable: frozenset[int] = frozenset()
    step: int = -1
    why: str = ""


@dataclass(frozen=True)
class Join:
    """An agent admitted to the running job for ``node``."""

    node: str
    agent_id: str
    slots: int


@dataclass(frozen=True, kw_only=True)
class Seen:
    now: float
    joins: tuple[Join, ...] = ()
    agent_beats: Mapping[str, str | None] = field(default_factory=dict)
    """Agent id -> its beat key's value (None: absent) for the agents looked at."""
    heartbeats: Mapping[int, str] = field(default_factory=dict)
    """Worker -> its newest valid heartbeat; a worker missing here keeps the beat it had (a
    forged or unreadable beat neither revives a silent worker nor silences a live one)."""
    exits: Mapping[int, Exit] = field(default_factory=dict)
    started: frozenset[int] = frozenset()
    """Workers whose heartbeat says they have started (their model built, their group formed)."""
    done: frozenset[int] = frozenset()
    stuck: Mapping[int, Stuck] = field(default_factory=dict)
    """The members that said their step failed in the current generation, each with its report."""
    ready: frozenset[int] = frozenset()
    switched: frozenset[int] = frozenset()
    """Members that reported the generation being switched to."""
    requests: tuple[Request, ...] = ()
    planning_failed: str | None = None
    """The executor's report: the change :func:`decide` just asked for could not be planned."""


# --- what to do ------------------------------------------------------------------------------
@dataclass(frozen=True)
class AdmitAgent:
    node: str
    agent_id: str
    replaces: str | None


@dataclass(frozen=True)
class IgnoreAgent:
    """An agent joined for a node whose agent still answers."""

    node: str
    agent_id: str


@dataclass(frozen=True)
class Drop:
    """Kill these workers (peers blocked in a collective with them fail at once)."""

    reasons: Mapping[int, str]


@dataclass(frozen=True)
class StartNewcomers:
    """Ask ``node``'s agent for these workers (id -> device); ``members`` is who the change
    would have, to plan for while they start."""

    node: str
    agent_id: str
    newcomers: Mapping[int, str]
    members: tuple[int, ...]
    policy: ScalingPolicy | None


@dataclass(frozen=True)
class StopNewcomers:
    wids: tuple[int, ...]


@dataclass(frozen=True)
class Switch:
    """Plan for ``members`` and publish them as ``generation`` (the members were ``before``)."""

    generation: int
    members: tuple[int, ...]
    before: tuple[int, ...]
    kind: str
    reason: str | None = None
    policy: ScalingPolicy | None = None


@dataclass(frozen=True)
class SwitchDone:
    """Record the switch (with the reports that came) and answer its request with it."""

    generation: int
    request_id: str | None


@dataclass(frozen=True)
class SwitchAbandoned:
    """The workers finished before switching: the generation before stays in force."""

    generation: int


@dataclass(frozen=True)
class Answer:
    request_id: str
    result: Mapping


@dataclass(frozen=True)
class AnswerAgain:
    request_id: str


@dataclass(frozen=True)
class Refuse:
    """Refuse a request (``request_id`` "": record it, answer nobody); ``forged``: it is not
    signed for this job, so any answer goes unsigned."""

    request_id: str
    reason: str
    command: Mapping | None = None
    forged: bool = False


@dataclass(frozen=True)
class Finish:
    pass


@dataclass(frozen=True)
class Fail:
    reason: str
    worker: int | None = None
    """The worker whose log tells more (the executor adds where that log is)."""
    bad_input: bool = False
    """Every worker that failed refused its input (exit 2) before it started (a global batch its
    dataset cannot fill): the launch ends as bad input, exit 2."""


Action = (
    AdmitAgent
    | IgnoreAgent
    | Drop
    | StartNewcomers
    | StopNewcomers
    | Switch
    | SwitchDone
    | SwitchAbandoned
    | Answer
    | AnswerAgain
    | Refuse
    | Finish
    | Fail
)

FINISHED_FIRST = "the job finished its last step; nothing changed"
FAILED_FIRST = "the job failed; nothing changed"
