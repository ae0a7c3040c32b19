"""The per-node agent: the group decision (pure), the torchrun environment, and that nothing it starts survives.

Workers are real subprocesses (``python -m <module>``) of small modules written to a temp dir.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from felactl.agents.agent import LocalWorkerAgent, WorkerSpec, split_cores
from felactl.agents.session import StopOrder
from felactl.control.documents import WorkerState, group_state
from felactl.errors import InputError

S, F, H, X = WorkerState.SUCCEEDED, WorkerState.FAILED, WorkerState.HEALTHY, WorkerState.STOPPED


@pytest.mark.parametrize(
    "states,expected", [([S, S], S), ([S, H], H), ([H, F], F), ([S, F, S], F), ([X, S], X), ([X, F], F), ([], H)]
)
def test_group_state(states, expected):
    assert group_state(states) is expected


def test_split_cores():
    assert split_cores([0, 1, 2, 3], 2) == ((0, 1), (2, 3))
    assert split_cores([0, 1, 2, 3, 4], 2) == ((0, 1, 2), (3, 4))
    assert split_cores([4, 5], 3) == ((4,), (5,), (4,))


def test_spec_rejects_ranks_outside_the_world(tmp_path):
    with pytest.raises(InputError, match="do not fit"):
        WorkerSpec(module="m", nproc=2, world_size=3, rank_offset=2, log_dir=tmp_path)
    with pytest.raises(InputError, match="nproc must be >= 0"):
        WorkerSpec(module="m", nproc=-1, world_size=1, log_dir=tmp_path)
    # No workers at first: an agent that joins a running elastic job waits for add commands.
    assert LocalWorkerAgent(WorkerSpec(module="m", nproc=0, world_size=1, log_dir=tmp_path)).start() == []


def _module(tmp_path: Path, name: str, body: str) -> dict[str, str]:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    return {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_workers_get_the_torchrun_environment_and_logs(tmp_path):
    env = _module(
        tmp_path,
        "envworker",
        """
        import json, os, sys
        keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "EXTRA",
                "FELACTL_CPU_CORES"]
        out = os.path.join(os.environ["OUT_DIR"], "env-" + os.environ["RANK"] + ".json")
        json.dump({k: os.environ.get(k) for k in keys} | {"args": sys.argv[1:],
                   "affinity": sorted(os.sched_getaffinity(0))}, open(out, "w"))
        print("hello from", os.environ["RANK"])
    """,
    )
    spec = WorkerSpec(
        module="envworker",
        args=("--x", "1"),
        nproc=2,
        world_size=5,
        rank_offset=3,
        master_addr="10.0.0.1",
        master_port=1234,
        log_dir=tmp_path / "logs",
        env={**env, "EXTRA": "yes", "OUT_DIR": str(tmp_path)},
        cpu_affinity=((0,), (0,)),
    )
    result = LocalWorkerAgent(spec).run()
    assert result.state is WorkerState.SUCCEEDED and result.exit_codes == {3: 0, 4: 0}
    seen = json.loads((tmp_path / "env-4.json").read_text())
    assert seen == {
        "RANK": "4",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "5",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "1234",
        "EXTRA": "yes",
        "FELACTL_CPU_CORES": "0",
        "args": ["--x", "1"],
        "affinity": [0],
    }
    assert "hello from 3" in (tmp_path / "logs" / "worker-3.log").read_text()


def _placement(tmp_path: Path, worker_id: int, timeout_s: float = 20) -> dict:
    deadline = time.monotonic() + timeout_s
    path = tmp_path / f"placed-{worker_id}.json"
    while not path.exists():
        assert time.monotonic() < deadline, f"worker {worker_id} did not say where it runs"
        time.sleep(0.05)
    return json.loads(path.read_text())


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to tell the slots apart")
def test_a_worker_added_live_is_placed_on_a_slot_as_the_ones_started_at_launch(tmp_path):
    """Issue 30 item 7: a newcomer (``scale --add``) ran with the agent's whole mask while the
    workers started at launch had a core each, and trained ~10x slower. It takes a free slot's
    cores (the one a dead worker left), else shares the least-held slot's; a node that joined
    with no workers places its newcomers on its slots too."""
    env = _module(
        tmp_path,
        "placed",
        """
        import json, os, time
        out = os.path.join(os.environ["OUT_DIR"], "placed-" + os.environ["FELACTL_WORKER_ID"] + ".json")
        json.dump({"cores": os.environ.get("FELACTL_CPU_CORES"), "affinity": sorted(os.sched_getaffinity(0))},
                  open(out + ".tmp", "w"))
        os.replace(out + ".tmp", out)
        time.sleep(60)
    """,
    )
    core_a, core_b = sorted(os.sched_getaffinity(0))[:2]
    slots = ((core_a,), (core_b,))
    spec = WorkerSpec(
        module="placed",
        nproc=2,
        world_size=2,
        log_dir=tmp_path / "logs",
        env={**env, "OUT_DIR": str(tmp_path)},
        cpu_affinity=slots,
    )
    agent = LocalWorkerAgent(spec)
    try:
        agent.start()
        assert [_placement(tmp_path, w)["affinity"] for w in (0, 1)] == [[core_a], [core_b]]
        agent.kill_worker(1)
        agent.workers[1].process.wait(timeout=10)
        agent.monitor()
        agent.add_worker(7, {})
        assert _placement(tmp_path, 7) == {"cores": str(core_b), "affinity": [core_b]}  # the slot worker 1 left
        agent.add_worker(8, {})  # no slot free: it shares one, never takes both
        assert _placement(tmp_path, 8)["affinity"] in ([core_a], [core_b])
    finally:
        agent.stop()

    joining = LocalWorkerAgent(dataclasses.replace(spec, nproc=0, log_dir=tmp_path / "logs2"))
    try:
        joining.start()
        joining.add_worker(9, {})
        assert _placement(tmp_path, 9)["affinity"] == [core_a]
    finally:
        joining.stop()


def test_local_rank_is_the_devices_index_on_the_node(tmp_path):
    """A plan that uses GPUs 0 and 2 of a node: its workers get LOCAL_RANK 0 and 2 (the CUDA
    ordinals), not 0 and 1; the launcher takes them from the plan's placement."""
    import dataclasses

    from felactl.launcher.controlplane import Member
    from felactl.launcher.node_agents import assign_ranks
    from felactl.spec import Placement

    env = _module(
        tmp_path,
        "localrank",
        """
        import os
        open(os.path.join(os.environ["OUT_DIR"], "lr-" + os.environ["RANK"]), "w").write(os.environ["LOCAL_RANK"])
    """,
    )
    spec = WorkerSpec(
        module="localrank",
        nproc=2,
        world_size=2,
        log_dir=tmp_path / "logs",
        env={**env, "OUT_DIR": str(tmp_path)},
        local_ranks=(0, 2),
    )
    assert LocalWorkerAgent(spec).run().state is WorkerState.SUCCEEDED
    assert [(tmp_path / f"lr-{r}").read_text() for r in (0, 1)] == ["0", "2"]
    with pytest.raises(InputError, match="local ranks"):
        WorkerSpec(module="m", nproc=2, world_size=2, local_ranks=(0,))

    from _worker_helpers import dp_plan

    plan = dataclasses.replace(
        dp_plan(2),
        placement=(
            Placement(device="cpu0", node="box", local_index=0),
            Placement(device="cpu1", node="box", local_index=2),
        ),
    )
    member = Member(agent_id="a1", node_name="box", num_slots=2, hostname="box")
    assignment = assign_ranks(plan, [member], {"box": ("cpu0", "cpu1")}, {})["a1"]
    assert assignment.local_indices == (0, 2) and assignment.rank_offset == 0


SLEEPER = """
    import os, subprocess, sys, time
    rank = os.environ["RANK"]
    out = os.environ["OUT_DIR"]
    if rank == "1":
        while not os.path.exists(os.path.join(out, "pids-0")):
            time.sleep(0.02)
        print("rank 1: cannot start, giving up", flush=True)
        sys.exit(3)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    with open(os.path.join(out, "pids-0.tmp"), "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    os.replace(os.path.join(out, "pids-0.tmp"), os.path.join(out, "pids-0"))
    time.sleep(60)
"""


def test_a_worker_dying_while_starting_takes_every_process_down(tmp_path):
    env = _module(tmp_path, "sleeper", SLEEPER)
    spec = WorkerSpec(
        module="sleeper",
        nproc=2,
        world_size=2,
        log_dir=tmp_path / "logs",
        env={**env, "OUT_DIR": str(tmp_path)},
        stop_grace_s=2,
    )
    agent = LocalWorkerAgent(spec)
    started = time.monotonic()
    result = agent.run()
    assert time.monotonic() - started < 20
    assert result.state is WorkerState.FAILED
    assert result.exit_codes[1] == 3
    assert result.failures == {1: "rank 1: cannot start, giving up"}
    worker_pid, grandchild_pid = map(int, (tmp_path / "pids-0").read_text().split())
    assert worker_pid == agent.workers[0].pid
    assert not _alive(worker_pid) and not _alive(grandchild_pid)
    assert agent.pids() == set()


def test_a_failed_start_kills_the_workers_already_started(tmp_path):
    env = _module(tmp_path, "sleeper", SLEEPER)
    logs = tmp_path / "logs"
    (logs / "worker-1.log").mkdir(parents=True)  # rank 1's log cannot be opened: its spawn fails
    agent = LocalWorkerAgent(
        WorkerSpec(
            module="sleeper", nproc=2, world_size=2, log_dir=logs, env={**env, "OUT_DIR": str(tmp_path)}, stop_grace_s=2
        )
    )
    try:
        with pytest.raises(IsADirectoryError):
            agent.start()
        assert len(agent.workers) == 1
        assert not _alive(agent.workers[0].pid)
    finally:
        agent.stop()


def test_stop_request_stops_healthy_workers(tmp_path):
    env = _module(tmp_path, "napper", "import time\ntime.sleep(60)\n")
    agent = LocalWorkerAgent(
        WorkerSpec(module="napper", nproc=2, world_size=2, log_dir=tmp_path, env=env, stop_grace_s=2)
    )
    calls = []

    def should_stop() -> StopOrder | None:
        calls.append(agent.pids())
        return StopOrder("enough") if len(calls) > 3 else None

    result = agent.run(should_stop)
    assert result.state is WorkerState.STOPPED
    assert len(calls[-1]) == 2 and not any(_alive(pid) for pid in calls[-1])


def test_a_drain_gives_the_workers_sigint_and_time_to_end_by_themselves(tmp_path):
    """A graceful stop: SIGINT, repeated while a worker runs (one still starting up may not listen
    yet); workers that then end by themselves (exit 0) succeeded, one that never listens is
    killed after the drain time."""
    env = _module(
        tmp_path,
        "drainer",
        "import os, signal, sys, time\n"
        "rank = os.environ['RANK']\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "if rank == '2':\n"
        "    time.sleep(1.5)  # still starting up: deaf to the first SIGINT\n"
        "if rank != '1':\n"
        "    signal.signal(signal.SIGINT, lambda *a: sys.exit(0))\n"
        "time.sleep(60)\n",
    )
    agent = LocalWorkerAgent(
        WorkerSpec(module="drainer", nproc=3, world_size=3, log_dir=tmp_path, env=env, stop_grace_s=2)
    )
    calls = []

    def should_stop() -> StopOrder | None:
        calls.append(agent.pids())
        return StopOrder("interrupted", drain_s=3.0) if len(calls) > 5 else None

    start = time.monotonic()
    agent.run(should_stop)
    assert {w.global_rank: w.state for w in agent.workers} == {
        0: WorkerState.SUCCEEDED,
        1: WorkerState.STOPPED,
        2: WorkerState.SUCCEEDED,
    }
    assert time.monotonic() - start < 12 and not any(_alive(pid) for pid in calls[-1])


@pytest.mark.multiprocess
def test_agent_stops_its_workers_when_the_coordinator_goes_away(tmp_path):
    """A real ``felactl agent`` process joins, runs sleepers, and kills them once the store is gone."""
    import subprocess
    import sys

    from felactl.control.documents import Assignment
    from felactl.launcher.controlplane import Coordinator, write_secret_file

    secret_file = tmp_path / "secret"
    secret = write_secret_file(secret_file)
    env = _module(tmp_path, "sleeper", SLEEPER.replace('rank == "1"', 'rank == "never"'))
    coordinator = Coordinator(secret, job="job")
    agent = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "felactl",
            "agent",
            "--rdzv-endpoint",
            coordinator.endpoint,
            "--secret-file",
            str(secret_file),
            "--nproc-per-node",
            "1",
            "--node-name",
            "n0",
            "--log-dir",
            str(tmp_path / "logs"),
            "--job",
            "job",
            "--join-timeout",
            "20",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        members = coordinator.wait_members(1, timeout_s=20)
        coordinator.publish_assignments(
            {
                members[0].agent_id: Assignment(
                    rank_offset=0, world_size=1, module="sleeper", env={**env, "OUT_DIR": str(tmp_path)}
                )
            }
        )
        pid_file = tmp_path / "pids-0"
        deadline = time.monotonic() + 20
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        worker_pid, grandchild_pid = map(int, pid_file.read_text().split())
        assert _alive(worker_pid) and _alive(grandchild_pid)
        coordinator.close()
        _, stderr = agent.communicate(timeout=20)
        assert agent.returncode == 1
        errors = [line for line in stderr.decode().splitlines() if "lost the coordinator" in line]
        assert len(errors) == 1 and errors[0].startswith("felactl: error: ") and "frame #" not in stderr.decode()
        assert not _alive(worker_pid) and not _alive(grandchild_pid)
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, 9)
            agent.wait()


@pytest.mark.parametrize(
    "state,failures,kept",
    [
        ("succeeded", {}, False),
        ("succeeded", {1: "exit 1"}, True),
        ("failed", {0: "boom"}, True),
        ("stopped", {}, True),
    ],
)
def test_a_joining_agent_removes_its_temp_logs_only_when_every_worker_succeeded(
    tmp_path, monkeypatch, state, failures, kept
):
    import dataclasses

    from felactl.agents import local_node
    from felactl.agents.agent import RunResult
    from felactl.control.documents import WorkerState

    logs = tmp_path / "felactl-agent-x"
    logs.mkdir()
    (logs / "worker0.log").write_text("...")
    config = local_node.local_agent_config(
        "127.0.0.1:1", "s", nproc=1, node_name="n", log_dir=logs, join_timeout_s=1, job=None
    )
    monkeypatch.setattr(
        local_node,
        "run_node_agent",
        lambda config, on_joined: RunResult(state=WorkerState(state), exit_codes={0: 0}, failures=failures),
    )
    result, where = local_node.run_joining_agent(config, temp_logs=True)
    assert result.state is WorkerState(state)
    assert (where == logs and logs.exists()) if kept else (where is None and not logs.exists())
    asked = tmp_path / "asked"
    asked.mkdir()
    _, where = local_node.run_joining_agent(dataclasses.replace(config, log_dir=asked), temp_logs=False)
    assert where == asked and asked.exists(), "a --log-dir the user gave is never removed"


def test_felactls_workers_get_the_secret_in_their_environment_a_users_script_does_not(tmp_path):
    """The secret reaches felactl's workers (they verify generation documents and sign what they
    write) from their agent's memory, never through the store; a user's ``--script`` gets none."""
    from types import SimpleNamespace

    from felactl.agents.node import NodeAgentConfig, _worker_spec
    from felactl.control.documents import Assignment
    from felactl.launcher.controlplane import new_secret

    secret = new_secret()
    session = SimpleNamespace(
        host="127.0.0.1",
        port=1,
        prefix="felactl/r/0/",
        worker_env=lambda: {"FELACTL_SECRET": secret, "FELACTL_SESSION": "s", "FELACTL_JOB": "r"},
    )
    config = NodeAgentConfig(endpoint="127.0.0.1:1", secret=secret, node_name="n", nproc=1, log_dir=tmp_path)
    ours = _worker_spec(config, session, Assignment(rank_offset=0, world_size=1, module="felactl.agents.worker"))
    theirs = _worker_spec(config, session, Assignment(rank_offset=0, world_size=1, script="train.py"))
    assert ours.env["FELACTL_SECRET"] == secret and ours.env["FELACTL_SESSION"] == "s"
    assert not any(secret in value for value in theirs.env.values())
    assert secret not in repr(ours)


def test_which_membership_a_worker_runs_comes_from_its_assignment(tmp_path):
    """An elastic job and a fixed one are started with the same environment; the launcher says
    which in one typed field of the assignment, and the agent tells its workers (as it tells them
    their RANK), never by reading an environment string the launcher wrote."""
    from types import SimpleNamespace

    from _worker_helpers import dp_plan

    from felactl.agents.node import NodeAgentConfig, _worker_spec
    from felactl.control.documents import Assignment
    from felactl.launcher.controlplane import Member
    from felactl.launcher.launch import assign_ranks

    session = SimpleNamespace(host="127.0.0.1", port=1, prefix="felactl/r/0/", worker_env=lambda: {})
    config = NodeAgentConfig(endpoint="127.0.0.1:1", secret="s", node_name="n", nproc=1, log_dir=tmp_path)
    elastic = Assignment(rank_offset=0, world_size=1, module="felactl.agents.worker", elastic=True)
    fixed = Assignment(rank_offset=0, world_size=1, module="felactl.agents.worker")
    assert _worker_spec(config, session, elastic).env["FELACTL_ELASTIC"] == "1"
    assert "FELACTL_ELASTIC" not in _worker_spec(config, session, fixed).env
    plan = dp_plan(2)
    member = Member(agent_id="a1", node_name="box", num_slots=2, hostname="box")
    nodes = {"box": tuple(plan.devices)}
    assert assign_ranks(plan, [member], nodes, {}, elastic=True)["a1"].elastic
    assert not assign_ranks(plan, [member], nodes, {})["a1"].elastic


def test_an_agent_started_in_a_testbed_node_takes_the_node_s_name(tmp_path, monkeypatch):
    """README's recipe, `felactl testbed exec NODE -- felactl agent ...` without --node-name: the
    agent is NODE (the testbed's exec sets FELACTL_TESTBED_NODE), not the host's name, so that
    `felactl scale --node NODE` finds it. A --node-name given still wins."""
    from felactl.agents import local_node

    monkeypatch.setenv("FELACTL_TESTBED_NODE", "fast2")
    config = local_node.local_agent_config(
        "127.0.0.1:1", "s", nproc=1, node_name=None, log_dir=tmp_path, join_timeout_s=1, job=None
    )
    assert config.node_name == "fast2"
    named = local_node.local_agent_config(
        "127.0.0.1:1", "s", nproc=1, node_name="mine", log_dir=tmp_path, join_timeout_s=1, job=None
    )
    assert named.node_name == "mine"


def test_a_failed_workers_reason_is_its_exceptions_first_line(tmp_path):
    """A worker's log ends in a traceback whose message spans lines (torch's argument errors list
    the signatures it expected): the reason is the exception's own line, not the log's last one,
    which read '* (tuple of ints dim, bool keepdim = False, ...)'."""
    from felactl.agents.agent import last_line

    log = tmp_path / "worker-0.log"
    log.write_text(
        "step 1\n"
        "Traceback (most recent call last):\n"
        '  File "a.py", line 1, in <module>\n'
        "    raise ValueError('first')\n"
        "ValueError: first\n"
        "\n"
        "During handling of the above exception, another exception occurred:\n"
        "\n"
        "Traceback (most recent call last):\n"
        '  File "myreg.py", line 10, in __getitem__\n'
        "    return x, x.sum(keepdim=True)\n"
        "              ^^^^^^^^^^^^^^^^^^^\n"
        "TypeError: sum() received an invalid combination of arguments - got (keepdim=bool, ), but expected one of:\n"
        " * (*, torch.dtype dtype = None)\n"
        " * (tuple of ints dim, bool keepdim = False, *, torch.dtype dtype = None)\n"
        "\n"
    )
    assert last_line(log) == (
        "TypeError: sum() received an invalid combination of arguments - got (keepdim=bool, ), but expected one of:"
    )
    log.write_text("step 1\nfelactl worker: error: plan.yaml: no such file\n")
    assert last_line(log) == "felactl worker: error: plan.yaml: no such file"


def test_after_a_failure_the_others_get_keep_state_s_to_end_and_count_as_stopped(tmp_path):
    """A job whose survivors write their state for its restart: the failure is told at once, then
    the others get ``keep_state_s`` to end by themselves (rank 1 does, failing on its lost peer;
    rank 2 never does and is killed after it). Only the first failure is the group's: the others'
    lines (a lost peer) would make the next failure look like the same one."""
    env = _module(
        tmp_path,
        "survivor",
        "import os, sys, time\n"
        "rank = os.environ['RANK']\n"
        "time.sleep({'0': 0.5, '1': 1.5, '2': 60}[rank])\n"
        "sys.exit(f'rank {rank} failed')\n",
    )
    spec = WorkerSpec(module="survivor", nproc=3, world_size=3, log_dir=tmp_path, env=env, stop_grace_s=2)
    told = []
    agent = LocalWorkerAgent(dataclasses.replace(spec, keep_state_s=4.0))
    start = time.monotonic()
    result = agent.run(on_failure=lambda r: told.append((time.monotonic() - start, dict(r.failures))))
    assert [failures for _, failures in told] == [{0: "rank 0 failed"}] and told[0][0] < 3, told
    assert result.failures == {0: "rank 0 failed"}, result.failures
    assert {w.global_rank: w.state for w in agent.workers} == {
        0: WorkerState.FAILED,
        1: WorkerState.STOPPED,
        2: WorkerState.STOPPED,
    }
    assert 4 <= time.monotonic() - start < 15, "rank 2 was given keep_state_s, then stopped"


def test_a_worker_that_stopped_after_anothers_failure_does_not_hide_that_failure(tmp_path):
    """A survivor that stops waiting once another failed exits 75 (EXIT_AFTER_ANOTHER), maybe before
    the failing worker itself, which still writes its state: it counts as stopped, the agent goes
    on watching, and the failure it reports is the failing worker's own line (not the survivor's,
    which repeats with every failure and would make the next one look like the same)."""
    env = _module(
        tmp_path,
        "follower",
        "import os, sys, time\n"
        "rank = os.environ['RANK']\n"
        "time.sleep({'0': 1.5, '1': 0.3, '2': 60}[rank])\n"
        "sys.exit(75 if rank == '1' else 'rank 0 failed')\n",
    )
    spec = WorkerSpec(module="follower", nproc=3, world_size=3, log_dir=tmp_path, env=env, stop_grace_s=2)
    agent = LocalWorkerAgent(dataclasses.replace(spec, keep_state_s=2.0))
    result = agent.run()
    assert result.failures == {0: "rank 0 failed"}, result.failures
    assert {w.global_rank: w.state for w in agent.workers} == {
        0: WorkerState.FAILED,
        1: WorkerState.STOPPED,
        2: WorkerState.STOPPED,
    }


def test_a_workers_failure_is_said_from_this_run_of_it_and_a_kill_as_a_kill(tmp_path):
    """Logs are appended to across restarts: a worker killed by a signal is said to be killed (its
    log's last line was an older attempt's traceback, or any line it printed), and one that raised
    is said by its own exception, not an earlier attempt's (a user's trial saw a restarted run
    blame a stale KeyboardInterrupt and an FSDP warning line)."""
    go = tmp_path / "go"
    env = _module(
        tmp_path,
        "dier",
        "import os, pathlib, time\n"
        "print('a warning line a library printed', flush=True)\n"
        f"while os.environ['RANK'] == '0' or not pathlib.Path({str(go)!r}).exists():\n"
        "    time.sleep(0.05)\n"
        "raise ValueError('this run raised this')\n",
    )
    logs = tmp_path / "logs"
    logs.mkdir()
    stale = "Traceback (most recent call last):\n  File x\nKeyboardInterrupt: an earlier attempt's\n"
    for rank in (0, 1):
        (logs / f"worker-{rank}.log").write_text(stale)
    agent = LocalWorkerAgent(WorkerSpec(module="dier", nproc=2, world_size=2, log_dir=logs, env=env, stop_grace_s=2))
    try:
        agent.start()
        deadline = time.monotonic() + 20
        while "a warning line" not in (logs / "worker-0.log").read_text():
            assert time.monotonic() < deadline, "the worker did not start"
            time.sleep(0.05)
        os.kill(agent.workers[0].pid, signal.SIGKILL)
        go.touch()
        for worker in agent.workers:
            worker.process.wait(timeout=20)
        result = agent.monitor()
    finally:
        agent.stop()
    assert result.failures == {0: "killed by SIGKILL", 1: "ValueError: this run raised this"}, result.failures


def test_an_elastic_agent_whose_coordinator_is_gone_says_so_and_a_finished_one_succeeds(monkeypatch):
    """The launch may close its store between a job's end and this agent's next look at it (a
    late agent, a busy machine): its workers having succeeded, the agent succeeds; with workers still
    running it is one line, "lost the coordinator" (was: an internal DistNetworkError)."""
    import torch.distributed as dist

    from felactl.agents import node
    from felactl.agents.agent import RunResult
    from felactl.control.documents import WorkerState
    from felactl.errors import ControlPlaneError

    class Store:
        def queue_len(self, name):
            raise dist.DistNetworkError("Failed to recv, got 0 bytes")

    class Session:
        host, port = "10.0.0.1", 29500
        agent_id, prefix, store = "na-1", "felactl/job/0/", Store()

    class Workers:
        def __init__(self, state):
            self.state, self.stopped = state, False

        def start(self):
            pass

        def monitor(self):
            return RunResult(state=self.state, exit_codes={0: 0}, failures={})

        def stop(self, drain_s: float = 0.0):
            self.stopped = True

    monkeypatch.setattr(node, "LOST_COORDINATOR_GRACE_S", 0.3)  # how long workers still running get to end
    done = Workers(WorkerState.SUCCEEDED)
    assert node._supervise_elastic(done, Session()).state is WorkerState.SUCCEEDED and done.stopped
    running = Workers(WorkerState.HEALTHY)
    with pytest.raises(ControlPlaneError, match=r"lost the coordinator at 10.0.0.1:29500: Failed to recv"):
        node._supervise_elastic(running, Session())
    assert running.stopped
