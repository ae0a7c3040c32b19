"""An agent that takes its work from the control plane: ``felactl agent``, and this machine's.

:func:`run_node_agent` joins the coordinator (proving the job secret), waits for its
:class:`~felactl.control.documents.Assignment`, runs the assigned workers with a
:class:`~felactl.agents.agent.LocalWorkerAgent` and reports how they ended. The assignment says
how the group is supervised: a job of fixed members ends with its workers (one failed, or all
succeeded; a script's job may start again, attempt by attempt), an elastic one
(:attr:`Assignment.elastic`) runs until the coordinator's stop order, adding and killing workers
on its signed commands, and its workers are told to run the elastic membership.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from torch.distributed import DistError

from felactl.agents.agent import LocalWorkerAgent, RunResult, WorkerSpec
from felactl.agents.worker.zygote import Zygote
from felactl.control import keys
from felactl.control.documents import CommandDoc, WorkerState
from felactl.control.store import first_line
from felactl.errors import ControlPlaneError, NodeNameTaken

if TYPE_CHECKING:
    from felactl.agents.session import StopOrder


@dataclass(frozen=True, kw_only=True)
class NodeAgentConfig:
    """How a node joins a job: where the coordinator is, the secret, and what this node offers."""

    endpoint: str
    secret: str
    node_name: str
    nproc: int
    log_dir: Path
    node_info: dict = field(default_factory=dict)
    cpu_affinity: tuple[tuple[int, ...], ...] | None = None
    job: str | None = "job"
    """The job's name on the control plane; None: the one the coordinator runs."""
    generation: int = 0
    join_timeout_s: float = 60.0
    name_given: bool = True
    """False: ``node_name`` is this host's default, and a second agent on the host (its name
    taken in a gathering job) joins as ``<name>-2``, a third as ``<name>-3`` (:func:`_join`)."""


def run_node_agent(config: NodeAgentConfig, on_joined: Callable[[str], None] = lambda agent_id: None) -> RunResult:
    """Join the coordinator (proving the secret), run the assigned workers, report how they ended.

    A job with restarts (``felactl launch --script --max-restarts N``) runs in attempts: when the
    coordinator publishes the next attempt, this node's workers are stopped (a failure elsewhere)
    or have ended, and the next attempt's are started. Raises AuthError when the secret is refused,
    ControlPlaneError when the coordinator cannot be reached; the workers are stopped when the
    coordinator says so or disappears.
    """
    from felactl.agents.session import AgentSession

    # felactl's workers fork from one process that imports torch once for every worker of this
    # node and every attempt (restarts and newcomers start without the import); it starts now,
    # so that the import overlaps the rendezvous, and ends if the job is a user's script
    zygote = Zygote.unless_switched_off()
    try:
        session = AgentSession(
            config.endpoint,
            config.secret,
            job=config.job,
            generation=config.generation,
            timeout_s=config.join_timeout_s,
        )
        agent_id, config = _join(session, config)
        session.reader.on_refused = _refusal_log(config.log_dir, session.reader.on_refused)
        on_joined(agent_id)
        try:
            assignment = session.wait_assignment(config.join_timeout_s, alive=lambda: _raise_if_stopped(session))
        except ControlPlaneError as exc:
            _report_quietly(session, WorkerState.STOPPED.value, message=str(exc))
            raise
        if zygote is not None and not assignment.module:
            zygote.close()
            zygote = None
        with session.beating():
            return _run_attempts(session, config, assignment, zygote)
    finally:
        if zygote is not None:
            zygote.close()


def _run_attempts(session, config: NodeAgentConfig, assignment, zygote: Zygote | None) -> RunResult:
    """Run the assigned workers, then each next attempt's, until the job needs no more."""
    while True:
        spec = _worker_spec(config, session, assignment)
        session.report(WorkerState.HEALTHY.value, attempt=assignment.attempt)
        agent = LocalWorkerAgent(spec, zygote)
        if assignment.elastic:
            result = _supervise_elastic(agent, session)
        else:
            result = agent.run(
                should_stop=lambda a=assignment: session.stop_requested() or _superseded(session, a),
                on_failure=lambda r, a=assignment: _report_result(session, r, a.attempt, config.log_dir, ending=True),
            )
        _report_result(session, result, assignment.attempt, config.log_dir)
        if not assignment.more_may_follow:
            return result
        # No deadline: another node's workers may train on for long; the stop order (or the
        # coordinator's loss) ends the wait. (join_timeout_s here failed healthy multi-node jobs.)
        assignment = session.wait_attempt(assignment.attempt + 1, math.inf)
        if assignment is None:  # the coordinator stopped the job
            return result


LOST_COORDINATOR_GRACE_S = 5.0
"""How long an elastic agent that lost its coordinator waits for its workers to end by themselves
(a finished job's do) before it says the coordinator was lost."""

SAME_HOST_NAMES = 16
"""Agents on one host that take distinct default names (``host``, ``host-2`` ... ``host-16``)."""


def _join(session, config: NodeAgentConfig) -> tuple[str, NodeAgentConfig]:
    """Join as the node's name; where that name is this host's default and another agent of the
    job has it (two agents on one machine), as the next free ``<name>-<n>``. The agent id and the
    config with the name it joined as."""
    names = [config.node_name]
    if not config.name_given:
        names += [f"{config.node_name}-{n}" for n in range(2, SAME_HOST_NAMES + 1)]
    for i, name in enumerate(names):
        try:
            return session.join(name, config.nproc, config.node_info), dataclasses.replace(config, node_name=name)
        except NodeNameTaken:
            if i == len(names) - 1:
                raise
    raise AssertionError("names is never empty")


def _worker_spec(config: NodeAgentConfig, session, assignment) -> WorkerSpec:
    nproc = config.nproc if assignment.num_workers is None else assignment.num_workers
    return WorkerSpec(
        module=assignment.module,
        script=assignment.script,
        args=tuple(assignment.args),
        nproc=nproc,
        world_size=assignment.world_size,
        rank_offset=assignment.rank_offset,
        master_addr=session.host,
        master_port=assignment.rendezvous_port or session.port,
        log_dir=config.log_dir,
        env={
            **assignment.env,
            "FELACTL_STORE_PREFIX": session.prefix,
            "FELACTL_NODE_NAME": config.node_name,
            # felactl's workers verify and sign documents; a user's script gets no secret
            **(session.worker_env() if assignment.module else {}),
            **({"FELACTL_ELASTIC": "1"} if assignment.elastic else {}),
        },
        cpu_affinity=config.cpu_affinity,
        keep_state_s=assignment.keep_state_s,
        local_ranks=tuple(assignment.local_indices) if len(assignment.local_indices) == nproc else (),
    )


def _superseded(session, assignment) -> StopOrder | None:
    """A stop order when the coordinator has published the next attempt (a worker failed
    somewhere), or has stopped this attempt (a job rescaled by a restart: its workers drain; one
    that failed elsewhere: they write their state, and the coordinator hears that they are ending)."""
    from felactl.agents.session import StopOrder

    if not assignment.more_may_follow:
        return None
    if session.attempt_published(assignment.attempt + 1):
        return StopOrder("restart")
    order = session.attempt_stopped(assignment.attempt)
    if order is not None and order.drain_s > 0:
        _report_quietly(session, WorkerState.HEALTHY.value, attempt=assignment.attempt, ending=True)
    return order


def _refusal_log(log_dir: Path, say: Callable[[str, str], None]) -> Callable[[str, str], None]:
    """Forgeries this agent ignores are said on stderr, and recorded as ``refused`` events too
    where the run's events.jsonl is beside its log directory (the launch's own agent; a node
    that shares the runs directory)."""
    from felactl.control.events import RefusalLog

    events = Path(log_dir).parent / "events.jsonl"
    if not events.is_file():
        return say
    record = RefusalLog(events, by="agent")

    def both(key: str, reason: str) -> None:
        say(key, reason)
        record(key, reason)

    return both


def _report_result(session, result: RunResult, attempt: int, log_dir: Path, ending: bool = False) -> None:
    """How an attempt's workers on this node ended. ``ending``: the first failure, as it happens,
    while the others still end (they write their state; the report of how they ended follows)."""
    _report_quietly(
        session,
        result.state.value,
        failures={str(k): v for k, v in result.failures.items()},
        exit_codes={str(k): v for k, v in result.exit_codes.items()},
        failed_at={str(k): v for k, v in result.failed_at.items()},
        attempt=attempt,
        log_dir=str(log_dir),
        **({"ending": True} if ending else {}),
    )


def _report_quietly(session, state: str, **details) -> None:
    try:
        session.report(state, **details)
    except RuntimeError:
        pass  # the coordinator is gone; nobody to tell


def _raise_if_stopped(session) -> None:
    order = session.stop_requested()
    if order is not None:
        raise ControlPlaneError(f"the coordinator stopped the job before it started: {order.reason}")


# --- elastic jobs: the coordinator adds and kills workers while the group runs --------------------
def _supervise_elastic(agent: LocalWorkerAgent, session) -> RunResult:
    """Start the assigned workers, then follow the coordinator's signed commands (``add``, ``kill``)
    and report every worker's state; a worker that ends does not end the group — the coordinator
    re-forms the job without it — and the agent runs until the coordinator says stop."""
    try:
        agent.start()
        return _follow_coordinator(agent, session)
    except (DistError, ControlPlaneError) as exc:  # the store went away under a beat, a report or a read
        deadline = time.monotonic() + LOST_COORDINATOR_GRACE_S  # workers of a finished job are exiting
        while (ended := agent.monitor()).state is WorkerState.HEALTHY and time.monotonic() < deadline:
            time.sleep(0.1)
        if ended.state is WorkerState.SUCCEEDED:  # the job ended and its launch closed before this agent heard
            return ended
        raise ControlPlaneError(f"lost the coordinator at {session.host}:{session.port}: {first_line(exc)}") from exc
    finally:
        agent.stop()


def _follow_coordinator(agent: LocalWorkerAgent, session) -> RunResult:
    """:func:`_supervise_elastic`'s loop, until the coordinator says stop."""
    reported = None
    while True:
        for command in _pop_commands(session):
            if command.get("op") == "add":
                agent.add_worker(int(command["worker_id"]), dict(command.get("env", {})))
            elif command.get("op") == "kill":
                agent.kill_worker(int(command["worker_id"]))
        agent.monitor()
        table = agent.worker_table()
        if table != reported:
            session.report(WorkerState.HEALTHY.value, workers=table)
            reported = table
        order = session.stop_requested()
        if order is not None:
            agent.stop(drain_s=order.drain_s)
            result = agent._result()
            state = WorkerState.SUCCEEDED if order.reason == "finished" else result.state
            return RunResult(state=state, exit_codes=result.exit_codes, failures=result.failures)
        time.sleep(agent.spec.monitor_interval_s)


def _pop_commands(session) -> list[dict]:
    """The coordinator's pending commands to this agent; forged or replayed ones are dropped (and said so)."""
    name = keys.agent_commands(session.agent_id)
    queue = keys.command_queue(session.prefix, session.agent_id)
    commands = []
    while session.store.queue_len(queue) > 0:
        raw = session.store.queue_pop(queue, block=False)
        opened = session.reader.open(name, raw, CommandDoc.KIND.value)
        if opened is not None:
            try:
                commands.append(CommandDoc.from_body(opened.body).to_body())
            except ValueError as exc:
                print(f"felactl agent: dropped a malformed command: {exc}", file=sys.stderr)
    return commands
