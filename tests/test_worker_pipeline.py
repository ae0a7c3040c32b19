"""Static pipelines (1F1B, GPipe) over point-to-point: parameters equal single-process training."""

from __future__ import annotations

import json

import pytest
import torch
from _worker_helpers import final_params, metrics, pipeline_plan, reference_params, run_plan

from felactl.agents.worker.pipeline import gpipe, one_f_one_b

STEPS = 3


def test_one_f_one_b_order():
    assert one_f_one_b(3, 0, 4) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("B", 2), ("B", 3)]
    assert one_f_one_b(3, 2, 3) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]
    assert one_f_one_b(4, 0, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    assert gpipe(2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]


def _all_params(run_dir, num_stages: int) -> torch.Tensor:
    return torch.cat([final_params(run_dir, STEPS, stage=s) for s in range(num_stages)])


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule,cuts", [("1f1b", [0, 1, 2, 3]), ("gpipe", [0, 2, 3])])
def test_pipeline_matches_single_process(tmp_path, schedule, cuts):
    plan = pipeline_plan(cuts, 1, schedule, micro_batch=6, optimizer="adamw", lr=3e-3)
    run_dir = run_plan(plan, tmp_path, STEPS)
    got, want = _all_params(run_dir, len(cuts) - 1), reference_params(plan, STEPS)
    assert got.shape == want.shape and (got - want).abs().max().item() < 1e-5
    records = metrics(run_dir)
    assert len(records) == STEPS * (len(cuts) - 1)
    assert all((r["loss"] is None) == (r["stage"] < len(cuts) - 2) for r in records)
    # every stage receives activations or gradients: their transfer is comm, the wait for them wait
    # (a user's summary table read comm 0.00 on a pipeline's every rank)
    assert all(r["comm_s"] > 1e-4 for r in records), [r["comm_s"] for r in records]  # was ~5 us: the tied sum


@pytest.mark.multiprocess
def test_two_pipelines_allreduce_each_stage(tmp_path):
    plan = pipeline_plan([0, 2, 3], 2, "1f1b", micro_batch=4)
    run_dir = run_plan(plan, tmp_path, STEPS)
    assert (_all_params(run_dir, 2) - reference_params(plan, STEPS)).abs().max().item() < 1e-5


@pytest.mark.multiprocess
def test_sdpipe_pipelines_train_and_stage_replicas_end_equal(tmp_path):
    steps = 20
    plan = pipeline_plan(
        [0, 2, 3],
        2,
        "1f1b",
        micro_batch=8,
        optimizer="adamw",
        lr=1e-2,
        sync="sdpipe",
        config={"input_dim": 256, "hidden": 1024, "depth": 2},
    )  # compute >> the 10 ms max wait
    # stage 0 holds the heavy layers; 20 slowed steps took over the 60 s default on a loaded machine.
    # 20x: each iteration also pays ~0.1 s of point-to-point and group waits whatever the compute,
    # and on a fast CPU rank 0's ~15 ms of compute made 3x a 25% difference, 0 on a CI run (20 and 20)
    run_dir = run_plan(plan, tmp_path, steps, env={"FELACTL_SLOWDOWN": "0=20"}, timeout_s=150)
    records = metrics(run_dir)
    assert sum(r["samples"] for r in records if r["stage"] == 0) == steps * 32, "every sample trained once"
    assert sum(r["samples"] for r in records if r["stage"] == 1) == steps * 32
    sums = {r: json.loads((run_dir / "workers" / f"rank{r}.json").read_text())["param_checksum"] for r in range(4)}
    assert abs(sums[0] - sums[2]) < 1e-6 and abs(sums[1] - sums[3]) < 1e-6, f"stage replicas differ: {sums}"
    losses = [r["loss"] for r in sorted(records, key=lambda r: r["time"]) if r["loss"] is not None]
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.3, f"loss should fall: {losses[:4]} .. {losses[-4:]}"
    slow_pipeline = sum(1 for r in records if r["rank"] == 0)
    fast_pipeline = sum(1 for r in records if r["rank"] == 2)
    print("iterations of the slowed and the other pipeline:", slow_pipeline, fast_pipeline)
    assert fast_pipeline > slow_pipeline, "pipelines run at their own pace: the one without the straggler does more"


def test_a_stages_forward_and_loss_run_under_the_jobs_autocast():
    """bf16 on CUDA workers covers pipeline stages as it covers data parallel (CPU runs fp32: the
    context is entered either way, and the job decides)."""
    from types import SimpleNamespace

    from felactl.agents.worker.pipeline import PipelineStep

    entered = []

    def autocast(fn, *args):
        entered.append(getattr(fn, "__name__", type(fn).__name__))
        return fn(*args)

    model = torch.nn.Linear(3, 2)
    trainer = SimpleNamespace(
        autocast=autocast,
        model=model,
        batch=lambda indices: (torch.ones(len(indices), 3), torch.zeros(len(indices), dtype=torch.long)),
        bundle=SimpleNamespace(loss=torch.nn.functional.cross_entropy),
        straggler=SimpleNamespace(after_compute=lambda elapsed: 0.0),
        global_batch=2,
    )
    PipelineStep(trainer, None, None).forward([0, 1])
    assert entered == ["Linear", "cross_entropy"]
