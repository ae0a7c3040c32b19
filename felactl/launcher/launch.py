"""``felactl launch``: run a plan — the coordinator here, one agent per node, workers per device.

The launch process hosts the control plane (:class:`Coordinator`), starts this machine's agent in a
thread (and, with a hostfile, the other nodes' agents over ssh), waits until every node of the
plan has joined and proved the job secret, hands each agent the ranks of its node's devices, then
watches: agents' states on the store, workers' records in ``metrics.jsonl``. It ends by writing
``summary.json``. Whatever happens, every process it started is stopped before it returns.

This module holds that sequence (:func:`launch`) and what every worker is told
(:func:`worker_env`); its steps live in their own modules: :mod:`~felactl.launcher.prepare`
(options, checks, the run directory), :mod:`~felactl.launcher.node_agents` (starting agents,
their ranks, the supervised life of the job) and :mod:`~felactl.launcher.follow` (watching the
run to its end and its summary).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from felactl.control import EventKind
from felactl.control.events import record
from felactl.launcher.controlplane import Coordinator
from felactl.launcher.elastic import ElasticController
from felactl.launcher.follow import LaunchState, follow
from felactl.launcher.liveness import Heartbeat, LaunchIdentity
from felactl.launcher.node_agents import WORKER_MODULE, Agents, assign_ranks, start_coordinator, supervised
from felactl.launcher.prepare import (
    LaunchOptions,
    check_min_nodes,
    check_nodes,
    check_restarts,
    check_this_machine,
    idle_gpus_warning,
    node_devices,
    prepare_run,
    resume_point,
    runnable_plan,
    testbed_for,
    why_not_elastic,
)
from felactl.launcher.restarts import Restarts
from felactl.launcher.resume import ResumePoint
from felactl.launcher.rundir import RunDir
from felactl.machine import default_node_name
from felactl.spec import ClusterSpec, ModelSpec, Plan

log = logging.getLogger(__name__)


def worker_env(
    options: LaunchOptions,
    run: RunDir,
    store_endpoint: str,
    *,
    plan: Path | None = None,
    generation: int = 0,
    resume_from: Path | None = None,
) -> dict[str, str]:
    """The FELACTL_* variables every worker reads (see felactl.agents.worker.config), the same for
    a job of fixed members and an elastic one (which its assignments say, :func:`assign_ranks`):
    the plan it runs (default the run's ``plan.yaml``), its membership generation, and the
    checkpoint directory it starts from (None: the start)."""
    env = {
        "FELACTL_PLAN": str((plan or run.plan).resolve()),
        "FELACTL_GENERATION": str(generation),
        "FELACTL_RUN_DIR": str(run.path.resolve()),
        "FELACTL_STORE": store_endpoint,
        "FELACTL_STEPS": str(options.steps),
        "FELACTL_CHECKPOINT_EVERY": str(options.checkpoint_every),
        "FELACTL_TIMEOUT_S": str(int(options.timeout_s)),
        "FELACTL_COLLECTIVE_TIMEOUT_S": str(options.collective_timeout_s),
        "FELACTL_HEARTBEAT_S": str(min(0.5, options.heartbeat_timeout_s / 4)),
        # A user's own script calling init_process_group("env://") connects to our store as a
        # client instead of trying to host one on MASTER_PORT (torchrun's agent does the same).
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }
    if options.slowdown:
        env["FELACTL_SLOWDOWN"] = options.slowdown
    if options.straggler:
        env["FELACTL_STRAGGLER"] = options.straggler
    if resume_from is not None:
        env["FELACTL_RESUME_FROM"] = str(resume_from.resolve())
    return env


def launch(options: LaunchOptions, on_update: Callable[[LaunchState], None] = lambda state: None) -> dict[str, Any]:
    """Run the plan to the end; return the summary (also written to ``summary.json``)."""
    local_node = options.node_name or default_node_name()
    resume = resume_point(options)
    plan = runnable_plan(options, resume)
    plan_path = resume.plan_path if resume is not None else options.plan_path  # what the checks name
    nodes = node_devices(plan, local_node)
    endpoint = options.rdzv_endpoint
    if options.testbed is not None:
        bed = testbed_for(options.testbed, nodes, plan_path)
        endpoint = f"{bed.host_address}:0"
    elif options.slurm is not None:
        endpoint = endpoint or options.slurm.coordinator_endpoint()
        options.slurm.check_holds(nodes, str(plan_path))
    else:
        check_nodes(options, nodes, local_node, plan_path)
        check_this_machine(options, plan, local_node, plan_path)
    not_elastic = why_not_elastic(options, plan)
    check_min_nodes(options, not_elastic)
    check_restarts(options, not_elastic)
    run, secret, resume = prepare_run(options, plan, resume)
    if (warning := idle_gpus_warning(plan, local_node)) is not None:
        log.warning(warning)
    # Live rescaling covers data-parallel plans of the rescalable sync modes, on CPUs (gloo) and GPUs (NCCL): a
    # newcomer builds its model on its own device before it joins (felactl.agents.worker.elastic).
    state = LaunchState(
        run=run, plan=plan, not_elastic=f"this job cannot be rescaled: {not_elastic}" if not_elastic else ""
    )
    coordinator = start_coordinator(secret, endpoint, run, new_run=resume is None)
    heartbeat = Heartbeat(run.heartbeat)  # with the identity below, how felactl status tells a lost launch
    _record_launch(options, run, plan, coordinator, resume)
    agents = Agents(
        coordinator,
        secret,
        local_slots=0 if options.testbed or options.slurm else len(nodes.get(local_node, ())),
        local_node=local_node,
        logs=run.logs,
        job=run.run_id,
        hostfile=options.hostfile,
        join_timeout_s=options.join_timeout_s,
        testbed=options.testbed,
        slurm=options.slurm,
        node_slots={node: len(devs) for node, devs in nodes.items()},
    )
    if (waiting := _agents_to_start(options, nodes, local_node, coordinator.endpoint, run, plan)) is not None:
        log.warning(waiting)
    with supervised(coordinator, agents, run, heartbeat, drain_s=options.drain_s):
        summary = _run(options, coordinator, agents, state, nodes, resume, on_update)
    run.write_summary(summary)
    record(run.events, EventKind.FINISHED, steps=summary["steps"])
    return summary


def _agents_to_start(
    options: LaunchOptions,
    nodes: dict[str, tuple[str, ...]],
    local_node: str,
    endpoint: str,
    run: RunDir,
    plan: Plan,
) -> str | None:
    """What the user must do now for a job whose other nodes' agents are started by hand
    (``--rdzv-endpoint``): the command for each, said once the secret file it needs exists."""
    others = sorted(node for node in nodes if node != local_node)
    if options.rdzv_endpoint is None or options.hostfile or options.testbed or options.slurm or not others:
        return None
    return (
        f"waiting {options.join_timeout_s:g} s for the agents of {', '.join(others)}: on each, run "
        f"`felactl agent --rdzv-endpoint {endpoint} --secret-file {run.secret} "
        f"--node-name {others[0] if len(others) == 1 else 'NODE'}` "
        f"(with that file copied there; {plan.model.source} must import there: the same code and "
        "environment on every node)"
    )


def _record_launch(
    options: LaunchOptions, run: RunDir, plan: Plan, coordinator: Coordinator, resume: ResumePoint | None
) -> None:
    """The run's ``launch`` (or ``resume``) event: where its control plane listens and who the launch is."""
    record(
        run.events,
        EventKind.RESUME if resume else EventKind.LAUNCH,
        run=run.run_id,
        steps=options.steps,  # what felactl status counts an ETA to
        endpoint=coordinator.endpoint,
        session=coordinator.session,
        devices=list(plan.devices),
        launcher=LaunchIdentity.of_this_process().to_dict(),
        **({"from_step": resume.step, "checkpoint": str(resume.checkpoint)} if resume else {}),
    )


def _capacity(
    options: LaunchOptions, nodes: dict[str, tuple[str, ...]], profiles: tuple[ClusterSpec, ModelSpec] | None
) -> dict[str, int]:
    """The workers each node may run when the job restarts on new ones: --max-nproc-per-node, else
    the plan's workers there or the devices profiled there, whichever is more."""
    profiled = profiles[0].device_names_by_node() if profiles is not None else {}
    return {
        node: options.max_nproc_per_node or max(len(devices), len(profiled.get(node, ())))
        for node, devices in nodes.items()
    }


def _record_start(run: RunDir, state: LaunchState) -> None:
    record(
        run.events,
        EventKind.START,
        members=[m.node_name for m in state.members],
        agents=[m.agent_id for m in state.members],
    )


def _run(
    options: LaunchOptions,
    coordinator: Coordinator,
    agents: Agents,
    state: LaunchState,
    nodes: dict[str, tuple[str, ...]],
    resume: ResumePoint | None,
    on_update: Callable[[LaunchState], None],
) -> dict[str, Any]:
    """The started job: its agents join and get their ranks (an elastic job, its controller too),
    and the run is followed to its end; returns its summary."""
    run, plan = state.run, state.plan
    agents.start()
    state.members = coordinator.wait_members(len(nodes), options.join_timeout_s, alive=agents.check)
    if not state.elastic:  # a failed worker or a rescale: every worker again, from a checkpoint
        summary = Restarts(
            coordinator,
            state,
            agents,
            nodes,
            lambda checkpoint, plan_path, generation: worker_env(
                options, run, coordinator.endpoint, plan=plan_path, generation=generation, resume_from=checkpoint
            ),
            max_restarts=options.restarts_allowed,
            steps=options.steps,
            scale_refused=None if options.elastic else state.not_elastic,
            capacity=_capacity(options, nodes, profiles := run.profiles()),
            profiles=profiles,
            keep_checkpoints=options.keep_checkpoints,
            on_update=on_update,
        ).run(resume, started=lambda: _record_start(run, state))
        coordinator.stop("finished")
        return summary
    env = worker_env(
        options,
        run,
        coordinator.endpoint,
        plan=resume.plan_path if resume else None,
        generation=resume.generation if resume else 0,
        resume_from=resume.checkpoint if resume else None,
    )
    controller = ElasticController(
        coordinator,
        run,
        plan,
        state.members,
        nodes,
        options.elastic_settings(),
        start_generation=resume.generation if resume else 0,
        plan_path=resume.plan_path if resume else run.plan,
        worker=(WORKER_MODULE, env),
    )
    coordinator.publish_assignments(assign_ranks(plan, state.members, nodes, env, elastic=True))
    _record_start(run, state)
    # The summary here, under supervision: a run without a step is recorded as failed.
    summary = follow(
        coordinator, state, agents, on_update, controller, options.keep_checkpoints, node_loss_is_fatal=False
    )  # the controller drops a lost node's workers once their heartbeats stop
    coordinator.stop("finished")
    return summary
