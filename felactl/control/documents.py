"""The documents of the control plane, typed, with their kind (what the signature binds)."""

from __future__ import annotations

import enum
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, ClassVar, TypeVar

T = TypeVar("T", bound="Document")


class DocKind(str, enum.Enum):
    JOB = "job"
    STOP = "stop"
    GENERATION = "generation"
    DONE = "done"
    AGENT_STATE = "agent-state"
    COMMAND = "command"
    SCALE_REQUEST = "scale-request"
    SCALE_REPLY = "scale-reply"
    HEARTBEAT = "heartbeat"
    READY = "ready"
    SWITCHED = "switched"
    STUCK = "stuck"
    LEFT = "left"
    SWITCH_AT = "switch-at"
    LAST_STEP = "last-step"
    ARRIVED = "arrived"


class Document:
    """A dataclass whose fields are its body; :meth:`from_body` checks each field's type."""

    KIND: ClassVar[DocKind]

    def to_body(self) -> dict:
        return asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_body(cls: type[T], body: dict) -> T:
        """The document in ``body``; ValueError when a field is missing or of the wrong type."""
        values = {}
        for f in fields(cls):  # type: ignore[arg-type]
            if f.name not in body:
                if f.default is not MISSING or f.default_factory is not MISSING:
                    continue
                raise ValueError(f"missing {f.name}")
            value = body[f.name]
            kind = _TYPES.get(str(f.type))
            if kind is not None and (not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool)):
                raise ValueError(f"{f.name}: {type(value).__name__}")
            values[f.name] = value
        return cls(**values)


_TYPES: dict[str, Any] = {
    "int": int,
    "float": (int, float),
    "str": str,
    "dict": dict,
    "list": list,
    "list[int]": list,
    "bool": bool,
}


@dataclass(frozen=True)
class StopDoc(Document):
    KIND: ClassVar[DocKind] = DocKind.STOP
    reason: str
    drain_s: float = 0.0


WORKER_MODULE = "felactl.agents.worker"
"""The module an agent runs for each of a plan's workers (``python -m``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Assignment:
    """What one agent runs in a job: its slots' global ranks and the worker module (or script)."""

    rank_offset: int
    world_size: int
    module: str = ""
    script: str = ""
    """A user's torchrun-style script, run as ``python script args`` (instead of a module)."""
    args: tuple[str, ...] = ()
    env: dict = field(default_factory=dict)
    local_indices: tuple[int, ...] = ()
    """Each slot's device index on the node (its LOCAL_RANK: the CUDA ordinal); empty: 0, 1, ..."""
    num_workers: int | None = None
    """Workers to start at once: None, one per slot; 0, a node joining a running elastic job,
    whose workers come later with the coordinator's ``add`` commands."""
    rendezvous_port: int = 0
    """The port, on the coordinator's host, of the store the workers' ``init_process_group("env://")``
    uses (their MASTER_PORT); 0: the control plane's own store."""
    attempt: int = 0
    """Which attempt of the job this is (torchrun's restart count)."""
    max_restarts: int | None = 0
    """Attempts after the first the coordinator may start: until then an agent whose workers ended
    waits for the next attempt (or the stop). None: no bound (a plan's job that restarts on a
    failure or a rescale: the launch counts its failures, and stops the agents at the end)."""

    @property
    def more_may_follow(self) -> bool:
        """Whether the coordinator may publish an attempt after this one."""
        return self.max_restarts is None or self.attempt < self.max_restarts

    keep_state_s: float = 0.0
    """After one of its workers failed, how long the agent gives the others to end by themselves
    before it stops them: a job whose survivors write their state for its restart
    (:mod:`felactl.agents.worker.survivors`). 0: stop them at once."""
    elastic: bool = False
    """The coordinator changes this job's members while it trains (the one place a job says so):
    the agent takes its ``add`` and ``kill`` commands and runs until the stop order, a worker that
    ends does not end the group, and its workers run the elastic membership (the agent tells them
    ``FELACTL_ELASTIC=1``)."""


@dataclass(frozen=True)
class JobDoc(Document):
    """The assignments of one attempt: agent id -> its :class:`Assignment` fields."""

    KIND: ClassVar[DocKind] = DocKind.JOB
    assignments: dict


@dataclass(frozen=True)
class GenerationDoc(Document):
    KIND: ClassVar[DocKind] = DocKind.GENERATION
    generation: int
    members: list[int]
    plan: str
    kind: str

    @classmethod
    def from_body(cls, body: dict) -> GenerationDoc:
        doc = super().from_body(body)
        if not all(isinstance(m, int) and not isinstance(m, bool) for m in doc.members):
            raise ValueError("members: not worker ids")
        return doc


@dataclass(frozen=True)
class DoneDoc(Document):
    KIND: ClassVar[DocKind] = DocKind.DONE
    step: int


class WorkerState(str, enum.Enum):
    """Where a worker, or an agent's group of workers, stands (an :class:`AgentStateDoc`'s ``state``)."""

    INIT = "init"
    HEALTHY = "healthy"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"


def group_state(states: list[WorkerState]) -> WorkerState:
    """One failed worker fails the group; the group succeeds only when every worker did."""
    if any(s is WorkerState.FAILED for s in states):
        return WorkerState.FAILED
    if states and all(s is WorkerState.SUCCEEDED for s in states):
        return WorkerState.SUCCEEDED
    if any(s is WorkerState.STOPPED for s in states):
        return WorkerState.STOPPED
    return WorkerState.HEALTHY


@dataclass(frozen=True)
class AgentStateDoc(Document):
    """An agent's report: its state and whatever it adds (its workers' table, exit codes)."""

    KIND: ClassVar[DocKind] = DocKind.AGENT_STATE
    state: str
    details: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {**self.details, "state": self.state}


@dataclass(frozen=True)
class CommandDoc(Document):
    """The coordinator's order to one agent: ``add`` or ``kill`` a worker."""

    KIND: ClassVar[DocKind] = DocKind.COMMAND
    op: str
    worker_id: int
    env: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ScaleRequestDoc(Document):
    KIND: ClassVar[DocKind] = DocKind.SCALE_REQUEST
    id: str
    command: dict


@dataclass(frozen=True)
class ScaleReplyDoc(Document):
    KIND: ClassVar[DocKind] = DocKind.SCALE_REPLY
    id: str
    ok: bool
    result: dict = field(default_factory=dict)
    error: str = ""


@dataclass(frozen=True)
class HeartbeatDoc(Document):
    KIND: ClassVar[DocKind] = DocKind.HEARTBEAT
    n: int
    step: int
    pid: int


@dataclass(frozen=True)
class ReadyDoc(Document):
    KIND: ClassVar[DocKind] = DocKind.READY
    pid: int
    time: float


@dataclass(frozen=True)
class SwitchedDoc(Document):
    """A member's report that it runs the new generation, with its timings."""

    KIND: ClassVar[DocKind] = DocKind.SWITCHED
    report: dict


@dataclass(frozen=True)
class StuckDoc(Document):
    """A member's report that its step failed, and the members it then could not reach."""

    KIND: ClassVar[DocKind] = DocKind.STUCK
    why: str
    """The failure in one line, ``Type: message`` (the user's own exception, or a collective's)."""
    unreachable: list[int] = field(default_factory=list)
    step: int = -1
    """The step that failed (its 0-based index: the steps done before it); -1: not said."""


@dataclass(frozen=True)
class LeftDoc(Document):
    KIND: ClassVar[DocKind] = DocKind.LEFT
    step: int


@dataclass(frozen=True)
class SwitchAtDoc(Document):
    """The step the members of a generation switch after, and to which generation."""

    KIND: ClassVar[DocKind] = DocKind.SWITCH_AT
    at: int
    to: int


@dataclass(frozen=True)
class LastStepDoc(Document):
    KIND: ClassVar[DocKind] = DocKind.LAST_STEP
    step: int


@dataclass(frozen=True)
class ArrivedDoc(Document):
    """A member is here for a generation; ``probe`` is where the others can test that they reach it."""

    KIND: ClassVar[DocKind] = DocKind.ARRIVED
    worker_id: int
    probe: str = ""
