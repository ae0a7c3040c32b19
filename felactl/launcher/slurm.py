"""felactl inside a Slurm allocation (a batch script, or ``srun`` in ``salloc``'s): the allocation is the cluster.

Where ``SLURM_JOB_ID`` is set, ``felactl profile``, ``launch`` and ``scale`` reach the allocation's
nodes as Slurm lets them, with job steps, as ``srun torchrun`` does:

* **its nodes**: ``scontrol show hostnames`` of ``SLURM_JOB_NODELIST`` (a heterogeneous job: of
  each component's ``SLURM_JOB_NODELIST_HET_GROUP_<i>``, each node keeping its component); the
  node this process runs on: ``SLURMD_NODENAME``, never ``hostname`` (nodes of an emulated cluster
  share one);
* **where a node listens**: its ``NodeAddr`` (``scontrol show node``), where the coordinator binds
  on the launching node;
* **one agent per node as a job step**: ``srun --overlap --nodes=1 --ntasks=1 --nodelist=NODE
  --kill-on-bad-exit=0 felactl agent ...``, whose stdin srun forwards to its one task: the
  secret travels there, as over ssh, never on a command line. A step per node (not one step of
  ``--ntasks-per-node=1``) lets one node's agent end, fail or be lost while the others run on,
  and gives each its own log, as an ssh agent has.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from felactl.errors import InputError
from felactl.spec import Plan

log = logging.getLogger(__name__)
COMMAND_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Allocation:
    """The Slurm allocation this process runs in."""

    job_id: str
    nodes: tuple[str, ...]
    """Its nodes' Slurm names, in the allocation's order."""
    this_node: str | None
    """``SLURMD_NODENAME``: the node this process runs on (None: outside a job step or batch script)."""
    components: Mapping[str, int]
    """Node -> its heterogeneous job component (0 in a plain allocation)."""
    cluster_name: str = "slurm"
    """``SLURM_CLUSTER_NAME``: what a profile of the allocation is named by default."""
    restart_count: int = 0
    """``SLURM_RESTART_COUNT``: how often the job was requeued (preempted, a node failed, ``scontrol requeue``)."""

    def __str__(self) -> str:
        return f"Slurm job {self.job_id} ({len(self.nodes)} node(s): {', '.join(self.nodes)})"

    @property
    def heterogeneous(self) -> bool:
        return len(set(self.components.values())) > 1

    def coordinator_endpoint(self) -> str:
        """Where a coordinator on this node listens (a free port on its address): the other
        nodes' agents reach it there."""
        if self.this_node is None:
            raise InputError(
                f"{self}: SLURMD_NODENAME is not set; run felactl inside the batch script or a job step "
                "(srun; in salloc's shell: srun --pty), not beside the allocation"
            )
        return f"{node_address(self.this_node)}:0"

    def check_holds(self, nodes, where: str) -> None:
        """Refuse (one line) a plan whose nodes are not all in this allocation."""
        missing = sorted(set(nodes) - set(self.nodes))
        if missing:
            raise InputError(
                f"{where}: placement: node {missing[0]!r} is not in {self}; plan for a cluster profiled with "
                "`felactl profile` inside this allocation, or ask Slurm for those nodes (sbatch --nodelist)"
            )


def requeued_onto(allocation: Allocation, plan: Plan) -> Plan:
    """A requeued job's plan on the nodes Slurm gave it this time: each node of the plan the
    allocation lacks becomes one of the allocation's nodes the plan does not use, in the
    allocation's order (a requeue gets as many nodes of the job's partitions; a node it got again
    keeps its workers). Unchanged where there are too few such nodes, or the job is heterogeneous
    (which component a lost node was of is not known): :meth:`Allocation.check_holds` then refuses
    it, naming the node."""
    used = list(dict.fromkeys(placed.node for placed in plan.placement))
    lost = [node for node in used if node not in allocation.nodes]
    spare = [node for node in allocation.nodes if node not in used]
    if not lost or len(spare) < len(lost) or allocation.heterogeneous:
        return plan
    onto = dict(zip(lost, spare))
    log.warning(
        "Slurm requeued job %s onto other nodes: its workers on %s run on %s",
        allocation.job_id,
        ", ".join(onto),
        ", ".join(onto.values()),
    )
    placement = tuple(dataclasses.replace(p, node=onto.get(p.node, p.node)) for p in plan.placement)
    return dataclasses.replace(plan, placement=placement)


def slurm_applies(slurm: bool, *elsewhere: object) -> bool:
    """Whether a command runs on the allocation it may be in: ``--slurm`` (the default), and no
    flag given of ``elsewhere`` (``--testbed``, ``--hostfile``, ``--rdzv-endpoint``: the nodes are
    said another way)."""
    return slurm and all(flag is None for flag in elsewhere)


def current_allocation(env: Mapping[str, str] | None = None) -> Allocation | None:
    """The allocation ``env`` (default: this process's) says this process runs in; None outside one."""
    env = os.environ if env is None else env
    job_id = env.get("SLURM_JOB_ID")
    if not job_id:
        return None
    components: dict[str, int] = {}
    het = sorted(
        (int(m.group(1)), value)
        for key, value in env.items()
        if (m := re.fullmatch(r"SLURM_JOB_NODELIST_HET_GROUP_(\d+)", key))
    )
    # SLURM_NODELIST first: in a step srun starts from outside the job (`srun --jobid=J -w n1`),
    # Slurm 22.05 sets SLURM_JOB_NODELIST to the step's nodes and SLURM_NODELIST to the job's
    # (inside the batch script and its steps the two agree)
    lists = het or [(0, env.get("SLURM_NODELIST") or env.get("SLURM_JOB_NODELIST") or "")]
    for component, nodelist in lists:
        if not nodelist:
            raise InputError(f"Slurm job {job_id}: SLURM_JOB_NODELIST is not set; run felactl inside the job")
        for node in hostnames(nodelist):
            components.setdefault(node, component)
    return Allocation(
        job_id=job_id,
        nodes=tuple(components),
        this_node=env.get("SLURMD_NODENAME"),
        components=components,
        cluster_name=env.get("SLURM_CLUSTER_NAME") or "slurm",
        restart_count=int(restarts) if (restarts := env.get("SLURM_RESTART_COUNT", "")).isdigit() else 0,
    )


def requeued_run(allocation: Allocation, run_id: str | None, runs_root: Path) -> tuple[str, str | None]:
    """The run a launch in ``allocation`` writes and the run it resumes (None: it starts one).
    The run is named after the job (``slurm-<job id>``) unless ``run_id`` is given, so a requeued
    job (preempted, and started again by Slurm with the same id) finds it and goes on from its
    newest complete checkpoint. A requeued job whose run has none yet starts again as
    ``<run>-r<restart count>``, and a later restart resumes the newest of those that has one. (A
    requeue onto other nodes moves the plan's workers there: :func:`requeued_onto`.)"""
    from felactl.launcher.resume import pick_checkpoint
    from felactl.launcher.rundir import RunDir

    run_id = run_id or f"slurm-{allocation.job_id}"
    if allocation.restart_count == 0:
        return run_id, None
    earlier = [run_id] + [f"{run_id}-r{n}" for n in range(1, allocation.restart_count)]
    for candidate in reversed(earlier):
        if not (Path(runs_root) / candidate).is_dir():
            continue
        try:
            pick_checkpoint(RunDir.find(candidate, root=runs_root))
        except InputError:
            continue
        log.warning(
            "Slurm requeued job %s (restart %d): resuming run %s",
            allocation.job_id,
            allocation.restart_count,
            candidate,
        )
        return candidate, candidate
    if not (Path(runs_root) / run_id).is_dir():
        return run_id, None
    log.warning("run %s has no complete checkpoint to resume: starting again", run_id)
    return f"{run_id}-r{allocation.restart_count}", None


def run_slurm(*argv: str) -> str:
    """Run a Slurm command (``scontrol``, ``sbatch``, ``squeue``, ``scancel``); its stdout, or
    one :class:`InputError` line: not installed, no answer in time, or what it said failing."""
    try:
        done = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, stdin=subprocess.DEVNULL
        )
    except FileNotFoundError:
        raise InputError(
            f"{argv[0]} is not on PATH: run felactl where Slurm's commands are (or, inside an allocation, with "
            "--no-slurm to use this machine only)"
        ) from None
    except subprocess.TimeoutExpired:
        raise InputError(f"{' '.join(argv[:3])}: no answer in {COMMAND_TIMEOUT_S:g} s") from None
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()
        raise InputError(f"{' '.join(argv[:3])}: {said[-1] if said else f'exit {done.returncode}'}")
    return done.stdout


def hostnames(nodelist: str) -> list[str]:
    """A Slurm node list (``n[0-3],gpu7``) as node names: ``scontrol show hostnames``."""
    return run_slurm("scontrol", "show", "hostnames", nodelist).split()


def node_address(node: str) -> str:
    """Where ``node`` listens: its ``NodeAddr`` in Slurm (its name, where the cluster resolves it)."""
    found = re.search(r"\bNodeAddr=(\S+)", run_slurm("scontrol", "show", "node", node))
    return found.group(1) if found else node


def agent_step_command(node: str, argv: list[str], job_id: str, het_group: int | None = None) -> list[str]:
    """``argv`` (an agent's command line) as a job step of one task on ``node``: beside the batch
    script's own step (``--overlap``), outliving a failed task elsewhere (``--kill-on-bad-exit=0``);
    in a heterogeneous job, in the node's component (``het_group``: srun's default is the first)."""
    return [
        "srun",
        f"--jobid={job_id}",
        *([f"--het-group={het_group}"] if het_group is not None else []),
        "--overlap",
        "--nodes=1",
        "--ntasks=1",
        f"--nodelist={node}",
        "--kill-on-bad-exit=0",
        f"--job-name=felactl-agent-{node}",
        *argv,
    ]


def start_step_agents(
    allocation: Allocation, slots: dict[str, int | None], endpoint: str, secret: str, log_dir: Path, job: str
) -> list[subprocess.Popen]:
    """``felactl agent`` on each node of ``slots`` (node -> worker slots; None: the agent's
    default there, the node's GPUs) as a job step of ``allocation``, joining ``endpoint``; the
    secret on the step's stdin; each agent's output in ``log_dir/slurm-<node>.log``."""
    from felactl.agents.agent import agent_argv, start_agent
    from felactl.machine import stop_processes

    allocation.check_holds(slots, "the job")
    if shutil.which("srun") is None:
        raise InputError(f"{allocation}: srun is not on PATH, so no agent can start on the nodes (or give --no-slurm)")
    procs: list[subprocess.Popen] = []
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        for node, count in slots.items():
            argv = agent_argv(
                endpoint,
                nproc=count,
                node_name=node,
                job=job,
                log_dir=str(log_dir / node),
                felactl=(sys.executable, "-m", "felactl"),
            )
            het_group = allocation.components[node] if allocation.heterogeneous else None
            command = agent_step_command(node, argv, allocation.job_id, het_group)
            procs.append(start_agent(command, secret, log_dir / f"slurm-{node}.log"))
    except BaseException:
        stop_processes(procs)
        raise
    return procs
