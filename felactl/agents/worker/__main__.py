"""``python -m felactl.agents.worker``: run one worker from its environment. Exit 2 on bad input."""

from __future__ import annotations

import os
import sys
import threading
import time

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


def main() -> int:
    exit_with_parent()
    try:
        run_worker(from_env())
    except FelactlError as exc:
        print(f"felactl worker: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
