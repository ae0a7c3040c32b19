"""``python -m felactl.agents.worker``: run one worker from its environment. Exit 2 on bad input."""

from __future__ import annotations

import sys

from felactl.agents.worker.config import from_env
from felactl.agents.worker.main import run_worker
from felactl.errors import FelactlError


def main() -> int:
    try:
        run_worker(from_env())
    except FelactlError as exc:
        print(f"felactl worker: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
