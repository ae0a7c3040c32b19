"""``python -m felactl.agents.worker``: run one worker from its environment. Exit 2 on bad input."""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from typing import NoReturn

from felactl.agents.worker import drain
from felactl.agents.worker.config import from_env
from felactl.agents.worker.main import run_worker
from felactl.errors import FelactlError

PARENT_CHECK_S = 0.5


def exit_with_parent() -> None:
    """Leave once the process that started this worker is gone. An agent killed with SIGKILL (or
    a crashed one) cannot stop its workers, which run in sessions of their own: each notices its
    parent changed and exits, so nothing trains on for a job nobody watches, and the job's
    coordinator sees the node's workers fail instead of waiting on them."""
    # The agent names itself: a parent that died while this process was still importing torch
    # would otherwise be missed (getppid() would already be the reaper's).
    parent = int(os.environ.get("FELACTL_PARENT_PID") or os.getppid())

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK_S)
        print(f"felactl worker: the process that started it ({parent}) is gone; exiting", file=sys.stderr, flush=True)
        os._exit(1)

    threading.Thread(target=watch, name="felactl-parent-watch", daemon=True).start()


def name_process(name: str) -> None:
    """This process's name in ``ps -o comm`` and ``top`` (15 characters at most)."""
    try:
        with open("/proc/self/comm", "w") as comm:
            comm.write(name[:15])
    except OSError:
        pass  # not Linux: the name stays python's


def worker_name() -> str:
    """``felactl-w<id>``: a worker forked from its agent's zygote shows the zygote's command line
    and environment in ``/proc``, so its name is where a person (or a test) finds which it is."""
    return f"felactl-w{os.environ.get('FELACTL_WORKER_ID') or os.environ.get('RANK', '')}"


def main() -> int:
    drain.listen()
    exit_with_parent()
    name_process(worker_name())
    try:
        run_worker(from_env())
    except FelactlError as exc:
        print(f"felactl worker: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


def run() -> NoReturn:
    """Run the worker and leave with its exit code at once. The interpreter's teardown is skipped
    on purpose: a store or gloo thread still busy in C++ at that point aborts the process
    ("terminate called without an active exception", exit -6), and the launch would then report
    the abort instead of the worker's own reason. Nothing is lost: metrics, checkpoints and
    summaries are written with unbuffered or atomic writes before ``main`` returns."""
    try:
        code = main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - a bug: show it, then leave as the interpreter would
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
