"""A worker's settings, read from its environment: torchrun's variables plus ``FELACTL_*``.

| variable | meaning | default |
|---|---|---|
| ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` | place of this worker; RANK indexes ``plan.devices`` | required |
| ``MASTER_ADDR``, ``MASTER_PORT`` | store address when ``FELACTL_STORE`` is not set (rank 0 hosts it) | required then |
| ``FELACTL_PLAN`` | path of ``plan.yaml`` | required |
| ``FELACTL_RUN_DIR`` | where metrics, checkpoints and worker summaries go | required |
| ``FELACTL_STORE`` | ``host:port`` of the control-plane TCPStore (a client connects) | MASTER_ADDR:PORT |
| ``FELACTL_STORE_PREFIX`` | key prefix of this job in the store | ``felactl`` |
| ``FELACTL_GENERATION`` | membership generation; process groups live under ``<prefix>/gen<G>/`` | 0 |
| ``FELACTL_STEPS`` | iterations (global batches) to train | 10 |
| ``FELACTL_CHECKPOINT_EVERY`` | checkpoint every K steps (0: never) | 0 |
| ``FELACTL_SLOWDOWN`` | ``RANK=FACTOR[,RANK=FACTOR]`` | none |
| ``FELACTL_STRAGGLER`` | ``roundrobin:SECONDS`` or ``prob:P:SECONDS`` | none |
| ``FELACTL_TIMEOUT_S`` | collective and store timeout | 120 |
| ``FELACTL_ELASTIC`` | 1: the elastic membership (felactl.agents.worker.elastic); the agent sets it from its assignment's ``elastic`` | 0 |
| ``FELACTL_WORKER_ID`` | elastic: this worker's id, stable across generations (metrics' ``rank``) | RANK |
| ``FELACTL_JOIN`` | elastic: 1 for a newcomer (RANK/WORLD_SIZE are placeholders until it is admitted) | 0 |
| ``FELACTL_RESUME_FROM`` | a checkpoint file to start from (``felactl launch --resume``) | none |
| ``FELACTL_HEARTBEAT_S`` | elastic: seconds between heartbeats | 0.5 |
| ``FELACTL_COLLECTIVE_TIMEOUT_S`` | elastic: timeout of the data-parallel group's collectives | 30 |
| ``FELACTL_SECRET`` | the job secret, from its agent (never on the store): signs, verifies | none: no protection |
| ``FELACTL_JOB``, ``FELACTL_SESSION`` | the run and its launch's session, which signatures bind | prefix, none |
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from felactl.control import Reader, Seal, job_binding
from felactl.control.events import EVENTS_FILE, RefusalLog
from felactl.control.stragglers import Pattern, parse_pattern, parse_slowdown
from felactl.errors import InputError
from felactl.spec import Plan, load_plan


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    rank: int
    local_rank: int
    world_size: int
    store_host: str
    store_port: int
    host_store: bool
    """True when this worker (rank 0 without FELACTL_STORE) hosts the store itself."""
    plan_path: Path
    run_dir: Path
    store_prefix: str = "felactl"
    generation: int = 0
    steps: int = 10
    checkpoint_every: int = 0
    slowdown: float = 1.0
    pattern: Pattern | None = None
    timeout_s: float = 120.0
    elastic: bool = False
    worker_id: int = 0
    join: bool = False
    resume_from: Path | None = None
    heartbeat_s: float = 0.5
    collective_timeout_s: float = 30.0
    secret: str = field(default="", repr=False)
    job: str = ""
    session: str = ""

    def seal(self) -> Seal:
        """This job's seal. Without a secret (a worker started by hand, not by felactl's agent)
        documents are sealed with a key anyone can derive from the store prefix: they still name
        their key and job, but protect nothing."""
        secret = self.secret or hashlib.sha256(self.store_prefix.encode()).hexdigest()
        return Seal(secret, job_binding(self.job or self.store_prefix, self.session))

    def reader(self, store, prefix: str | None = None) -> Reader:
        """Reads and writes sealed documents at ``prefix`` (default: the job's) + a key's name in
        ``store``; a forgery is recorded in the run's events.jsonl."""
        return Reader(
            self.seal(),
            store,
            self.store_prefix if prefix is None else prefix,
            on_refused=_refusals(self.events, self.worker_id),
        )

    @property
    def events(self) -> Path:
        """The run's events.jsonl (where this node has the run directory)."""
        return self.run_dir / EVENTS_FILE

    def load_plan(self) -> Plan:
        """The plan, this worker's one source for the sync mode, the batch, the stages and the
        backend (the launcher writes ``--sync`` into the run's copy), checked against ``WORLD_SIZE``."""
        plan = load_plan(self.plan_path)
        if len(plan.devices) != self.world_size:
            raise InputError(
                f"{self.plan_path}: plan has {len(plan.devices)} devices but WORLD_SIZE is {self.world_size}"
            )
        return plan


_REFUSAL_LOGS: dict[tuple[Path, int], RefusalLog] = {}


def _refusals(events: Path, worker_id: int) -> RefusalLog:
    """One log per worker process, however many readers it has (each key's refusals are counted once)."""
    return _REFUSAL_LOGS.setdefault((events, worker_id), RefusalLog(events, worker=worker_id))


def _int(env: Mapping[str, str], name: str, default: int | None = None, minimum: int = 0) -> int:
    text = env.get(name)
    if text is None or text == "":
        if default is None:
            raise InputError(f"{name} is not set")
        return default
    try:
        value = int(text)
    except ValueError:
        raise InputError(f"{name} must be an integer, got {text!r}") from None
    if value < minimum:
        raise InputError(f"{name} must be >= {minimum}, got {value}")
    return value


def _address(env: Mapping[str, str], rank: int) -> tuple[str, int, bool]:
    if env.get("FELACTL_STORE"):
        host, _, port = env["FELACTL_STORE"].rpartition(":")
        if not host or not port.isdigit():
            raise InputError(f"FELACTL_STORE must be host:port, got {env['FELACTL_STORE']!r}")
        return host, int(port), False
    if "MASTER_ADDR" not in env:
        raise InputError("set FELACTL_STORE or MASTER_ADDR/MASTER_PORT")
    return env["MASTER_ADDR"], _int(env, "MASTER_PORT", minimum=1), rank == 0


def from_env(env: Mapping[str, str] | None = None) -> WorkerConfig:
    env = os.environ if env is None else env
    rank = _int(env, "RANK")
    world_size = _int(env, "WORLD_SIZE", minimum=1)
    if rank >= world_size:
        raise InputError(f"RANK {rank} must be < WORLD_SIZE {world_size}")
    for name in ("FELACTL_PLAN", "FELACTL_RUN_DIR"):
        if not env.get(name):
            raise InputError(f"{name} is not set")
    host, port, host_store = _address(env, rank)
    return WorkerConfig(
        rank=rank,
        local_rank=_int(env, "LOCAL_RANK", default=rank),
        world_size=world_size,
        store_host=host,
        store_port=port,
        host_store=host_store,
        plan_path=Path(env["FELACTL_PLAN"]),
        run_dir=Path(env["FELACTL_RUN_DIR"]),
        store_prefix=env.get("FELACTL_STORE_PREFIX") or "felactl",
        generation=_int(env, "FELACTL_GENERATION", default=0),
        steps=_int(env, "FELACTL_STEPS", default=10, minimum=1),
        checkpoint_every=_int(env, "FELACTL_CHECKPOINT_EVERY", default=0),
        slowdown=parse_slowdown(env.get("FELACTL_SLOWDOWN")).get(rank, 1.0),
        pattern=parse_pattern(env.get("FELACTL_STRAGGLER")),
        timeout_s=float(_int(env, "FELACTL_TIMEOUT_S", default=120, minimum=1)),
        elastic=env.get("FELACTL_ELASTIC") == "1",
        worker_id=_int(env, "FELACTL_WORKER_ID", default=rank),
        join=env.get("FELACTL_JOIN") == "1",
        resume_from=Path(env["FELACTL_RESUME_FROM"]) if env.get("FELACTL_RESUME_FROM") else None,
        heartbeat_s=_float(env, "FELACTL_HEARTBEAT_S", 0.5),
        collective_timeout_s=_float(env, "FELACTL_COLLECTIVE_TIMEOUT_S", 30.0),
        secret=_secret(env),
        job=env.get("FELACTL_JOB", ""),
        session=env.get("FELACTL_SESSION", ""),
    )


def _secret(env: Mapping[str, str]) -> str:
    text = env.get("FELACTL_SECRET", "").strip()
    if text and (len(text) < 32 or any(c not in "0123456789abcdef" for c in text.lower())):
        raise InputError("FELACTL_SECRET is not a felactl job secret (expected at least 32 hex digits)")
    return text


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    text = env.get(name)
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise InputError(f"{name} must be a number, got {text!r}") from None
    if value <= 0:
        raise InputError(f"{name} must be > 0, got {value}")
    return value
