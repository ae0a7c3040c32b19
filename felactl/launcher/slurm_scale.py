"""``felactl scale RUN --slurm-nodes K``: a running job grows onto nodes Slurm grants it, and gives
them back when their workers are removed.

Growing submits a batch job of its own (``sbatch --nodes=K``) whose one step starts ``felactl
agent`` on each granted node (``srun --ntasks-per-node=1``), joining the run's coordinator with the
run's secret file (a path on the command line, the secret itself never), named as Slurm names the
node. Once every granted node's agent has joined, each gets ``--nproc-per-node`` workers through
the ordinary signed scale request (:func:`~felactl.launcher.scale.request_scale`), so the job
rescales as for any new node. The run records the Slurm job and the workers it holds
(``slurm-nodes``). Slurm not granting the nodes within ``--timeout`` cancels the request's job:
nothing changes. When ``felactl scale --remove`` leaves a granted job's nodes without workers,
that job is cancelled (``scancel``) and the run records it (``slurm-released``).
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

from felactl.control import EventKind
from felactl.control.events import record
from felactl.errors import InputError
from felactl.launcher.rundir import RunDir
from felactl.launcher.scale import coordinator_endpoint, request_scale
from felactl.launcher.slurm import hostnames

POLL_S = 0.5


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
    (module doc); what changed."""
    rundir = RunDir.find(run, root=runs_root)
    endpoint = coordinator_endpoint(rundir)
    deadline = time.monotonic() + timeout_s
    job_id = _submit(rundir, endpoint, nodes, nproc_per_node, sbatch_args)
    try:
        granted = _wait_granted(job_id, deadline)
        _wait_joined(rundir, granted, deadline)
    except BaseException:
        _scancel(job_id)
        raise
    results = [
        request_scale(
            rundir.run_id,
            {"op": "add", "count": nproc_per_node, "node": node},
            runs_root=runs_root,
            timeout_s=max(1.0, deadline - time.monotonic()),
        )
        for node in granted
    ]
    added = sorted(set(results[-1]["members_after"]) - set(results[0]["members_before"]))
    record(rundir.events, EventKind.SLURM_NODES, job=job_id, nodes=granted, workers=added)
    return {**results[-1], "members_before": results[0]["members_before"], "slurm_job": job_id, "nodes": granted}


def release_emptied(run: str, members_after: list[int], *, runs_root: Path) -> list[str]:
    """Cancel the Slurm jobs :func:`grow` submitted for ``run`` none of whose workers is among
    ``members_after``; the job ids cancelled."""
    rundir = RunDir.find(run, root=runs_root)
    granted, released = {}, set()
    for line in rundir.events.read_text().splitlines() if rundir.events.exists() else ():
        event = json.loads(line)
        if event.get("kind") == EventKind.SLURM_NODES.value:
            granted[event["job"]] = event
        elif event.get("kind") == EventKind.SLURM_RELEASED.value:
            released.add(event["job"])
    cancelled = []
    for job_id, event in granted.items():
        if job_id not in released and not set(event["workers"]) & set(members_after):
            _scancel(job_id)
            record(rundir.events, EventKind.SLURM_RELEASED, job=job_id, nodes=event["nodes"])
            cancelled.append(job_id)
    return cancelled


def _submit(rundir: RunDir, endpoint: str, nodes: int, nproc: int, sbatch_args: tuple[str, ...]) -> str:
    agent = [
        sys.executable,
        "-m",
        "felactl",
        "agent",
        "--rdzv-endpoint",
        endpoint,
        "--secret-file",
        str(rundir.secret.resolve()),
        "--job",
        rundir.run_id,
        "--nproc-per-node",
        str(nproc),
        "--log-dir",
        str(rundir.logs.resolve()),
    ]
    script = rundir.path / "slurm-grow.sh"
    script.write_text(
        "#!/bin/sh\n"
        f"# felactl scale {rundir.run_id} --slurm-nodes: an agent on each granted node joins the running job\n"
        f"exec srun --ntasks-per-node=1 --kill-on-bad-exit=0 {shlex.join(agent)}\n"
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
    done = _slurm(argv)
    return done.split(";")[0].strip()


def _wait_granted(job_id: str, deadline: float) -> list[str]:
    """The nodes of ``job_id`` once it runs; InputError if Slurm has not started it by ``deadline``."""
    while True:
        shown = _slurm(["squeue", "--noheader", f"--jobs={job_id}", "--format=%T|%N"]).strip()
        state, _, nodelist = shown.partition("|")
        if state == "RUNNING" and nodelist:
            return hostnames(nodelist)
        if state in ("", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "COMPLETED"):
            raise InputError(
                f"Slurm job {job_id} for the new nodes ended before it ran ({state or 'gone'}); nothing changed"
            )
        if time.monotonic() > deadline:
            raise InputError(
                f"Slurm did not grant the nodes in time (job {job_id} still {state}); cancelled it, nothing changed"
            )
        time.sleep(POLL_S)


def _wait_joined(rundir: RunDir, nodes: list[str], deadline: float) -> None:
    """Until every node of ``nodes`` has an agent in the job (its ``node-joined`` event)."""
    while True:
        text = rundir.events.read_text() if rundir.events.exists() else ""
        joined = {
            json.loads(line).get("node") for line in text.splitlines() if f'"{EventKind.NODE_JOINED.value}"' in line
        }
        missing = [node for node in nodes if node not in joined]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise InputError(
                f"the agents on {', '.join(missing)} did not join in time (see {rundir.logs}/slurm-grow-*.out); "
                "cancelled their Slurm job, nothing changed"
            )
        time.sleep(POLL_S)


def _scancel(job_id: str) -> None:
    subprocess.run(["scancel", job_id], capture_output=True, timeout=30, stdin=subprocess.DEVNULL)


def _slurm(argv: list[str]) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise InputError(
            f"--slurm-nodes: {argv[0]} is not on PATH (run felactl scale where Slurm's commands are)"
        ) from None
    if done.returncode != 0:
        raise InputError(f"{argv[0]}: {(done.stderr or done.stdout).strip() or f'exit {done.returncode}'}")
    return done.stdout
