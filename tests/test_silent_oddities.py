"""Oddities that used to pass in silence are refused, or said (issue 30, item 6).

Each test here failed before its fix: a list flag that dropped an empty item, a cluster file
claiming a core no machine has, a micro-batch larger than any worker's share, a dataset shorter
than the global batch, a built-in model too large for this machine, a run without an ETA.
"""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from felactl.cli.main import app

runner = CliRunner()


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["profile", "--model", "mlp", "--batch-sizes", "1,,2"], "--batch-sizes"),
        (["profile", "--model", "mlp", "--batch-sizes", "1,2,"], "--batch-sizes"),
        (["profile", "--model", "mlp", "--input-shape", "3,,32"], "--input-shape"),
    ],
)
def test_an_empty_item_in_a_list_flag_is_refused(argv, flag, tmp_path, monkeypatch):
    """``1,,2`` profiled batch sizes 1 and 2 and said nothing of the item it dropped."""
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, argv)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"felactl: error: {flag}") and "empty item" in lines[0], (
        result.stderr
    )
    assert not list(tmp_path.iterdir())


def _cluster_with_cores(tmp_path, cores) -> str:
    import yaml
    from test_cli_errors import CLUSTER

    cluster = {**CLUSTER, "nodes": [dict(n, devices=list(n["devices"])) for n in CLUSTER["nodes"]]}
    cluster["nodes"][0]["devices"][0] = {**cluster["nodes"][0]["devices"][0], "kind": "cpu", "cpu_cores": cores}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cluster))
    return str(path)


@pytest.mark.parametrize(
    ("cores", "problem"),
    [
        ([10**12], "cpu_cores[0]: must be at most 8191"),
        ([0, 3, 3], "cpu_cores[2]: core 3 is listed twice"),
        ([-1], "cpu_cores[0]: must be >= 0"),
        ([], "cpu_cores: names no core"),
    ],
)
def test_check_refuses_cores_no_machine_has(tmp_path, cores, problem):
    """``cpu_cores: [10**12]`` passed ``felactl check``; a slot pinned there cannot start."""
    result = runner.invoke(app, ["check", _cluster_with_cores(tmp_path, cores)])
    assert result.exit_code == 2, result.output
    assert f"nodes[0].devices[0].{problem}" in result.stderr and len(result.stderr.splitlines()) == 1, result.stderr


def test_check_accepts_real_cores(tmp_path):
    result = runner.invoke(app, ["check", _cluster_with_cores(tmp_path, [0, 1, 8191])])
    assert result.exit_code == 0, result.output


def test_a_micro_batch_larger_than_a_workers_share_is_refused(tmp_path, monkeypatch):
    """``--micro-batch 16`` with 4 or 5 samples per worker ran forwards of 4 or 5 and never said so:
    a worker never holds more than its share of a step. Refused before anything starts."""
    monkeypatch.chdir(tmp_path)
    argv = ["launch", "--job", "mlp", "--nproc-per-node", "2", "--global-batch", "9", "--micro-batch", "16"]
    result = runner.invoke(app, argv)
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == (
        "felactl: error: --micro-batch 16 is larger than a worker's share of --global-batch 9 over 2 "
        "workers (at most 5 samples): use --micro-batch 5 or less, or leave it out"
    )
    assert not list(tmp_path.iterdir())


def test_a_micro_batch_up_to_the_largest_share_is_taken():
    from felactl.launcher.launch import job_plan

    assert job_plan("mlp", {}, 2, 9, 5).stages[0].micro_batch == 5
    assert job_plan("mlp", {}, 2, 9, None).stages[0].micro_batch == 5
