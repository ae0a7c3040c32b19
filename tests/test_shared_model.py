"""A node's workers start with the model its zygote built once (felactl.agents.worker.shared_model):
the user's function runs once a node instead of once a worker, the forks train exactly what
workers that built their own would, and a build a fork could not share safely is not shared."""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path

import pytest
import torch
from _worker_helpers import dp_plan, final_params, pipeline_plan, reference_params, run_plan

from felactl.agents.worker import shared_model
from felactl.agents.worker.zygote import Zygote
from felactl.control.documents import WORKER_MODULE
from felactl.errors import WorkerFailed
from felactl.spec import ModelRef, save

TESTS = Path(__file__).parent
STEPS = 3


def _counted(plan, record: Path, leave: str = ""):
    source = "_user_models:counted_builds"
    return dataclasses.replace(
        plan, model=ModelRef(name="counted", source=source, config={"record": str(record), "leave": leave})
    )


def _builders(record: Path) -> list[int]:
    return [int(line) for line in record.read_text().split()]


def _run(tmp_path: Path, leave: str = "") -> tuple[list[int], torch.Tensor, torch.Tensor]:
    record = tmp_path / "builds"
    plan = _counted(pipeline_plan([0, 2, 3], 1, "1f1b"), record, leave)
    run_dir = run_plan(plan, tmp_path, STEPS, env={"PYTHONPATH": f"{TESTS}:{os.environ.get('PYTHONPATH', '')}"})
    got = torch.cat([final_params(run_dir, STEPS, stage=s) for s in range(2)])
    builders = _builders(record)
    record.write_text("")
    return builders, got, reference_params(plan, STEPS)


@pytest.mark.multiprocess
def test_a_pipelines_workers_share_one_build_of_the_model_and_train_it_exactly(tmp_path, monkeypatch):
    builders, got, want = _run(tmp_path)
    assert len(builders) == 1, builders  # was one a worker: each built the whole model
    assert (got - want).abs().max().item() < 1e-6
    monkeypatch.setenv("FELACTL_ZYGOTE", "0")
    exec_d, _, _ = _run(tmp_path / "exec")
    assert len(exec_d) == 2
    monkeypatch.setenv("FELACTL_ZYGOTE", "1")
    monkeypatch.setenv(shared_model.SWITCH, "0")  # the way out: forked, each building its own
    own, _, _ = _run(tmp_path / "own")
    assert len(own) == 2


@pytest.mark.multiprocess
@pytest.mark.parametrize("leave", ["file", "thread", "print", "memmap"])
def test_a_build_a_fork_cannot_share_is_each_workers_own_and_the_run_still_trains(tmp_path, leave):
    """An open file would share its offset between forks (a memory-mapped one, as np.memmap keeps
    it, is read through the map: shared); a thread is not copied by a fork (a lock it held stays
    held), so that zygote forks no more; a print must not garble the zygote's answers."""
    builders, got, want = _run(tmp_path, leave)
    assert (got - want).abs().max().item() < 1e-6
    expected = {"file": 3, "thread": 3, "print": 1, "memmap": 1}[leave]  # the zygote's build, then each worker's
    assert len(builders) == expected, builders


def test_only_a_plan_whose_workers_hold_part_of_the_model_builds_it_in_the_zygote():
    assert shared_model.worth_sharing(pipeline_plan([0, 2, 3], 1, "1f1b"))
    assert not shared_model.worth_sharing(dp_plan(2, "bsp"))  # each worker keeps it whole: one copy more


def test_a_worker_takes_the_zygotes_model_once_and_only_the_one_its_plan_trains(tmp_path, monkeypatch):
    plan = _counted(pipeline_plan([0, 2, 3], 1, "1f1b"), tmp_path / "builds")
    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.setattr(shared_model, "_built", None)
    shared_model.prepare({"FELACTL_PLAN": str(save(plan, tmp_path / "plan.yaml"))})
    shared_model.prepare({"FELACTL_PLAN": str(tmp_path / "plan.yaml")})  # built once
    assert len(_builders(tmp_path / "builds")) == 1
    other = dataclasses.replace(plan, training=dataclasses.replace(plan.training, seed=1))
    assert shared_model.take(other) is None
    bundle = shared_model.take(plan)
    assert bundle is not None and shared_model.take(plan) is None


@pytest.mark.multiprocess
def test_a_zygote_a_build_left_unable_to_fork_says_so_and_leaves_once_it_has_no_child(tmp_path):
    """It would otherwise hold what the build made (a thread here; a CUDA context on a GPU node)
    for as long as its agent runs, forking nothing."""
    plan = _counted(pipeline_plan([0, 2, 3], 1, "1f1b"), tmp_path / "builds", leave="thread")
    env = dict(os.environ, PYTHONPATH=f"{TESTS}:{os.environ.get('PYTHONPATH', '')}")
    zygote = Zygote(env)
    try:
        worker_env = dict(env, FELACTL_PLAN=str(save(plan, tmp_path / "plan.yaml")))
        with pytest.raises(OSError, match="started a thread, which a forked worker would lack"):
            zygote.start(WORKER_MODULE, worker_env, tmp_path / "worker.log")
        assert not zygote.serves([sys.executable, "-m", WORKER_MODULE], worker_env)  # the rest are exec'd
        assert zygote.proc.wait(timeout=10) == 0  # was: it stayed, forking nothing
    finally:
        zygote.close()


@pytest.fixture
def in_zygote(tmp_path, monkeypatch):
    """``prepare(leave)``: what the zygote does before it forks a worker of a two-stage plan of
    :func:`_user_models.counted_builds`, in this process; returns the plan."""
    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.setattr(shared_model, "_built", None)

    def prepare(leave: str = "", record: Path | None = None):
        plan = _counted(pipeline_plan([0, 2, 3], 1, "1f1b"), record or tmp_path / "builds", leave)
        shared_model.prepare({"FELACTL_PLAN": str(save(plan, tmp_path / "plan.yaml"))})
        return plan

    return prepare


def test_a_build_that_runs_over_its_budget_leaves_every_worker_to_build_its_own(in_zygote, monkeypatch):
    """The agent waits a bounded time for the zygote's answer: the zygote answers in time, and
    forks no more (the code it cut short left who knows what behind)."""
    monkeypatch.setattr(shared_model, "BUILD_BUDGET_S", 0.5)
    start = time.monotonic()
    with pytest.raises(shared_model.Unforkable, match=r"took over 0.5 s; each worker builds its own") as caught:
        in_zygote("slow")
    assert time.monotonic() - start < 10 and not caught.value.quiet


def test_the_zygote_says_which_file_a_build_left_open(in_zygote, tmp_path):
    with pytest.raises(shared_model.Unforkable) as caught:
        in_zygote("file")
    assert str(caught.value) == (
        f"building _user_models:counted_builds left {tmp_path / 'builds'} open, which forked workers would share"
    )


def test_a_build_that_raises_is_left_quietly_to_the_workers_to_report(in_zygote):
    """The zygote said "building it failed (InputError)" first, which read as the cause; the
    workers build it again and say what the user's function raised."""
    with pytest.raises(shared_model.Unforkable) as caught:
        in_zygote("raise")
    assert caught.value.quiet and shared_model._built is None


def test_what_a_build_does_to_the_environment_and_directory_is_done_in_the_worker_not_the_zygote(
    in_zygote, tmp_path, monkeypatch
):
    monkeypatch.delenv("COUNTED_BUILDS", raising=False)
    plan = in_zygote("environ")
    assert "COUNTED_BUILDS" not in os.environ  # the zygote's own environment is as it was
    assert shared_model.take(plan) is not None
    assert os.environ["COUNTED_BUILDS"] == "set by the build"  # as in a worker that built it


def test_a_builds_seeds_and_signal_handlers_stay_out_of_the_zygote(in_zygote):
    """A user's set_seed would otherwise hold in an exec'd worker and not in a fork (which reseeds
    its generators); a SIGCHLD ignored would leave the zygote unable to say how its children end."""
    import random
    import signal

    import numpy

    before = (random.getstate(), numpy.random.get_state()[1].copy(), signal.getsignal(signal.SIGCHLD))
    in_zygote("seed")
    in_zygote("signal")  # another model: dropped for it
    assert random.getstate() == before[0] and (numpy.random.get_state()[1] == before[1]).all()
    assert signal.getsignal(signal.SIGCHLD) == before[2]


def test_what_a_model_function_prints_goes_to_stderr_not_a_commands_json(tmp_path, monkeypatch, capsys):
    from felactl import models

    monkeypatch.syspath_prepend(str(TESTS))
    models.build("_user_models:counted_builds", {"record": str(tmp_path / "builds"), "leave": "print"})
    out, err = capsys.readouterr()
    assert out == "" and "building the model" in err


@pytest.mark.multiprocess
def test_a_failed_build_is_each_workers_to_report_and_the_zygote_says_nothing(tmp_path, capfd):
    record = tmp_path / "builds"
    plan = _counted(pipeline_plan([0, 2, 3], 1, "1f1b"), record, "raise")
    with pytest.raises(WorkerFailed, match="the user's own build error"):
        run_plan(plan, tmp_path, STEPS, env={"PYTHONPATH": f"{TESTS}:{os.environ.get('PYTHONPATH', '')}"})
    assert "zygote" not in capfd.readouterr().err


def test_what_a_models_module_prints_as_it_imports_goes_to_stderr_too(tmp_path, monkeypatch, capsys):
    """``felactl check --json`` of a plan of such a module printed the banner before its JSON."""
    from felactl import models

    (tmp_path / "banner_module.py").write_text("print('IMPORT-TIME BANNER')\n\ndef job():\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    models.check_source("banner_module:job", {})
    out, err = capsys.readouterr()
    assert out == "" and "IMPORT-TIME BANNER" in err
