"""Starting a job (a plan's or a script's): its control plane (:func:`start_coordinator`) and its
agents, and handing them their work: this machine's agent in a thread, the
other nodes' over ssh or in a testbed's nodes (:class:`Agents`), each node's ranks
(:func:`assign_ranks`), and the life of a started job around them (:func:`supervised`: a graceful
drain on Ctrl-C, a stop on failure, late ``felactl scale`` requests answered, every process ended)."""

from __future__ import annotations

import contextlib
import logging
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from felactl.agents.local_node import AgentThread, local_agent_config
from felactl.control import EventKind
from felactl.control.documents import WORKER_MODULE, Assignment
from felactl.control.events import record
from felactl.errors import ControlPlaneError, InputError, Stopped
from felactl.launcher import hosts as hostfile
from felactl.launcher.controlplane import Coordinator, Member
from felactl.launcher.liveness import Heartbeat
from felactl.launcher.resume import pick_checkpoint
from felactl.launcher.rundir import RunDir
from felactl.launcher.scale_requests import refuse_requests
from felactl.launcher.slurm import Allocation, start_step_agents
from felactl.machine import stop_processes
from felactl.spec import Plan

log = logging.getLogger(__name__)


def start_coordinator(secret: str, endpoint: str | None, run: RunDir, *, new_run: bool = True) -> Coordinator:
    """The job's control plane, listening on ``endpoint``; a ``new_run``'s directory is removed
    again when it cannot start (nothing ran: no run directory for `felactl status` to list)."""
    with removed_if_it_fails(run.path if new_run else None):
        return Coordinator(secret, endpoint=endpoint, job=run.run_id, events=run.events)


@contextlib.contextmanager
def removed_if_it_fails(made: Path | None) -> Iterator[None]:
    """Remove the directory ``made`` for a job (None: none was) when starting its control plane
    fails: nothing ran, so there is nothing to read there."""
    try:
        yield
    except BaseException:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
        raise


def assign_ranks(
    plan: Plan,
    members: list[Member],
    nodes: dict[str, tuple[str, ...]],
    env: dict[str, str],
    *,
    elastic: bool = False,
    any_slots: bool = False,
) -> dict[str, Assignment]:
    """Give each member the ranks of its node's devices (pure; every mismatch is an InputError);
    ``elastic``: the coordinator rescales the job (:attr:`Assignment.elastic`); ``any_slots``: a
    node may run other than the workers its agent offered (a job restarted on new workers: each
    assignment says how many)."""
    by_node = {m.node_name: m for m in members}
    missing = [n for n in nodes if n not in by_node]
    if missing:
        raise InputError(f"no agent joined for node {missing[0]!r} of the plan (joined: {', '.join(by_node)})")
    assignments = {}
    for node, devices in nodes.items():
        member = by_node[node]
        if member.num_slots != len(devices) and not any_slots:
            raise InputError(
                f"node {node!r} offers {member.num_slots} worker slot(s) but the plan puts "
                f"{len(devices)} device(s) there"
            )
        ranks = [plan.rank_of(d) for d in devices]
        if ranks != list(range(ranks[0], ranks[0] + len(ranks))):
            raise InputError(f"the devices of node {node!r} must have consecutive ranks in plan.devices, got {ranks}")
        placed = {p.device: p.local_index for p in plan.placement}
        local_indices = tuple(placed[d] for d in devices) if all(d in placed for d in devices) else ()
        assignments[member.agent_id] = Assignment(
            rank_offset=ranks[0],
            world_size=len(plan.devices),
            module=WORKER_MODULE,
            env=dict(env),
            local_indices=local_indices,
            elastic=elastic,
            num_workers=len(devices) if any_slots else None,
        )
    return assignments


class Agents:
    """The agents a job starts itself: this machine's (a thread, with ``local_slots`` workers) and,
    with a hostfile, one ``felactl agent`` over ssh per host; in a testbed's nodes or a Slurm
    allocation's, one per node of ``node_slots``. (Agents started by hand join too.)"""

    def __init__(
        self,
        coordinator: Coordinator,
        secret: str,
        *,
        local_slots: int,
        local_node: str,
        logs: Path,
        job: str,
        hostfile: Path | None = None,
        join_timeout_s: float,
        testbed: str | None = None,
        slurm: Allocation | None = None,
        node_slots: dict[str, int | None] | None = None,
    ):
        """``testbed``: a testbed that is up; one agent runs in each of its nodes (namespace and
        cgroup) with ``node_slots[node]`` workers. ``slurm``: the allocation this runs in; one
        agent runs on each node of ``node_slots`` as a job step (:mod:`~felactl.launcher.slurm`)."""
        self.coordinator, self.secret = coordinator, secret
        self.local_slots, self.local_node, self.logs, self.job = local_slots, local_node, logs, job
        self.hostfile, self.join_timeout_s = hostfile, join_timeout_s
        self.testbed, self.slurm, self.node_slots = testbed, slurm, node_slots or {}
        self.thread: AgentThread | None = None
        self.ssh: list = []
        self.lost: set = set()
        """Remote agents whose end an elastic job survived (said once)."""

    def start(self) -> None:
        if self.hostfile is not None:
            hosts = hostfile.read_hostfile(self.hostfile)
            self.ssh += hostfile.start_ssh_agents(
                hosts, self.coordinator.endpoint, self.secret, self.logs, job=self.job
            )
        if self.testbed is not None:
            from felactl.testbed import read_state, start_node_agents

            self.ssh += start_node_agents(
                read_state(self.testbed),
                self.node_slots,
                self.coordinator.endpoint,
                self.secret,
                self.logs,
                self.job,
            )
        if self.slurm is not None:
            self.ssh += start_step_agents(
                self.slurm, self.node_slots, self.coordinator.endpoint, self.secret, self.logs, self.job
            )
        if self.local_slots:
            config = local_agent_config(
                self.coordinator.endpoint,
                self.secret,
                nproc=self.local_slots,
                node_name=self.local_node,
                log_dir=self.logs,
                join_timeout_s=self.join_timeout_s,
                job=self.job,
            )
            self.thread = AgentThread(config)
            self.thread.start()

    def check(self, *, node_loss_is_fatal: bool = True) -> None:
        """Raise when an agent has failed. An elastic job survives losing a remote node's agent (a
        lost machine): its controller drops the node's workers once their heartbeats stop, so the
        agent's end is only logged here."""
        if self.thread is not None:
            self.thread.check()
        for proc in self.ssh:
            if proc.poll() in (None, 0) or proc in self.lost:
                continue
            where = f"{self.logs}/ssh-*.log, testbed-*.log or slurm-*.log"
            if node_loss_is_fatal:
                raise ControlPlaneError(
                    f"an agent started over ssh, in a testbed node or as a Slurm step exited with code {proc.returncode} (see {where})"
                )
            self.lost.add(proc)
            log.warning(
                "an agent started over ssh, in a testbed node or as a Slurm step exited with code %s (see %s); its workers "
                "are dropped once their heartbeats stop",
                proc.returncode,
                where,
            )

    def stop(self, timeout_s: float = 30, *, let_remote_drain: bool = False) -> None:
        """Stop the agents. ``let_remote_drain``: a graceful stop, where the agents over ssh or in a
        testbed nodes end by themselves once their workers have checkpointed the agreed last step
        (the coordinator's stop order): wait for them up to ``timeout_s`` before they are
        terminated (terminating them at once killed their workers before the checkpoint)."""
        deadline = time.monotonic() + timeout_s
        if self.thread is not None:
            self.thread.join(timeout=timeout_s)
        if let_remote_drain:
            for proc in self.ssh:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        stop_processes(self.ssh)


@contextlib.contextmanager
def supervised(
    coordinator: Coordinator,
    agents: Agents,
    run: RunDir,
    heartbeat: Heartbeat,
    *,
    drain_s: float,
    late_requests: str | None = None,
) -> Iterator[None]:
    """The life of a started job (a plan's or a script's) around its body. Ctrl-C or SIGTERM
    drains it (the workers checkpoint a step they agree on) and raises :class:`Stopped`, saying
    where the run stands; any other exception stops the job and records it as failed. Whatever
    happened, :func:`close_job` then answers late ``felactl scale`` requests with
    ``late_requests``, or else with how the job ended."""
    ending = "the job finished its last step; nothing changed"
    try:
        yield
    except KeyboardInterrupt:
        ending = "the job was stopped; nothing changed"
        raise drain_job(coordinator, agents, run, drain_s) from None
    except BaseException as exc:
        ending = "the job failed; nothing changed"
        coordinator.stop(f"launch ended: {type(exc).__name__}")
        record(run.events, EventKind.FAILED, reason=str(exc) or type(exc).__name__)
        raise
    finally:
        close_job(agents, coordinator, run, heartbeat, late_requests or ending)


def close_job(agents: Agents, coordinator: Coordinator, run: RunDir, heartbeat: Heartbeat, ending: str) -> None:
    """Whatever happened: stop the agents, answer late scale requests, close the store, stop the heartbeat."""
    agents.stop()
    # A felactl scale request that came after the last look must not just find the store
    # gone: answer it. (One sent after this sweep still may; felactl scale then reads how
    # the run ended.)
    with contextlib.suppress(RuntimeError):
        refuse_requests(coordinator, run, ending)
    coordinator.close()
    heartbeat.stop()


def drain_job(coordinator: Coordinator, agents: Agents, run: RunDir, drain_s: float) -> Stopped:
    """A graceful stop: the workers end after an agreed step and checkpoint it (within
    ``drain_s``, else they are killed); the ``stopped`` event says which step a resume starts at.
    Returns what the launch raises then: where the run stands, for the user."""
    coordinator.stop("interrupted", drain_s=drain_s)
    agents.stop(timeout_s=drain_s + 10, let_remote_drain=True)
    try:
        step = pick_checkpoint(run).step
    except InputError:
        step = None
    record(run.events, EventKind.STOPPED, checkpoint_step=step)
    if step is None:
        return Stopped(f"run {run.run_id} stopped before its first checkpoint (in {run.path})")
    return Stopped(f"run {run.run_id} stopped at step {step}; continue with `felactl launch --resume {run.run_id}`")
