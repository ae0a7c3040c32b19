"""Storage trouble does not kill a healthy job: a checkpoint that cannot be written is a warning
and an event, training goes on; a launch that cannot record a re-form stops, naming the
checkpoint to resume from."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from felactl.agents.worker import engine
from felactl.agents.worker.checkpoint import checkpoint_path
from felactl.agents.worker.engine import Trainer
from felactl.agents.worker.fixed import FixedMembership
from felactl.agents.worker.runtime import Runtime
from felactl.launcher.resume import pick_checkpoint
from felactl.launcher.rundir import RunDir, read_jsonl
from felactl.spec import save

sys.path.insert(0, str(Path(__file__).parent))
from _worker_helpers import Job, dp_plan, local_worker_config, one_node_controller  # noqa: E402


@pytest.fixture
def one_worker(tmp_path):
    """A Trainer of a one-worker plan, in this process (no process group: checkpoints need none)."""
    plan_path = save(dp_plan(1), tmp_path / "plan.yaml")
    run_dir = tmp_path / "run"
    cfg = local_worker_config(plan_path, run_dir)
    sigint = signal.getsignal(signal.SIGINT)  # the trainer's drain takes SIGINT; pytest keeps its own
    try:
        runtime = Runtime(cfg, dist.HashStore(), "gloo", torch.device("cpu"), dist.HashStore())
        yield Trainer(runtime, cfg.load_plan(), membership=FixedMembership(cfg))
    finally:
        signal.signal(signal.SIGINT, sigint)


def test_a_checkpoint_that_cannot_be_written_is_a_warning_and_an_event(one_worker, monkeypatch, caplog):
    trainer, run_dir = one_worker, one_worker.runtime.cfg.run_dir
    real_save = engine.save_checkpoint

    def disk_full(path, **state):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(engine, "save_checkpoint", disk_full)
    trainer.steps_done, trainer.data_position = 5, 160
    with caplog.at_level(logging.WARNING):
        trainer.checkpoint()  # does not raise: the job goes on
    assert trainer.checkpointed_at is None, "a checkpoint not written is not taken for one"
    assert "No space left on device" in caplog.text and "step 5" in caplog.text
    failed = [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "checkpoint-failed"]
    assert len(failed) == 1 and failed[0]["step"] == 5 and "No space left on device" in failed[0]["reason"]

    monkeypatch.setattr(engine, "save_checkpoint", real_save)  # the storage is back: the next one is written
    trainer.steps_done, trainer.data_position = 10, 320
    trainer.checkpoint()
    assert trainer.checkpointed_at == 10 and checkpoint_path(run_dir, 10, 0).is_file()


def test_a_checkpoint_directory_that_cannot_be_made_is_a_warning_too(one_worker, caplog):
    """atomic_write says InputError where it cannot make the directory: still storage, not the job's end."""
    trainer, run_dir = one_worker, one_worker.runtime.cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "checkpoints").write_text("a file where the checkpoints directory goes")
    trainer.steps_done = 3
    with caplog.at_level(logging.WARNING):
        trainer.checkpoint()
    assert trainer.checkpointed_at is None and "step 3" in caplog.text
    assert [e["step"] for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "checkpoint-failed"] == [3]


def _chattr(flag: str, path: Path) -> None:
    subprocess.run(["chattr", flag, str(path)], check=True, capture_output=True)


@pytest.fixture
def immutable():
    """``immutable(path)`` makes a directory immutable (``chattr +i``: even root cannot create or
    delete entries in it) until the test ends; skips where chattr cannot (not root, not ext4/xfs)."""
    if shutil.which("chattr") is None:
        pytest.skip("chattr is not installed")
    made: list[Path] = []

    def make(path: Path) -> None:
        try:
            _chattr("+i", path)
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"chattr +i does not work here: {exc.stderr.decode().strip()}")
        made.append(path)

    try:
        yield make
    finally:
        for path in made:
            _chattr("-i", path)


def test_a_worker_summary_or_metrics_record_the_storage_refuses_is_a_warning(one_worker, caplog):
    trainer, run_dir = one_worker, one_worker.runtime.cfg.run_dir
    (run_dir / "workers").write_text("a file where the workers' summaries go")
    trainer.metrics._fd = os.open(run_dir / "metrics.jsonl", os.O_RDONLY)  # every write now fails (EBADF)
    with caplog.at_level(logging.WARNING):
        trainer.record(step=0, samples=4, loss_sum=2.0, compute_s=0.1, comm_s=0.0, wait_s=0.0, duration_s=0.1)
        trainer.record(step=1, samples=4, loss_sum=2.0, compute_s=0.1, comm_s=0.0, wait_s=0.0, duration_s=0.1)
        trainer.finish(1.0)
    assert caplog.text.count("metrics from step 0 on are not recorded") == 1, "said once, not per step"
    assert "summary" in caplog.text and trainer.totals["steps"] == 2


@pytest.mark.multiprocess
def test_a_run_directory_made_unwritable_mid_run_keeps_the_job_training(tmp_path, immutable, no_leftovers):
    """``chattr +i`` on the run directory and its checkpoints directory mid-run (root cannot make
    files there either): every checkpoint after it fails, each one a warning on the console and an
    event, the workers' and the run's summaries are not written, and the job trains to its last
    step and exits 0, its summary on stdout."""
    steps = 300
    plan = save(dp_plan(2), tmp_path / "plan.yaml")
    job = Job(tmp_path, str(plan), "--run-id", "ro", "--steps", str(steps), "--checkpoint-every", "25")
    try:
        job.wait_step("ro", 5)
        immutable(tmp_path / "runs" / "ro" / "checkpoints")
        immutable(tmp_path / "runs" / "ro")
        made_unwritable = max(r["step"] for r in job.records("ro"))
        out, err = job.proc.communicate(timeout=90)
    finally:
        job.stop()
    assert job.proc.returncode == 0, err.decode()[-3000:]
    assert json.loads(out)["steps"] == steps
    failed = [e for e in read_jsonl(tmp_path / "runs" / "ro" / "events.jsonl") if e["kind"] == "checkpoint-failed"]
    assert failed and failed[-1]["step"] == steps, failed
    assert all(e["step"] > made_unwritable - 25 and e["step"] % 25 == 0 for e in failed), failed
    assert f"checkpoint of step {steps} was not written" in err.decode()
    assert "summary.json was not written" in err.decode() and not (tmp_path / "runs" / "ro" / "summary.json").exists()


@pytest.mark.multiprocess
def test_a_re_form_the_run_directory_cannot_record_stops_the_launch_naming_its_checkpoint(
    tmp_path, immutable, no_leftovers
):
    """The run directory made immutable, then a worker killed: the survivors cannot re-form
    without the new generation's plan (plan.1.yaml), so the launch stops with exit 1 and one line
    naming its newest complete checkpoint and how to resume, not an internal error."""
    plan = save(dp_plan(3), tmp_path / "plan.yaml")
    run_dir = tmp_path / "runs" / "rf"
    job = Job(
        tmp_path, str(plan), "--run-id", "rf", "--steps", "5000", "--checkpoint-every", "10", "--heartbeat-timeout", "2"
    )
    try:
        job.wait_step("rf", 25)
        immutable(run_dir)
        job.signal_worker("rf", 1, signal.SIGKILL)
        _, err = job.proc.communicate(timeout=60)
    finally:
        job.stop()
    last_line = err.decode().strip().splitlines()[-1]
    assert job.proc.returncode == 1, err.decode()[-3000:]
    assert "internal error" not in last_line and "plan.1.yaml" in last_line, last_line
    newest = pick_checkpoint(RunDir(run_dir)).step
    assert f"step {newest}" in last_line and "felactl launch --resume rf" in last_line, last_line


def test_a_requested_rescale_whose_plan_cannot_be_written_is_refused_and_nothing_changes(tmp_path, monkeypatch):
    """A scale request is refused with the reason (the job goes on as it is); only a re-form
    after a failure, which cannot be refused, stops the job."""
    import time

    from felactl.launcher import elastic
    from felactl.launcher.controlplane import Coordinator, write_secret_file
    from felactl.launcher.membership.state import Request, Seen

    run = RunDir.create("scale", root=tmp_path)
    plan = dp_plan(2)
    save(plan, run.plan)

    def read_only(obj, path):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    coordinator = Coordinator(write_secret_file(run.secret), job="scale")
    try:
        controller = one_node_controller(coordinator, run, plan, 2)
        monkeypatch.setattr(elastic, "save", read_only)
        monkeypatch.setattr(controller, "_command", lambda wid, command: None)
        controller._apply(Seen(now=time.monotonic(), requests=(Request("r1", {"op": "remove", "ranks": [1]}),)))
    finally:
        coordinator.close()
    answer = controller.answers["r1"]
    assert not answer["ok"] and "plan.1.yaml cannot be written (Read-only file system)" in answer["error"], answer
    assert controller.members == [0, 1] and controller.generation == 0
