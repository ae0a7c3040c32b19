"""Fela's flexible hybrid on real workers: sub-models with their own micro-batches and worker sets,
driven by the token server; the parameters still equal single-process training (BSP semantics)."""

from __future__ import annotations

import pytest
import torch
from _worker_helpers import final_params, hybrid_plan, metrics, reference_params, run_plan

from felactl.agents.worker.flexible import make_dag, token_weights
from felactl.errors import InputError
from felactl.spec import check_executable

STEPS = 3


def test_weights_and_dag_from_the_plan():
    plan = hybrid_plan([(0, 1, 4, [0, 1]), (1, 2, 8, [0, 1]), (2, 3, 16, [1])], 2, global_batch=48)
    assert token_weights(plan) == (1, 2, 4)
    dag = make_dag(plan)
    assert (dag.num_first, [dag.count(i) for i in range(3)]) == (12, [12, 6, 3])
    with pytest.raises(InputError, match="multiple"):
        check_executable(hybrid_plan([(0, 2, 4, [0]), (2, 3, 6, [0])], 1))


def _params(run_dir, num_stages: int) -> torch.Tensor:
    return torch.cat([final_params(run_dir, STEPS, s) for s in range(num_stages)])


@pytest.mark.multiprocess
def test_ctd_fc_on_one_worker_matches_single_process(tmp_path):
    plan = hybrid_plan([(0, 2, 4, [0, 1, 2]), (2, 3, 8, [2])], 3)
    run_dir = run_plan(plan, tmp_path, STEPS)
    assert (_params(run_dir, 2) - reference_params(plan, STEPS)).abs().max().item() < 1e-5
    records = metrics(run_dir)
    for step in range(STEPS):
        at_step = [r for r in records if r["step"] == step]
        assert sum(r["samples"] for r in at_step) == 32
        assert sum(r["tokens"] for r in at_step) == 2 * (8 + 4)
        assert [r["rank"] for r in at_step if r["loss"] is not None] == [2], "only worker 2 runs the last sub-model"


@pytest.mark.multiprocess
def test_three_levels_with_a_slow_worker_match_single_process(tmp_path):
    plan = hybrid_plan(
        [(0, 1, 32, [0, 1]), (1, 2, 64, [0, 1]), (2, 3, 128, [0, 1])],
        2,
        global_batch=256,
        config={"input_dim": 512, "hidden": 1024, "depth": 2},
    )
    run_dir = run_plan(plan, tmp_path, STEPS, env={"FELACTL_SLOWDOWN": "0=3"})
    assert (_params(run_dir, 3) - reference_params(plan, STEPS)).abs().max().item() < 1e-5
    records = metrics(run_dir)
    tokens = {rank: sum(r["tokens"] for r in records if r["rank"] == rank) for rank in (0, 1)}
    assert tokens[0] + tokens[1] == STEPS * 2 * (8 + 4 + 2)
    assert tokens[1] > tokens[0], f"the fast worker pulls more tokens: {tokens}"
    assert sum(r["recomputed"] for r in records if r["rank"] == 1) > 0, "it took backward tokens of the straggler"
