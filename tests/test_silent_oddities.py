"""Oddities that used to pass in silence are refused, or said (issue 30, item 6).

Each test here failed before its fix: a list flag that dropped an empty item, a cluster file
claiming a core no machine has, a micro-batch larger than any worker's share, a dataset shorter
than the global batch, a built-in model too large for this machine, a run without an ETA.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from felactl.cli.main import app

runner = CliRunner()
REPO = Path(__file__).resolve().parents[1]


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
    from felactl.launcher.prepare import job_plan

    assert job_plan("mlp", {}, 2, 9, 5).stages[0].micro_batch == 5
    assert job_plan("mlp", {}, 2, 9, None).stages[0].micro_batch == 5


SHORT_DATA = (
    "model '_user_models:few_samples': its dataset has 10 sample(s), fewer than the global batch of 64: "
    "every step would see each sample about 6.4 times; use a global batch of at most 10, or more data"
)


def test_a_dataset_shorter_than_the_global_batch_is_refused_at_launch(tmp_path, monkeypatch):
    """10 samples and a global batch of 64 trained in silence, each sample ~6 times a step.
    ``--job`` builds the job before any worker starts: exit 2, both numbers, nothing left."""
    monkeypatch.chdir(tmp_path)
    argv = ["launch", "--job", "_user_models:few_samples", "--nproc-per-node", "2", "--global-batch", "64"]
    result = runner.invoke(app, argv)
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == f"felactl: error: {SHORT_DATA}"
    assert not list(tmp_path.iterdir())
    from felactl.launcher.prepare import job_plan  # as many samples as the batch: each seen once a step

    assert job_plan("_user_models:few_samples", {}, 2, 10, None).global_batch == 10


@pytest.mark.multiprocess
def test_a_worker_refuses_a_plan_whose_batch_its_dataset_cannot_fill(tmp_path):
    """A plan's launch builds the job in the workers: each refuses (exit 2, the same line) before
    it connects to anyone, so the launch ends with the reason instead of training on repeats."""
    from felactl.spec import ModelRef, data_parallel_plan, save

    source = "_user_models:few_samples"
    plan = data_parallel_plan(
        model=ModelRef(name=source, source=source),
        num_layers=1,
        devices=["cpu0", "cpu1"],
        global_batch=64,
        micro_batch=32,
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]),
        "OMP_NUM_THREADS": "1",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "FELACTL_PLAN": str(save(plan, tmp_path / "plan.yaml")),
        "FELACTL_RUN_DIR": str(tmp_path / "run"),
        "FELACTL_STORE": "127.0.0.1:1",  # never reached: the refusal comes first
    }
    proc = subprocess.run(
        [sys.executable, "-m", "felactl.agents.worker"], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == f"felactl worker: {SHORT_DATA}"


def _felactl(cwd: Path, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "felactl", *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.multiprocess
def test_a_model_deeper_than_any_is_refused_in_seconds(tmp_path):
    """``--config depth=100000000`` built blocks for minutes (7 GB after 90 s). A real process,
    so that the old behaviour fails this test by its timeout instead of hanging the suite."""
    proc = _felactl(tmp_path, "profile", "--model", "gpt-mini", "--config", "depth=100000000")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (
        "felactl: error: model 'gpt-mini': config depth=100000000: must be at most 4096 "
        "(four times the deepest transformer trained, DeepNet's 1,000 layers)"
    )
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("model", "config", "said"),
    [  # hundreds of terabytes or more: no machine has that
        ("gpt-mini", "width=10000000", r"has 4,800,003,240,000,103 parameters: .* need 3.84e\+07 GB"),
        ("mlp", "input_dim=10000000000", r"has 5,120,000,793,610 parameters: .* need 3.71e\+05 GB"),
        ("vgg-mini", "image_size=100000", r"has 20,480,001,347,882 parameters: .* need 3.11e\+06 GB"),
    ],
)
def test_a_built_in_model_no_machine_can_hold_is_refused_naming_its_size(tmp_path, monkeypatch, model, config, said):
    """A width, an input or an image no machine holds used to allocate until the allocator
    gave up (or, smaller, until the machine swapped); now its size is said before anything is."""
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["profile", "--model", model, "--config", config])
    assert result.exit_code == 2, result.output
    line = result.stderr.strip()
    assert re.fullmatch(
        rf"felactl: error: model '{model}' with {config} {said}, more than this machine's [0-9.]+ GB of memory", line
    ), line
    assert not list(tmp_path.iterdir())


def test_the_size_a_built_in_is_refused_at_is_this_machines_memory(monkeypatch):
    """The estimate counts parameters on the meta device (exactly what the build makes) and the
    data the built-in generates; a model that needs more than the machine has is refused."""
    from felactl import machine, models

    config = {"depth": 6, "width": 64}
    params = sum(p.numel() for p in models.build("gpt-mini", config).model.parameters())
    assert models.builtin_params("gpt-mini", config) == params  # (its vocabulary is the corpus's 103 characters)
    need = models.builtin_bytes("gpt-mini", config)
    assert need > 2 * 4 * params  # weights, their gradients, and the corpus
    monkeypatch.setattr(machine, "memory_bytes", lambda: need - 1)
    with pytest.raises(models.InputError, match=rf"model 'gpt-mini' with depth=6, width=64 has {params:,} parameters"):
        models.build("gpt-mini", config)
    monkeypatch.setattr(machine, "memory_bytes", lambda: need)
    models.build("gpt-mini", config)


@pytest.mark.multiprocess
def test_a_plans_launch_whose_dataset_is_shorter_than_its_batch_exits_2_saying_it_once(tmp_path, no_leftovers):
    """Each worker refuses the plan before it starts (exit 2, above); the launch says so once, as
    bad input: it ended with exit 1 and the line once per worker."""
    from felactl.spec import ModelRef, data_parallel_plan, save

    source = "_user_models:few_samples"
    plan = data_parallel_plan(
        model=ModelRef(name=source, source=source),
        num_layers=1,
        devices=["cpu0", "cpu1"],
        global_batch=64,
        micro_batch=32,
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "felactl",
            "launch",
            str(save(plan, tmp_path / "plan.yaml")),
            "--steps",
            "3",
            "--runs-root",
            str(tmp_path / "runs"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    errors = [line for line in proc.stderr.splitlines() if line.startswith("felactl: error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
    assert errors[0].count(SHORT_DATA) == 1, errors[0]
