"""Start felactl's workers by forking a process that has already imported torch (a zygote).

A worker started as ``python -m felactl.agents.worker`` spends ~1.6 s of a core importing torch
and felactl before it does anything, every time: each worker of a node, and again for each one
at every restart and scale-out (where the pause is what the user waits through). The node's
agent starts one zygote instead (``python -m felactl.agents.worker.zygote``), which imports them
once and forks a worker per request, the way Android starts apps and Python's ``forkserver`` starts
``multiprocessing`` children. The zygote never starts a thread of its own and never touches a
GPU, so a forked child starts as clean as an exec'd one.

A forked worker is what an exec'd one is: its own session (the agent stops its group), its own
environment, log and cores; it knows its parent (the zygote, which leaves when the agent goes, so
an orphaned worker exits as before: ``worker/__main__.py:exit_with_parent``). What cannot be set
after the zygote's start is not: a worker whose environment differs from the zygote's in a
variable read at import time (``PYTHONPATH``, thread counts, ``LD_*`` ...) is started the old way,
as is any other module or a user's script (:meth:`Zygote.serves`).

Before it forks a training worker, the zygote builds the model the worker's plan trains, where
the node's workers can share it (``shared_model.py``: one build a node, pages shared
copy-on-write, none at a restart).

Protocol, one JSON object a line. The zygote says ``{"ready": true}`` once its imports are done.
The agent writes ``{"module": ..., "env": ..., "log": ...}`` to its stdin; the zygote answers
each, in order, with ``{"pid": N}`` (or ``{"error": ...}``; with ``"unforkable": true`` when a
build left it unable to fork, after which it answers every request so), and says ``{"exited": N, "code": C}``
when a child ends (``C`` as ``Popen.returncode``: ``-signal`` when killed). A closed stdin (the
agent gone) ends the zygote.
"""

from __future__ import annotations

import json
import os
import queue
import runpy
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import NoReturn

import psutil

from felactl.control.documents import WORKER_MODULE

LATE_READ = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
"""The torchrun variables a worker reads when it runs (any may differ from the zygote's)."""

LATE_READ_PREFIXES = ("FELACTL_", "TORCHELASTIC_", "NCCL_", "GLOO_", "CUDA_", "PYTHONUNBUFFERED")
"""Prefixes of variables read when a worker runs, not when torch is imported (CUDA's at its
first use, which the zygote never makes; felactl's, NCCL's and gloo's when groups form)."""

ZYGOTE_SWITCH = "FELACTL_ZYGOTE"
"""The environment variable that, set to ``0`` where an agent starts, has it exec every worker."""

START_TIMEOUT_S = 120.0
"""How long the agent waits for the zygote to answer a start (it may still be importing torch)."""

REAP_S = 0.02
"""How often the zygote looks for children that ended while no request came."""


class Zygote:
    """The agent's side: starts the zygote, asks it for workers, learns how they exit."""

    def __init__(self, env: dict[str, str] | None = None):
        self.env = dict(os.environ if env is None else env)
        self.proc = subprocess.Popen(
            [sys.executable, "-u", "-m", "felactl.agents.worker.zygote"],
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None,  # its own errors go where the agent's go
            start_new_session=True,  # a terminal's Ctrl-C is the agent's to handle
        )
        self._lock = threading.Lock()  # one request and its answer at a time
        self._answers: queue.Queue[tuple[dict, ForkedWorker | None]] = queue.Queue()
        self._children: dict[int, ForkedWorker] = {}
        """Each pid's newest child (the kernel gives an ended child's pid again)."""
        self._gone = threading.Event()
        self._ready = threading.Event()
        """Set once its imports are done, or once it is gone (nobody waits for it then)."""
        self._mute = False
        """It once left a request unanswered (an answer that comes late would be misread), or said it
        can fork no more: it gets no more requests."""
        threading.Thread(target=self._read, name="felactl-zygote-reader", daemon=True).start()

    @classmethod
    def unless_switched_off(cls, env: dict[str, str] | None = None) -> Zygote | None:
        """A zygote, or None where ``FELACTL_ZYGOTE=0`` (every worker exec'd: a benchmark's
        baseline, and a way out of the fork should a library need it)."""
        return None if os.environ.get(ZYGOTE_SWITCH, "1") == "0" else cls(env)

    def serves(self, argv: list[str], env: dict[str, str]) -> bool:
        """Whether a worker of ``argv`` and ``env`` starts from this zygote as it would exec'd:
        ``python -m felactl.<module>`` (the training worker, the profiling one), no arguments."""
        if len(argv) != 3 or argv[1] != "-m" or not argv[2].startswith("felactl.") or self.gone():
            return False
        if self._mute:
            return False
        changed = {k for k in env.keys() | self.env.keys() if env.get(k) != self.env.get(k)}
        return all(k in LATE_READ or k.startswith(LATE_READ_PREFIXES) for k in changed)

    def start(self, module: str, env: dict[str, str], log_path: Path) -> ForkedWorker:
        """``python -m module`` forked with ``env``, its output appended to ``log_path``. Raises
        OSError where the zygote cannot start it and has not (the agent then execs the worker):
        it is gone, or still importing after :data:`START_TIMEOUT_S` (it is ended: it has no
        child yet). A ready zygote that does not answer may yet fork: that is a RuntimeError,
        since a worker exec'd beside it would run twice."""
        request = {"module": module, "env": env, "log": str(log_path)}
        with self._lock:
            if not self._ready.wait(START_TIMEOUT_S) or self.gone():
                self.close()
                raise OSError(f"the zygote did not get ready within {START_TIMEOUT_S:.0f} s, or exited")
            try:
                self.proc.stdin.write((json.dumps(request) + "\n").encode())
                self.proc.stdin.flush()
            except (OSError, ValueError) as exc:
                raise OSError(f"the zygote did not start a worker: {exc!r}") from exc
            try:
                answer, child = self._answers.get(timeout=START_TIMEOUT_S)
            except queue.Empty:
                self._mute = True
                raise RuntimeError(f"the zygote did not answer within {START_TIMEOUT_S:.0f} s") from None
        if child is None:
            self._mute = self._mute or bool(answer.get("unforkable"))  # it forks no more: exec the rest quietly
            raise Declined(f"the zygote did not start a worker: {answer.get('error')}", quiet=bool(answer.get("quiet")))
        return child

    def gone(self) -> bool:
        """Whether the zygote has exited (it reports on no child any more)."""
        return self._gone.is_set()

    def close(self, timeout_s: float = 5.0) -> None:
        """End the zygote (its children are the agent's to stop first); one still importing has
        none, and is not waited for."""
        if not self._ready.is_set():
            self.proc.kill()
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if "exited" in message:  # said before the kernel can give the pid to a later child
                if (child := self._children.pop(int(message["exited"]), None)) is not None:
                    child.returncode = int(message["code"])
            elif "ready" in message:
                self._ready.set()
            elif "pid" in message:
                child = self._children[int(message["pid"])] = ForkedWorker(int(message["pid"]), self)
                self._answers.put((message, child))
            else:
                self._answers.put((message, None))
        try:
            self.proc.wait(timeout=5)  # reaped now, not left a zombie until the agent closes it
        except subprocess.TimeoutExpired:
            pass  # it closed its output but runs on: close() ends it
        self._gone.set()
        self._ready.set()
        self._answers.put(({"error": "the zygote exited"}, None))


class Declined(OSError):
    """The zygote answered a start with an error: the worker is exec'd. ``quiet``: the zygote has
    nothing to tell (a model's build failed in it: the worker builds it again and says why)."""

    def __init__(self, message: str, quiet: bool = False):
        super().__init__(message)
        self.quiet = quiet


def start_process(
    argv: list[str], env: dict[str, str], log_path: Path, zygote: Zygote | None
) -> subprocess.Popen | ForkedWorker:
    """``argv`` in its own session with ``env``, its output appended to ``log_path``: forked from
    ``zygote`` where it serves it, else exec'd."""
    if zygote is not None and zygote.serves(argv, env):
        try:
            return zygote.start(argv[2], env, log_path)
        except OSError as exc:
            if not getattr(exc, "quiet", False):
                print(f"felactl: {exc}; starting the worker as a new process", file=sys.stderr)
    with open(log_path, "ab") as log_file:
        return subprocess.Popen(
            argv, env=env, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        )


class ForkedWorker:
    """A forked worker, read as a ``subprocess.Popen`` is (what the agent holds of a worker)."""

    def __init__(self, pid: int, zygote: Zygote):
        self.pid, self._zygote = pid, zygote
        self.returncode: int | None = None
        """Set by the zygote's report of its end."""

    def poll(self) -> int | None:
        """Its exit code once ended; one the zygote can no longer report on (the zygote is gone)
        counts as failed once it no longer runs."""
        if self.returncode is None and self._zygote.gone() and not _running(self.pid):
            self.returncode = 1
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired([WORKER_MODULE], timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # it ended since (Popen's way too)
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _running(pid: int) -> bool:
    """Whether ``pid`` still runs. One the zygote left behind may have become this process's
    child (an agent that is PID 1 in a container inherits orphans): reaped here, else its zombie
    would read as running for ever."""
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    except ChildProcessError:
        pass
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# --- the zygote's side ------------------------------------------------------------------------
def serve() -> None:
    """Import what a worker imports, then fork a worker per request until stdin closes."""
    import torch

    from felactl.agents.worker import shared_model  # the model its workers share is built here
    from felactl.agents.worker.__main__ import name_process  # torch and the whole worker, once

    os.environ.setdefault(shared_model.NVML_CHECK, "1")  # a library's is_available() inits no CUDA here

    if torch.cuda.is_initialized():  # a child of a process that holds a CUDA context cannot use CUDA
        return  # the agent sees the zygote gone and execs its workers
    name_process("felactl-zygote")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the agent ends the zygote by closing its stdin
    requests, answers = sys.stdin.buffer.raw, sys.stdout.fileno()
    _answer(answers, {"ready": True})
    pending = b""
    unforkable = None  # once set, every request is answered with it: the agent execs the worker
    while True:
        readable, _, _ = select.select([requests], [], [], REAP_S)
        if readable:
            chunk = os.read(requests.fileno(), 1 << 16)
            if not chunk:
                break
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                request = json.loads(line)
                try:
                    if unforkable is None and request["module"] == WORKER_MODULE:
                        shared_model.prepare(request["env"])
                except shared_model.Unforkable as exc:  # it stays for the children it has (they watch it)
                    unforkable = exc
                except Exception as exc:  # noqa: BLE001 - what the check itself met (no file left to open)
                    unforkable = shared_model.Unforkable(f"the zygote could not check the model's build: {exc!r}")
                if unforkable is not None:
                    _answer(answers, {"error": str(unforkable), "unforkable": True, "quiet": unforkable.quiet})
                else:
                    _answer(answers, _fork(request, requests.fileno(), answers))
        _reap(answers)
        if unforkable is not None and not _has_children():
            break  # what the build holds (a CUDA context, its threads) goes with it


def _fork(request: dict, *zygote_fds: int) -> dict:
    try:
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as exc:
        return {"error": f"cannot open the worker's log: {exc}"}
    zygote = os.getpid()  # the parent it watches, named before a fork it could die during
    in_session, session_taken = os.pipe()
    pid = os.fork()
    if pid:
        os.close(log)
        os.close(session_taken)
        os.read(in_session, 1)  # until the child has its own session: the agent may killpg(pid) at once
        os.close(in_session)
        return {"pid": pid}
    try:  # the child: it never returns into the zygote's loop
        os.setsid()
        os.close(session_taken)
        _become_worker(request, log, zygote, (*zygote_fds, in_session))
    except BaseException:  # noqa: BLE001 - said in its log (fd 2 is the log once dup'd), then gone
        traceback.print_exc()
    finally:
        os._exit(1)


def _become_worker(request: dict, log: int, zygote: int, zygote_fds: tuple[int, ...]) -> None:
    """In the forked child, in its own session: take the worker's environment, output and cores,
    then run it as ``python -m`` would."""
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in any python: KeyboardInterrupt
    env = dict(request["env"], FELACTL_PARENT_PID=str(zygote))
    os.environ.clear()
    os.environ.update(env)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    for fd in {devnull, log, *zygote_fds} - {0, 1, 2}:
        os.close(fd)
    _take_cores(env)
    if "numpy" in sys.modules:  # every fork would otherwise draw the same numbers (random reseeds itself)
        sys.modules["numpy"].random.seed()
    sys.argv = [request["module"]]
    if request["module"] == WORKER_MODULE:
        from felactl.agents.worker.__main__ import run

        run()  # leaves with the worker's exit code
    _run_as_main(request["module"])


def _take_cores(env: dict[str, str]) -> None:
    """Pin to the slot's cores before running a line (the agent pins it too, after). An exec'd
    worker loaded OpenMP pinned, which then sized its pool to the slot; the zygote loaded it
    with the node's cores, so the pool is sized here (where no thread count was set)."""
    cores = env.get("FELACTL_CPU_CORES")
    if not cores:
        return
    try:
        os.sched_setaffinity(0, [int(c) for c in cores.split(",")])
    except OSError:
        return  # as the agent's own pinning: a core gone from the cpuset leaves it unpinned
    if "OMP_NUM_THREADS" not in env:
        import torch

        torch.set_num_threads(len(cores.split(",")))


def _run_as_main(module: str) -> NoReturn:
    """``python -m module``, leaving as the interpreter would (0, ``SystemExit``'s code, by
    SIGINT after a KeyboardInterrupt, or 1 after the traceback), without its teardown."""
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        code = 1
    except BaseException:  # noqa: BLE001 - the module's own error: shown as python -m shows it
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _answer(fd: int, message: dict) -> None:
    os.write(fd, (json.dumps(message) + "\n").encode())


def _has_children() -> bool:
    """Whether a child runs or is still to be reaped (looked at, not reaped)."""
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    return True


def _reap(answers: int) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _answer(answers, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    try:
        serve()
    except BrokenPipeError:
        pass  # the agent is gone
    os._exit(0)  # without the interpreter's teardown of torch (half a second the agent would wait)
