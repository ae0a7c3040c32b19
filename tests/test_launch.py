"""felactl launch end to end: coordinator, this machine's agent, real worker processes (gloo)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from typer.testing import CliRunner

from felactl.cli.main import app
from felactl.launcher.rundir import read_jsonl
from felactl.machine import short_hostname
from felactl.spec import DeviceKind, ModelRef, Placement, save

sys.path.insert(0, str(Path(__file__).parent))
from _worker_helpers import dp_plan, fake_ssh, worker_processes  # noqa: E402

pytestmark = pytest.mark.multiprocess


def _launch(tmp_path: Path, *args: str):
    return CliRunner().invoke(app, ["launch", *args, "--runs-root", str(tmp_path / "runs")])


def test_launch_runs_the_plan_and_leaves_a_run_directory(tmp_path, no_leftovers):
    plan_path = save(dp_plan(2, "bsp"), tmp_path / "plan.yaml")
    result = _launch(tmp_path, str(plan_path), "--steps", "6", "--run-id", "r1", "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["steps"] == 6 and summary["samples"] == 6 * 32
    assert summary["final_loss"] > 0 and len(summary["workers"]) == 2
    run = tmp_path / "runs" / "r1"
    records = read_jsonl(run / "metrics.jsonl")
    assert sorted((r["rank"], r["step"]) for r in records) == [(r, s) for r in range(2) for s in range(6)]
    assert stat.S_IMODE((run / "secret").stat().st_mode) == 0o600
    assert [e["kind"] for e in read_jsonl(run / "events.jsonl")] == ["launch", "start", "finished"]
    assert json.loads((run / "summary.json").read_text())["steps"] == 6

    status = CliRunner().invoke(app, ["status", "r1", "--runs-root", str(tmp_path / "runs"), "--json"])
    assert status.exit_code == 0, status.output
    assert json.loads(status.stdout)["state"] == "finished"


def test_a_run_keeps_only_its_newest_checkpoints(tmp_path, no_leftovers):
    plan_path = save(dp_plan(2, "bsp"), tmp_path / "plan.yaml")
    result = _launch(
        tmp_path, str(plan_path), "--steps", "12", "--run-id", "k", "--checkpoint-every", "2", "--keep-checkpoints", "2"
    )
    assert result.exit_code == 0, result.output
    kept = sorted(p.name for p in (tmp_path / "runs" / "k" / "checkpoints").iterdir())
    assert kept == ["step000010", "step000012"]


def test_old_checkpoints_are_pruned_while_the_run_goes_on(tmp_path, monkeypatch, no_leftovers):
    """Not only once it ends: a long run must not fill the disk first."""
    from felactl.launcher import follow
    from felactl.launcher.launch import launch
    from felactl.launcher.prepare import LaunchOptions
    from felactl.launcher.rundir import RunDir

    calls = []

    def recording_prune(checkpoints, num_stages, keep):
        doomed = launch_mod_prune(checkpoints, num_stages, keep)
        calls.append((RunDir(checkpoints.parent).read_summary() is None, len(doomed)))
        return doomed

    launch_mod_prune = follow.prune_checkpoints
    monkeypatch.setattr(follow, "prune_checkpoints", recording_prune)
    monkeypatch.setattr(follow, "PRUNE_EVERY_S", 0.0)
    plan_path = save(dp_plan(2, "bsp"), tmp_path / "plan.yaml")
    options = LaunchOptions(
        plan_path=plan_path,
        run_id="p",
        runs_root=tmp_path / "runs",
        steps=30,
        checkpoint_every=1,
        keep_checkpoints=2,
        straggler="roundrobin:0.05",
    )
    launch(options)
    assert sorted(p.name for p in (tmp_path / "runs" / "p" / "checkpoints").iterdir()) == ["step000029", "step000030"]
    during = [removed for running, removed in calls[:-1] if running]
    assert sum(during) > 0, f"nothing was pruned while the run went on: {calls}"


def test_a_worker_that_dies_at_start_fails_the_launch_and_leaves_nothing(tmp_path, no_leftovers):
    plan = dp_plan(2, "bsp")
    broken = dataclasses.replace(plan, model=ModelRef(name="x", source="os:getcwd"))  # imports, builds no model
    plan_path = save(broken, tmp_path / "plan.yaml")
    result = _launch(tmp_path, str(plan_path), "--steps", "3")
    assert result.exit_code == 2, result.output  # every worker refused the plan's model: bad input
    assert re.search(r"node '.+' could not start: workers? [\d, ]+ exited with code 2", result.stderr), result.stderr
    assert "model 'os:getcwd'" in result.stderr
    assert [
        e["kind"]
        for e in read_jsonl(
            tmp_path / "runs" / next(iter(p.name for p in (tmp_path / "runs").iterdir())) / "events.jsonl"
        )
    ][-1] == "failed"


def test_a_job_that_ends_without_recording_a_step_is_recorded_as_failed(tmp_path, monkeypatch, no_leftovers):
    """(A user's script may write no metrics.) The launch used to raise after its last event,
    leaving the run 'running' in its directory forever."""
    from felactl.fsutil import JsonlTail

    monkeypatch.setattr(JsonlTail, "read_new", lambda self: [])
    result = _launch(tmp_path, str(save(dp_plan(2, "bsp"), tmp_path / "plan.yaml")), "--steps", "2", "--run-id", "q")
    assert result.exit_code == 1 and "without recording a step" in result.stderr, result.output
    events = read_jsonl(tmp_path / "runs" / "q" / "events.jsonl")
    assert events[-1]["kind"] == "failed" and "without recording a step" in events[-1]["reason"]
    assert _status(tmp_path, "q")["state"] == "failed"


def test_a_plan_for_another_machine_is_refused(tmp_path, no_leftovers):
    plan = dp_plan(2, "bsp")
    placed = dataclasses.replace(
        plan,
        placement=tuple(
            Placement(device=d, node="elsewhere", kind=DeviceKind.CPU, local_index=i)
            for i, d in enumerate(plan.devices)
        ),
    )
    plan_path = save(placed, tmp_path / "plan.yaml")
    result = _launch(tmp_path, str(plan_path))
    assert result.exit_code == 2
    assert "elsewhere" in result.stderr and short_hostname() in result.stderr
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").iterdir())


@pytest.mark.parametrize(
    "content, needle",
    [(None, "no such file"), ("kind: Plan\nstages: [", "not valid YAML"), ("kind: Cluster\n", "must be Plan")],
)
def test_bad_plan_files(tmp_path, content, needle):
    path = tmp_path / "plan.yaml"
    if content is not None:
        path.write_text(content)
    result = _launch(tmp_path, str(path))
    assert result.exit_code == 2 and needle in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_port_in_use_is_bad_input(tmp_path):
    plan_path = save(dp_plan(2, "bsp"), tmp_path / "plan.yaml")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        result = _launch(tmp_path, str(plan_path), "--rdzv-endpoint", f"127.0.0.1:{port}")
    assert result.exit_code == 2 and f"port {port}" in result.stderr
    assert not list((tmp_path / "runs").iterdir())  # nothing ran: no run directory for `felactl status`


def test_bad_flags(tmp_path):
    plan_path = save(dp_plan(2, "bsp"), tmp_path / "plan.yaml")
    (tmp_path / "bad-hosts").write_text("nodeB slots=x\n")
    for args, needle in [
        (["--slowdown", "1=x"], "slowdown"),
        (["--straggler", "sometimes"], "straggler"),
        (["--nnodes", "2"], "--rdzv-endpoint"),
        (["--slowdown", "5=2"], "rank 5 does not exist"),
        (["--straggler", "roundrobin:abc"], "SECONDS must be a number"),
        (["--collective-timeout", "-1"], "--collective-timeout"),
        (["--join-timeout", "0"], "--join-timeout"),
        (["--rdzv-endpoint", "127.0.0.1:99999"], "port in 0..65535"),
        (["--rdzv-endpoint", "127.0.0.1:29999", "--nnodes", "2"], "places its workers on 1 node"),
        (["--hostfile", str(tmp_path / "missing")], "no such hostfile"),
        (["--hostfile", str(tmp_path / "bad-hosts"), "--rdzv-endpoint", "127.0.0.1:1"], "slots"),
        (["--max-restarts", "-1"], "--max-restarts must be >= 0"),
        (["--max-restarts", "2"], "--max-restarts: this job rescales live"),  # --no-elastic restarts
    ]:
        result = _launch(tmp_path, str(plan_path), *args)
        assert result.exit_code == 2, (args, result.output)
        assert needle.lower() in result.stderr.lower(), (args, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1, (args, result.stderr)
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").iterdir())


def test_nnodes_min_max_needs_a_job_that_goes_on_without_a_node(tmp_path):
    """--nnodes MIN:MAX lets an elastic job start without a node that cannot; a job of fixed
    membership cannot, and is refused before anything starts."""
    plan = dp_plan(2, "bsp")
    two_nodes = dataclasses.replace(
        plan, placement=tuple(Placement(device=d, node=f"n{i}", local_index=0) for i, d in enumerate(plan.devices))
    )
    plan_path = save(two_nodes, tmp_path / "plan.yaml")
    args = ("--nnodes", "1:2", "--rdzv-endpoint", "127.0.0.1:0", "--node-name", "n0", "--no-elastic")
    result = _launch(tmp_path, str(plan_path), *args)
    assert result.exit_code == 2 and "--nnodes 1:2: going on without a node needs live rescaling" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").iterdir())


def test_a_plan_for_gpus_this_machine_lacks_is_refused_before_anything_starts(tmp_path, no_leftovers):
    plan = dp_plan(2, "bsp")
    on_gpus = dataclasses.replace(
        plan,
        placement=tuple(
            Placement(device=d, node="box", kind=DeviceKind.CUDA, local_index=i + 6) for i, d in enumerate(plan.devices)
        ),
    )
    plan_path = save(on_gpus, tmp_path / "plan.yaml")
    result = _launch(tmp_path, str(plan_path), "--node-name", "box")
    assert result.exit_code == 2, result.output
    assert "GPU indices up to 7" in result.stderr and "GPU(s)" in result.stderr
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").iterdir())


def test_a_cpu_plan_on_a_machine_with_gpus_says_they_stay_idle(monkeypatch):
    import torch

    from felactl.launcher.prepare import idle_gpus_warning

    def placed(kind, node="box"):
        plan = dp_plan(2)
        return dataclasses.replace(
            plan,
            placement=tuple(
                Placement(device=d, node=node, kind=kind, local_index=i) for i, d in enumerate(plan.devices)
            ),
        )

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert "4 GPU(s) stay idle" in idle_gpus_warning(placed(DeviceKind.CPU), "box")
    assert "stay idle" in idle_gpus_warning(dp_plan(2), "box")  # places nothing: CPU workers here
    assert idle_gpus_warning(placed(DeviceKind.CUDA), "box") is None  # NCCL on the GPUs
    assert idle_gpus_warning(placed(DeviceKind.CPU, node="other"), "box") is None  # none of it runs here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert idle_gpus_warning(placed(DeviceKind.CPU), "box") is None


def _start_launch(tmp_path: Path, run_id: str) -> tuple[subprocess.Popen, list[psutil.Process]]:
    """A launch of a long run in a process of its own, once its 2 workers have recorded a step."""
    plan_path = save(dp_plan(2, "bsp"), tmp_path / "plan.yaml")
    launch = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "felactl",
            "launch",
            str(plan_path),
            "--steps",
            "1000000",
            "--runs-root",
            str(tmp_path / "runs"),
            "--run-id",
            run_id,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        metrics = tmp_path / "runs" / run_id / "metrics.jsonl"
        deadline = time.monotonic() + 30
        while not (metrics.exists() and metrics.stat().st_size > 0):
            assert launch.poll() is None and time.monotonic() < deadline, launch.stderr.read().decode()[-2000:]
            time.sleep(0.05)
        workers = list(worker_processes(launch.pid).values())
        assert len(workers) == 2
    except BaseException:
        _kill(launch)
        raise
    return launch, workers


def _kill(*procs) -> None:
    for proc in procs:
        try:
            proc.kill()
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass
    for proc in procs:
        if isinstance(proc, subprocess.Popen):
            proc.wait()


def _status(tmp_path: Path, run_id: str) -> dict:
    result = CliRunner().invoke(app, ["status", run_id, "--runs-root", str(tmp_path / "runs"), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_killed_launch_leaves_no_worker_running(tmp_path, sig):
    """SIGTERM takes Ctrl-C's way out (workers stopped, exit 130); after SIGKILL nobody can stop
    the workers, which run in sessions of their own, so each leaves once its parent is gone."""
    launch, workers = _start_launch(tmp_path, "k")
    try:
        os.kill(launch.pid, sig)
        launch.wait(timeout=30)
        _, alive = psutil.wait_procs(workers, timeout=5)
        assert not alive, f"workers still running after the launch got signal {sig}"
        if sig == signal.SIGTERM:
            said = launch.stderr.read().decode()
            assert launch.returncode == 130 and "run k stopped" in said and "felactl launch --resume k" in said, said
            assert _status(tmp_path, "k")["state"] == "stopped", "an interrupted launch records how it ended"
    finally:
        _kill(launch, *workers)


def test_a_run_whose_launch_was_killed_reads_as_lost_and_cannot_be_scaled(tmp_path):
    """SIGKILL leaves no word in the run directory: its launch process being gone is the evidence."""
    launch, workers = _start_launch(tmp_path, "gone")
    try:
        assert _status(tmp_path, "gone")["state"] == "running"
        os.kill(launch.pid, signal.SIGKILL)
        launch.wait(timeout=30)
        status = _status(tmp_path, "gone")
        assert status["state"] == "lost", status
        assert f"its launch process (pid {launch.pid} on {short_hostname()}) is gone" in status["state_reason"]
        human = CliRunner().invoke(app, ["status", "gone", "--runs-root", str(tmp_path / "runs")])
        assert "(lost)" in human.stderr and "felactl launch --resume gone" in human.stderr, human.stderr

        scale = CliRunner().invoke(app, ["scale", "gone", "--add", "1", "--runs-root", str(tmp_path / "runs")])
        assert scale.exit_code == 2 and scale.stdout == "", scale.output
        assert scale.stderr.splitlines() == [
            f"felactl: error: run gone is lost: its launch process (pid {launch.pid} on {short_hostname()}) is "
            "gone, so nothing can rescale it; continue it from its newest checkpoint with "
            "`felactl launch --resume gone`"
        ]

        _, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive, "the orphaned workers leave by themselves"
    finally:
        _kill(launch, *workers)


def test_profiles_that_do_not_fit_the_plan_are_refused(tmp_path):
    from felactl.spec import ClusterSpec, Device, Node

    plan_path = save(dp_plan(2, "bsp"), tmp_path / "plan.yaml")
    other = ClusterSpec(
        name="x",
        nodes=(
            Node(name="x", devices=(Device(name="gpu7", kind=DeviceKind.CPU, model="m", tflops=1.0, memory_gb=1.0),)),
        ),
    )
    cluster = save(other, tmp_path / "cluster.yaml")
    result = _launch(tmp_path, str(plan_path), "--cluster", str(cluster))
    assert result.exit_code == 2 and "--cluster and --model go together" in result.stderr
    from felactl.profiling.model import profile_model

    model = save(
        profile_model("mlp", {"input_dim": 32, "hidden": 64, "depth": 2}, [4], repeats=1), tmp_path / "model.yaml"
    )
    result = _launch(tmp_path, str(plan_path), "--cluster", str(cluster), "--model", str(model))
    assert result.exit_code == 2 and "devices[0]: device 'cpu0' is not in cluster 'x'" in result.stderr, result.output
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_hostfile_starts_the_other_nodes_agent_over_ssh(tmp_path, no_leftovers):
    """DeepSpeed's way: ``--hostfile`` lists the other node; the launch starts its agent with ssh
    (here a stand-in ssh that runs the remote command on this machine, as a second node), the
    secret goes on ssh's stdin, never on a command line, and the job runs across both nodes."""
    bin_dir = fake_ssh(tmp_path / "bin")
    plan = dataclasses.replace(
        dp_plan(2, "bsp"),
        placement=(
            Placement(device="cpu0", node="na", local_index=0),
            Placement(device="cpu1", node="nb", local_index=0),
        ),
    )
    plan_path = save(plan, tmp_path / "plan.yaml")
    (tmp_path / "hosts").write_text("nb slots=1\n")
    log = tmp_path / "ssh.log"
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "FAKE_SSH_LOG": str(log),
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "felactl",
            "launch",
            str(plan_path),
            "--hostfile",
            str(tmp_path / "hosts"),
            "--node-name",
            "na",
            "--steps",
            "8",
            "--run-id",
            "h",
            "--runs-root",
            str(tmp_path / "runs"),
            "--json",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err.decode()[-3000:]
    summary = json.loads(out)
    assert summary["steps"] == 8 and len(summary["workers"]) == 2
    (call,) = [json.loads(line) for line in log.read_text().splitlines()]
    secret = (tmp_path / "runs" / "h" / "secret").read_text().strip()
    assert call["host"] == "nb" and "BatchMode=yes" in call["options"]
    assert call["stdin"].strip() == secret and secret not in call["remote"]
    assert "--secret-file -" in call["remote"] and "--node-name nb" in call["remote"]
    records = read_jsonl(tmp_path / "runs" / "h" / "metrics.jsonl")
    assert {r["rank"] for r in records} == {0, 1}
