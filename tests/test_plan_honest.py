"""Honest errors and baselines (issue 14, item 5): what fits on no device is named; --compare says
why a baseline is missing."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from felactl.cli.main import app
from felactl.errors import PlanInfeasible
from felactl.optimizer.planner import make_plan
from felactl.spec import load_plan, save
from tests.planner_fixtures import cluster, model


def test_fits_on_no_device_names_the_layer_inside_the_first_block():
    layers = [(1_000_000, 4096, 2e6)] * 20  # 20 layers: planned in blocks of several
    layers[2] = (1_000_000_000, 4096, 2e9)  # 16 GB of weights, gradients and AdamW state
    with pytest.raises(
        PlanInfeasible, match=r"layer 2 \('l2'\) fits on no device: 16 GB .* largest device has 6.2 GB usable"
    ):
        make_plan(cluster([[("A", 20.0, 8.0)] * 2]), model(layers), 64)


def test_fits_on_no_device_names_a_block_that_only_fits_cut():
    layers = [(1_000_000, 4096, 2e6)] * 16
    layers[2] = layers[3] = (200_000_000, 4096, 2e6)  # 3.2 GB each, in one block of equal FLOPs
    # 5 GB devices, 3.5 GB usable after the headroom: each layer fits, the block does not: each fits, the two together do not
    with pytest.raises(PlanInfeasible, match=r"layers 2-3 \('l2'..'l3'\), one block the planner does not cut"):
        make_plan(cluster([[("A", 20.0, 5.0)] * 2]), model(layers), 64)


DP_DOES_NOT_FIT = [(100_000, 400_000, 1e8), (300_000_000, 4096, 6e8), (300_000_000, 4096, 6e8)]


def test_compare_says_why_a_baseline_is_missing(tmp_path):
    save(cluster([[("A", 20.0, 8.0)] * 4]), tmp_path / "c.yaml")
    save(model(DP_DOES_NOT_FIT), tmp_path / "m.yaml")
    args = ["plan", "--cluster", str(tmp_path / "c.yaml"), "--model", str(tmp_path / "m.yaml"), "--global-batch", "64"]
    result = CliRunner().invoke(app, args + ["--json", "-o", str(tmp_path / "p.yaml")])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert "dp" not in data["baselines"]
    assert data["baselines_missing"]["dp"].startswith("does not fit: needs 9.6 GB on n0.d0 (6.2 of its 8 GB usable)")
    assert load_plan(tmp_path / "p.yaml").predicted.baselines_missing["dp"] == data["baselines_missing"]["dp"]
    shown = CliRunner().invoke(app, args + ["--compare"])
    assert shown.exit_code == 0, shown.output
    assert "no plan: does not fit" in " ".join(shown.output.split())
    assert "simulated peak memory" in shown.output
