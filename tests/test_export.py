"""felactl export: a run's checkpoint, stages merged, as one state_dict the whole model loads strictly."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from felactl import models
from felactl.agents.worker.checkpoint import checkpoint_path, save_checkpoint, stage_state
from felactl.cli.main import app
from felactl.errors import InputError
from felactl.launcher.export import check_state_dict
from felactl.spec import save

sys.path.insert(0, str(Path(__file__).parent))
from _worker_helpers import MLP_CONFIG, dp_plan, pipeline_plan, reference_params  # noqa: E402


def _export(runs: Path, *args: str):
    return CliRunner().invoke(app, ["export", *args, "--runs-root", str(runs)])


def _write_run(runs: Path, run_id: str, plan, steps: dict[int, list[int]], generation: int | None = None) -> Path:
    """A run directory with ``plan`` and, for each step, the given stages' checkpoint files, from
    the model built with seed ``step`` (so each step's tensors differ)."""
    run = runs / run_id
    save(plan, run / "plan.yaml")
    for step, stages in steps.items():
        layers = models.build(plan.model.source, plan.model.config, seed=step).layers
        for s in stages:
            stage = plan.stages[s]
            part = layers[stage.layer_start : stage.layer_end]
            save_checkpoint(
                checkpoint_path(run, step, s),
                state=stage_state(part, torch.optim.SGD(part.parameters())),
                step=step,
                data_position=step * plan.global_batch,
                layers=(stage.layer_start, stage.layer_end),
                extra={} if generation is None else {"generation": generation},
            )
    return run


def _loads_strictly(path: Path, plan) -> torch.nn.Sequential:
    model = models.build(plan.model.source, plan.model.config, seed=99).layers
    model.load_state_dict(torch.load(path, weights_only=True), strict=True)
    return model


def _one_line_error(result, needle: str) -> None:
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1 and needle in result.stderr, result.stderr


@pytest.mark.multiprocess
def test_a_pipeline_runs_checkpoint_exports_as_the_whole_model(tmp_path, no_leftovers):
    plan = pipeline_plan([0, 2, 3], 1, "1f1b", micro_batch=8)
    plan_path = save(plan, tmp_path / "plan.yaml")
    runs = tmp_path / "runs"
    launched = CliRunner().invoke(
        app,
        [
            "launch",
            str(plan_path),
            "--steps",
            "4",
            "--checkpoint-every",
            "2",
            "--run-id",
            "pipe",
            "--runs-root",
            str(runs),
        ],
    )
    assert launched.exit_code == 0, launched.output

    result = _export(runs, "pipe", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["step"] == 4 and report["num_stages"] == 2 and report["data_position"] == 4 * 32
    assert report["output"] == str(runs / "pipe" / "model.pt")

    model = _loads_strictly(runs / "pipe" / "model.pt", plan)
    got = model.state_dict()
    for s in range(2):
        saved = torch.load(checkpoint_path(runs / "pipe", 4, s), weights_only=False)["model"]
        assert all(torch.equal(got[key], tensor) for key, tensor in saved.items())
    flat = torch.cat([v.reshape(-1) for v in got.values()])
    assert (flat - reference_params(plan, 4)).abs().max().item() < 1e-5, "the export is what training made"


def test_the_stages_merge_into_the_whole_model(tmp_path):
    # a path longer than a line: printed whole (a path wrapped across lines cannot be copied)
    runs = tmp_path / ("a-rather-long-folder-name-" * 4) / "runs"
    plan = pipeline_plan([0, 1, 3], 1)
    _write_run(runs, "two", plan, {2: [0, 1], 4: [0, 1]})

    result = _export(runs, "two", "-o", str(tmp_path / "out" / "m.pt"), "--step", "2", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["step"] == 2
    got = _loads_strictly(tmp_path / "out" / "m.pt", plan).state_dict()
    want = models.build("mlp", MLP_CONFIG, seed=2).layers.state_dict()
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)

    default = _export(runs, "two")
    assert default.exit_code == 0 and default.stdout == "", default.output
    assert "step 4" in default.stderr and str(runs / "two" / "model.pt") in default.stderr
    got = _loads_strictly(runs / "two" / "model.pt", plan).state_dict()
    assert torch.equal(got["2.weight"], models.build("mlp", MLP_CONFIG, seed=4).layers.state_dict()["2.weight"])


def test_a_checkpoint_missing_a_stage_is_not_complete(tmp_path):
    runs = tmp_path / "runs"
    _write_run(runs, "r", pipeline_plan([0, 1, 3], 1), {2: [0, 1], 4: [0]})

    newest = _export(runs, "r", "--json")
    assert newest.exit_code == 0 and json.loads(newest.stdout)["step"] == 2, newest.output
    _one_line_error(_export(runs, "r", "--step", "4"), "checkpoint of step 4 is not complete")
    _one_line_error(_export(runs, "r", "--step", "3"), "no checkpoint of step 3 (it has: 2, 4)")

    _write_run(runs, "half", pipeline_plan([0, 1, 3], 1), {2: [1], 4: [0]})
    _one_line_error(_export(runs, "half"), "run half has no complete checkpoint")


def test_the_plan_of_the_checkpoints_generation_decides_the_stages(tmp_path):
    runs = tmp_path / "runs"
    run = _write_run(runs, "g", dp_plan(2), {6: [0]}, generation=1)
    # plan.yaml has 2 stages, so stage0.pt alone would not be complete under it
    save(pipeline_plan([0, 1, 3], 1), run / "plan.yaml")
    _one_line_error(_export(runs, "g"), "plan.1.yaml: the plan of the checkpoint's generation is missing")
    save(dp_plan(3), run / "plan.1.yaml")
    result = _export(runs, "g", "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["num_stages"] == 1, result.output


def test_bad_inputs_are_one_line_and_exit_2(tmp_path):
    runs = tmp_path / "runs"
    _one_line_error(_export(runs, "nope"), "no run 'nope'")
    _write_run(runs, "empty", dp_plan(2), {})
    _one_line_error(_export(runs, "empty"), "run empty has no complete checkpoint")
    _write_run(runs, "r", dp_plan(2), {2: [0]})
    (tmp_path / "dir").mkdir()
    _one_line_error(_export(runs, "r", "-o", str(tmp_path / "dir")), "is a directory")
    assert list((tmp_path / "dir").iterdir()) == []
    _one_line_error(_export(runs, "r", "--step", "-1"), "--step")


def test_a_checkpoint_that_does_not_fit_the_model_names_the_keys():
    want = models.build("mlp", MLP_CONFIG).layers.state_dict()
    got = dict(want)
    del got["0.0.bias"]
    got["9.weight"] = torch.zeros(1)
    got["2.weight"] = torch.zeros(3, 3)
    with pytest.raises(InputError) as caught:
        check_state_dict(got, want, where="step000002")
    assert str(caught.value) == (
        "step000002: the checkpoint does not fit the plan's model: missing 0.0.bias; "
        "unexpected 9.weight; wrong shape 2.weight (3, 3) (model: (10, 64))"
    )


def test_a_run_whose_model_changed_is_refused(tmp_path):
    runs = tmp_path / "runs"
    run = _write_run(runs, "r", dp_plan(2), {2: [0]})
    save(dp_plan(2, config={**MLP_CONFIG, "depth": 3}), run / "plan.yaml")
    _one_line_error(_export(runs, "r"), "missing 2.0.weight, 2.0.bias, 3.weight, 3.bias; unexpected 2.weight, 2.bias")
