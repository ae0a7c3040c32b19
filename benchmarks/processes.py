"""Waiting on a benchmark's worker processes: every one to exit 0, and none left behind."""

from __future__ import annotations

import subprocess


def wait_all(procs: list[subprocess.Popen], timeout_s: float, what: str) -> None:
    """Wait for each of ``procs``; a non-zero exit is a SystemExit naming ``what`` failed. Those
    still running when it returns or raises (a failure, a timeout, Ctrl-C) are killed."""
    try:
        for proc in procs:
            if proc.wait(timeout=timeout_s) != 0:
                raise SystemExit(f"{what} failed (exit {proc.returncode})")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
