"""The one table of sync modes (felactl.spec.sync_modes) and everything that must agree with it: a
mode added in one place and not the others fails here, whichever place it was.

Checked against the table: the ``SyncMode`` enum, the worker's strategy classes (a class for
exactly the executions a row allows, at its own pace exactly where the row says so), ``felactl
check``'s rules, the shapes the planner plans, the CLI's ``--sync`` help and README's table."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType

import pytest
from planner_fixtures import random_instance
from test_executable import _plan
from typer.testing import CliRunner

from felactl.agents.worker.strategies import STRATEGIES
from felactl.agents.worker.strategy import AtOwnPace, Lockstep
from felactl.cli.main import app
from felactl.optimizer.planner import make_plan
from felactl.spec import DeviceKind, Placement, Schedule, SyncMode, check_executable, sync_modes
from felactl.spec.executable import execution, problems
from felactl.spec.sync_modes import (
    SYNC_MODE_SUPPORT,
    Execution,
    SyncModeSupport,
    rescalable_mode_names,
    sync_support,
)

README = Path(__file__).parent.parent / "README.md"


def test_every_sync_mode_has_one_row():
    assert list(SYNC_MODE_SUPPORT) == list(SyncMode), "a SyncMode without a row in felactl/spec/sync_modes.py"
    assert all(row.mode is mode for mode, row in SYNC_MODE_SUPPORT.items())


def test_a_row_plans_a_shape_it_runs():
    with pytest.raises(ValueError, match="planned as pipeline, which it does not run"):
        replace(sync_support(SyncMode.SDPIPE), executions=frozenset({Execution.DATA_PARALLEL}))


def test_the_worker_has_a_strategy_for_exactly_what_the_rows_allow():
    allowed = {(how, mode) for mode, row in SYNC_MODE_SUPPORT.items() for how in row.executions}
    assert set(STRATEGIES) - allowed == set(), "a strategy for a pair felactl check refuses"
    assert allowed - set(STRATEGIES) == set(), "a pair felactl check lets through that no strategy runs"


@pytest.mark.parametrize("pair", sorted(STRATEGIES, key=str), ids=lambda p: f"{p[0].value}-{p[1].value}")
def test_a_strategy_goes_at_its_own_pace_where_its_row_settles_on_rescale(pair):
    cls, row = STRATEGIES[pair], sync_support(pair[1])
    assert issubclass(cls, AtOwnPace) is row.at_own_pace, cls
    assert issubclass(cls, Lockstep) is not row.at_own_pace, cls


def _plan_of(how: Execution, mode: SyncMode):
    if how is Execution.DATA_PARALLEL:
        return _plan([(0, 3, 8, [0, 1])], 2, sync=mode)
    if how is Execution.SHARDED:
        plan = _plan([(0, 3, 8, [0, 1])], 2, sync=mode)
        return replace(plan, stages=(replace(plan.stages[0], shard=True),))
    if how is Execution.FLEXIBLE:
        return _plan([(0, 1, 4, [0, 1]), (1, 2, 8, [1]), (2, 3, 16, [0])], 2, global_batch=48, sync=mode)
    return _plan(
        [(0, 1, 4, [0, 1]), (1, 3, 4, [2, 3])],
        4,
        schedule=Schedule.ONE_F_ONE_B,
        pipelines=(("d0", "d2"), ("d1", "d3")),
        sync=mode,
    )


@pytest.mark.parametrize("mode", list(SyncMode), ids=lambda m: m.value)
@pytest.mark.parametrize("how", list(Execution), ids=lambda e: e.value)
def test_check_refuses_exactly_the_executions_a_row_does_not_run(how, mode):
    plan = _plan_of(how, mode)
    assert execution(plan) is how
    keys = [p.key for p in problems(plan, [1, 1, 1])]
    assert keys == ([] if how in sync_support(mode).executions else ["sync.mode"])


def test_check_refuses_gpus_where_a_row_runs_on_cpu_slots_only(monkeypatch):
    plan = _plan_of(Execution.DATA_PARALLEL, SyncMode.BSP)
    on_gpus = replace(
        plan,
        placement=tuple(
            Placement(device=d, node="n", kind=DeviceKind.CUDA, local_index=i) for i, d in enumerate(plan.devices)
        ),
    )
    assert problems(on_gpus) == [] and sync_support(SyncMode.BSP).runs_on_gpus
    rows = dict(SYNC_MODE_SUPPORT) | {SyncMode.BSP: replace(sync_support(SyncMode.BSP), runs_on_gpus=False)}
    monkeypatch.setattr(sync_modes, "SYNC_MODE_SUPPORT", MappingProxyType(rows))
    assert [p.key for p in problems(on_gpus)] == ["sync.mode"]
    assert "runs on CPU slots (gloo) only" in problems(on_gpus)[0].reason
    assert problems(plan) == [], "on CPU slots it runs"


@pytest.mark.parametrize(
    ("live", "named"), [({SyncMode.TOKENS}, "tokens"), ({SyncMode.BSP, SyncMode.SDPIPE}, "bsp or sdpipe")]
)
def test_rescale_messages_name_the_rows_that_rescale_live(monkeypatch, live, named):
    rows = {mode: replace(row, rescales_live=mode in live) for mode, row in SYNC_MODE_SUPPORT.items()}
    monkeypatch.setattr(sync_modes, "SYNC_MODE_SUPPORT", MappingProxyType(rows))
    assert rescalable_mode_names() == named


@pytest.mark.parametrize("mode", list(SyncMode), ids=lambda m: m.value)
def test_the_planner_plans_the_shape_of_the_row(mode):
    cluster, model, global_batch = random_instance(7)
    plan = make_plan(cluster, model, global_batch, sync=mode.value, time_limit_s=10, max_stages=3)
    check_executable(plan)
    row = sync_support(mode)
    assert execution(plan) in row.executions
    if row.planned_as is Execution.DATA_PARALLEL:
        assert len(plan.stages) == 1
    expected = Schedule.ONE_F_ONE_B if row.planned_as is Execution.PIPELINE else Schedule.TOKENS
    assert plan.schedule is expected


@pytest.mark.parametrize("command", [["plan", "--help"], ["launch", "--help"]], ids=lambda c: c[0])
def test_the_sync_help_names_every_mode(command):
    result = CliRunner().invoke(app, command, env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    unwrapped = re.sub(r"-\n\s*", "-", result.output)  # a line broken after a hyphen ("micro-\nbatches")
    text = " ".join(unwrapped.split())  # the words, without the wrapping
    for mode, row in SYNC_MODE_SUPPORT.items():
        assert f"{mode.value}: {row.summary}" in text, mode


EXECUTION_WORDS = {
    Execution.DATA_PARALLEL: "data parallel",
    Execution.FLEXIBLE: "flexible hybrid",
    Execution.PIPELINE: "static pipelines",
    Execution.SHARDED: "sharded stages",
}


def _readme_tables() -> list[list[list[str]]]:
    """The tables of README's "Sync modes" section: each a list of rows of cells, after its header."""
    section = README.read_text().split("## Sync modes", 1)[1].split("\n## ", 1)[0]
    tables = [block for block in section.split("\n\n") if block.lstrip().startswith("|")]
    return [
        [[c.strip() for c in line.strip().strip("|").split("|")] for line in t.strip().splitlines()[2:]] for t in tables
    ]


def test_readme_describes_every_mode_as_its_row_does():
    what, support = _readme_tables()
    assert [r[0] for r in what] == [f"`{m.value}`" for m in SyncMode]
    assert [r[0] for r in support] == [f"`{m.value}`" for m in SyncMode]
    for (_, runs, planned, trees, rescaling, gpus), row in zip(support, SYNC_MODE_SUPPORT.values(), strict=True):
        assert {e for e, words in EXECUTION_WORDS.items() if words in runs} == row.executions, row.mode
        assert EXECUTION_WORDS[row.planned_as] in planned, row.mode
        assert (trees, gpus) == ("yes" if row.sums_over_trees else "no", "yes" if row.runs_on_gpus else "no")
        assert ("settle" in rescaling) is row.at_own_pace and (rescaling != "no") is row.rescales_live


def test_rows_are_frozen():
    with pytest.raises(AttributeError):
        sync_support(SyncMode.BSP).rescales_live = False  # type: ignore[misc]
    assert isinstance(sync_support(SyncMode.BSP), SyncModeSupport)
