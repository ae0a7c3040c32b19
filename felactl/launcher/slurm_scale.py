"""``felactl scale RUN --slurm-nodes K``: a running job grows onto nodes Slurm grants it, and gives
them back when their workers are removed.

Growing submits a batch job of its own (``sbatch --nodes=K``) whose one step starts ``felactl
agent`` on each granted node (``srun --ntasks-per-node=1``), joining the run's coordinator with the
run's secret file (a path on the command line, the secret itself never), named as Slurm names the
node. Once every granted node's agent has joined, each gets ``--nproc-per-node`` workers through
the ordinary signed scale request (:func:`~felactl.launcher.scale.request_scale`), so the job
rescales as for any new node. The run records the Slurm job and the workers it holds
(``slurm-nodes``). Slurm not granting the nodes within ``--timeout``, or their agents not joining,
cancels the request's job: nothing changes. Only joins after the request count (a node the run
has already, granted again, is another agent's). When ``felactl scale --remove`` leaves a granted job's nodes without workers,
that job is cancelled (``scancel``) and the run records it (``slurm-released``).
"""

from __future__ import annotations

import functools
import logging
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from felactl.agents.agent import agent_argv
from felactl.control import EventKind
from felactl.control.events import record
from felactl.errors import InputError
from felactl.fsutil import atomic_write_text, read_jsonl
from felactl.launcher.controlplane import read_secret_file
from felactl.launcher.membership.requests import NO_AGENT_THERE
from felactl.launcher.rundir import RunDir
from felactl.launcher.scale import coordinator_endpoint, request_scale
from felactl.launcher.slurm import current_allocation, hostnames, run_slurm, start_step_agents
from felactl.machine import stop_processes

log = logging.getLogger(__name__)

POLL_S = 0.5
TOOLS = ("sbatch", "squeue", "scontrol", "scancel")
WAITING = ("PENDING", "CONFIGURING", "RUNNING")
"""A Slurm job in any other state has ended (or is ending) for good."""


def grow(
    run: str,
    nodes: int,
    *,
    nproc_per_node: int,
    sbatch_args: tuple[str, ...] = (),
    runs_root: Path,
    timeout_s: float,
) -> dict:
    """Ask Slurm for ``nodes`` more nodes for ``run`` and put ``nproc_per_node`` workers on each
    (module doc); what changed. Anything going wrong before the workers are in cancels the Slurm
    job (nothing changed); once some are in, the run records them, so ``--remove`` releases it."""
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        raise InputError(
            f"--slurm-nodes: {', '.join(missing)} not on PATH (run felactl scale where Slurm's commands are)"
        )
    rundir = RunDir.find(run, root=runs_root)
    endpoint = coordinator_endpoint(rundir)
    deadline = time.monotonic() + timeout_s
    seen = len(read_jsonl(rundir.events))  # joins before the request are other agents'
    job_id = _submit(rundir, endpoint, nodes, nproc_per_node, sbatch_args)
    results: list[dict] = []
    try:
        granted = _wait_granted(job_id, deadline)
        ended = functools.partial(_job_ended, job_id)
        _wait_joined(rundir, granted, seen, deadline, ended, see=f"{rundir.logs}/slurm-grow-{job_id}.out")
        for node in granted:
            command = {"op": "add", "count": nproc_per_node, "node": node}
            left = max(1.0, deadline - time.monotonic())
            results.append(request_scale(rundir.run_id, command, runs_root=runs_root, timeout_s=left))
    except BaseException:
        if not results:
            _scancel(job_id)
        raise
    finally:
        if results:  # whatever came after, these workers run on the granted nodes: --remove releases them
            added = sorted(set(results[-1]["members_after"]) - set(results[0]["members_before"]))
            record(rundir.events, EventKind.SLURM_NODES, job=job_id, nodes=granted, workers=added)
    return {**results[-1], "members_before": results[0]["members_before"], "slurm_job": job_id, "nodes": granted}


def rescale(run: str, command: dict, *, runs_root: Path, secret_file: Path | None, timeout_s: float) -> dict:
    """``felactl scale``'s signed request (:func:`~felactl.launcher.scale.request_scale`). Inside
    an allocation, ``--add N --node NODE`` onto a node of it with no agent in the job starts one
    there first (:func:`_start_allocation_agent`). A shrink that leaves nodes Slurm granted the
    run without workers gives them back (:func:`release_emptied`: ``slurm_released`` in the answer)."""
    deadline = time.monotonic() + timeout_s

    def ask() -> dict:
        left = max(1.0, deadline - time.monotonic())
        return request_scale(run, command, runs_root=runs_root, secret_file=secret_file, timeout_s=left)

    try:
        result = ask()
    except InputError as refused:
        step = _start_allocation_agent(run, command, refused, runs_root, secret_file, deadline)
        if step is None:
            raise
        try:
            result = ask()
        except BaseException:  # nothing changed: the agent it started goes too
            stop_processes([step])
            raise
    if command["op"] in ("remove", "to") and "members_after" in result:
        result["slurm_released"] = release_emptied(run, result["members_after"], runs_root=runs_root)
    return result


def _start_allocation_agent(
    run: str, command: dict, refused: InputError, runs_root: Path, secret_file: Path | None, deadline: float
) -> subprocess.Popen | None:
    """The job step of an agent started for a ``--node`` the job has none on, because it is a
    node of the Slurm allocation this runs in (as the launch starts its own: a job step, the run's
    secret on its stdin), once it joined the job; None where none was started. The nodes of an allocation the launch's plan left spare
    are how a job inside it grows."""
    allocation = current_allocation()
    node = command.get("node")
    spare = allocation is not None and node in allocation.nodes and NO_AGENT_THERE in str(refused)
    if command["op"] != "add" or not spare:
        return None
    rundir = RunDir.find(run, root=runs_root)
    seen = len(read_jsonl(rundir.events))
    secret = read_secret_file(secret_file or rundir.secret)
    (step,) = start_step_agents(
        allocation, {node: command["count"]}, coordinator_endpoint(rundir), secret, rundir.logs, rundir.run_id
    )
    log.warning("no agent of run %s on %s: started one as a step of %s", rundir.run_id, node, allocation)

    def ended() -> str | None:
        return None if step.poll() is None else f"its job step ended (exit code {step.returncode})"

    try:
        _wait_joined(rundir, [node], seen, deadline, ended, see=f"{rundir.logs}/slurm-{node}.log")
    except BaseException:
        stop_processes([step])
        raise
    return step


def release_emptied(run: str, members_after: list[int], *, runs_root: Path) -> list[str]:
    """Cancel the Slurm jobs :func:`grow` submitted for ``run`` none of whose workers is among
    ``members_after``; the job ids cancelled (each recorded once it is)."""
    rundir = RunDir.find(run, root=runs_root)
    events = read_jsonl(rundir.events)
    released = {e["job"] for e in events if e.get("kind") == EventKind.SLURM_RELEASED.value}
    granted = {e["job"]: e for e in events if e.get("kind") == EventKind.SLURM_NODES.value}
    cancelled = []
    for job_id, event in granted.items():
        if job_id not in released and not set(event["workers"]) & set(members_after):
            _scancel(job_id)
            record(rundir.events, EventKind.SLURM_RELEASED, job=job_id, nodes=event["nodes"])
            cancelled.append(job_id)
    return cancelled


def _submit(rundir: RunDir, endpoint: str, nodes: int, nproc: int, sbatch_args: tuple[str, ...]) -> str:
    agent = agent_argv(
        endpoint,
        nproc=nproc,
        node_name=None,  # each takes its node's Slurm name
        job=rundir.run_id,
        log_dir=str(rundir.logs.resolve()),
        secret_file=str(rundir.secret.resolve()),
    )
    script = rundir.path / "slurm-grow.sh"
    atomic_write_text(
        script,
        "#!/bin/sh\n"
        f"# felactl scale {rundir.run_id} --slurm-nodes: an agent on each granted node joins the running job\n"
        f"exec srun --ntasks-per-node=1 --kill-on-bad-exit=0 {shlex.join(agent)}\n",
    )
    argv = [
        "sbatch",
        "--parsable",
        f"--nodes={nodes}",
        f"--job-name=felactl-grow-{rundir.run_id}",
        f"--output={rundir.logs.resolve()}/slurm-grow-%j.out",
        *sbatch_args,
        str(script),
    ]
    return run_slurm(*argv).split(";")[0].strip()


def _wait_granted(job_id: str, deadline: float) -> list[str]:
    """The nodes of ``job_id`` once it runs; InputError if it ends first or has not started by ``deadline``."""
    while True:
        state, nodelist = _job(job_id)
        if state == "RUNNING" and nodelist:
            return hostnames(nodelist)
        if state not in WAITING:
            raise InputError(
                f"Slurm job {job_id} for the new nodes ended before it ran ({state or 'gone'}); nothing changed"
            )
        if time.monotonic() > deadline:
            raise InputError(
                f"Slurm did not grant the nodes in time (job {job_id} still {state}); cancelled it, nothing changed"
            )
        time.sleep(POLL_S)


def _wait_joined(
    rundir: RunDir, nodes: list[str], seen: int, deadline: float, ended: Callable[[], str | None], see: str
) -> None:
    """Until every node of ``nodes`` has an agent in the job (a ``node-joined`` event after the
    first ``seen`` events); InputError (the caller undoes what it started) if ``ended()`` says
    why the agents cannot come any more, or ``deadline`` passes first."""
    while True:
        joined = {
            e.get("node") for e in read_jsonl(rundir.events)[seen:] if e.get("kind") == EventKind.NODE_JOINED.value
        }
        missing = [node for node in nodes if node not in joined]
        if not missing:
            return
        why = ended()
        if why is not None or time.monotonic() > deadline:
            raise InputError(
                f"the agents on {', '.join(missing)} did not join: {why or 'in time'} (see {see}); nothing changed"
            )
        time.sleep(POLL_S)


def _job_ended(job_id: str) -> str | None:
    """Why the agents of Slurm job ``job_id`` cannot join any more (None: they still may)."""
    state, _ = _job(job_id)
    return None if state in WAITING else f"their Slurm job {job_id} ended ({state or 'gone'})"


def _job(job_id: str) -> tuple[str, str]:
    """(state, node list) of a Slurm job; ("", "") once Slurm no longer lists it."""
    state, _, nodelist = run_slurm("squeue", "--noheader", f"--jobs={job_id}", "--format=%T|%N").strip().partition("|")
    return state, nodelist


def _scancel(job_id: str) -> None:
    run_slurm("scancel", job_id)
