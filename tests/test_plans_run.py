"""Plans the planner writes run: a sample of them launched for 2 steps on gloo CPU workers, and a
plan whose model cannot be imported refused before any worker starts."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
from _worker_helpers import dp_plan
from test_executable import BUILTIN_SPECS, cpu_cluster
from typer.testing import CliRunner

from felactl.agents.worker.config import from_env
from felactl.agents.worker.membership import load_checked
from felactl.cli.main import app
from felactl.errors import InputError
from felactl.optimizer.planner import make_plan
from felactl.spec import ModelRef, Schedule, Stage, StageWorker, load_plan, save
from felactl.spec.executable import execution
from felactl.spec.sync_modes import Execution


def _launch(tmp_path: Path, *args: str):
    return CliRunner().invoke(app, ["launch", *args, "--runs-root", str(tmp_path / "runs")])


@pytest.mark.parametrize(
    "source, needle",
    [
        ("no_such_module:build", "model 'no_such_module:build': cannot import: No module named 'no_such_module'"),
        ("os:no_such_function", "model 'os:no_such_function': cannot import: module 'os' has no attribute"),
        ("no-such-model", "unknown model 'no-such-model'"),
    ],
)
def test_a_plan_whose_model_cannot_be_imported_is_refused_before_any_worker_starts(
    tmp_path, source, needle, no_leftovers
):
    plan = dataclasses.replace(dp_plan(2, "bsp"), model=ModelRef(name="x", source=source))
    result = _launch(tmp_path, str(save(plan, tmp_path / "plan.yaml")), "--steps", "2")
    assert result.exit_code == 2, result.output
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"felactl: error: {needle}"), line
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_a_plan_the_runtime_cannot_execute_is_refused_before_any_worker_starts(tmp_path, no_leftovers):
    plan = dp_plan(2, "bsp")
    stage = plan.stages[0]
    split = dataclasses.replace(
        plan,
        schedule=Schedule.TOKENS,
        stages=(
            dataclasses.replace(stage, layer_end=1, micro_batch=16),
            dataclasses.replace(stage, layer_start=1, micro_batch=4),
        ),
    )
    result = _launch(tmp_path, str(save(split, tmp_path / "plan.yaml")), "--steps", "2")
    assert result.exit_code == 2, result.output
    assert "stages[1].micro_batch: must be a multiple of stages[0].micro_batch (16)" in result.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_the_worker_refuses_a_stage_of_parameter_free_layers_before_it_connects(tmp_path):
    """A user's CNN with a stage holding only Flatten: it crashed building its optimizer."""
    plan = dataclasses.replace(
        dp_plan(2, "bsp"),
        model=ModelRef(name="cnn", source="_user_models:cnn"),
        schedule=Schedule.TOKENS,
        stages=(
            Stage(layer_start=0, layer_end=2, micro_batch=4, workers=(StageWorker(device="cpu0", share=1.0),)),
            Stage(layer_start=2, layer_end=3, micro_batch=4, workers=(StageWorker(device="cpu1", share=1.0),)),
            Stage(layer_start=3, layer_end=4, micro_batch=4, workers=(StageWorker(device="cpu0", share=1.0),)),
        ),
    )
    env = {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "FELACTL_STORE": "127.0.0.1:1",
        "FELACTL_RUN_DIR": str(tmp_path),
        "FELACTL_PLAN": str(save(plan, tmp_path / "plan.yaml")),
    }
    with pytest.raises(InputError, match=r"plan.yaml: stages\[1\]: layers 2..2 hold no trainable parameter"):
        load_checked(from_env(env))


# (CPU cluster seed, model, sync, global batch) -> how the plan runs: a flexible plan of 4 stages on
# 2 workers, one of 2 stages on 3 workers, an SDPipe pipeline. The previous planner wrote plans the
# worker rejected for the last two (micro-batches 8/32/8; 2/1 along a pipeline).
SAMPLE = {
    (3, "vgg-mini", "tokens", 32): (Execution.FLEXIBLE, 4, 2),
    (5, "vgg-mini", "tokens", 32): (Execution.FLEXIBLE, 2, 3),
    (3, "vgg-mini", "sdpipe", 32): (Execution.PIPELINE, 2, 2),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", SAMPLE, ids=[f"{s}-{m}-{y}-{b}" for s, m, y, b in SAMPLE])
def test_a_sample_of_planned_plans_trains_two_steps(tmp_path, case, no_leftovers):
    seed, name, sync, global_batch = case
    plan = make_plan(cpu_cluster(seed), BUILTIN_SPECS[name], global_batch, sync=sync, time_limit_s=10)
    assert (execution(plan), len(plan.stages), len(plan.devices)) == SAMPLE[case]
    result = _launch(
        tmp_path,
        str(save(plan, tmp_path / "plan.yaml")),
        "--steps",
        "2",
        "--node-name",
        "here",
        "--run-id",
        "r",
        "--json",
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["steps"] == 2 and summary["samples"] == 2 * global_batch, summary
    assert math.isfinite(summary["final_loss"]) and summary["final_loss"] > 0
    assert load_plan(tmp_path / "runs" / "r" / "plan.yaml") == plan
