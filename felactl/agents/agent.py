"""The per-node agent: start worker processes, watch them, stop every one of them.

Shaped like torch.distributed.elastic's agent: a :class:`WorkerSpec` says what to run, each
:class:`Worker` records one process, a :class:`WorkerState` enum names where things stand, and
:class:`LocalWorkerAgent` offers ``start`` / ``monitor`` / ``stop`` plus ``run`` (start, then
monitor until done). What a set of worker states means for the group is decided by the pure
function :func:`group_state`, so that decision is tested without processes.

Workers are ``python -m <module> [args]`` subprocesses with the torchrun environment, so a user's
script runs under the agent the same way it runs under torchrun. Each worker gets its own session
(process group): stopping kills the whole group, grandchildren included, and nothing the agent
started outlives it, even when a worker dies during start-up or ``start`` itself fails half-way.
"""

from __future__ import annotations

import enum
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psutil

from felactl.errors import ControlPlaneError, InputError


class WorkerState(str, enum.Enum):
    INIT = "init"
    HEALTHY = "healthy"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"


@dataclass(frozen=True, kw_only=True)
class WorkerSpec:
    """What one agent runs: ``nproc`` workers of ``module`` with ranks ``rank_offset ...``."""

    module: str
    """Run as ``python -m module``."""
    nproc: int
    world_size: int
    rank_offset: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment for every worker (on top of this process's and torchrun's)."""
    log_dir: Path = Path(".")
    """Worker ``i`` writes stdout and stderr to ``log_dir/worker-<rank>.log``."""
    cpu_affinity: tuple[tuple[int, ...], ...] | None = None
    """Cores per local worker; each process is pinned to its share with ``sched_setaffinity``."""
    local_ranks: tuple[int, ...] = ()
    """Each worker's LOCAL_RANK (its device's index on the node: a plan may use GPUs 0 and 2);
    empty: 0, 1, ..."""
    monitor_interval_s: float = 0.1
    stop_grace_s: float = 3.0
    """How long ``stop`` waits after SIGTERM before SIGKILL."""

    def __post_init__(self) -> None:
        if self.nproc < 0:  # 0: an elastic node that waits for the coordinator's add commands
            raise InputError(f"nproc must be >= 0, got {self.nproc}")
        if self.local_ranks and len(self.local_ranks) != self.nproc:
            raise InputError(f"{len(self.local_ranks)} local ranks given for {self.nproc} worker(s)")
        if not 0 <= self.rank_offset or self.rank_offset + self.nproc > self.world_size:
            raise InputError(f"ranks {self.rank_offset}..{self.rank_offset + self.nproc - 1} do not fit in a world "
                             f"of {self.world_size}")
        if self.cpu_affinity is not None and len(self.cpu_affinity) != self.nproc:
            raise InputError(f"cpu_affinity lists {len(self.cpu_affinity)} workers, expected {self.nproc}")


@dataclass(kw_only=True)
class Worker:
    local_rank: int
    global_rank: int
    log_path: Path
    process: subprocess.Popen | None = field(default=None, repr=False)
    state: WorkerState = WorkerState.INIT
    exit_code: int | None = None

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid


@dataclass(frozen=True, kw_only=True)
class RunResult:
    state: WorkerState
    exit_codes: dict[int, int]
    """Global rank -> exit code of every worker that has ended."""
    failures: dict[int, str]
    """Global rank -> one line about what went wrong (the last line of its log)."""


def group_state(states: list[WorkerState]) -> WorkerState:
    """One failed worker fails the group; the group succeeds only when every worker did."""
    if any(s is WorkerState.FAILED for s in states):
        return WorkerState.FAILED
    if states and all(s is WorkerState.SUCCEEDED for s in states):
        return WorkerState.SUCCEEDED
    if any(s is WorkerState.STOPPED for s in states):
        return WorkerState.STOPPED
    return WorkerState.HEALTHY


def split_cores(cores: list[int], nproc: int) -> tuple[tuple[int, ...], ...]:
    """Give each of ``nproc`` workers a disjoint, contiguous share (round-robin when cores are few)."""
    if nproc <= len(cores):
        share, extra = divmod(len(cores), nproc)
        out, start = [], 0
        for i in range(nproc):
            size = share + (1 if i < extra else 0)
            out.append(tuple(cores[start:start + size]))
            start += size
        return tuple(out)
    return tuple((cores[i % len(cores)],) for i in range(nproc))


def last_line(path: Path, max_bytes: int = 4096) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            lines = [ln for ln in f.read().decode("utf-8", "replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1].strip() if lines else ""


class LocalWorkerAgent:
    """Starts, watches and stops the worker processes of one node."""

    def __init__(self, spec: WorkerSpec):
        self.spec = spec
        self.workers: list[Worker] = []

    def worker_env(self, local_rank: int) -> dict[str, str]:
        s = self.spec
        env = {**os.environ, **{k: str(v) for k, v in s.env.items()}}
        device_index = s.local_ranks[local_rank] if s.local_ranks else local_rank
        env.update(RANK=str(s.rank_offset + local_rank), LOCAL_RANK=str(device_index), WORLD_SIZE=str(s.world_size),
                   LOCAL_WORLD_SIZE=str(s.nproc), MASTER_ADDR=s.master_addr, MASTER_PORT=str(s.master_port),
                   PYTHONUNBUFFERED="1", FELACTL_WORKER_ID=str(s.rank_offset + local_rank),
                   FELACTL_PARENT_PID=str(os.getpid()))
        if s.cpu_affinity is not None:
            env["FELACTL_CPU_CORES"] = ",".join(map(str, s.cpu_affinity[local_rank]))
        return env

    def start(self) -> list[Worker]:
        """Spawn every worker; if any spawn fails, kill the ones already started and re-raise."""
        s = self.spec
        s.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            for local_rank in range(s.nproc):
                self.workers.append(self._spawn(local_rank))
        except BaseException:
            self.stop()
            raise
        return self.workers

    def _spawn(self, local_rank: int) -> Worker:
        s = self.spec
        rank = s.rank_offset + local_rank
        worker = Worker(local_rank=local_rank, global_rank=rank, log_path=s.log_dir / f"worker-{rank}.log")
        with open(worker.log_path, "ab") as log_file:
            worker.process = subprocess.Popen(
                [sys.executable, "-m", s.module, *s.args], env=self.worker_env(local_rank),
                stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
        if s.cpu_affinity is not None:
            try:
                os.sched_setaffinity(worker.process.pid, s.cpu_affinity[local_rank])
            except (OSError, AttributeError):
                pass  # it already exited (monitor will see it) or the platform cannot pin
        worker.state = WorkerState.HEALTHY
        return worker

    def add_worker(self, worker_id: int, env: dict[str, str]) -> Worker:
        """Start one more worker beside the running ones (a rescale's newcomer): ``env`` overrides
        the spec's torchrun variables (a newcomer learns its rank when it is admitted)."""
        local_rank = len(self.workers)
        worker = Worker(local_rank=local_rank, global_rank=worker_id,
                        log_path=self.spec.log_dir / f"worker-{worker_id}.log")
        full_env = {**self.worker_env(0), "LOCAL_RANK": str(local_rank), **{k: str(v) for k, v in env.items()}}
        full_env.pop("FELACTL_CPU_CORES", None)
        with open(worker.log_path, "ab") as log_file:
            worker.process = subprocess.Popen(
                [sys.executable, "-m", self.spec.module, *self.spec.args], env=full_env,
                stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
        worker.state = WorkerState.HEALTHY
        self.workers.append(worker)
        return worker

    def kill_worker(self, worker_id: int) -> bool:
        """SIGKILL one worker's process group (a hung or dropped member); False if it is not ours."""
        for w in self.workers:
            if w.global_rank == worker_id and w.process is not None:
                try:
                    os.killpg(w.process.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                return True
        return False

    def worker_table(self) -> dict[str, dict]:
        """Each worker's pid, state and exit code, by its global rank (an elastic worker's id)."""
        return {str(w.global_rank): {"pid": w.pid, "state": w.state.value, "exit_code": w.exit_code,
                                     **({"failure": last_line(w.log_path)} if w.state is WorkerState.FAILED else {})}
                for w in self.workers}

    def monitor(self) -> RunResult:
        """Poll every worker once and say how the group stands."""
        for w in self.workers:
            if w.process is not None and w.state is WorkerState.HEALTHY:
                code = w.process.poll()
                if code is not None:
                    w.exit_code = code
                    w.state = WorkerState.SUCCEEDED if code == 0 else WorkerState.FAILED
        return self._result()

    def _result(self) -> RunResult:
        failures = {w.global_rank: last_line(w.log_path) or f"exit code {w.exit_code}"
                    for w in self.workers if w.state is WorkerState.FAILED}
        return RunResult(state=group_state([w.state for w in self.workers]),
                         exit_codes={w.global_rank: w.exit_code for w in self.workers if w.exit_code is not None},
                         failures=failures)

    def run(self, should_stop: Callable[[], str | None] = lambda: None) -> RunResult:
        """Start, then watch until every worker succeeded, one failed, or ``should_stop()`` says why to stop."""
        try:
            self.start()
            while True:
                result = self.monitor()
                if result.state is not WorkerState.HEALTHY:
                    return result
                if should_stop() is not None:
                    self.stop()
                    return self._result()
                time.sleep(self.spec.monitor_interval_s)
        finally:
            self.stop()

    def pids(self) -> set[int]:
        """Every live process this agent started, with their descendants."""
        pids: set[int] = set()
        for w in self.workers:
            if w.process is None:
                continue
            try:
                proc = psutil.Process(w.process.pid)
                pids.add(proc.pid)
                pids.update(child.pid for child in proc.children(recursive=True))
            except psutil.NoSuchProcess:
                pass
        return pids

    def stop(self) -> None:
        """SIGTERM each worker's process group, then SIGKILL whatever is left after the grace period."""
        leftovers = self.pids()
        for w in self.workers:
            if w.process is not None and w.process.poll() is None and w.state is WorkerState.HEALTHY:
                w.state = WorkerState.STOPPED
        self._signal_groups(signal.SIGTERM)
        _, alive = psutil.wait_procs(_existing(leftovers), timeout=self.spec.stop_grace_s)
        self._signal_groups(signal.SIGKILL)
        for proc in alive:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=self.spec.stop_grace_s)
        for w in self.workers:
            if w.process is not None:
                try:
                    w.exit_code = w.process.wait(timeout=self.spec.stop_grace_s)
                except subprocess.TimeoutExpired:
                    pass

    def _signal_groups(self, sig: int) -> None:
        for w in self.workers:
            if w.process is None:
                continue
            try:
                os.killpg(w.process.pid, sig)  # start_new_session: the worker leads its own group
            except (ProcessLookupError, PermissionError):
                pass


def _existing(pids: set[int]) -> list[psutil.Process]:
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    return procs


# --- an agent that takes its work from the control plane -----------------------------------------
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


def run_node_agent(config: NodeAgentConfig, on_joined: Callable[[str], None] = lambda agent_id: None) -> RunResult:
    """Join the coordinator (proving the secret), run the assigned workers, report how they ended.

    Raises AuthError when the secret is refused, ControlPlaneError when the coordinator cannot be
    reached; the workers are stopped when the coordinator says so or disappears.
    """
    from felactl.launcher.controlplane import AgentSession

    session = AgentSession(config.endpoint, config.secret, job=config.job, generation=config.generation,
                           timeout_s=config.join_timeout_s)
    agent_id = session.join(config.node_name, config.nproc, config.node_info)
    on_joined(agent_id)
    try:
        assignment = session.wait_assignment(config.join_timeout_s, alive=lambda: _raise_if_stopped(session))
    except ControlPlaneError as exc:
        _report_quietly(session, WorkerState.STOPPED.value, message=str(exc))
        raise
    nproc = config.nproc if assignment.num_workers is None else assignment.num_workers
    spec = WorkerSpec(module=assignment.module, args=tuple(assignment.args), nproc=nproc,
                      world_size=assignment.world_size, rank_offset=assignment.rank_offset,
                      master_addr=session.host, master_port=session.port, log_dir=config.log_dir,
                      env={**assignment.env, "FELACTL_STORE_PREFIX": session.prefix,
                           "FELACTL_NODE_NAME": config.node_name},
                      cpu_affinity=config.cpu_affinity if nproc == config.nproc else None,
                      local_ranks=tuple(assignment.local_indices) if nproc == config.nproc else ())
    session.report(WorkerState.HEALTHY.value)
    agent = LocalWorkerAgent(spec)
    if assignment.env.get("FELACTL_ELASTIC") == "1":
        result = _run_elastic(agent, session, config)
    else:
        result = agent.run(should_stop=session.stop_requested)
    _report_quietly(session, result.state.value, failures={str(k): v for k, v in result.failures.items()},
                    log_dir=str(config.log_dir))
    return result


def _report_quietly(session, state: str, **details) -> None:
    try:
        session.report(state, **details)
    except RuntimeError:
        pass  # the coordinator is gone; nobody to tell


def _raise_if_stopped(session) -> None:
    reason = session.stop_requested()
    if reason is not None:
        raise ControlPlaneError(f"the coordinator stopped the job before it started: {reason}")


# --- elastic jobs: the coordinator adds and kills workers while the group runs --------------------
AGENT_BEAT_S = 0.5

def _run_elastic(agent: LocalWorkerAgent, session, config: NodeAgentConfig) -> RunResult:
    """Start the assigned workers, then follow the coordinator's signed commands (``add``, ``kill``)
    and report every worker's state; a worker that ends does not end the group — the coordinator
    re-forms the job without it — and the agent runs until the coordinator says stop."""
    try:
        agent.start()
        reported, last_beat = None, 0.0
        while True:
            if time.monotonic() - last_beat >= AGENT_BEAT_S:
                session.beat()
                last_beat = time.monotonic()
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
            reason = session.stop_requested()
            if reason is not None:
                agent.stop()
                result = agent._result()
                state = WorkerState.SUCCEEDED if reason == "finished" else result.state
                return RunResult(state=state, exit_codes=result.exit_codes, failures=result.failures)
            time.sleep(agent.spec.monitor_interval_s)
    finally:
        agent.stop()


def command_queue(prefix: str, agent_id: str) -> str:
    return f"{prefix}agents/{agent_id}/commands"


def _pop_commands(session) -> list[dict]:
    """The coordinator's pending commands to this agent; unsigned ones are dropped (and said so)."""
    from felactl.errors import AuthError
    from felactl.launcher.controlplane import open_envelope

    queue = command_queue(session.prefix, session.agent_id)
    commands = []
    while session.store.queue_len(queue) > 0:
        raw = session.store.queue_pop(queue, block=False)
        try:
            commands.append(open_envelope(session.secret, "command", raw))
        except AuthError as exc:
            print(f"felactl agent: dropped a command: {exc}", file=sys.stderr)
    return commands
