"""Run a job's workers as local subprocesses around a store started here: for tests and benchmarks.

The real path is ``felactl launch`` (coordinator + agents); this runs exactly the same worker
entry (``python -m felactl.agents.worker``) with the same environment, without the agents, and
always reaps every process it started.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from felactl.agents.worker.zygote import ForkedWorker, Zygote, start_process
from felactl.control.documents import WORKER_MODULE
from felactl.control.store import serve_store
from felactl.errors import WorkerFailed


def worker_env(
    rank: int,
    world_size: int,
    *,
    store_port: int,
    plan_path: Path,
    run_dir: Path,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(store_port),
            "FELACTL_STORE": f"127.0.0.1:{store_port}",
            "FELACTL_PLAN": str(plan_path),
            "FELACTL_RUN_DIR": str(run_dir),
            "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
        }
    )
    env.update(extra or {})
    return env


def run_local(
    plan_path: str | os.PathLike,
    run_dir: str | os.PathLike,
    world_size: int,
    extra_env: Mapping[str, str] | None = None,
    per_rank_env: Mapping[int, Mapping[str, str]] | None = None,
    timeout_s: float = 120.0,
) -> float:
    """Start ``world_size`` workers, wait for all; returns the wall seconds. Raises
    :class:`WorkerFailed` (with the failing worker's last stderr lines) if any exits non-zero."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    store, port = serve_store("127.0.0.1")  # loopback only (a plain TCPStore server listens everywhere)
    procs: list[subprocess.Popen | ForkedWorker] = []
    logs = []
    start = time.perf_counter()
    secret = secrets.token_hex(32)  # the workers sign what they agree on (a graceful stop's last step)
    envs = [
        worker_env(
            rank,
            world_size,
            store_port=port,
            plan_path=Path(plan_path),
            run_dir=run_dir,
            extra={"FELACTL_SECRET": secret, **(extra_env or {}), **((per_rank_env or {}).get(rank, {}))},
        )
        for rank in range(world_size)
    ]
    zygote = Zygote.unless_switched_off(envs[0])  # one import of torch for every worker, as the agent's
    try:
        for rank, env in enumerate(envs):
            log_path = run_dir / f"worker{rank}.log"
            logs.append(open(log_path, "w+b"))  # read back for a failure's last lines
            procs.append(start_process([sys.executable, "-m", WORKER_MODULE], env, log_path, zygote))
        _wait_all(procs, logs, start + timeout_s)
        return time.perf_counter() - start
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        if zygote is not None:
            zygote.close()
        for log in logs:
            log.close()
        del store


STACKS_GRACE_S = 1.0
"""How long a worker that timed out is given to write its threads' stacks to its log."""


def _wait_all(procs: list[subprocess.Popen | ForkedWorker], logs: list, deadline: float) -> None:
    while any(p.poll() is None for p in procs):
        failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
        if failed:
            raise WorkerFailed(
                f"worker {failed[0]} exited with {procs[failed[0]].returncode}: {_tail(logs[failed[0]])}"
            )
        if time.perf_counter() > deadline:
            rank = next(r for r, p in enumerate(procs) if p.poll() is None)
            raise WorkerFailed(f"worker {rank} timed out; where it was: {_stacks(procs[rank], logs[rank])}")
        time.sleep(0.05)
    failed = [r for r, p in enumerate(procs) if p.returncode != 0]
    if failed:
        raise WorkerFailed(f"worker {failed[0]} exited with {procs[failed[0]].returncode}: {_tail(logs[failed[0]])}")


def _stacks(proc: subprocess.Popen | ForkedWorker, log) -> str:
    """A stuck worker's threads' stacks: every worker dumps them on SIGUSR1 (``faulthandler``, in
    ``main.run_worker``), which lands in the log; a hang seen once in CI left an empty log and
    nothing to go on."""
    try:
        proc.send_signal(signal.SIGUSR1)
    except ProcessLookupError:
        return _tail(log)
    time.sleep(STACKS_GRACE_S)
    return _tail(log, num_lines=60)


def _tail(log, num_lines: int = 8) -> str:
    log.flush()
    log.seek(0)
    lines = log.read().decode("utf-8", "replace").strip().splitlines()
    return " | ".join(lines[-num_lines:])
