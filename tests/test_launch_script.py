"""felactl launch --script: a torchrun-style script, unmodified, on felactl's agents."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from felactl.cli.main import app
from felactl.launcher.controlplane import Member
from felactl.launcher.rundir import read_jsonl
from felactl.launcher.script import (
    Action,
    first_failure,
    next_action,
    script_assignments,
)

sys.path.insert(0, str(Path(__file__).parent))
from _worker_helpers import fake_ssh

SCRIPT = Path(__file__).parent / "_torchrun_script.py"
STEPS = ["--steps", "12", "--lr", "0.07"]


def _script(tmp_path: Path, *options: str, args: tuple[str, ...] = ()):
    return CliRunner().invoke(
        app, ["launch", "--script", str(SCRIPT), *options, "--runs-root", str(tmp_path / "runs"), "--", *args]
    )


def _last_json(text: str) -> dict:
    return json.loads([line for line in text.splitlines() if line.startswith("{")][-1])


def _run(cmd: list[str], env: dict | None = None, timeout_s: float = 60) -> tuple[int, str, str]:
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, out.decode(), err.decode()


@pytest.fixture(scope="module")
def torchrun_result(tmp_path_factory) -> dict:
    """What torchrun itself makes of the script on 2 workers."""
    code, out, err = _run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT), *STEPS],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert code == 0, err[-3000:]
    return _last_json(out)


# --- pure decisions ------------------------------------------------------------------------------
def _report(state: str, attempt: int, **details) -> dict:
    return {"state": state, "attempt": attempt, **details}


def test_an_attempt_succeeds_only_when_every_agent_reports_success_for_it():
    assert next_action([_report("succeeded", 0), None], 0, 0) is Action.WAIT
    assert next_action([_report("succeeded", 0), _report("succeeded", 0)], 0, 0) is Action.SUCCEED
    # an agent's report of the attempt before counts as still running
    assert next_action([_report("succeeded", 1), _report("failed", 0)], 1, 2) is Action.WAIT


def test_a_failure_restarts_while_restarts_are_left_then_fails():
    reports = [_report("healthy", 1), _report("failed", 1)]
    assert next_action(reports, 1, 2) is Action.RESTART
    assert next_action(reports, 1, 1) is Action.FAIL
    assert next_action([_report("stopped", 0)], 0, 0) is Action.FAIL


def test_the_first_failure_is_the_root_cause_and_a_signal_reads_as_128_plus_n():
    reports = [
        _report("failed", 0, failures={"0": "peer gone"}, exit_codes={"0": 1}, failed_at={"0": 12.0}),
        _report("failed", 0, failures={"3": "OOM"}, exit_codes={"3": 7}, failed_at={"3": 10.0}),
        _report("failed", 1, failures={"5": "old"}, exit_codes={"5": 9}, failed_at={"5": 1.0}),
    ]
    failure = first_failure(reports, 0)
    assert (failure.rank, failure.exit_code, failure.line) == (3, 7, "OOM")
    killed = [_report("failed", 0, failures={"1": ""}, exit_codes={"1": -9}, failed_at={"1": 1.0})]
    assert first_failure(killed, 0).exit_code == 137


def test_ranks_go_to_this_machine_first_then_by_node_name():
    members = [
        Member(agent_id="b1", node_name="b", num_slots=2, hostname="b"),
        Member(agent_id="here", node_name="me", num_slots=1, hostname="me"),
        Member(agent_id="a1", node_name="a", num_slots=3, hostname="a"),
    ]
    out = script_assignments(members, "me")
    assert {k: (a.rank_offset, a.world_size) for k, a in out.items()} == {"here": (0, 6), "a1": (1, 6), "b1": (4, 6)}


# --- CLI: bad input ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "options, needle",
    [
        (["--script", "missing.py"], "--script missing.py: no such file"),
        (["--script", str(SCRIPT), "no-such-plan.yaml"], "no-such-plan.yaml: no such plan file"),
        (["--script", str(SCRIPT), "--max-restarts", "-1"], "--max-restarts must be >= 0, got -1"),
        (["--script", str(SCRIPT), "--nproc-per-node", "0"], "--nproc-per-node must be >= 1, got 0"),
        (["--script", str(SCRIPT), "--steps", "3"], "--steps applies to a plan's training"),
        (["plan.yaml", "--", "x"], "arguments after --: only with --script"),
    ],
)
def test_bad_script_inputs_exit_2_with_one_line(tmp_path, options, needle):
    result = CliRunner().invoke(app, ["launch", *options, "--runs-root", str(tmp_path / "runs")])
    assert result.exit_code == 2, result.output
    assert needle in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


# --- multi-process: real workers (gloo) -----------------------------------------------------------


@pytest.mark.multiprocess
def test_the_script_ends_with_torchruns_loss_and_gets_its_arguments(tmp_path, torchrun_result, no_leftovers):
    result = _script(tmp_path, "--nproc-per-node", "2", "--run-id", "s", "--json", args=tuple(STEPS))
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert (summary["exit_code"], summary["attempts"], summary["num_workers"]) == (0, 1, 2)
    ours = _last_json((tmp_path / "runs" / "s" / "logs" / "worker-0.log").read_text())
    assert ours["argv"] == STEPS and ours["world_size"] == 2
    assert ours["final_loss"] == pytest.approx(torchrun_result["final_loss"], abs=1e-6)
    assert [e["kind"] for e in read_jsonl(tmp_path / "runs" / "s" / "events.jsonl")] == ["launch", "start", "finished"]
    status = CliRunner().invoke(app, ["status", "s", "--runs-root", str(tmp_path / "runs"), "--json"])
    assert status.exit_code == 0, status.output
    assert json.loads(status.stdout)["state"] == "finished"
    human = CliRunner().invoke(app, ["status", "s", "--runs-root", str(tmp_path / "runs")])
    assert human.exit_code == 0 and "exit code 0 on 2 worker(s)" in human.stderr, human.output


@pytest.mark.multiprocess
def test_the_scripts_exit_code_is_the_launchs(tmp_path, no_leftovers):
    result = _script(
        tmp_path,
        "--nproc-per-node",
        "2",
        "--run-id",
        "x",
        "--max-restarts",
        "0",
        args=("--fail-rank", "1", "--exit-code", "3"),
    )
    assert result.exit_code == 3, result.output
    assert "the script failed on rank 1 with exit code 3" in result.stderr
    run = tmp_path / "runs" / "x"
    assert json.loads((run / "summary.json").read_text())["exit_code"] == 3
    status = CliRunner().invoke(app, ["status", "x", "--runs-root", str(tmp_path / "runs"), "--json"])
    assert status.exit_code == 0 and json.loads(status.stdout)["state"] == "failed", status.output


@pytest.mark.multiprocess
def test_a_failed_first_attempt_is_restarted_with_a_new_restart_count(tmp_path, torchrun_result, no_leftovers):
    result = _script(
        tmp_path,
        "--nproc-per-node",
        "2",
        "--run-id",
        "r",
        "--max-restarts",
        "1",
        "--json",
        args=(*STEPS, "--fail-rank", "1", "--exit-code", "5", "--first-attempt-only"),
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["attempts"] == 2
    run = tmp_path / "runs" / "r"
    (restart,) = [e for e in read_jsonl(run / "events.jsonl") if e["kind"] == "restart"]
    assert (restart["restart_count"], restart["failed_rank"], restart["exit_code"]) == (1, 1, 5)
    ours = _last_json((run / "logs" / "worker-0.log").read_text())
    assert ours["restart_count"] == 1
    assert ours["final_loss"] == pytest.approx(torchrun_result["final_loss"], abs=1e-6)


@pytest.mark.multiprocess
def test_a_hostfile_runs_the_script_across_two_agents(tmp_path, torchrun_result, no_leftovers):
    """This machine's agent (1 worker) and an 'ssh' agent (the stand-in ssh runs it here): the
    same agents' join as a plan's, one world of 2, the same loss as torchrun's 2 workers."""
    bin_dir = fake_ssh(tmp_path / "bin")
    (tmp_path / "hosts").write_text("nb slots=1\n")
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "FAKE_SSH_LOG": str(tmp_path / "ssh.log"),
        "OMP_NUM_THREADS": "1",
    }
    code, out, err = _run(
        [
            sys.executable,
            "-m",
            "felactl",
            "launch",
            "--script",
            str(SCRIPT),
            "--nproc-per-node",
            "1",
            "--hostfile",
            str(tmp_path / "hosts"),
            "--node-name",
            "na",
            "--run-id",
            "h",
            "--runs-root",
            str(tmp_path / "runs"),
            "--json",
            "--",
            *STEPS,
        ],
        env=env,
        timeout_s=90,
    )
    assert code == 0, err[-3000:]
    assert json.loads(out)["num_workers"] == 2
    ours = _last_json((tmp_path / "runs" / "h" / "logs" / "worker-0.log").read_text())
    assert ours["world_size"] == 2
    assert ours["final_loss"] == pytest.approx(torchrun_result["final_loss"], abs=1e-6)


@pytest.mark.multiprocess
def test_ctrl_c_stops_the_script_gracefully_and_the_run_reads_stopped(tmp_path, no_leftovers):
    """Ctrl-C on the launch: each worker gets SIGINT (a torchrun script sees KeyboardInterrupt) and
    the run is recorded as stopped, not failed."""
    script = tmp_path / "loop.py"
    script.write_text(
        "import os, sys, time\n"
        "open(os.path.join(os.environ['FELACTL_RUN_DIR'], 'up' + os.environ['RANK']), 'w').close()\n"
        "try:\n"
        "    time.sleep(120)\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted, cleaning up', flush=True)\n"
        "    sys.exit(0)\n"
    )
    runs = tmp_path / "runs"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "felactl",
            "launch",
            "--script",
            str(script),
            "--nproc-per-node",
            "2",
            "--run-id",
            "c",
            "--runs-root",
            str(runs),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not all((runs / "c" / f"up{r}").exists() for r in (0, 1)):
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read().decode()[-2000:]
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err.decode()[-2000:]
    kinds = [e["kind"] for e in read_jsonl(runs / "c" / "events.jsonl")]
    assert kinds[-1] == "stopped" and "failed" not in kinds, kinds
    logs = "".join(p.read_text() for p in (runs / "c" / "logs").glob("*"))
    assert logs.count("interrupted, cleaning up") == 2
    status = CliRunner().invoke(app, ["status", "c", "--runs-root", str(runs), "--json"])
    assert json.loads(status.stdout)["state"] == "stopped", status.output
