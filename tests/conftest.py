import os

import psutil
import pytest

# Multi-process tests share 2 cores: one thread per process keeps them fast and predictable.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _descendants() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


@pytest.fixture
def no_leftovers():
    """Fails the test if a process it started (directly or not) outlives it by more than 5 s."""
    before = _descendants()
    yield
    leftover = [psutil.Process(pid) for pid in _descendants() - before if psutil.pid_exists(pid)]
    _, alive = psutil.wait_procs(leftover, timeout=5)
    assert not alive, f"processes left behind: {[p.cmdline() for p in alive]}"
