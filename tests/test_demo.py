"""README's main job, shortened: profile -> plan -> launch on 2 local workers; the loss must fall.

A global batch of 8, not the demo's 32: every step still runs (the profile times the same batch
sizes), while the data-parallel sync is timed, and the job trains, at 4 samples a worker, not 16:
the sync's timing, which adds pairs of blocks while it is noisy, is the longest step."""

import json

import pytest
from typer.testing import CliRunner

from felactl.cli.main import app
from felactl.optimizer.cost import CostModel
from felactl.spec import load_cluster, load_model, load_plan
from tests.planner_fixtures import calibrated_exposed_sync_s

pytestmark = pytest.mark.multiprocess


def test_demo_profiles_plans_and_trains(tmp_path):
    result = CliRunner().invoke(
        app,
        [
            "demo",
            "--steps",
            "40",
            "--global-batch",
            "8",
            "--out-dir",
            str(tmp_path / "demo"),
            "--runs-root",
            str(tmp_path / "runs"),
            "--run-id",
            "d",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    cluster, model, plan = load_cluster(out["cluster"]), load_model(out["model"]), load_plan(out["plan"])
    assert len(cluster.devices) == 2 and len(cluster.links) == 2
    assert model.name == "gpt-mini" and plan.num_layers == model.num_layers
    # the sync of the 2 slots was measured as training runs it, and the plan priced it so
    (sync,) = model.data_parallel_sync
    assert set(sync.devices) == {d.name for d in cluster.devices} and sync.cluster == cluster.name
    assert sync.sync_ms != 0.0, sync  # measured, or absent where the machine was too busy: never 0
    charged, expected = calibrated_exposed_sync_s(CostModel(cluster, model), sync)
    assert charged == pytest.approx(expected)
    summary = out["summary"]
    assert summary["steps"] == 40 and summary["samples"] == 40 * plan.global_batch
    assert summary["final_loss"] < 0.8 * summary["first_loss"]
    assert (tmp_path / "runs" / "d" / "summary.json").exists()
