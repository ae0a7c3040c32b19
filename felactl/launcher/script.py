"""``felactl launch --script``: a user's own torchrun-style script on felactl's agents.

The script runs unmodified, as ``python train.py ARGS`` per worker, with torchrun's environment
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``, ``TORCHELASTIC_RESTART_COUNT``, ``TORCHELASTIC_MAX_RESTARTS``,
``TORCHELASTIC_RUN_ID``). The coordinator, its agents and their join are the ones a plan's launch
uses; only what the workers run differs.

Rendezvous: like torchrun's agent store, ``TORCHELASTIC_USE_AGENT_STORE=True``, so the script's
``init_process_group("env://")`` connects to a TCPStore as a client (none of its ranks hosts one).
The coordinator serves a fresh store on its own host for every attempt (``MASTER_ADDR`` is the
coordinator's host as each agent reaches it, ``MASTER_PORT`` that store's port): every agent already
reaches that host, and no key of a failed attempt can meet the next one.

Restarts follow torchrun's: any worker's failure fails the attempt; the coordinator then publishes
the next attempt (its agents stop the workers still running and start every worker again), up to
``max_restarts`` times, each recorded as a ``restart`` event. The job succeeds when every worker of
an attempt exits 0. When the last attempt fails, the launch exits with the exit code of the
worker that failed first (torchrun exits 1); a worker killed by signal N reads as 128 + N.
"""

from __future__ import annotations

import enum
import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from felactl.control import EventKind
from felactl.control.documents import Assignment, WorkerState, group_state
from felactl.control.events import record
from felactl.control.store import parse_endpoint, serve_store
from felactl.errors import InputError, WorkerFailed
from felactl.fsutil import atomic_write_text
from felactl.launcher import hosts as hostfile
from felactl.launcher.controlplane import Coordinator, Member, write_secret_file
from felactl.launcher.follow import POLL_S
from felactl.launcher.launch_defaults import JOIN_TIMEOUT_S
from felactl.launcher.liveness import Heartbeat, LaunchIdentity
from felactl.launcher.node_agents import Agents, assign_ranks, start_coordinator, supervised
from felactl.launcher.prepare import check_nodes, node_devices
from felactl.launcher.rundir import DEFAULT_RUNS_ROOT, RunDir
from felactl.launcher.scale_requests import refuse_requests
from felactl.launcher.slurm import Allocation
from felactl.machine import default_node_name
from felactl.spec import Plan, load_plan, save

NOT_ELASTIC = "a --script job cannot be rescaled: felactl does not own its training loop"
SCRIPT_STOP_S = 30.0
"""How long a stopped script's workers have to leave after SIGINT before they are killed."""


class ScriptFailed(WorkerFailed):
    """The script failed on its last attempt; the launch exits with that worker's own exit code."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True, kw_only=True)
class ScriptOptions:
    script: Path
    args: tuple[str, ...] = ()
    """Given to the script verbatim (what follows ``--`` on the command line)."""
    plan_path: Path | None = None
    """Where the workers go: the plan's devices (its sync and stages are not used)."""
    nproc_per_node: int | None = None
    """Workers on this machine without a plan (default: its GPUs, else 2 CPU slots)."""
    max_restarts: int = 0
    run_id: str | None = None
    runs_root: Path = DEFAULT_RUNS_ROOT
    rdzv_endpoint: str | None = None
    nnodes: int = 1
    hostfile: Path | None = None
    node_name: str | None = None
    join_timeout_s: float = JOIN_TIMEOUT_S
    slurm: Allocation | None = None
    """The Slurm allocation the script runs on (an agent per node as a job step)."""

    def __post_init__(self) -> None:
        if not self.script.is_file():
            raise InputError(f"--script {self.script}: no such file")
        if self.max_restarts < 0:
            raise InputError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if self.nproc_per_node is not None and self.nproc_per_node < 1:
            raise InputError(f"--nproc-per-node must be >= 1, got {self.nproc_per_node}")
        if self.nproc_per_node is not None and self.plan_path is not None:
            raise InputError("give --nproc-per-node or a PLAN (its devices say how many workers), not both")
        if self.plan_path is not None and not self.plan_path.is_file():
            raise InputError(f"{self.plan_path}: no such plan file")
        if self.nnodes < 1:
            raise InputError(f"--nnodes must be >= 1, got {self.nnodes}")
        if self.nnodes > 1 and not (self.rdzv_endpoint or self.hostfile or self.slurm):
            raise InputError("--nnodes > 1 needs --rdzv-endpoint (agents join there) or --hostfile")
        if self.rdzv_endpoint is not None:
            parse_endpoint(self.rdzv_endpoint)
        if self.hostfile is not None:
            hostfile.read_hostfile(self.hostfile)


# --- decisions (pure) ---------------------------------------------------------------------------
class Action(enum.Enum):
    WAIT = "wait"
    SUCCEED = "succeed"
    RESTART = "restart"
    FAIL = "fail"


def next_action(reports: list[dict | None], attempt: int, max_restarts: int) -> Action:
    """What the coordinator does given each agent's latest report (reports of an earlier attempt
    count as still running): every worker exited 0 -> succeed; any failed -> restart while
    restarts are left, else fail."""
    states = [WorkerState(r["state"]) if r and r.get("attempt", 0) == attempt else WorkerState.HEALTHY for r in reports]
    state = group_state(states)
    if state is WorkerState.SUCCEEDED:
        return Action.SUCCEED
    if state is WorkerState.HEALTHY:
        return Action.WAIT
    return Action.RESTART if attempt < max_restarts else Action.FAIL


@dataclass(frozen=True)
class Failure:
    rank: int | None
    exit_code: int
    """The launch's exit code: the worker's own, 128 + N for a worker killed by signal N."""
    line: str


def first_failure(reports: list[dict | None], attempt: int) -> Failure:
    """The worker of ``attempt`` that failed first (the root cause; the others often die of it)."""
    seen = []
    for r in reports:
        if not r or r.get("attempt", 0) != attempt:
            continue
        for rank, line in r.get("failures", {}).items():
            when = r.get("failed_at", {}).get(rank, float("inf"))
            seen.append((when, int(rank), int(r.get("exit_codes", {}).get(rank, 1)), line))
    if not seen:
        return Failure(None, 1, "an agent stopped before its workers ended")
    _, rank, code, line = min(seen)
    return Failure(rank, 128 - code if code < 0 else code or 1, line)


def script_assignments(members: list[Member], local_node: str) -> dict[str, Assignment]:
    """Ranks by node, this machine's first, then by node name; each agent runs one worker per slot."""
    ordered = sorted(members, key=lambda m: (m.node_name != local_node, m.node_name))
    world_size = sum(m.num_slots for m in ordered)
    assignments, offset = {}, 0
    for member in ordered:
        assignments[member.agent_id] = Assignment(rank_offset=offset, world_size=world_size)
        offset += member.num_slots
    return assignments


# --- doing -------------------------------------------------------------------------------------
def launch_script(options: ScriptOptions) -> dict[str, Any]:
    """Run the script to its end on every worker, restarting as allowed; return the summary
    (also ``summary.json``). Raises :class:`ScriptFailed` when the last attempt fails."""
    local_node = options.node_name or default_node_name()
    plan = load_plan(options.plan_path) if options.plan_path is not None else None
    nodes = node_devices(plan, local_node) if plan is not None else None
    endpoint, local_slots, placed, num_agents = _agents_layout(options, nodes, local_node)
    run, secret = _prepare_run(options, plan)
    coordinator = start_coordinator(secret, endpoint, run)
    heartbeat = Heartbeat(run.heartbeat)
    started = time.monotonic()
    record(
        run.events,
        EventKind.LAUNCH,
        run=run.run_id,
        script=str(options.script),
        args=list(options.args),
        endpoint=coordinator.endpoint,
        session=coordinator.session,
        launcher=LaunchIdentity.of_this_process().to_dict(),
    )
    agents = Agents(
        coordinator,
        secret,
        local_slots=local_slots,
        local_node=local_node,
        logs=run.logs,
        job=run.run_id,
        hostfile=options.hostfile,
        join_timeout_s=options.join_timeout_s,
        slurm=options.slurm,
        node_slots=placed,
    )
    # A stop gives each worker SIGINT, as torchrun forwards it: the script may clean up.
    with supervised(coordinator, agents, run, heartbeat, drain_s=SCRIPT_STOP_S, late_requests=NOT_ELASTIC):
        agents.start()
        members = coordinator.wait_members(num_agents, options.join_timeout_s, alive=agents.check)
        base = _assignments(options, run, plan, nodes, members, local_node)
        attempts, failure = _run_attempts(coordinator, run, agents, members, base, options.max_restarts)
        coordinator.stop("finished" if failure is None else "failed")
    return _end(options, run, started, next(iter(base.values())).world_size, attempts, failure)


def _end(
    options: ScriptOptions, run: RunDir, started: float, num_workers: int, attempts: int, failure: Failure | None
) -> dict[str, Any]:
    """The run's summary (also ``summary.json``) and its last event; :class:`ScriptFailed` when
    the last attempt failed."""
    summary = {
        "run": run.run_id,
        "run_dir": str(run.path),
        "script": str(options.script),
        "args": list(options.args),
        "num_workers": num_workers,
        "exit_code": 0 if failure is None else failure.exit_code,
        "attempts": attempts,
        "restarts": attempts - 1,
        "wall_s": time.monotonic() - started,
        **({"failure": asdict(failure)} if failure is not None else {}),
    }
    run.write_summary(summary)
    if failure is not None:
        message = (
            f"the script failed on rank {failure.rank} with exit code {failure.exit_code} "
            f"({failure.line}) after {attempts} attempt(s); logs in {run.logs}"
        )
        record(run.events, EventKind.FAILED, reason=message, exit_code=failure.exit_code)
        raise ScriptFailed(message, failure.exit_code)
    record(run.events, EventKind.FINISHED, attempts=attempts)
    return summary


def _agents_layout(
    options: ScriptOptions, nodes: dict[str, tuple[str, ...]] | None, local_node: str
) -> tuple[str | None, int, dict[str, int | None] | None, int]:
    """Where the coordinator listens, this machine's worker slots, the agents felactl starts on
    other nodes (node -> slots; None: none) and how many agents join: a plan's nodes say the
    workers; in a Slurm allocation an agent per node runs as a job step (``--nproc-per-node`` or
    the node's own slots without a plan)."""
    if options.slurm is not None:
        if nodes is not None:
            options.slurm.check_holds(nodes, str(options.plan_path))
            placed = {node: len(devices) for node, devices in nodes.items()}
        else:
            placed = dict.fromkeys(options.slurm.nodes, options.nproc_per_node)
        endpoint = options.rdzv_endpoint or options.slurm.coordinator_endpoint()
        return endpoint, 0, placed, len(placed)
    if nodes is not None:
        check_nodes(options, nodes, local_node, options.plan_path)
        return options.rdzv_endpoint, len(nodes.get(local_node, ())), None, len(nodes)
    return options.rdzv_endpoint, _default_nproc(options), None, _num_agents(options)


def _default_nproc(options: ScriptOptions) -> int:
    from felactl.launcher.profile import default_nproc_per_node

    return options.nproc_per_node or default_nproc_per_node()


def _num_agents(options: ScriptOptions) -> int:
    if options.hostfile is not None:
        return 1 + len(hostfile.read_hostfile(options.hostfile))
    return options.nnodes


def _prepare_run(options: ScriptOptions, plan: Plan | None) -> tuple[RunDir, str]:
    run = RunDir.create(options.run_id, root=options.runs_root)
    secret = write_secret_file(run.secret)
    if plan is not None:
        save(plan, run.plan)
    atomic_write_text(
        run.launch_options,
        json.dumps(
            {
                k: (list(v) if isinstance(v, tuple) else str(v) if isinstance(v, Path) else v)
                for k, v in asdict(options).items()
            },
            indent=2,
        )
        + "\n",
    )
    return run, secret


def _assignments(
    options: ScriptOptions, run: RunDir, plan: Plan | None, nodes, members: list[Member], local_node: str
) -> dict[str, Assignment]:
    """Each agent's ranks (a plan's devices, or the slots each agent offers), running the script."""
    if plan is not None:
        ranked = assign_ranks(plan, members, nodes, {})
    else:
        ranked = script_assignments(members, local_node)
    by_offset = sorted(ranked, key=lambda agent_id: ranked[agent_id].rank_offset)
    env = {
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_MAX_RESTARTS": str(options.max_restarts),
        "TORCHELASTIC_RUN_ID": run.run_id,
        "FELACTL_RUN_DIR": str(run.path.resolve()),
    }
    return {
        agent_id: replace(
            a,
            module="",
            script=str(options.script.resolve()),
            args=tuple(options.args),
            max_restarts=options.max_restarts,
            env={**env, "GROUP_RANK": str(by_offset.index(agent_id))},
        )
        for agent_id, a in ranked.items()
    }


def _run_attempts(
    coordinator: Coordinator,
    run: RunDir,
    agents: Agents,
    members: list[Member],
    base: dict[str, Assignment],
    max_restarts: int,
) -> tuple[int, Failure | None]:
    """Attempt after attempt until one succeeds or the restarts are spent: (attempts, last failure)."""
    stores = []  # this attempt's rendezvous store and the one before (its workers may still be stopping)
    for attempt in range(max_restarts + 1):
        store, port = serve_store(coordinator.host)
        stores = [*stores[-1:], store]
        coordinator.publish_assignments(
            {
                aid: replace(
                    a, attempt=attempt, rendezvous_port=port, env={**a.env, "TORCHELASTIC_RESTART_COUNT": str(attempt)}
                )
                for aid, a in base.items()
            },
            attempt=attempt,
        )
        if attempt == 0:
            record(run.events, EventKind.START, members=[m.node_name for m in members])
        action, reports = _watch_attempt(coordinator, run, agents, members, attempt, max_restarts)
        if action is Action.SUCCEED:
            return attempt + 1, None
        failure = first_failure(reports, attempt)
        if action is Action.FAIL:
            return attempt + 1, failure
        record(
            run.events,
            EventKind.RESTART,
            attempt=attempt + 1,
            restart_count=attempt + 1,
            max_restarts=max_restarts,
            failed_rank=failure.rank,
            exit_code=failure.exit_code,
            reason=failure.line,
        )
    raise AssertionError("unreachable: the last attempt either succeeds or fails")


def _watch_attempt(
    coordinator: Coordinator, run: RunDir, agents: Agents, members: list[Member], attempt: int, max_restarts: int
) -> tuple[Action, list[dict | None]]:
    while True:
        agents.check()
        refuse_requests(coordinator, run, NOT_ELASTIC)
        coordinator.audit()
        reports = [coordinator.agent_state(m.agent_id) for m in members]
        action = next_action(reports, attempt, max_restarts)
        if action is not Action.WAIT:
            return action, reports
        time.sleep(POLL_S)
