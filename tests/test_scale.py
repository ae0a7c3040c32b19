"""felactl scale end to end: a gpt-mini job on CPU workers grows, shrinks, loses workers and resumes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from felactl import models
from felactl.cli.main import app
from felactl.control import Reader, keys
from felactl.errors import InputError
from felactl.launcher.rundir import read_jsonl
from felactl.launcher.scale_plan import ScalingPolicy, replan
from felactl.report.series import read_run
from felactl.spec import Plan, SyncMode, SyncSpec, Training, save
from tests.test_report import check_report

sys.path.insert(0, str(Path(__file__).parent))
from _worker_helpers import Job, dp_plan, one_node_controller, rescale  # noqa: E402

pytestmark = pytest.mark.multiprocess
GPT_CONFIG = {"depth": 1, "width": 64}
PACED_ENV = {"PYTHONPATH": f"{Path(__file__).parent}:{os.environ.get('PYTHONPATH', '')}"}
"""What a job of ``_paced_job:gpt_mini`` needs (its launcher, agents and workers import it)."""


class Pace:
    """Holds a job of :func:`gpt_plan` with this pace to about a step a second from step
    ``from_step`` on (each sample takes ``sample_s`` more: ``tests/_paced_job.py``), until
    :meth:`release`: the job trains on slowly while the test's calls take their time, and then
    trains its last steps at full speed. 80 steps of 8 samples a worker last a minute."""

    def __init__(self, tmp_path: Path, from_step: int, sample_s: float = 0.1):
        self.file, self.from_step, self.sample_s = tmp_path / "pace", from_step, sample_s
        self.file.touch()

    def config(self, global_batch: int) -> dict:
        slow_from = self.from_step * global_batch
        return {**GPT_CONFIG, "pace_file": str(self.file), "slow_from": slow_from, "sample_s": self.sample_s}

    def release(self) -> None:
        self.file.unlink(missing_ok=True)


def gpt_plan(num_workers: int, global_batch: int = 16, sync: str = "bsp", pace: Pace | None = None) -> Plan:
    """gpt-mini, ``num_workers`` data-parallel; with ``pace``, the paced gpt-mini of ``tests/_paced_job.py``
    (its job launched with :data:`PACED_ENV`)."""
    return models.local_data_parallel_plan(
        "gpt-mini" if pace is None else "_paced_job:gpt_mini",
        GPT_CONFIG if pace is None else pace.config(global_batch),
        num_workers,
        global_batch=global_batch,
        micro_batch=8,
        sync=SyncSpec(mode=SyncMode(sync)),
        training=Training(optimizer="adamw", lr=3e-3, seed=0),
    )


def _no_step_lost(records: list[dict], survivors: tuple[int, ...], steps: int) -> bool:
    """Across a failure, every step was completed by some survivor and none twice by one. (A
    peer that dies inside the last allreduce of a step can leave one survivor with the step done,
    the full sum applied, and another with it failed: the second then takes the first's state by
    replication and goes on from the next step, so its own records skip that one.)"""
    done = set()
    for wid in survivors:
        own = _steps(records, wid)
        if own != sorted(set(own)):
            return False
        done |= set(own)
    return done == set(range(steps))


def _steps(records: list[dict], wid: int) -> list[int]:
    return [r["step"] for r in records if r["rank"] == wid]


def _checksums(event: dict) -> set[float]:
    return {round(w["param_checksum"], 6) for w in event["switch_s"].values()}


def _wait_events(job: Job, run: str, kind: str, count: int, timeout_s: float = 30) -> list[dict]:
    """The first ``count`` events of ``kind`` of ``run``, once recorded (the launch must run until then)."""
    events = job.root / run / "events.jsonl"
    deadline = time.monotonic() + timeout_s
    while True:
        found = [e for e in read_jsonl(events) if e["kind"] == kind]
        if len(found) >= count:
            return found[:count]
        assert time.monotonic() < deadline, f"not {count} {kind} event(s) within {timeout_s} s: {read_jsonl(events)}"
        assert job.proc.poll() is None, job.proc.stderr.read().decode()[-2000:]
        time.sleep(0.05)


@pytest.mark.parametrize("sync", ["bsp", "tokens"])
def test_scale_out_and_in_keeps_processes_steps_and_identical_replicas(sync, tmp_path, no_leftovers):
    """Two workers grow to three and shrink back to two: the stayers keep their processes and
    every step, each change leaves the replicas identical. Requests the job cannot meet are
    refused (exit 2, the reason said) and change nothing: a wrong secret, a worker beyond the
    slots, removing every worker or one that does not exist, ``--to 0`` (refused by the CLI
    itself); a request for what the job already is answers 'unchanged'."""
    # The job trains on while the newcomer starts (3-9 s here, up to the --join-timeout of 60 s on
    # a loaded machine): ~0.8 s a step in bsp, ~0.25 s in tokens, whose members agree on a switch
    # 10 steps ahead.
    sample_s, steps = {"bsp": (0.1, 110), "tokens": (0.03, 230)}[sync]
    pace = Pace(tmp_path, from_step=30, sample_s=sample_s)
    plan = save(gpt_plan(2, sync=sync, pace=pace), tmp_path / "plan.yaml")
    job = Job(tmp_path, str(plan), "--run-id", "s", "--steps", str(steps), "--max-nproc-per-node", "3", env=PACED_ENV)
    try:
        job.wait_step("s", 30)
        grown = job.scale("s", "--add", "1")
        assert grown.exit_code == 0, grown.output
        out = json.loads(grown.stdout)
        assert out["kind"] == "scale-out" and out["members_before"] == [0, 1] and out["members_after"] == [0, 1, 2]
        assert out["replicated_bytes"] > 0 and set(out["replicated_from"]) == {"0", "1"}  # two senders at once
        assert len(_checksums(out)) == 1, out["switch_s"]  # the newcomer holds exactly the stayers' parameters
        assert out["pause_s"] < 1.0
        too_many = job.scale("s", "--add", "1")  # 3 slots, 3 in use: refused, nothing changes
        assert too_many.exit_code == 2 and "slot" in too_many.stderr
        shrunk = job.scale("s", "--remove", "2")
        assert shrunk.exit_code == 0, shrunk.output
        out2 = json.loads(shrunk.stdout)
        assert out2["kind"] == "scale-in" and out2["members_after"] == [0, 1] and len(_checksums(out2)) == 1
        bad = tmp_path / "bad-secret"
        bad.write_text("ab" * 32 + "\n")
        for args, needle in [
            (("--add", "1", "--secret-file", str(bad)), "secret"),
            (("--remove", "0,1"), "at least one"),
            (("--remove", "9"), "no such worker"),
            (("--to", "0"), "--to must be >= 1"),
        ]:
            result = job.scale("s", *args)
            assert result.exit_code == 2, (args, result.output)
            assert needle in result.stderr, (args, result.stderr)
        same = job.scale("s", "--to", "2")  # already 2: nothing to do, and nothing done
        assert same.exit_code == 0 and json.loads(same.stdout)["kind"] == "unchanged", same.output
        pace.release()
        summary = job.finish()
    finally:
        job.stop()
    assert summary["steps"] == steps
    records = job.records("s")
    for wid in (0, 1):
        assert _steps(records, wid) == list(range(steps))  # continuous: no step lost or repeated
        assert len({r["pid"] for r in records if r["rank"] == wid}) == 1  # same process throughout
    joined = _steps(records, 2)
    assert joined and joined == list(range(joined[0], joined[-1] + 1)) and joined[0] > 30
    losses = [r["loss"] for r in records if r["rank"] == 0 and r["loss"] is not None]  # tokens: skipped steps have none
    assert sum(losses[-20:]) / 20 < sum(losses[:20]) / 20 - 0.3
    finals = [
        json.loads((tmp_path / "runs" / "s" / "workers" / f"rank{w}.json").read_text())["param_checksum"]
        for w in (0, 1)
    ]
    assert finals[0] == finals[1]
    # every request that reached the coordinator is recorded (--to 0 is refused by the CLI itself)
    refusals = ["refused"] * 3
    kinds = [e["kind"] for e in read_jsonl(tmp_path / "runs" / "s" / "events.jsonl")]
    assert kinds == ["launch", "start", "scale-out", "refused", "scale-in", *refusals, "finished"], kinds
    status = CliRunner().invoke(app, ["status", "s", "--runs-root", str(tmp_path / "runs"), "--json"])
    history = json.loads(status.stdout)["history"]
    assert [h["kind"] for h in history] == ["scale-out", "refused", "scale-in", *refusals]


UNCHANGED_STEPS = 120


@pytest.fixture(scope="module")
def late_scale_out(tmp_path_factory) -> SimpleNamespace:
    """A job of two workers and 120 steps, asked to scale out at step 80, run to its end: what
    :func:`test_a_scale_out_the_job_outruns_is_refused_and_the_job_still_finishes` checks, and, as
    the refused request changed nothing, the reference run that
    :func:`test_resume_continues_from_the_last_checkpoint_with_identical_parameters` compares with."""
    tmp_path = tmp_path_factory.mktemp("late")
    plan = save(gpt_plan(2), tmp_path / "plan.yaml")
    job = Job(tmp_path, str(plan), "--run-id", "o", "--steps", str(UNCHANGED_STEPS), "--max-nproc-per-node", "3")
    try:
        job.wait_step("o", UNCHANGED_STEPS - 40)
        late = job.scale("o", "--add", "1")
        summary = job.finish()
    finally:
        job.stop()
    return SimpleNamespace(late=late, summary=summary, run=tmp_path / "runs" / "o", records=job.records("o"))


def test_a_scale_out_the_job_outruns_is_refused_and_the_job_still_finishes(late_scale_out, no_leftovers):
    """The last 40 of 120 steps (~0.4 s, a few s under load) end before a newcomer can start (3-9 s): the
    request is answered (refused, nothing changed), the newcomer is stopped, and the job ends as
    finished, not as a failed switch. (Asked at step 2, a loaded machine made 200 steps outlast
    the newcomer's start, and the scale-out succeeded.)"""
    late, summary = late_scale_out.late, late_scale_out.summary
    assert late.exit_code == 2 and "finished" in late.stderr, late.output
    assert summary["steps"] == UNCHANGED_STEPS
    # "refused" is missing only when the request came after the launch's last sweep of the queue
    # (the store closed under it; felactl scale then read the ending from the run directory)
    assert [e["kind"] for e in read_jsonl(late_scale_out.run / "events.jsonl")] in (
        ["launch", "start", "refused", "finished"],
        ["launch", "start", "finished"],
    )
    assert all(_steps(late_scale_out.records, w) == list(range(UNCHANGED_STEPS)) for w in (0, 1))


def test_a_killed_agent_on_another_node_is_dropped_and_the_run_completes(tmp_path, no_leftovers):
    """Two agents on this machine act as two nodes: the launch's own (na: workers 0, 1) and a
    ``felactl agent`` process (nb: worker 2). SIGKILL that agent mid-run: its worker leaves with
    it, the survivors drop it by heartbeat and go on, and adding on nb is refused. Start a new
    agent on nb: it joins the running job, and ``--add 1 --node nb`` puts a worker there again."""
    import dataclasses
    import socket

    from felactl.spec import Placement

    pace = Pace(tmp_path, from_step=30)  # the job trains on while agents come and go
    plan = gpt_plan(3, global_batch=24, pace=pace)
    plan = dataclasses.replace(
        plan,
        placement=tuple(
            Placement(device=d, node=n, local_index=i)
            for d, n, i in [("cpu0", "na", 0), ("cpu1", "na", 1), ("cpu2", "nb", 0)]
        ),
    )
    plan_path = save(plan, tmp_path / "plan.yaml")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{s.getsockname()[1]}"
    steps = 110
    job = Job(
        tmp_path,
        str(plan_path),
        "--run-id",
        "a",
        "--steps",
        str(steps),
        "--node-name",
        "na",
        "--rdzv-endpoint",
        endpoint,
        "--nnodes",
        "2",
        "--heartbeat-timeout",
        "2",
        "--max-nproc-per-node",
        "3",
        env=PACED_ENV,
    )
    agent = None
    try:
        secret = tmp_path / "runs" / "a" / "secret"
        deadline = time.monotonic() + 20
        while not secret.exists():
            assert time.monotonic() < deadline and job.proc.poll() is None
            time.sleep(0.05)

        def start_agent():
            return subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "felactl",
                    "agent",
                    "--rdzv-endpoint",
                    endpoint,
                    "--secret-file",
                    str(secret),
                    "--node-name",
                    "nb",
                    "--nproc-per-node",
                    "1",
                    "--job",
                    "a",
                ],
                env={**os.environ, "OMP_NUM_THREADS": "1", **PACED_ENV},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )

        agent = start_agent()
        job.wait_step("a", 30)
        assert {r["rank"] for r in job.records("a")} == {0, 1, 2}
        agent.kill()
        agent.wait()
        events = tmp_path / "runs" / "a" / "events.jsonl"
        deadline = time.monotonic() + 15
        while not any(e["kind"] == "failure" for e in read_jsonl(events)):
            assert time.monotonic() < deadline, read_jsonl(events)
            time.sleep(0.1)
        refused = job.scale("a", "--add", "1", "--node", "nb")
        assert refused.exit_code == 2 and "agent" in refused.stderr, refused.output
        agent = start_agent()  # a new agent on nb joins the running job, with no workers yet
        deadline = time.monotonic() + 20
        while not any(e["kind"] == "node-joined" for e in read_jsonl(events)):
            assert time.monotonic() < deadline and agent.poll() is None, read_jsonl(events)
            time.sleep(0.1)
        back = job.scale("a", "--add", "1", "--node", "nb")
        assert back.exit_code == 0, back.output
        assert json.loads(back.stdout)["members_after"] == [0, 1, 3]
        pace.release()
        summary = job.finish()
    finally:
        if agent is not None and agent.poll() is None:
            agent.kill()
            agent.wait()
        job.stop()
    assert summary["steps"] == steps
    failure = next(e for e in read_jsonl(tmp_path / "runs" / "a" / "events.jsonl") if e["kind"] == "failure")
    assert failure["members_before"] == [0, 1, 2] and failure["members_after"] == [0, 1]
    assert "agent of node 'nb' is gone" in failure["reason"]
    assert _no_step_lost(job.records("a"), (0, 1), steps)
    kinds = [e["kind"] for e in read_jsonl(tmp_path / "runs" / "a" / "events.jsonl")]
    assert kinds == ["launch", "start", "failure", "refused", "node-joined", "scale-out", "finished"], kinds


@pytest.mark.parametrize("sync", ["bsp", "tokens"])
def test_a_killed_worker_and_then_a_hung_one_are_dropped_and_the_run_completes(sync, tmp_path, no_leftovers):
    """Three workers. SIGKILL worker 1: the survivors re-form within seconds, identical, the batch
    and rate scaled to two workers (linear-lr). Then SIGSTOP worker 2: its silence is noticed by
    heartbeat (3 s), not by a collective's timeout, it is dropped, and worker 0 trains on alone
    to the last step, no step lost."""
    # Steps of ~0.1 s from the kill on: tokens' survivors go on without the killed worker, and
    # switch 10 steps after they see the failure's generation.
    pace = Pace(tmp_path, from_step=40, sample_s=0.015)
    plan = save(gpt_plan(3, global_batch=24, sync=sync, pace=pace), tmp_path / "plan.yaml")
    steps = 200
    job = Job(
        tmp_path,
        str(plan),
        "--run-id",
        "k",
        "--steps",
        str(steps),
        "--max-nproc-per-node",
        "3",
        "--heartbeat-timeout",
        "3",  # 1.5 and 2 s dropped a starting worker, starved on a loaded machine
        "--collective-timeout",
        "3",
        "--scaling-policy",
        "linear-lr",
        env=PACED_ENV,
    )
    try:
        job.wait_step("k", 40)
        killed_at = job.signal_worker("k", 1, signal.SIGKILL)
        _wait_events(job, "k", "failure", 1)
        job.signal_worker("k", 2, signal.SIGSTOP)
        killed, hung = _wait_events(job, "k", "failure", 2)
        pace.release()
        summary = job.finish()
    finally:
        job.stop()
    assert killed["members_before"] == [0, 1, 2] and killed["members_after"] == [0, 2]
    assert killed["pause_s"] < 5.0 and killed["time"] - killed_at < 5.0
    assert len(_checksums(killed)) == 1
    assert killed["global_batch"] == 16 and killed["lr"] == pytest.approx(2e-3)  # linear-lr: 3 -> 2 workers
    assert "no heartbeat" in hung["reason"] and hung["members_before"] == [0, 2] and hung["members_after"] == [0]
    assert hung["pause_s"] < 10.0  # heartbeat timeout + kill + re-form, not a 30-minute collective timeout
    assert summary["steps"] == steps
    assert _no_step_lost(job.records("k"), (0, 2), steps)


def test_a_slow_first_step_is_not_cut_short_by_the_collective_timeout(tmp_path, no_leftovers):
    """The short --collective-timeout bounds steps once the group has run one: a first step that
    takes longer (worker 1's first forward sleeps 3 s, as a compiling or autotuning step does)
    is waited for under the start-up timeout. It used to fail worker 0's first allreduce after
    1 s: the job re-formed with the same members after a 9 s pause, or, where the failure came
    before the loop that survives failures (CI), the whole job failed."""
    env_path = f"{Path(__file__).parent}:{os.environ.get('PYTHONPATH', '')}"
    job = Job(
        tmp_path,
        "--job",
        "_user_models:slow_first_step",
        "--nproc-per-node",
        "2",
        "--global-batch",
        "8",
        "--sync",
        "bsp",
        "--run-id",
        "slow",
        "--steps",
        "6",
        "--collective-timeout",
        "1",
        env={"PYTHONPATH": env_path},
    )
    try:
        summary = job.finish()
    finally:
        job.stop()
    assert summary["steps"] == 6
    kinds = [e["kind"] for e in read_jsonl(tmp_path / "runs" / "slow" / "events.jsonl")]
    assert kinds == ["launch", "start", "finished"], kinds  # no failure, no re-form


def test_resume_continues_from_the_last_checkpoint_with_identical_parameters(late_scale_out, tmp_path, no_leftovers):
    """A job killed whole (launcher, agent, workers) at step 50 resumes from its last checkpoint
    and ends with the parameters of the same plan run without a stop (``late_scale_out``'s job)."""
    plan = save(gpt_plan(2), tmp_path / "plan.yaml")
    steps = UNCHANGED_STEPS
    job = Job(tmp_path, str(plan), "--run-id", "r", "--steps", str(steps), "--checkpoint-every", "20")
    try:
        job.wait_step("r", 50)
        job.stop()  # the whole job dies: launcher, agent and workers
    finally:
        job.stop()
    checkpoints = sorted(p.name for p in (tmp_path / "runs" / "r" / "checkpoints").iterdir())
    assert checkpoints and int(checkpoints[-1][4:]) >= 40
    too_few = CliRunner().invoke(
        app, ["launch", "--resume", "r", "--steps", "10", "--runs-root", str(tmp_path / "runs")]
    )
    assert too_few.exit_code == 2 and "is already at step" in too_few.stderr, too_few.output  # and nothing changed:
    resumed = Job(tmp_path, "--resume", "r")
    try:
        summary = resumed.finish()
    finally:
        resumed.stop()
    assert summary["run"] == "r" and summary["steps"] == steps  # training steps, though some ran twice
    records = resumed.records("r")
    last_checkpoint = int(checkpoints[-1][4:])
    resumed_steps = [r["step"] for r in records if r["rank"] == 0 and r["generation"] > 0]
    assert resumed_steps == list(range(last_checkpoint, steps))
    runs = tmp_path / "runs"
    final = json.loads((runs / "r" / "workers" / "rank0.json").read_text())["param_checksum"]
    assert final == json.loads((late_scale_out.run / "workers" / "rank0.json").read_text())["param_checksum"]
    kinds = [e["kind"] for e in read_jsonl(runs / "r" / "events.jsonl")]
    assert kinds[0] == "launch" and "resume" in kinds and kinds[-1] == "finished"
    # the resume kept the launch's --keep-checkpoints (default 3) and pruned the rest
    assert sorted(p.name for p in (runs / "r" / "checkpoints").iterdir()) == ["step000080", "step000100", "step000120"]


def test_a_job_that_is_not_elastic_refuses_scale_at_once(tmp_path, no_leftovers):
    pace = Pace(tmp_path, from_step=3)
    plan = save(gpt_plan(2, pace=pace), tmp_path / "plan.yaml")
    job = Job(tmp_path, str(plan), "--run-id", "n", "--steps", "40", "--no-elastic", env=PACED_ENV)
    try:
        job.wait_step("n", 3)
        result = job.scale("n", "--add", "1")
        assert result.exit_code == 2 and "cannot be rescaled" in result.stderr, result.output
        pace.release()
        assert job.finish()["steps"] == 40
    finally:
        job.stop()
    status = CliRunner().invoke(app, ["status", "n", "--runs-root", str(tmp_path / "runs")])
    assert status.exit_code == 0 and "membership history" in status.stderr and "refused" in status.stderr


def test_a_gpu_jobs_newcomer_is_started_on_a_free_gpu_without_a_profile(tmp_path, monkeypatch):
    """A GPU job launched without profiles holds GPUs 0 and 2 of node n: a newcomer is told GPU 1
    (LOCAL_RANK, the index the re-plan gives it), not the agent's count of the workers it started
    (which put it on a GPU in use, where NCCL refuses a second rank)."""
    import dataclasses as dc

    from felactl.launcher.controlplane import Coordinator, write_secret_file
    from felactl.launcher.membership.state import Request, Seen
    from felactl.launcher.rundir import RunDir
    from felactl.spec import DeviceKind, Placement

    run = RunDir.create("gpu", root=tmp_path)
    cpu_plan = gpt_plan(2)
    plan = dc.replace(
        cpu_plan,
        devices=("n.gpu0", "n.gpu2"),
        stages=(
            dc.replace(
                cpu_plan.stages[0],
                workers=tuple(
                    dc.replace(w, device=d) for w, d in zip(cpu_plan.stages[0].workers, ("n.gpu0", "n.gpu2"))
                ),
            ),
        ),
        placement=(
            Placement(device="n.gpu0", node="n", kind=DeviceKind.CUDA, local_index=0),
            Placement(device="n.gpu2", node="n", kind=DeviceKind.CUDA, local_index=2),
        ),
        pipelines=(("n.gpu0",), ("n.gpu2",)),
    )
    save(plan, run.plan)
    coordinator = Coordinator(write_secret_file(run.secret), job="gpu")
    try:
        controller = one_node_controller(
            coordinator, run, plan, 3, heartbeat_timeout_s=5, ready_timeout_s=20, switch_timeout_s=10
        )
        commands = []
        monkeypatch.setattr(controller, "_command", lambda wid, command: commands.append(command))
        controller._apply(Seen(now=time.monotonic(), requests=(Request("r1", {"op": "add", "count": 1}),)))
    finally:
        coordinator.close()
    [add] = commands
    assert add["op"] == "add" and add["env"]["LOCAL_RANK"] == "1", add
    members, (early, _how) = controller.early_plan
    newcomer = next(p for p in early.placement if p.device not in plan.devices)
    assert newcomer.device == "cuda2" and newcomer.kind is DeviceKind.CUDA and newcomer.local_index == 1


def test_scaling_policies_and_replan():
    fixed, linear = ScalingPolicy("fixed-batch"), ScalingPolicy("linear-lr", max_batch=48)
    assert fixed.batch_and_lr(16, 1e-3, 2, 5) == (16, 1e-3)
    assert linear.batch_and_lr(16, 1e-3, 2, 3) == (24, pytest.approx(1.5e-3))
    assert linear.batch_and_lr(16, 1e-3, 2, 8) == (48, pytest.approx(3e-3))  # capped, then held
    assert linear.batch_and_lr(16, 1e-3, 2, 1) == (8, pytest.approx(5e-4))
    with pytest.raises(InputError, match="scaling-policy"):
        ScalingPolicy("sometimes")
    plan = replan(gpt_plan(2), ["cpu0", "cpu1", "cpu7"], {"cpu0": 100.0, "cpu1": 300.0}, {}, global_batch=24, lr=2e-3)
    shares = [w.share for w in plan.stages[0].workers]
    assert plan.devices == ("cpu0", "cpu1", "cpu7") and plan.global_batch == 24 and plan.training.lr == 2e-3
    assert shares == pytest.approx([1 / 6, 1 / 2, 1 / 3])  # by speed; the newcomer gets the mean speed
    import dataclasses

    from felactl.spec import Placement

    on_gpus_0_and_2 = dataclasses.replace(
        gpt_plan(2),
        placement=(
            Placement(device="cpu0", node="n", local_index=0),
            Placement(device="cpu1", node="n", local_index=2),
        ),
    )
    grown = replan(on_gpus_0_and_2, ["cpu0", "cpu1", "cpu7"], {}, {"cpu7": "n"}, global_batch=24, lr=2e-3)
    assert [p.local_index for p in grown.placement] == [0, 2, 1]  # stayers keep theirs; the newcomer takes 1


def _local_profiles(tmp_path: Path, num_devices: int, pace: Pace):
    """A cluster profile of this machine as ``num_devices`` CPU slots (cpu0..), and the model
    profile of gpt-mini paced by ``pace`` (at a global batch of 16): what ``felactl launch --cluster --model`` keeps for re-planning. The link
    between cpu1 and cpu2 is a hundredth of the others: a ring must cross it and trees route
    around it, so a group of three syncs over packed trees. (With every link alike, gpt-mini's
    270 KB sum is so small that the trees' fill and the ring's latency decide, and they are
    close; with a tenth, the trees' messages cost the CPU slots more than the ring's thin link:
    1.7 ms of a core at the busiest slot against 0.9 ms.)"""
    from felactl.machine import short_hostname
    from felactl.profiling.model import profile_model
    from felactl.spec import ClusterSpec, Device, DeviceKind, Link, LinkDefault, LinkType, Node

    node = Node(
        name=short_hostname(),
        devices=tuple(
            Device(name=f"cpu{i}", kind=DeviceKind.CPU, model="cpu", tflops=0.05, memory_gb=4.0, local_index=i)
            for i in range(num_devices)
        ),
    )
    cluster = ClusterSpec(
        name="here",
        nodes=(node,),
        intra_node_default=LinkDefault(bandwidth_gbps=5.0, latency_us=50.0, type=LinkType.LOOPBACK),
        links=tuple(
            Link(src=a, dst=b, bandwidth_gbps=0.05, latency_us=50.0, type=LinkType.LOOPBACK)
            for a, b in (("cpu1", "cpu2"), ("cpu2", "cpu1"))
            if num_devices > 2
        ),
    )
    model = profile_model("_paced_job:gpt_mini", pace.config(16), [8], repeats=1)
    return save(cluster, tmp_path / "cluster.yaml"), save(model, tmp_path / "model.yaml")


def test_with_its_profiles_a_rescale_runs_the_planner_again(tmp_path, no_leftovers):
    """Launched with --cluster/--model, a scale-out names the newcomer after a free device of the
    profile, and the new generation's plan is the planner's: its micro-batch, shares, packed
    trees and prediction for the three devices. ``felactl report`` draws the run while it trains
    and once it finished rescaled, what it recorded (:func:`tests.test_report.check_report`). Beyond the profile's devices: refused. (linear-lr:
    the batch grows to 24 with the third worker; at 16, two micro-batches of gpt-mini's profiled 8
    are cheaper on two devices than smaller ones on three, and the planner says so.)"""
    from felactl.optimizer.planner import make_plan

    pace = Pace(tmp_path, from_step=20)  # the job trains on while the newcomer starts
    cluster_path, model_path = _local_profiles(tmp_path, 3, pace)
    from felactl.spec import load_cluster, load_model

    first = make_plan(
        load_cluster(cluster_path), load_model(model_path), 16, sync="bsp", devices=["cpu0", "cpu1"], max_stages=1
    )
    plan_path = save(first, tmp_path / "plan.yaml")
    steps = 100
    job = Job(
        tmp_path,
        str(plan_path),
        "--run-id",
        "p",
        "--steps",
        str(steps),
        "--cluster",
        str(cluster_path),
        "--model",
        str(model_path),
        "--scaling-policy",
        "linear-lr",
        env=PACED_ENV,
    )
    try:
        job.wait_step("p", 20)
        running = check_report(tmp_path / "runs" / "p", tmp_path / "running")  # felactl report while it trains
        grown = job.scale("p", "--add", "1")
        assert grown.exit_code == 0, grown.output
        event = json.loads(grown.stdout)
        full = job.scale("p", "--add", "1")
        pace.release()
        summary = job.finish()
    finally:
        job.stop()
    assert running["state"] == "running" and not running["left_out"]  # its profiles: the Gantt drawn too
    finished = check_report(tmp_path / "runs" / "p", tmp_path / "finished")
    assert finished["state"] == "finished"
    assert [m.kind for m in read_run(str(tmp_path / "runs" / "p"), tmp_path / "runs").marks] == ["scale-out"]
    assert event["planned_by"] == "planner" and event["predicted_iteration_s"] > 0
    assert full.exit_code == 2 and "cluster profile" in full.stderr + full.stdout, full.output
    from felactl.spec import load_plan

    replanned = load_plan(tmp_path / "runs" / "p" / f"plan.{event['generation']}.yaml")
    assert replanned.devices == ("cpu0", "cpu1", "cpu2")  # the newcomer is the profile's free device
    assert replanned.collectives and set(replanned.collectives[0].devices) == {"cpu0", "cpu1", "cpu2"}
    assert replanned.predicted is not None and replanned.solver is not None
    assert summary["steps"] == steps and len({r["rank"] for r in job.records("p")}) == 3


def test_status_history_says_how_each_generation_was_planned():
    from rich.console import Console

    from felactl.cli.status import history_table

    events = [
        {
            "time": 0,
            "kind": "scale-out",
            "generation": 1,
            "members_before": [0, 1],
            "members_after": [0, 1, 2],
            "pause_s": 0.05,
            "replicated_bytes": 2e6,
            "replicated_from": {"0": 1e6, "1": 1e6},
            "planned_by": "planner",
            "predicted_iteration_s": 0.0123,
        },
        {
            "time": 1,
            "kind": "failure",
            "generation": 2,
            "members_before": [0, 1, 2],
            "members_after": [0, 1],
            "pause_s": 1.2,
            "planned_by": "measured speeds",
            "reason": "worker 2: no heartbeat for 5.0 s",
        },
    ]
    console = Console(width=200, record=True)
    console.print(history_table(events))
    text = console.export_text()
    assert "planner (12.3 ms/it)" in text and "measured speeds" in text and "no heartbeat" in text


def test_a_worker_lost_after_the_others_finished_ends_the_job_instead_of_hanging(tmp_path):
    """The coordinator alone, on a real store, with workers played by store keys: workers 0 and 1
    finished their last step; worker 2 went silent. The failure's re-plan finds nobody to switch:
    the job is done with the survivors (it used to put worker 2 back and poll forever)."""
    from felactl.launcher.controlplane import Coordinator, Member, write_secret_file
    from felactl.launcher.elastic import ElasticController, ElasticSettings
    from felactl.launcher.rundir import RunDir

    run = RunDir.create("end", root=tmp_path)
    plan = gpt_plan(3, global_batch=24)
    save(plan, run.plan)
    coordinator = Coordinator(write_secret_file(run.secret), job="end")
    try:
        member = Member(agent_id="a", node_name="n", num_slots=3, hostname="n")
        controller = ElasticController(
            coordinator,
            run,
            plan,
            [member],
            {"n": plan.devices},
            ElasticSettings(heartbeat_timeout_s=0.2, ready_timeout_s=0.3, switch_timeout_s=5),
        )
        reader = coordinator.reader
        for wid in (0, 1):
            reader.write(keys.heartbeat(wid), "heartbeat", {"n": 1, "step": 9, "pid": 1})
            reader.write(keys.done(wid), "done", {"step": 10})
        deadline = time.monotonic() + 10
        while not controller.poll():
            assert time.monotonic() < deadline, f"the finished job never ended (members {controller.members})"
            time.sleep(0.05)
        assert controller.members == [0, 1]
        assert not any(e["kind"] == "failure" for e in read_jsonl(run.events))  # nothing re-formed
    finally:
        coordinator.close()


def test_a_member_lost_while_a_newcomer_starts_is_planned_out_of_the_scale_out(tmp_path):
    """Same harness: worker 1 goes silent while newcomer 2 starts. The coordinator drops 1 (a
    failure generation of [0]), then publishes the scale-out for [0, 2] with a plan of exactly
    their devices (it used to publish the plan made for [0, 1, 2])."""
    import threading

    from felactl.launcher.controlplane import Coordinator, Member, write_secret_file
    from felactl.launcher.elastic import ElasticController, ElasticSettings
    from felactl.launcher.rundir import RunDir
    from felactl.spec import load_plan

    run = RunDir.create("race", root=tmp_path)
    plan = gpt_plan(2)
    save(plan, run.plan)
    coordinator = Coordinator(write_secret_file(run.secret), job="race")
    stop = threading.Event()
    store = coordinator.store
    try:
        member = Member(agent_id="a", node_name="n", num_slots=3, hostname="n")
        controller = ElasticController(
            coordinator,
            run,
            plan,
            [member],
            {"n": plan.devices},
            ElasticSettings(heartbeat_timeout_s=0.5, ready_timeout_s=20, switch_timeout_s=10, max_nproc_per_node=3),
        )
        workers_reader = Reader(coordinator.seal, store, coordinator.prefix)  # the workers hold the secret too

        def beat_of(wid: int, n: int) -> None:
            workers_reader.write(keys.heartbeat(wid), "heartbeat", {"n": n, "step": n, "pid": 1})

        def workers() -> None:
            """Workers 0 and (once started) 2 beat and report every generation that names them;
            worker 1 beats once and then never again."""
            beat_of(1, 1)
            beat, reported = 0, set()
            while not stop.is_set():
                beat += 1
                beat_of(0, beat)
                if beat == 20:  # the newcomer is ready once worker 1 has been silent a while
                    workers_reader.write(keys.ready(2), "ready", {"pid": 1, "time": 0.0})
                if beat > 20:
                    beat_of(2, beat)
                gen = int(store.get(coordinator.prefix + keys.GENERATION))
                if gen > 0 and gen not in reported:
                    doc = workers_reader.read(keys.generation_document(gen), "generation", generation=gen).body
                    for w in doc["members"]:
                        workers_reader.write(
                            keys.switched(gen, w),
                            "switched",
                            {"report": {"stayed": w == 0, "pause_s": 0.01, "step": 5, "param_checksum": 1.0}},
                            generation=gen,
                        )
                    reported.add(gen)
                time.sleep(0.05)

        thread = threading.Thread(target=workers, daemon=True)
        thread.start()
        event = rescale(controller, {"op": "add", "count": 1})
    finally:
        stop.set()
        coordinator.close()
    kinds = [(e["kind"], e["members_after"]) for e in read_jsonl(run.events)]
    assert kinds == [("failure", [0]), ("scale-out", [0, 2])], kinds
    assert event["members_after"] == [0, 2]
    assert load_plan(run.path / f"plan.{event['generation']}.yaml").devices == ("cpu0", "cpu2")


def test_a_rescale_that_the_planner_would_leave_idle_is_refused_with_what_to_do():
    from felactl.launcher.scale_plan import replan_with_planner
    from felactl.optimizer.planner import make_plan
    from tests.planner_fixtures import cluster, model

    spec = cluster([[("fast", 100.0, 16.0), ("slow", 0.001, 16.0)]], intra_gbps=0.01)
    net = model([(1_000_000, 1000, 1e9)])
    plan = make_plan(spec, net, 8, sync="bsp", devices=["n0.d0"], max_stages=1)
    with pytest.raises(InputError, match="gives no work to n0.d1 at a global batch of 8 .* --scaling-policy linear-lr"):
        replan_with_planner(
            plan, spec, net, ["n0.d0", "n0.d1"], {"n0.d0": "n0", "n0.d1": "n0"}, global_batch=8, lr=1e-3
        )


def test_a_scale_result_reads_as_one_line():
    from felactl.cli.scale import describe

    assert describe({"kind": "unchanged", "members": [0, 1]}) == "unchanged: the job already runs workers [0, 1]"
    assert describe(
        {
            "kind": "scale-out",
            "members_before": [0, 1],
            "members_after": [0, 1, 2],
            "pause_s": 0.0491,
            "replicated_bytes": 10_314_012,
            "replicated_from": {"0": 5, "1": 5},
        }
    ) == ("scale-out: workers [0, 1] -> [0, 1, 2], pause 0.049 s, 10.3 MB replicated from 0, 1")
    assert (
        describe(
            {
                "kind": "scale-in",
                "members_before": [0, 1, 2],
                "members_after": [0, 1],
                "pause_s": None,
                "replicated_bytes": 0,
            }
        )
        == "scale-in: workers [0, 1, 2] -> [0, 1]"
    )


@pytest.mark.parametrize("ending,error", [("finished", "InputError"), ("failed", "ControlPlaneError")])
def test_a_scale_request_whose_coordinator_closes_unanswered_reads_how_the_run_ended(tmp_path, ending, error):
    """A job that ends closes its store, possibly before it saw a request just queued: felactl
    scale must not report a lost coordinator for a job that merely finished (exit 2, 'finished')."""
    import threading

    from felactl import errors
    from felactl.launcher.controlplane import Coordinator, write_secret_file
    from felactl.launcher.rundir import RunDir, append_jsonl
    from felactl.launcher.scale import request_scale

    run = RunDir.create("gone", root=tmp_path)
    save(gpt_plan(2), run.plan)
    coordinator = Coordinator(write_secret_file(run.secret), job="gone")
    append_jsonl(run.events, {"time": time.time(), "kind": "launch", "endpoint": coordinator.endpoint})
    queue = coordinator.prefix + "elastic/scale/requests"

    def end_the_job_once_asked() -> None:
        deadline = time.monotonic() + 10
        while coordinator.store.queue_len(queue) == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        coordinator.close()  # the store goes with the last reference, the request unanswered
        time.sleep(0.3)
        append_jsonl(run.events, {"time": time.time(), "kind": ending})

    thread = threading.Thread(target=end_the_job_once_asked, daemon=True)
    thread.start()
    with pytest.raises(getattr(errors, error)) as caught:
        request_scale("gone", {"op": "add", "count": 1}, runs_root=tmp_path, timeout_s=20)
    thread.join(5)
    assert ("finished its last step" in str(caught.value)) == (ending == "finished"), str(caught.value)


def _claimed_samples(records: list[dict], wids) -> list[int]:
    """The steps (global batches) the records of ``wids`` began in, with repeats."""
    return sorted(r["step"] for r in records if r["rank"] in wids)


@pytest.mark.parametrize("sync", ["wbsp", "sdpipe"])
def test_modes_at_their_own_pace_scale_and_lose_workers_keeping_one_model(sync, tmp_path, no_leftovers):
    """WBSP and SDPipe members stop each at a step of its own; rank 0 hosts WBSP's parameter
    server and SDPipe's scheduler. Four workers grow to five, then worker 0 leaves (the host:
    worker 1 is rank 0 now); a planned change settles the members first (the server's or the
    groups' final merge), so every member switches identical, and a policy that would change the
    batch is refused. Then SIGKILL worker 2 (the host lives on) and worker 1 (the host, taking
    the server or scheduler along): after each, the survivors merge into one model within
    seconds. Workers 3 and 4 keep their processes to the last step, every global batch trained,
    and end identical."""
    pace = Pace(tmp_path, from_step=30)  # the job trains on while the newcomer starts (3-9 s here)
    plan = save(gpt_plan(4, global_batch=32, sync=sync, pace=pace), tmp_path / "plan.yaml")
    steps = 110
    job = Job(tmp_path, str(plan), "--run-id", "w", "--steps", str(steps), "--max-nproc-per-node", "5", env=PACED_ENV)
    killed_at = []
    try:
        job.wait_step("w", 30)
        grown = job.scale("w", "--add", "1")
        assert grown.exit_code == 0, grown.output
        out = json.loads(grown.stdout)
        assert out["kind"] == "scale-out" and out["members_after"] == [0, 1, 2, 3, 4]
        assert len(_checksums(out)) == 1, out["switch_s"]
        shrunk = job.scale("w", "--remove", "0")  # the parameter server's / scheduler's host leaves
        assert shrunk.exit_code == 0, shrunk.output
        out2 = json.loads(shrunk.stdout)
        assert out2["kind"] == "scale-in" and out2["members_after"] == [1, 2, 3, 4] and len(_checksums(out2)) == 1
        refused = job.scale("w", "--add", "1", "--scaling-policy", "linear-lr")
        assert refused.exit_code == 2 and "fixed global batch" in refused.stderr
        for n, wid in enumerate((2, 1), 1):
            killed_at.append(job.signal_worker("w", wid, signal.SIGKILL))
            failures = _wait_events(job, "w", "failure", n)
        pace.release()
        summary = job.finish()
    finally:
        job.stop()
    for failure, survivors, at in zip(failures, ([1, 3, 4], [3, 4]), killed_at):
        assert failure["members_after"] == survivors and failure["time"] - at < 5.0, failure
        assert len(_checksums(failure)) == 1  # the survivors merged into one model
    assert summary["steps"] == steps
    records = job.records("w")
    for wid in (3, 4):
        assert len({r["pid"] for r in records if r["rank"] == wid}) == 1  # the same process throughout
    assert max(r["step"] for r in records if r["rank"] in (3, 4)) == steps - 1
    assert {r["generation"] for r in records if r["rank"] == 3} == {0, 1, 2, 3, 4}
    # every global batch was trained: the claims cover each step, none past the last
    assert set(_claimed_samples(records, range(5))) == set(range(steps))
    losses = [r["loss"] for r in records if r["rank"] == 3]
    assert sum(losses[-20:]) / 20 < sum(losses[:20]) / 20 - 0.3
    finals = {
        json.loads((tmp_path / "runs" / "w" / "workers" / f"rank{w}.json").read_text())["param_checksum"]
        for w in (3, 4)
    }
    assert len(finals) == 1
    kinds = [e["kind"] for e in read_jsonl(tmp_path / "runs" / "w" / "events.jsonl")]
    assert kinds == ["launch", "start", "scale-out", "scale-in", "refused", "failure", "failure", "finished"], kinds


def test_a_membership_event_records_the_rate_the_workers_train_at():
    """A job that brings its own optimizer trains at its own rate, which the workers report
    with their switch: the event said the plan's default (0.003) where they trained at 0.05."""
    from felactl.launcher.elastic import _event

    plan = dp_plan(2, "bsp", optimizer="adamw", lr=0.003)
    reports = {0: {"stayed": True, "pause_s": 0.1, "lr": 0.05}}
    event = _event("failure", 1, [0, 1], [0], reports, plan, "worker 1 exited")
    assert event["lr"] == 0.05 and event["global_batch"] == plan.global_batch
