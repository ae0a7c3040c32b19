"""A job that cannot rescale live (a pipeline, a sharded stage, ``--no-elastic``) survives a failed
worker: every worker starts again from the run's newest checkpoint and trains to the last step
(issue 32, item 3); a failure that repeats the same way after a restart is the job's own and ends it."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import psutil
import pytest

from felactl.errors import InputError
from felactl.launcher.resume import pick_checkpoint
from felactl.launcher.rundir import RunDir, read_jsonl
from felactl.spec import save

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))
from _worker_helpers import Job, pipeline_plan  # noqa: E402
from test_job_errors import SLIP, _user_job  # noqa: E402

pytestmark = pytest.mark.multiprocess
STARTUP_S = 120.0
"""How long a launch may take to reach its first steps on a loaded machine (a bound, not a measurement)."""


def _step_losses(records: list[dict]) -> dict[tuple[int, int], float]:
    """The last stage's loss of each (generation, step): what each attempt computed."""
    return {(r.get("generation", 0), r["step"]): r["loss"] for r in records if r.get("loss") is not None}


def _checkpoint_at_least(runs: Path, run: str, step: int, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            found = pick_checkpoint(RunDir.find(run, root=runs)).step
        except InputError:
            found = -1
        if found >= step:
            return found
        assert time.monotonic() < deadline, f"no complete checkpoint at step {step} or later"
        time.sleep(0.05)


def _worker_process(job: Job, rank: int) -> psutil.Process:
    """The launch's worker process of ``rank`` (a job of fixed members records no pids)."""
    for proc in psutil.Process(job.proc.pid).children(recursive=True):
        if "felactl.agents.worker" in " ".join(proc.cmdline()) and proc.environ().get("RANK") == str(rank):
            return proc
    raise AssertionError(f"no worker of rank {rank} is running")


def test_a_killed_worker_of_a_two_stage_pipeline_restarts_from_the_checkpoint_and_completes_every_step(
    tmp_path, no_leftovers
):
    """Kill -9 the last stage's worker mid-run: the launch restarts both stages from the newest
    complete checkpoint, redoes the steps after it exactly (the same losses), and ends at the
    last step with the restart, its pause and what it redid in the summary."""
    plan = save(pipeline_plan([0, 2, 3], optimizer="adamw", lr=0.01), tmp_path / "plan.yaml")
    steps = 40
    args = ("--run-id", "p", "--steps", str(steps), "--checkpoint-every", "5", "--straggler", "roundrobin:0.1")
    job = Job(tmp_path, str(plan), *args)
    try:
        job.wait_step("p", 12, timeout_s=STARTUP_S)
        _checkpoint_at_least(tmp_path / "runs", "p", 10, STARTUP_S)
        _worker_process(job, rank=1).send_signal(signal.SIGKILL)
        summary = job.finish(timeout_s=STARTUP_S)
    finally:
        job.stop()
    run = tmp_path / "runs" / "p"
    assert summary["steps"] == steps
    (restart,) = summary["restarts"]
    assert restart["attempt"] == 1 and restart["from_step"] >= 10 and restart["pause_s"] > 0
    events = [e for e in read_jsonl(run / "events.jsonl") if e["kind"] == "restart"]
    assert len(events) == 1 and events[0]["checkpoint"].endswith(f"step{restart['from_step']:06d}")
    losses = _step_losses(read_jsonl(run / "metrics.jsonl"))
    assert {step for _, step in losses} == set(range(steps)), "every step trained"
    redone = [step for generation, step in losses if generation == 1 and (0, step) in losses]
    assert redone and min(redone) == restart["from_step"], (restart, sorted(losses))
    for step in redone:  # the same state and the same batches: the same loss
        assert losses[(1, step)] == pytest.approx(losses[(0, step)], rel=1e-5, abs=1e-6), step


def test_a_failure_that_repeats_after_a_restart_ends_the_job_as_the_jobs_own(tmp_path, no_leftovers):
    """A user's loss that raises fails every attempt at the same step with the same line: one
    restart, then exit 1 saying so, not ``--max-restarts`` rounds of the same failure."""
    job = _user_job(tmp_path, "where=loss_fn", extra=("--no-elastic",))
    try:
        _, err = job.proc.communicate(timeout=STARTUP_S)
    finally:
        job.stop()
    err = err.decode()
    assert job.proc.returncode == 1, err[-3000:]
    errors = [ln for ln in err.splitlines() if ln.startswith("felactl: error:")]
    assert len(errors) == 1 and SLIP in errors[0] and "failed the same way after a restart" in errors[0], errors
    kinds = [e["kind"] for e in read_jsonl(tmp_path / "runs" / "slip" / "events.jsonl")]
    assert kinds.count("restart") == 1 and kinds[-1] == "failed", kinds
