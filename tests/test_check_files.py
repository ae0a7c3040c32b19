"""``felactl check plan.yaml cluster.yaml model.yaml``: the files checked against each other, and a
plan against what the runtime can execute; each problem one line naming the plan file and key."""

from __future__ import annotations

import copy

import pytest
import yaml
from test_cli_errors import CLUSTER, MODEL, PLAN
from typer.testing import CliRunner

from felactl.cli.main import app

runner = CliRunner()


def _write(tmp_path, plan=PLAN, cluster=CLUSTER, model=MODEL) -> None:
    for name, data in (("plan", plan), ("cluster", cluster), ("model", model)):
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(data, sort_keys=False))


def _check_error(tmp_path, monkeypatch, *files: str) -> str:
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["check", *files])
    assert result.exit_code == 2, result.output
    assert result.stdout == "" and "Traceback" not in result.output
    [line] = result.stderr.splitlines()
    return line


def _changed(base: dict, change) -> dict:
    data = copy.deepcopy(base)
    change(data)
    return data


def test_matching_files_pass(tmp_path, monkeypatch):
    _write(tmp_path)
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["check", "plan.yaml", "cluster.yaml", "model.yaml"])
    assert result.exit_code == 0, result.output
    assert len(result.stderr.splitlines()) == 3


@pytest.mark.parametrize(
    "files, change, expected",
    [
        (
            ("plan.yaml", "cluster.yaml"),
            lambda c: c["nodes"][1]["devices"][0].update(name="c0"),
            "plan.yaml: devices[2]: device 'b0' is not in cluster 'lab' (it has: a0, a1, c0)",
        ),
        (
            ("plan.yaml", "model.yaml"),
            lambda m: m.update(layers=m["layers"][:4]),
            "plan.yaml: stages[1].layer_end: the stages cover 5 layers but model 'mlp' has 4",
        ),
        (
            ("plan.yaml", "model.yaml"),
            lambda m: m.update(source="vgg-mini"),
            "plan.yaml: model.source: is 'mlp' but the model profile is of 'vgg-mini'",
        ),
        (
            ("plan.yaml", "model.yaml"),
            lambda m: m.update(name="mlp2"),
            "plan.yaml: model.name: is 'mlp' but the model profile is of 'mlp2'",
        ),
        (
            ("plan.yaml", "model.yaml"),
            lambda m: [m["layers"][i].update(params=0, param_bytes=0) for i in (3, 4)],
            "plan.yaml: stages[1]: layers 3..4 hold no trainable parameter",
        ),
    ],
)
def test_a_plan_that_does_not_fit_its_cluster_or_model(tmp_path, monkeypatch, files, change, expected):
    cluster = _changed(CLUSTER, change) if "cluster.yaml" in files else CLUSTER
    model = _changed(MODEL, change) if "model.yaml" in files else MODEL
    _write(tmp_path, cluster=cluster, model=model)
    line = _check_error(tmp_path, monkeypatch, *files)
    assert line.startswith(f"felactl: error: {expected}"), line


def test_the_placement_must_match_the_cluster(tmp_path, monkeypatch):
    placed = _changed(
        PLAN,
        lambda p: p.update(
            placement=[
                {"device": "a0", "node": "box0", "kind": "cuda", "local_index": 0},
                {"device": "a1", "node": "box0", "kind": "cuda", "local_index": 1},
                {"device": "b0", "node": "box0", "kind": "cuda", "local_index": 0},
            ]
        ),
    )
    _write(tmp_path, plan=placed)
    line = _check_error(tmp_path, monkeypatch, "cluster.yaml", "plan.yaml")
    assert line == "felactl: error: plan.yaml: placement[2].node: 'b0' is on node 'box1' of cluster 'lab', not 'box0'"


def test_a_plan_the_runtime_cannot_execute_is_refused_alone(tmp_path, monkeypatch):
    """The issue's plan: micro-batches 32/2 after one another under token scheduling."""

    def shrink(p):
        p["stages"][0]["micro_batch"] = 32
        p["stages"][1]["micro_batch"] = 2

    _write(tmp_path, plan=_changed(PLAN, shrink))
    line = _check_error(tmp_path, monkeypatch, "plan.yaml")
    assert line == (
        "felactl: error: plan.yaml: stages[1].micro_batch: must be a multiple of stages[0].micro_batch "
        "(32) for token scheduling, got 2"
    )


def test_a_plan_whose_memory_does_not_fit_the_clusters_device(tmp_path, monkeypatch):
    """Found by a user trial: check passed a plan predicting 0.0088 GB on a device of 1e-6 GB."""

    def needs_more(p):
        p["stages"][0]["workers"][0]["predicted_memory_gb"] = 1000.0

    _write(tmp_path, plan=_changed(PLAN, needs_more))
    line = _check_error(tmp_path, monkeypatch, "cluster.yaml", "plan.yaml")
    assert line.startswith(
        "felactl: error: plan.yaml: stages[0].workers[0].predicted_memory_gb: 1000 GB does not fit"
    ), line


def test_a_seed_torch_cannot_take_is_refused(tmp_path, monkeypatch):
    """Found by a user trial: training.seed 2**70 passed check, then every worker died."""
    _write(tmp_path, plan=_changed(PLAN, lambda p: p.setdefault("training", {}).update(seed=2**70)))
    line = _check_error(tmp_path, monkeypatch, "plan.yaml")
    assert "training.seed: must be at most" in line, line


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (
            {"hiden": 64},
            "felactl: error: plan.yaml: model 'mlp': unknown config key 'hiden'; it takes input_dim, hidden",
        ),
        ({}, None),
    ],
)
def test_a_plans_model_config_is_checked_as_launch_checks_it(tmp_path, monkeypatch, config, expected):
    """A plan with a config key its model does not take passed check, and failed the launch."""
    plan = _changed(PLAN, lambda p: p["model"].update(config=config))
    _write(tmp_path, plan=plan)
    if expected is None:
        monkeypatch.chdir(tmp_path)
        assert runner.invoke(app, ["check", "plan.yaml"]).exit_code == 0
        return
    assert _check_error(tmp_path, monkeypatch, "plan.yaml").startswith(expected)
