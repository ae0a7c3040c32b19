"""The per-node agent: start worker processes, watch them, stop every one of them.

Shaped like torch.distributed.elastic's agent: a :class:`WorkerSpec` says what to run, each
:class:`Worker` records one process, a :class:`~felactl.control.documents.WorkerState` enum names
where things stand, and :class:`LocalWorkerAgent` offers ``start`` / ``monitor`` / ``stop`` plus
``run`` (start, then monitor until done). What a set of worker states means for the group is
decided by the pure function :func:`~felactl.control.documents.group_state`, so that decision is
tested without processes; both are the control plane's words, since the agent reports its state to
the coordinator, which reads it the same way.

Workers are ``python -m <module> [args]`` (felactl's own workers) or ``python <script> [args]``
(a user's torchrun-style script) subprocesses with the torchrun environment, so a user's script
runs under the agent the same way it runs under torchrun. Each worker gets its own session
(process group): stopping kills the whole group, grandchildren included, and nothing the agent
started outlives it, even when a worker dies during start-up or ``start`` itself fails half-way.

The agent that joins a job on the control plane and runs this one for it is
:mod:`felactl.agents.node`; starting an agent elsewhere (ssh, a testbed node) is at the end here.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from felactl.agents.worker.zygote import ForkedWorker, Zygote, start_process
from felactl.control.documents import WorkerState, group_state
from felactl.errors import EXIT_AFTER_ANOTHER, InputError

if TYPE_CHECKING:
    from felactl.agents.session import StopOrder


DRAIN_RESIGNAL_S = 1.0
"""During a graceful stop, how often the agent repeats SIGINT to workers that are still running."""


@dataclass(frozen=True, kw_only=True)
class WorkerSpec:
    """What one agent runs: ``nproc`` workers of ``module`` (or ``script``) with ranks ``rank_offset ...``."""

    module: str = ""
    """Run as ``python -m module``."""
    script: str = ""
    """Or run as ``python script`` (a user's torchrun-style script); exactly one of the two."""
    nproc: int
    world_size: int
    rank_offset: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict, repr=False)
    """Extra environment for every worker (on top of this process's and torchrun's)."""
    log_dir: Path = Path(".")
    """Worker ``i`` writes stdout and stderr to ``log_dir/worker-<rank>.log``."""
    cpu_affinity: tuple[tuple[int, ...], ...] | None = None
    """The cores of each of the node's worker slots (:func:`split_cores`); a worker is pinned to
    its slot's with ``sched_setaffinity``. A worker started with the job holds the slot of its
    local rank; one added later (a rescale's newcomer) a free slot, else the least held."""
    local_ranks: tuple[int, ...] = ()
    """Each worker's LOCAL_RANK (its device's index on the node: a plan may use GPUs 0 and 2);
    empty: 0, 1, ..."""
    monitor_interval_s: float = 0.1
    stop_grace_s: float = 3.0
    """How long ``stop`` waits after SIGTERM before SIGKILL."""
    keep_state_s: float = 0.0
    """After a worker failed, how long the others get to end by themselves (they write their state
    for the job's restart: :mod:`felactl.agents.worker.survivors`) before they are stopped."""

    @property
    def argv(self) -> list[str]:
        """The worker's command line."""
        target = ["-m", self.module] if self.module else [self.script]
        return [sys.executable, *target, *self.args]

    def __post_init__(self) -> None:
        if bool(self.module) == bool(self.script):
            raise InputError("a worker spec runs a module or a script (exactly one)")
        if self.nproc < 0:  # 0: an elastic node that waits for the coordinator's add commands
            raise InputError(f"nproc must be >= 0, got {self.nproc}")
        if self.local_ranks and len(self.local_ranks) != self.nproc:
            raise InputError(f"{len(self.local_ranks)} local ranks given for {self.nproc} worker(s)")
        if not 0 <= self.rank_offset or self.rank_offset + self.nproc > self.world_size:
            raise InputError(
                f"ranks {self.rank_offset}..{self.rank_offset + self.nproc - 1} do not fit in a world "
                f"of {self.world_size}"
            )
        if self.cpu_affinity is not None and not all(self.cpu_affinity):
            raise InputError("cpu_affinity: every worker slot needs at least one core")


@dataclass(kw_only=True)
class Worker:
    local_rank: int
    global_rank: int
    log_path: Path
    process: subprocess.Popen | ForkedWorker | None = field(default=None, repr=False)
    state: WorkerState = WorkerState.INIT
    exit_code: int | None = None
    ended_at: float | None = None
    """Wall-clock time its end was seen (which of several failures came first)."""
    slot: int = 0
    """The node's worker slot it holds (its cores: ``WorkerSpec.cpu_affinity[slot]``)."""
    log_start: int = 0
    """Where this run of it begins in its log (a restarted worker's log goes on)."""

    def failure(self) -> str:
        """Why it failed: the signal that killed it, else its own exception's line (this run's)."""
        if self.exit_code is not None and self.exit_code < 0:
            try:
                return f"killed by {signal.Signals(-self.exit_code).name}"
            except ValueError:
                return f"killed by signal {-self.exit_code}"
        return last_line(self.log_path, since=self.log_start) or f"exit code {self.exit_code}"

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid


def _ended_as(exit_code: int, keeps_state: bool) -> WorkerState:
    """How a worker that exited with ``exit_code`` ended: in a job whose survivors keep their
    state, one that stopped because another worker of its attempt failed
    (:data:`~felactl.errors.EXIT_AFTER_ANOTHER`) did not fail itself."""
    if exit_code == 0:
        return WorkerState.SUCCEEDED
    return WorkerState.STOPPED if keeps_state and exit_code == EXIT_AFTER_ANOTHER else WorkerState.FAILED


@dataclass(frozen=True, kw_only=True)
class RunResult:
    state: WorkerState
    exit_codes: dict[int, int]
    """Global rank -> exit code of every worker that has ended."""
    failures: dict[int, str]
    """Global rank -> one line about what went wrong (the last line of its log)."""
    failed_at: dict[int, float] = field(default_factory=dict)
    """Global rank -> wall-clock time its failure was seen."""


def split_cores(cores: list[int], nproc: int) -> tuple[tuple[int, ...], ...]:
    """Give each of ``nproc`` workers a disjoint, contiguous share (round-robin when cores are few)."""
    if nproc <= len(cores):
        share, extra = divmod(len(cores), nproc)
        out, start = [], 0
        for i in range(nproc):
            size = share + (1 if i < extra else 0)
            out.append(tuple(cores[start : start + size]))
            start += size
        return tuple(out)
    return tuple((cores[i % len(cores)],) for i in range(nproc))


def last_line(path: Path, max_bytes: int = 4096, since: int = 0) -> str:
    """Why a worker failed, from the end of its log (what it wrote after byte ``since``: a log
    goes on over restarts): the line of its last traceback's exception (``TypeError: ...``: a
    message may go on over more lines, which say less), else the log's last line."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(since, f.tell() - max_bytes))
            lines = [ln for ln in f.read().decode("utf-8", "replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    starts = [i for i, ln in enumerate(lines) if ln.startswith("Traceback (most recent call last)")]
    if starts:  # the frames below it are indented; the exception's line is the first that is not
        exception = next((ln for ln in lines[starts[-1] + 1 :] if not ln[0].isspace()), None)
        if exception is not None:
            return exception.strip()
    return lines[-1].strip() if lines else ""


class LocalWorkerAgent:
    """Starts, watches and stops the worker processes of one node."""

    def __init__(self, spec: WorkerSpec, zygote: Zygote | None = None):
        self.spec = spec
        self.zygote = zygote
        """Where felactl's workers are forked from, torch already imported (the node's); else each is exec'd."""
        self.workers: list[Worker] = []

    def worker_env(self, local_rank: int) -> dict[str, str]:
        s = self.spec
        env = {**os.environ, **{k: str(v) for k, v in s.env.items()}}
        device_index = s.local_ranks[local_rank] if s.local_ranks else local_rank
        env.update(
            RANK=str(s.rank_offset + local_rank),
            LOCAL_RANK=str(device_index),
            WORLD_SIZE=str(s.world_size),
            LOCAL_WORLD_SIZE=str(s.nproc),
            MASTER_ADDR=s.master_addr,
            MASTER_PORT=str(s.master_port),
            PYTHONUNBUFFERED="1",
            FELACTL_WORKER_ID=str(s.rank_offset + local_rank),
            FELACTL_PARENT_PID=str(os.getpid()),
        )
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
        slot = s.local_ranks[local_rank] if s.local_ranks else local_rank
        worker = Worker(local_rank=local_rank, global_rank=rank, log_path=s.log_dir / f"worker-{rank}.log", slot=slot)
        self._start_on_slot(worker, self.worker_env(local_rank))
        return worker

    def add_worker(self, worker_id: int, env: dict[str, str]) -> Worker:
        """Start one more worker beside the running ones (a rescale's newcomer): ``env`` overrides
        the spec's torchrun variables (a newcomer learns its rank when it is admitted). It is placed
        as the workers started with the job are: on a slot (the device's own, ``LOCAL_RANK``, where
        the coordinator gives it and no live worker holds it; else a free one, else the least held)."""
        wanted = int(env["LOCAL_RANK"]) if str(env.get("LOCAL_RANK", "")).isdigit() else None
        slot = self._slot_for_newcomer(wanted)
        worker = Worker(
            local_rank=len(self.workers),
            global_rank=worker_id,
            log_path=self.spec.log_dir / f"worker-{worker_id}.log",
            slot=slot,
        )
        full_env = {
            **self.worker_env(0),
            "LOCAL_RANK": str(slot),
            "FELACTL_WORKER_ID": str(worker_id),
            **{k: str(v) for k, v in env.items()},
        }
        self.spec.log_dir.mkdir(parents=True, exist_ok=True)
        self._start_on_slot(worker, full_env)
        self.workers.append(worker)
        return worker

    def _slot_for_newcomer(self, wanted: int | None) -> int:
        held = [w.slot for w in self.workers if w.process is not None and w.process.poll() is None]
        num_slots = len(self.spec.cpu_affinity) if self.spec.cpu_affinity else max([*held, -1]) + 1
        if wanted is not None and wanted not in held:
            return wanted
        free = [i for i in range(num_slots) if i not in held]
        if free:
            return free[0]
        return min(range(max(num_slots, 1)), key=lambda i: (held.count(i), i))

    def _start_on_slot(self, worker: Worker, env: dict[str, str]) -> None:
        """Start ``worker``'s process pinned to its slot's cores (where the node pins its slots)."""
        cores = self._slot_cores(worker.slot)
        if cores is not None:
            env = {**env, "FELACTL_CPU_CORES": ",".join(map(str, cores))}
        worker.log_start = worker.log_path.stat().st_size if worker.log_path.exists() else 0
        worker.process = self._popen(worker.log_path, env)
        if cores is not None:
            try:
                os.sched_setaffinity(worker.process.pid, cores)
            except (OSError, AttributeError):
                pass  # it already exited (monitor will see it) or the platform cannot pin
        worker.state = WorkerState.HEALTHY

    def _slot_cores(self, slot: int) -> tuple[int, ...] | None:
        table = self.spec.cpu_affinity
        return None if not table else table[slot % len(table)]

    def _popen(self, log_path: Path, env: dict[str, str]) -> subprocess.Popen | ForkedWorker:
        """The one way a worker process starts: its own session, its output to its log; forked
        from the node's zygote where it serves this worker, else exec'd."""
        return start_process(self.spec.argv, env, log_path, self.zygote)

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
        """Each worker's pid, state, exit code and log, by its global rank (an elastic worker's id)."""
        return {
            str(w.global_rank): {
                "pid": w.pid,
                "state": w.state.value,
                "exit_code": w.exit_code,
                "log": str(w.log_path),
                **({"failure": w.failure()} if w.state is WorkerState.FAILED else {}),
            }
            for w in self.workers
        }

    def monitor(self) -> RunResult:
        """Poll every worker once and say how the group stands."""
        for w in self.workers:
            if w.process is not None and w.state is WorkerState.HEALTHY:
                code = w.process.poll()
                if code is not None:
                    w.exit_code, w.ended_at = code, time.time()
                    w.state = _ended_as(code, keeps_state=self.spec.keep_state_s > 0)
        return self._result()

    def _result(self) -> RunResult:
        failures = {w.global_rank: w.failure() for w in self.workers if w.state is WorkerState.FAILED}
        return RunResult(
            state=group_state([w.state for w in self.workers]),
            exit_codes={w.global_rank: w.exit_code for w in self.workers if w.exit_code is not None},
            failures=failures,
            failed_at={
                w.global_rank: w.ended_at
                for w in self.workers
                if w.state is WorkerState.FAILED and w.ended_at is not None
            },
        )

    def run(
        self,
        should_stop: Callable[[], StopOrder | None] = lambda: None,
        on_failure: Callable[[RunResult], None] = lambda result: None,
    ) -> RunResult:
        """Start, then watch until every worker succeeded, one failed, or ``should_stop()`` orders a
        stop. A failure is told ``on_failure`` at once, also where the others then get
        :attr:`WorkerSpec.keep_state_s` to end by themselves."""
        try:
            self.start()
            while True:
                result = self.monitor()
                if result.state is WorkerState.FAILED and self.spec.keep_state_s > 0:
                    on_failure(result)  # the coordinator tells the workers elsewhere not to wait for it
                    self._let_the_others_end(self.spec.keep_state_s, should_stop)
                running = any(w.state is WorkerState.HEALTHY for w in self.workers)
                if result.state is WorkerState.FAILED or (result.state is not WorkerState.HEALTHY and not running):
                    return result  # (one that stopped after another's failure: the failure comes)
                order = should_stop()
                if order is not None:
                    self.stop(drain_s=order.drain_s)
                    return self._result()
                time.sleep(self.spec.monitor_interval_s)
        finally:
            self.stop()

    def _let_the_others_end(self, within_s: float, should_stop: Callable[[], StopOrder | None]) -> None:
        """A worker failed: wait up to ``within_s`` for the others to end by themselves (they write
        their state, then fail too), or until an order to stop other than the restart's (the job
        ends: ``felactl launch`` interrupted, no restart left). They count as stopped, not failed:
        the failure is the first one's, and their lines (a lost peer) say nothing of it."""
        deadline = time.monotonic() + within_s
        running = [w for w in self.workers if w.process is not None and w.state is WorkerState.HEALTHY]
        while running and time.monotonic() < deadline:
            order = should_stop()
            if order is not None and order.reason != "restart":
                return  # stop() takes them
            for w in [w for w in running if w.process.poll() is not None]:
                w.exit_code, w.ended_at, w.state = w.process.returncode, time.time(), WorkerState.STOPPED
                running.remove(w)
            time.sleep(self.spec.monitor_interval_s)

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

    def stop(self, drain_s: float = 0.0) -> None:
        """SIGTERM each worker's process group, then SIGKILL whatever is left after the grace period.
        ``drain_s`` > 0: first SIGINT the workers and give them that long to end by themselves
        (they agree on a last step and checkpoint it; one that exits 0 then succeeded)."""
        if drain_s > 0:
            # Again every second: a worker still starting up may not listen yet (a shell's
            # background job even starts with SIGINT ignored until felactl's handler is in).
            deadline = time.monotonic() + drain_s
            while (left := deadline - time.monotonic()) > 0 and self._signal_workers(signal.SIGINT):
                psutil.wait_procs(_existing(self.pids()), timeout=min(DRAIN_RESIGNAL_S, left))
            self.monitor()
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

    def _signal_workers(self, sig: int) -> int:
        """``sig`` to the workers themselves (not their groups' other processes); how many were alive."""
        alive = 0
        for w in self.workers:
            if w.process is not None and w.process.poll() is None:
                alive += 1
                try:
                    os.kill(w.process.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
        return alive

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


# --- starting an agent elsewhere (ssh, a testbed node) -----------------------------------


def agent_argv(
    endpoint: str,
    *,
    nproc: int | None,
    node_name: str | None,
    job: str,
    log_dir: str | None = None,
    felactl: tuple[str, ...] = (sys.executable, "-m", "felactl"),
    secret_file: str = "-",
) -> list[str]:
    """``felactl agent`` joining ``endpoint`` as ``node_name`` (None: the name its node gives it)
    with ``nproc`` worker slots (None: the agent's default on its node) for ``job``; it reads the
    job secret from stdin (:func:`start_agent` writes it there), or from ``secret_file``."""
    argv = [*felactl, "agent", "--rdzv-endpoint", endpoint, "--secret-file", secret_file]
    argv += ["--nproc-per-node", str(nproc)] if nproc is not None else []
    argv += ["--node-name", node_name] if node_name is not None else []
    argv += ["--job", job]
    return argv + (["--log-dir", log_dir] if log_dir else [])


def start_agent(command: list[str], secret: str, log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``command`` (an :func:`agent_argv`, wrapped in ssh or a testbed node's entry) in a session
    of its own, its output appended to ``log_path``, and hand it the secret on stdin (never on its
    command line, where ``ps`` shows it)."""
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(
            command, env=env, stdin=subprocess.PIPE, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
    assert proc.stdin is not None
    proc.stdin.write((secret + "\n").encode())
    proc.stdin.close()
    return proc
