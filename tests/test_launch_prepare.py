"""A plan's launch before anything starts, without processes: what every worker is told, and the
checks of the plan against the flags and this machine."""

from __future__ import annotations

import pytest
import torch
from _worker_helpers import dp_plan, pipeline_plan, placed
from typer.testing import CliRunner

from felactl.cli.main import app
from felactl.errors import InputError
from felactl.launcher.launch import worker_env
from felactl.launcher.prepare import LaunchOptions, check_min_nodes, why_not_elastic
from felactl.launcher.rundir import RunDir
from felactl.spec import save
from felactl.spec.executable import why_not_rescalable


def test_workers_are_told_nothing_their_plan_says(tmp_path):
    """The plan is each worker's one source for its sync mode, batch, stages and backend: the
    environment carries where the plan is, not a copy of what is in it."""
    run = RunDir.create("r", root=tmp_path)
    env = worker_env(LaunchOptions(plan_path=tmp_path / "plan.yaml", runs_root=tmp_path), run, "127.0.0.1:1")
    assert env["FELACTL_PLAN"] == str(run.plan.resolve())
    assert not {"FELACTL_BACKEND", "FELACTL_SYNC"} & set(env)


def test_a_launch_that_cannot_rescale_says_why_once(tmp_path):
    """``--nnodes MIN:MAX`` is refused with the plan's one reason (spec.executable.why_not_rescalable),
    or ``--no-elastic`` alone where the plan could rescale (it used to list the stages and mode of a
    plan that rescales)."""
    flags = dict(plan_path=tmp_path / "plan.yaml", runs_root=tmp_path, nnodes=2, min_nodes=1, rdzv_endpoint="h:1")
    pipeline, data_parallel = pipeline_plan([0, 1, 3]), dp_plan(2)
    assert why_not_elastic(LaunchOptions(**flags), data_parallel) is None
    check_min_nodes(LaunchOptions(**flags), None)
    why = why_not_elastic(LaunchOptions(**flags), pipeline)
    assert why == why_not_rescalable(pipeline)
    with pytest.raises(InputError) as refused:
        check_min_nodes(LaunchOptions(**flags), why)
    assert str(refused.value) == f"--nnodes 1:2: going on without a node needs live rescaling: {why}"
    assert why_not_elastic(LaunchOptions(**flags, elastic=False), data_parallel) == "it was launched --no-elastic"
    assert why_not_elastic(LaunchOptions(**flags, elastic=False), pipeline) == f"{why}; it was launched --no-elastic"


def test_a_resumed_run_on_another_machine_names_its_plan_file(tmp_path):
    """A resume has no PLAN argument: the check that the plan's nodes are this machine names the
    run's plan file it read (it said ``.: placement: ...``), and a refused resume writes nothing
    (it left the next generation's copy of the plan behind)."""
    run = RunDir.create("r", root=tmp_path / "runs")
    save(placed(dp_plan(1), node="elsewhere"), run.plan)
    (run.checkpoints / "step000002").mkdir()
    torch.save({"model": {}, "step": 2}, run.checkpoints / "step000002" / "stage0.pt")
    result = CliRunner().invoke(
        app, ["launch", "--resume", "r", "--runs-root", str(tmp_path / "runs"), "--node-name", "here", "--steps", "5"]
    )
    assert result.exit_code == 2, result.output
    assert f"{run.plan}: placement: the plan runs on node(s) elsewhere but this machine is 'here'" in (
        " ".join(result.stderr.split())
    )
    assert not (run.path / "plan.1.yaml").exists(), "a refused resume leaves no generation of its own behind"


def test_a_launch_waiting_for_hand_started_agents_names_the_command_once_its_secret_exists(tmp_path):
    """What `felactl launch --rdzv-endpoint` says while the other nodes' agents are to be started
    by hand: the agent command with the run's secret file (written by then) and the node's name;
    nothing where the launch starts them itself."""
    from felactl.launcher.launch import _agents_to_start
    from felactl.launcher.prepare import LaunchOptions, job_plan, prepare_run

    plan = job_plan("examples.cnn:job", {}, 1, 16, None, nodes=("a", "b"))
    options = LaunchOptions(plan_path=None, rdzv_endpoint="a:29500", runs_root=tmp_path)
    run, _, _ = prepare_run(options, plan)
    said = _agents_to_start(options, plan.nodes(), "a", "10.0.0.1:29500", run, plan)
    assert run.secret.exists()
    assert f"--rdzv-endpoint 10.0.0.1:29500 --secret-file {run.secret} --node-name b" in said
    assert "examples.cnn:job must import there" in said
    import dataclasses

    assert _agents_to_start(dataclasses.replace(options, rdzv_endpoint=None), plan.nodes(), "a", "e", run, plan) is None


def test_job_nodes_named_twice_are_one_line():
    from typer.testing import CliRunner

    from felactl.cli.main import app

    done = CliRunner().invoke(
        app, ["launch", "--job", "examples.cnn:job", "--nproc-per-node", "1", "--global-batch", "8", "--nodes", "a,a"]
    )
    assert done.exit_code == 2 and "--nodes a,a: a node is named twice" in done.output, done.output
