"""README's main job, shortened: profile -> plan -> launch on 2 local workers; the loss must fall."""

import dataclasses
import json

import pytest
from typer.testing import CliRunner

from felactl.cli.main import app
from felactl.optimizer.cost import CostModel, stage_param_bytes
from felactl.spec import load_cluster, load_model, load_plan

pytestmark = pytest.mark.multiprocess


def test_demo_profiles_plans_and_trains(tmp_path):
    result = CliRunner().invoke(
        app,
        [
            "demo",
            "--steps",
            "40",
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
    measured_s = CostModel(cluster, model).sync_time_s(sync.devices, sync_bytes(model))
    link_s = CostModel(cluster, dataclasses.replace(model, data_parallel_sync=())).sync_time_s(
        sync.devices, sync_bytes(model)
    )
    assert sync.sync_ms != 0.0, sync  # measured, or absent where the machine was too busy: never 0
    assert measured_s == pytest.approx(max(link_s, sync.sync_ms / 1e3) if sync.measured else link_s)
    summary = out["summary"]
    assert summary["steps"] == 40 and summary["samples"] == 40 * plan.global_batch
    assert summary["final_loss"] < 0.8 * summary["first_loss"]
    assert (tmp_path / "runs" / "d" / "summary.json").exists()


def sync_bytes(model) -> int:
    return stage_param_bytes(model, 0, model.num_layers)
