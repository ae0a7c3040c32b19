import functools
import os
from collections import Counter

import psutil
import pytest
import typer.testing

# typer builds the click command from the app on every CliRunner.invoke, reading every command's
# signature and evaluating its annotations: about half of what an in-process CLI test costs. The
# app does not change during a run, so the tests build it once (a process the user starts builds
# it once too).
typer.testing._get_command = functools.cache(typer.testing._get_command)

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


def pytest_collection_modifyitems(config, items):
    """Files that start the most processes run first. The suite runs on two workers, a file on
    one worker (pyproject: ``-n 2 --dist loadfile``, a file's shared jobs made once); the longest
    files started first leave short ones to fill in at the end, instead of one worker alone with
    a long file while the other idles. Within a file the order is as written."""
    weight = Counter(item.path for item in items if item.get_closest_marker("multiprocess"))
    first_seen = {path: i for i, path in enumerate(dict.fromkeys(item.path for item in items))}
    items.sort(key=lambda item: (-weight[item.path], first_seen[item.path]))


JOBS_ALONE_FILES = ("tests/test_slurm.py", "tests/test_testbed_jobs.py")
"""The modules whose testbed jobs run one module at a time (``testbed_fixtures.jobs_alone``)."""


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile``, but the :data:`JOBS_ALONE_FILES` are one unit, sent to one worker: on
    two workers the second of them waited up to 70 s for the first's lock while its worker idled
    (the suite's slowest setup)."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class JobsAloneTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return "testbed jobs" if scope in JOBS_ALONE_FILES else scope

    return JobsAloneTogether(config, log)
