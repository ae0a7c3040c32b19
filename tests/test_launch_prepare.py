"""A plan's launch before anything starts, without processes: what every worker is told, and the
checks of the plan against the flags and this machine."""

from __future__ import annotations

from felactl.launcher.launch import worker_env
from felactl.launcher.prepare import LaunchOptions
from felactl.launcher.rundir import RunDir


def test_workers_are_told_nothing_their_plan_says(tmp_path):
    """The plan is each worker's one source for its sync mode, batch, stages and backend: the
    environment carries where the plan is, not a copy of what is in it."""
    run = RunDir.create("r", root=tmp_path)
    env = worker_env(LaunchOptions(plan_path=tmp_path / "plan.yaml", runs_root=tmp_path), run, "127.0.0.1:1")
    assert env["FELACTL_PLAN"] == str(run.plan.resolve())
    assert not {"FELACTL_BACKEND", "FELACTL_SYNC"} & set(env)
