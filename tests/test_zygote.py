"""Workers forked from a zygote that imported torch once (felactl.agents.worker.zygote): each is
what an exec'd one is (its own environment, session, log and exit code), the agent reads it as a
``Popen``, and what a fork cannot set (a variable read at import time) is exec'd instead."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from felactl.agents.worker.zygote import ForkedWorker, Zygote, start_process
from felactl.control.documents import WORKER_MODULE

pytestmark = pytest.mark.multiprocess
TESTS = str(Path(__file__).parent)


@pytest.fixture(scope="module")
def zygote():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]))
    zygote = Zygote(env)
    yield zygote
    zygote.close()
    assert zygote.proc.returncode == 0


def _fork(zygote: Zygote, tmp_path: Path, what: str, worker: int = 0) -> tuple[ForkedWorker, Path]:
    log = tmp_path / f"child{worker}.log"
    env = dict(zygote.env, ZYGOTE_CHILD=what, FELACTL_WORKER_ID=str(worker))
    return zygote.start("_zygote_child", env, log), log


def test_a_forked_child_has_its_own_environment_session_and_log(zygote, tmp_path):
    child, log = _fork(zygote, tmp_path, "env", worker=7)
    assert child.wait(timeout=30) == 0
    worker, own_session, parent, watched = log.read_text().split()
    assert worker == "7" and own_session == "True" and int(parent) == int(watched) == zygote.proc.pid


@pytest.mark.parametrize(("what", "code"), [("exit:0", 0), ("exit:3", 3), ("raise", 1)])
def test_its_exit_code_is_the_one_python_m_gives(zygote, tmp_path, what, code):
    child, log = _fork(zygote, tmp_path, what)
    assert child.wait(timeout=30) == code
    if what == "raise":
        assert "ValueError: the child's own error" in log.read_text()


def test_a_signal_reads_as_popen_reads_it_and_its_group_is_its_own(zygote, tmp_path):
    child, log = _fork(zygote, tmp_path, "sleep")
    deadline = time.monotonic() + 30
    while "sleeping" not in log.read_text():
        assert time.monotonic() < deadline and child.poll() is None
        time.sleep(0.02)
    assert child.poll() is None
    with pytest.raises(Exception, match="timed out"):
        child.wait(timeout=0.05)
    os.killpg(child.pid, signal.SIGKILL)  # how the agent stops a worker's group
    assert child.wait(timeout=30) == -signal.SIGKILL


def test_two_forks_draw_different_numbers(zygote, tmp_path):
    draws = []
    for worker in (0, 1):
        child, log = _fork(zygote, tmp_path, "random", worker)
        assert child.wait(timeout=30) == 0
        draws.append(log.read_text())
    assert draws[0] != draws[1]


def test_what_a_fork_cannot_set_is_exec_d(zygote):
    argv = [sys.executable, "-m", WORKER_MODULE]
    assert zygote.serves(argv, dict(zygote.env, RANK="3", FELACTL_PLAN="p.yaml", CUDA_VISIBLE_DEVICES="1"))
    assert not zygote.serves(argv, dict(zygote.env, PYTHONPATH="/elsewhere"))  # read when python starts
    assert not zygote.serves(argv, dict(zygote.env, OMP_NUM_THREADS="7"))  # read when torch loads
    assert not zygote.serves([sys.executable, "train.py"], zygote.env)  # a user's script
    assert not zygote.serves([sys.executable, "-m", "mypackage.train"], zygote.env)
    assert not zygote.serves([*argv, "--flag"], zygote.env)


def test_a_worker_the_zygote_does_not_serve_starts_as_a_process_of_its_own(zygote, tmp_path):
    env = dict(zygote.env, PYTHONPATH=TESTS, ZYGOTE_CHILD="exit:4")
    proc = start_process([sys.executable, "-m", "_zygote_child"], env, tmp_path / "c.log", zygote)
    assert not isinstance(proc, ForkedWorker) and proc.wait(timeout=30) == 4


def test_workers_end_when_the_zygote_ends_and_a_zygote_still_importing_is_not_waited_for(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]))
    zygote = Zygote(env)
    try:
        child, log = _fork(zygote, tmp_path, "sleep")
        deadline = time.monotonic() + 30
        while "sleeping" not in log.read_text():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        zygote.proc.kill()  # as when its agent is killed: a worker left alone exits (exit_with_parent)
        zygote.proc.wait()
        assert child.wait(timeout=30) == 1  # the zygote can no longer say how: counted as failed
        assert not psutil.pid_exists(child.pid) or psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE
    finally:
        zygote.close()
    importing = Zygote(env)
    start = time.monotonic()
    importing.close()
    assert time.monotonic() - start < 1.0 and importing.proc.returncode == -signal.SIGKILL


def test_a_pid_given_again_is_not_taken_for_the_earlier_child_that_had_it():
    """The kernel reuses pids: the ended child keeps its exit code, the new one with its pid runs."""
    zygote = object.__new__(Zygote)
    lines = [b'{"ready": true}\n', b'{"pid": 4242}\n', b'{"exited": 4242, "code": 3}\n', b'{"pid": 4242}\n']
    zygote.proc = SimpleNamespace(stdout=iter(lines), wait=lambda timeout: 0)
    zygote._answers, zygote._children = queue.Queue(), {}
    zygote._gone, zygote._ready = threading.Event(), threading.Event()
    zygote._read()
    (_, first), (_, second) = zygote._answers.get_nowait(), zygote._answers.get_nowait()
    assert first.pid == second.pid == 4242 and first.returncode == 3 and second.returncode is None
    assert zygote._children == {4242: second}  # an ended child leaves the table


def test_its_group_is_its_own_as_soon_as_its_pid_is_known(zygote, tmp_path):
    """The agent may stop a newcomer's group the moment it starts (an elastic ``kill``)."""
    child, _ = _fork(zygote, tmp_path, "sleep")
    os.killpg(child.pid, signal.SIGKILL)  # no ProcessLookupError: the child already leads its group
    assert child.wait(timeout=30) == -signal.SIGKILL


def test_a_pinned_child_sizes_its_threads_to_its_cores_and_a_core_gone_leaves_it_unpinned(tmp_path):
    """An exec'd worker loaded OpenMP once pinned, which sized its pool to the slot; the zygote
    loaded it with every core of the node."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores to tell a slot's threads from the node's")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    zygote = Zygote(dict(env, PYTHONPATH=os.pathsep.join([TESTS, env.get("PYTHONPATH", "")])))
    try:
        outputs = []
        for cores in ("0", "999"):  # a core the cpuset does not hold: unpinned, as the agent leaves it
            log = tmp_path / f"threads-{cores}.log"
            child = zygote.start(
                "_zygote_child", dict(zygote.env, ZYGOTE_CHILD="threads", FELACTL_CPU_CORES=cores), log
            )
            assert child.wait(timeout=30) == 0, log.read_text()
            outputs.append(log.read_text().split())
        assert outputs[0] == ["1", "1"]
        assert outputs[1][1] == str(len(os.sched_getaffinity(0)))
    finally:
        zygote.close()


def test_a_zombie_left_to_this_process_reads_as_ended():
    """An agent that is PID 1 in a container inherits the zygote's orphans: it reaps them."""
    from felactl.agents.worker.zygote import _running

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    while psutil.Process(proc.pid).status() != psutil.STATUS_ZOMBIE:
        time.sleep(0.01)
    assert not _running(proc.pid)
    assert not psutil.pid_exists(proc.pid)  # reaped


def test_a_zygote_that_exits_before_it_is_ready_is_not_waited_for(tmp_path, monkeypatch):
    """One whose imports fail (here torch itself) is gone at once: its workers are exec'd then,
    not after the start-up timeout."""
    from felactl.agents.worker import zygote as zygote_module

    monkeypatch.setattr(zygote_module, "START_TIMEOUT_S", 20.0)
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('no torch here')\n")
    broken = Zygote(dict(os.environ, PYTHONPATH=str(tmp_path)))
    try:
        start = time.monotonic()
        with pytest.raises(OSError, match="or exited"):
            broken.start(WORKER_MODULE, broken.env, tmp_path / "w.log")
        assert time.monotonic() - start < 10 and broken.gone()
    finally:
        broken.close()


def test_a_zygote_that_dies_is_reaped_at_once_not_left_a_zombie(tmp_path):
    """A user's trial killed the zygote: it stayed <defunct> until the launch ended."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]))
    zygote = Zygote(env)
    try:
        child, _ = _fork(zygote, tmp_path, "exit:0")  # once it is ready
        child.wait(timeout=30)
        os.kill(zygote.proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not zygote.gone() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert zygote.gone() and zygote.proc.returncode == -signal.SIGKILL
        assert (
            not psutil.pid_exists(zygote.proc.pid) or psutil.Process(zygote.proc.pid).status() != psutil.STATUS_ZOMBIE
        )
    finally:
        zygote.close()
