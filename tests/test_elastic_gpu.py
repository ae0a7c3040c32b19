"""Elastic jobs on GPUs (NCCL): a job on GPUs is elastic as one on CPUs is; it grows onto a free
GPU, shrinks, survives a killed worker and resumes from a checkpoint on its GPU. NCCL runs one
rank per GPU, so what needs two workers needs two GPUs and skips with that reason elsewhere."""

from __future__ import annotations

import dataclasses
import json
import signal
import sys
from pathlib import Path

import pytest
import torch

from felactl import models
from felactl.machine import short_hostname
from felactl.spec import DeviceKind, ModelRef, Placement, SyncMode, SyncSpec, Training, data_parallel_plan, save

sys.path.insert(0, str(Path(__file__).parent))
from _worker_helpers import Job  # noqa: E402

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multiprocess,
    pytest.mark.skipif(GPUS == 0, reason="needs CUDA (NCCL)"),
]
two_gpus = pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs: NCCL runs one rank per GPU")
CONFIG = {"depth": 1, "width": 64}
STEPS = 3000
"""Long enough that a GPU job (a few ms a step) still trains when a scale call and a stop come."""


def gpu_plan(num_workers: int, sync: str = "bsp", global_batch: int = 16):
    """A data-parallel gpt-mini plan on GPUs 0..num_workers-1 of this machine."""
    devices = [f"cuda{i}" for i in range(num_workers)]
    plan = data_parallel_plan(
        model=ModelRef(name="gpt-mini", source="gpt-mini", config=CONFIG),
        num_layers=len(models.build("gpt-mini", CONFIG).layers),
        devices=devices,
        global_batch=global_batch,
        micro_batch=8,
        sync=SyncSpec(mode=SyncMode(sync)),
        training=Training(optimizer="adamw", lr=3e-3, seed=0),
    )
    node = short_hostname()  # the launcher runs the devices placed on this machine here
    placement = tuple(
        Placement(device=d, node=node, kind=DeviceKind.CUDA, local_index=i) for i, d in enumerate(devices)
    )
    return dataclasses.replace(plan, placement=placement)


def _final(root: Path, run: str, wid: int) -> float:
    return json.loads((root / run / "workers" / f"rank{wid}.json").read_text())["param_checksum"]


def test_a_job_on_a_gpu_is_elastic_and_resumes_on_its_gpu(tmp_path, no_leftovers):
    plan = save(gpu_plan(1), tmp_path / "plan.yaml")
    reference = Job(tmp_path, str(plan), "--run-id", "ref", "--steps", str(STEPS))
    try:
        reference.finish(timeout_s=120)
    finally:
        reference.stop()
    job = Job(tmp_path, str(plan), "--run-id", "g", "--steps", str(STEPS), "--checkpoint-every", "100")
    try:
        job.wait_step("g", 50, timeout_s=90)
        added = job.scale("g", "--add", "1")
        if GPUS == 1:  # elastic (not "cannot be rescaled"), but this machine has no second GPU
            assert added.exit_code == 2 and "one worker per GPU" in added.stderr, added.output
        else:
            assert added.exit_code == 0, added.output
        job.wait_step("g", 250, timeout_s=90)  # past two checkpoints
        job.stop()  # the whole job dies: launcher, agent and workers
    finally:
        job.stop()
    resumed = Job(tmp_path, "--resume", "g")
    try:
        summary = resumed.finish(timeout_s=120)
    finally:
        resumed.stop()
    assert summary["steps"] == STEPS
    worker = json.loads((tmp_path / "runs" / "g" / "workers" / "rank0.json").read_text())
    assert worker["device"] == "cuda:0"
    # the same run resumed on its GPU ends where the uninterrupted one did (GPU kernels may sum in
    # another order from run to run: close, not bit-equal)
    final, expected = _final(tmp_path / "runs", "g", 0), _final(tmp_path / "runs", "ref", 0)
    assert abs(final - expected) <= 1e-3 * max(1.0, abs(expected)), (final, expected)


@pytest.mark.parametrize("sync", ["tokens", "wbsp", "sdpipe"])
def test_every_rescalable_mode_trains_elastic_on_a_gpu(sync, tmp_path, no_leftovers):
    plan = save(gpu_plan(1, sync), tmp_path / "plan.yaml")
    job = Job(tmp_path, str(plan), "--run-id", "m", "--steps", "40")
    try:
        summary = job.finish(timeout_s=120)
    finally:
        job.stop()
    assert summary["steps"] == 40
    worker = json.loads((tmp_path / "runs" / "m" / "workers" / "rank0.json").read_text())
    assert worker["device"] == "cuda:0" and worker["sync"] == sync


@two_gpus
@pytest.mark.parametrize("sync", ["bsp", "tokens", "wbsp", "sdpipe"])
def test_a_job_on_gpus_grows_onto_a_free_gpu_and_shrinks_keeping_its_processes(sync, tmp_path, no_leftovers):
    plan = save(gpu_plan(1, sync), tmp_path / "plan.yaml")
    job = Job(tmp_path, str(plan), "--run-id", "s", "--steps", str(STEPS))
    try:
        job.wait_step("s", 20, timeout_s=90)
        grown = job.scale("s", "--add", "1")
        assert grown.exit_code == 0, grown.output
        out = json.loads(grown.stdout)
        assert out["members_after"] == [0, 1] and out["replicated_bytes"] > 0
        assert len({round(w["param_checksum"], 4) for w in out["switch_s"].values()}) == 1, out["switch_s"]
        shrunk = job.scale("s", "--remove", "1")
        assert shrunk.exit_code == 0, shrunk.output
        summary = job.finish(timeout_s=180)
    finally:
        job.stop()
    assert summary["steps"] == STEPS
    records = job.records("s")
    assert len({r["pid"] for r in records if r["rank"] == 0}) == 1  # the stayer kept its process
    assert any(r["rank"] == 1 for r in records)  # the newcomer trained
    assert json.loads((tmp_path / "runs" / "s" / "workers" / "rank0.json").read_text())["device"] == "cuda:0"


@two_gpus
def test_a_killed_worker_on_gpus_is_dropped_and_the_run_completes(tmp_path, no_leftovers):
    plan = save(gpu_plan(2), tmp_path / "plan.yaml")
    job = Job(tmp_path, str(plan), "--run-id", "k", "--steps", str(STEPS), "--collective-timeout", "10")
    try:
        job.wait_step("k", 30, timeout_s=90)
        job.signal_worker("k", 1, signal.SIGKILL)
        summary = job.finish(timeout_s=180)
    finally:
        job.stop()
    assert summary["steps"] == STEPS
    steps = sorted({r["step"] for r in job.records("k") if r["rank"] == 0})
    assert steps == list(range(STEPS))
