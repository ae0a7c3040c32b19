"""Every run is right or refused: resume continues in every sync mode and plan shape, replicas
start identical, the last completed step is never lost (issue 11, items 1, 3, 4)."""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import torch
from typer.testing import CliRunner

from felactl import models
from felactl.cli.main import app
from felactl.launcher.resume import pick_checkpoint
from felactl.launcher.rundir import RunDir, read_jsonl
from felactl.spec import SyncMode, SyncSpec, Training, save

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))
from _worker_helpers import Job, dp_plan, hybrid_plan, pipeline_plan, run_plan, wait_checkpoint  # noqa: E402

pytestmark = pytest.mark.multiprocess
STARTUP_S = 120.0
"""How long a launch may take to reach its first steps on a loaded machine (a bound, not a measurement)."""
USER_ENV = {"PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}


def _plan(shape: str):
    """Small mlp plans of each shape and sync mode, AdamW so the loss falls fast."""
    training = {"optimizer": "adamw", "lr": 0.01}
    if shape == "pipeline":
        return pipeline_plan([0, 2, 3], **training)
    if shape == "flexible":
        return hybrid_plan([(0, 2, 4, [0, 1]), (2, 3, 8, [0, 1])], 2, **training)
    return dp_plan(2, shape, **training)


def _records_after(run: Path, event_kind: str) -> list[dict]:
    """The metrics records written after the run's newest ``event_kind`` event."""
    since = [e for e in read_jsonl(run / "events.jsonl") if e["kind"] == event_kind][-1]["time"]
    return [r for r in read_jsonl(run / "metrics.jsonl") if r["time"] > since]


def _mean_loss(records: list[dict], step: int) -> float | None:
    """The step's loss over its samples (each worker's record is the mean over those it took)."""
    losses = [(r["loss"], r["samples"]) for r in records if r["step"] == step and r.get("loss") is not None]
    return sum(loss * n for loss, n in losses) / sum(n for _, n in losses) if losses else None


@pytest.mark.parametrize("shape", ["bsp", "tokens", "wbsp", "sdpipe", "pipeline", "flexible"])
def test_a_killed_run_resumes_at_its_checkpoint_in_every_mode(shape, tmp_path, no_leftovers):
    plan = save(_plan(shape), tmp_path / "plan.yaml")
    job = Job(tmp_path, str(plan), "--run-id", "r", "--steps", "2000", "--checkpoint-every", "5")
    try:
        job.wait_step("r", 14, timeout_s=STARTUP_S)
        # a checkpoint is written while training goes on: under load step 14 can come before
        # step 10's checkpoint is complete, so the kill waits for the newer of at least two
        checkpoint = wait_checkpoint(tmp_path / "runs", "r", at_least=10, timeout_s=STARTUP_S)
    finally:
        job.stop()  # kill -9: the launch, its agent and every worker
    run = tmp_path / "runs" / "r"
    before = read_jsonl(run / "metrics.jsonl")
    checkpoint = pick_checkpoint(RunDir.find("r", root=tmp_path / "runs")).step
    assert checkpoint >= 10  # the newer of at least two
    resumed = Job(tmp_path, "--resume", "r", "--steps", str(checkpoint + 3))
    try:
        summary = resumed.finish()
    finally:
        resumed.stop()
    after = _records_after(run, "resume")
    assert min(r["step"] for r in after) == checkpoint, "the first step after a resume is the checkpoint's"
    assert summary["steps"] == checkpoint + 3
    if shape in ("bsp", "tokens"):  # every sample once, the redone ones not twice
        # A worker killed between its step's all-reduce and its record leaves that step's record
        # out (the checkpoint, written by another, holds the step): at most the last step's.
        recorded = sum(r["samples"] for r in before if r["step"] < checkpoint)
        assert recorded >= (checkpoint - 1) * 32 + 16, "only a record of the step before the checkpoint may be lost"
        assert summary["samples"] == recorded + 3 * 32
    first_loss = _mean_loss(before, 0)
    resumed_loss = _mean_loss(after, checkpoint) or _mean_loss(after, checkpoint + 1)
    previous = _mean_loss(before, checkpoint - 1)
    assert resumed_loss < first_loss - 0.5 * (first_loss - previous), (first_loss, previous, resumed_loss)
    redone = _mean_loss(before, checkpoint)
    # The kill can fall between two workers' records of that step: compare only a step every worker
    # recorded before it (one worker's loss against the mean of two failed a loaded suite's run).
    complete = _loss_records(before, checkpoint) == _loss_records(after, checkpoint)
    if shape in ("bsp", "tokens", "pipeline") and redone is not None and complete:  # the same step, the same state
        # (the flexible hybrid's records count first-stage samples, not the loss's: not comparable)
        assert _mean_loss(after, checkpoint) == pytest.approx(redone, rel=1e-4)


def _loss_records(records: list[dict], step: int) -> int:
    """How many workers recorded a loss for ``step``."""
    return sum(1 for r in records if r["step"] == step and r.get("loss") is not None)


def _attention_plan(mode: str, **config):
    return models.local_data_parallel_plan(
        "user_models:attention_net",
        config,
        2,
        global_batch=16,
        micro_batch=4,
        sync=SyncSpec(mode=SyncMode(mode)),
        training=Training(optimizer="adamw", lr=0.01, seed=0),
    )


def _param_checksum(run: Path, rank: int) -> float:
    return json.loads((run / "workers" / f"rank{rank}.json").read_text())["param_checksum"]


@pytest.fixture(scope="module")
def noisy_run(tmp_path_factory) -> Callable[[str], Path]:
    """``noisy_run(mode)``: a 3-step run of ``_attention_plan(mode, per_process_noise=1)``, made
    once per mode for the tests that read it."""
    runs: dict[str, Path] = {}

    def run(mode: str) -> Path:
        if mode not in runs:
            plan = _attention_plan(mode, per_process_noise=1)
            runs[mode] = run_plan(plan, tmp_path_factory.mktemp(f"noisy-{mode}"), steps=3, env=USER_ENV)
        return runs[mode]

    return run


@pytest.mark.parametrize("mode", ["bsp", "tokens", "wbsp", "sdpipe"])
def test_replicas_start_identical_whatever_the_users_initialisation(mode, noisy_run):
    """A user model whose weights and buffers differ in every process (an initialisation of its
    own, other in each process; nn.MultiheadAttention): every replica ends with the same parameters."""
    run = noisy_run(mode)
    assert _param_checksum(run, 0) == _param_checksum(run, 1)


@pytest.mark.parametrize("mode", ["bsp", "tokens", "wbsp"])
def test_replicas_buffers_agree_after_training(mode, tmp_path):
    """BatchNorm statistics, which each replica updates from its own samples, follow the stage's
    first replica after every step (as DDP's broadcast_buffers has them) and at the end."""
    plan = models.local_data_parallel_plan(
        "user_models:batchnorm_net",
        {},
        2,
        global_batch=16,
        micro_batch=4,
        sync=SyncSpec(mode=SyncMode(mode)),
        training=Training(optimizer="adamw", lr=0.01, seed=0),
    )
    run = run_plan(plan, tmp_path, steps=4, env=USER_ENV)
    workers = [json.loads((run / "workers" / f"rank{r}.json").read_text()) for r in range(2)]
    assert workers[0]["buffer_checksum"] == workers[1]["buffer_checksum"] != 32.0 + 4  # trained, not the initial
    assert workers[0]["param_checksum"] == workers[1]["param_checksum"]


@pytest.mark.parametrize("mode", ["bsp", "tokens"])
def test_two_runs_of_the_same_plan_and_seed_end_the_same(mode, tmp_path, noisy_run):
    """Bit for bit under bsp. Under tokens the sum of a step's gradients is added up in the order
    the workers happened to take its tokens, so two runs agree to float rounding only (AdamW
    turns rounding in near-zero gradients into steps of up to lr). The plan is the replicas
    test's (its processes start apart), whose run is the first of the two."""
    second = run_plan(_attention_plan(mode, per_process_noise=1), tmp_path, steps=3, env=USER_ENV)
    sums = [_param_checksum(noisy_run(mode), 0), _param_checksum(second, 0)]
    assert sums[0] == (sums[1] if mode == "bsp" else pytest.approx(sums[1], rel=1e-3))


def test_a_users_own_weights_are_kept(monkeypatch):
    """felactl never re-initialises a user's model (pretrained weights stay what they were)."""
    monkeypatch.syspath_prepend(str(TESTS))
    layers = models.build("user_models:pretrained_net", {}, seed=3).layers
    assert {float(v) for p in layers.parameters() for v in p.detach().flatten()} == {0.25}


def test_the_last_step_is_checkpointed_and_exports(tmp_path, no_leftovers):
    """7 steps with --checkpoint-every 5: the checkpoint of step 7 is there, and exports."""
    plan = save(dp_plan(2, "tokens"), tmp_path / "plan.yaml")
    runs = tmp_path / "runs"
    result = CliRunner().invoke(
        app,
        [
            "launch",
            str(plan),
            "--run-id",
            "s",
            "--steps",
            "7",
            "--checkpoint-every",
            "5",
            "--runs-root",
            str(runs),
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (runs / "s" / "checkpoints").iterdir()) == ["step000005", "step000007"]
    exported = CliRunner().invoke(app, ["export", "s", "--runs-root", str(runs), "-o", str(tmp_path / "m.pt")])
    assert exported.exit_code == 0, exported.output
    model = models.build("mlp", plan_config := dict(dp_plan(2).model.config)).layers
    model.load_state_dict(torch.load(tmp_path / "m.pt"), strict=True)
    saved = torch.load(runs / "s" / "checkpoints" / "step000007" / "stage0.pt", weights_only=False)
    assert saved["step"] == 7 and saved["data_position"] == 7 * 32 and plan_config


@pytest.mark.parametrize("mode", ["bsp", "tokens"])
def test_a_graceful_stop_checkpoints_the_step_it_stops_at(mode, tmp_path, no_leftovers):
    """SIGTERM to the launch: the workers agree on a last step, checkpoint it and exit; the run
    reads 'stopped', and a resume goes on from that step."""
    plan = save(dp_plan(2, mode), tmp_path / "plan.yaml")
    job = Job(tmp_path, str(plan), "--run-id", "g", "--steps", "5000", "--checkpoint-every", "1000")
    try:
        job.wait_step("g", 5, timeout_s=STARTUP_S)
        job.proc.send_signal(signal.SIGTERM)
        job.proc.communicate(timeout=45)
    finally:
        job.stop()
    runs = tmp_path / "runs"
    stopped = read_jsonl(runs / "g" / "events.jsonl")[-1]
    assert stopped["kind"] == "stopped" and stopped["checkpoint_step"] >= 5, stopped
    last = stopped["checkpoint_step"]
    records = read_jsonl(runs / "g" / "metrics.jsonl")
    assert {max(r["step"] for r in records if r["rank"] == rank) for rank in (0, 1)} == {last - 1}
    assert RunDir.find("g", root=runs).state() == "stopped"
    resumed = Job(tmp_path, "--resume", "g", "--steps", str(last + 3))
    try:
        assert resumed.finish()["steps"] == last + 3
    finally:
        resumed.stop()
    assert min(r["step"] for r in _records_after(runs / "g", "resume")) == last


def test_a_graceful_stop_after_a_rescale_stops_every_member_at_one_step(tmp_path, no_leftovers):
    """The drain's agreement lives in the job's store, not a generation's: after a scale-out the
    newcomer learns the last step one stayer proposed (it asked its own store before: it never
    learned, trained on alone, and the job hung in its collective)."""
    plan = save(dp_plan(2, "bsp"), tmp_path / "plan.yaml")
    job = Job(tmp_path, str(plan), "--run-id", "g", "--steps", "50000", "--max-nproc-per-node", "3")
    try:
        job.wait_step("g", 5, timeout_s=STARTUP_S)
        grown = job.scale("g", "--add", "1")
        assert grown.exit_code == 0, grown.output
        job.wait_step("g", max(r["step"] for r in job.records("g")) + 5)
        job.signal_worker("g", 0, signal.SIGINT)  # only one worker is asked; the others learn it
        pids = {r["pid"] for r in job.records("g")}
        _, alive = psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)], timeout=30)
        records = job.records("g")
    finally:
        job.stop()
    assert not alive, "a worker trained on (or hung) after the others stopped"
    last = {w: max(r["step"] for r in records if r["rank"] == w) for w in (0, 1, 2)}
    assert len(set(last.values())) == 1, last
