"""The prediction a plan records is the schedule it runs (issue 30, item 10): the in-flight limit
a plan imposes for memory is priced (ILP and cost model), is no lower than memory needs, and a
plan whose simulator disagrees with its prediction by more than 10% says so."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from felactl.cli.main import app
from felactl.optimizer import ilp
from felactl.optimizer.cost import CostModel
from felactl.optimizer.evaluate import StageChoice, held_terms, predict
from felactl.optimizer.planner import _as_simulated, _Candidate, make_plan
from felactl.optimizer.search import best_by_enumeration
from felactl.optimizer.simulator import SimResult
from felactl.optimizer.space import build_space
from felactl.spec import ModelSpec, load_cluster, save
from tests.planner_fixtures import fast_feeds_slow, gpt2xl_like, model, tight_instance

ROOT = Path(__file__).resolve().parents[1]


def _binding(plan) -> list[int]:
    """The stages, not last, whose in-flight limit is below the tokens one of their workers runs."""
    return [
        s
        for s, st in enumerate(plan.stages[:-1])
        if st.max_in_flight is not None
        and any(math.ceil(w.share * plan.global_batch / st.micro_batch) > st.max_in_flight for w in st.workers)
    ]


def test_a_pipeline_its_in_flight_limit_holds_back_is_priced_as_it_runs():
    # The fast device has room for 4 micro-batches of 4 beside its 9.6 GB of weights; each round
    # of 4 waits for the slow stage: priced without the limit, 1.25 s predicted ran 1.51 s.
    spec, net = fast_feeds_slow(40_000_000)
    plan = make_plan(spec, net, 64)
    assert len(plan.stages) >= 2 and _binding(plan)
    predicted = plan.predicted
    assert predicted.simulated_iteration_s == pytest.approx(predicted.iteration_s, rel=0.10)
    assert predicted.simulation_agrees


def test_no_in_flight_limit_where_memory_holds_every_micro_batch():
    # The same pipeline with small activations: memory holds all 16 micro-batches of the fast
    # stage, so no limit; the default of 4 ran it 1.3x slower than its prediction.
    spec, net = fast_feeds_slow(1_000_000)
    plan = make_plan(spec, net, 64)
    assert len(plan.stages) >= 2
    assert [st.max_in_flight for st in plan.stages] == [None] * len(plan.stages)
    assert plan.predicted.simulated_iteration_s == pytest.approx(plan.predicted.iteration_s, rel=0.10)


def test_the_ilp_prices_the_in_flight_limit_exactly_as_the_cost_model():
    # Four slow devices at 2.5 TFLOP/s: at micro-batch 2 the fast device's limit of 4 sets the
    # pace (the ILP without it took micro-batch 2 at 0.42 s, which the cost model prices 0.56 s).
    spec, net = fast_feeds_slow(1_000_000)
    cost = CostModel(spec, net, use_trees=False)
    pruned = build_space(cost, 32, max_stages=3, max_micro_batches=3)
    full = build_space(cost, 32, max_stages=3, max_micro_batches=3, prune=False, groups=pruned.groups)
    solution = ilp.solve(pruned)
    oracle_s, _ = best_by_enumeration(full)
    assert solution.objective_s == pytest.approx(oracle_s, rel=1e-6)
    prediction = predict(cost, tuple(o.choice for o in solution.options), 32, 3)
    assert prediction.iteration_s == pytest.approx(solution.objective_s, rel=1e-6)
    assert prediction.held_s == pytest.approx(prediction.iteration_s, rel=1e-6)  # the limit sets the pace


@dataclass(frozen=True)
class _ConstantCosts:
    """Made-up costs: one micro-batch's forward and backward take ``fwd_s`` and ``bwd_s`` on any
    device; fetches, the runtime's work around a token, the sync and the optimizer step nothing."""

    model: ModelSpec
    fwd_s: float
    bwd_s: float

    def stage_times_s(self, start, end, device, micro_batch):
        return self.fwd_s, self.bwd_s

    def tokens_per_micro_batch(self, start, end):
        return 1

    def token_overhead_s(self, device):
        return 0.0

    def claim_s(self, start, end, device, server=None):
        return 0.0

    def mean_fetch_s(self, device, num_bytes):
        return 0.0

    def exposed_sync_s(self, devices, start, end, device, micro_batch):
        return 0.0

    def optimizer_step_s(self, start, end, device):
        return 0.0


def test_a_held_worker_runs_each_backward_once_though_its_last_round_is_short():
    # 8 tokens of micro-batch 1 under a limit of 7: a round of 7 and a round of 1. Each round
    # waits on its first forward's trip through the later stages (held_terms' rounds); the worker
    # runs 8 backwards, not a full round's 7 in both rounds (14 of them: 142 s).
    cost = _ConstantCosts(model=model([(1000, 100, 1e6)] * 2), fwd_s=1.0, bwd_s=10.0)
    stage = StageChoice(0, 1, 1, (("d", 1.0),))
    assert held_terms(cost, stage, "d", 8, 7, next_micro_batch=1) == (2, pytest.approx(2 * 1.0 + 8 * 10.0))
    # A next stage of micro-batch 2 takes two at once: 6 out at a time, rounds of 6 and 2, each
    # waiting on a group of 2 forwards.
    assert held_terms(cost, stage, "d", 8, 7, next_micro_batch=2) == (2, pytest.approx(2 * 2 * 1.0 + 8 * 10.0))
    # Whole rounds (14 tokens, 2 rounds of 7) as before; a limit that holds every token binds nothing.
    assert held_terms(cost, stage, "d", 14, 7, next_micro_batch=1) == (2, pytest.approx(2 * 1.0 + 14 * 10.0))
    assert held_terms(cost, stage, "d", 7, 7, next_micro_batch=1) is None


def _candidate(solved: str, iteration_s: float, simulated_s: float, *, held: bool) -> _Candidate:
    """A candidate of made-up times (``solution``: which solve it came from)."""
    simulation = SimResult(iteration_s=simulated_s, intervals=())
    return _Candidate(solved, (), None, None, iteration_s, held, simulation)


@pytest.mark.parametrize(
    ("simulated_s", "solves", "kept"),
    [(0.7, ["held"], "held"), (1.05, ["held"], "held"), (1.3, ["held", "unheld"], "unheld")],
)
def test_only_a_held_plan_simulated_slower_than_priced_is_solved_again_unheld(simulated_s, solves, kept):
    # A plan an in-flight limit holds back, priced 1 s; the best plan no limit holds back is priced
    # and simulated 1.2 s. Simulated 30% faster than priced, the held plan is kept without the
    # second solve: the unheld plan's price, no less than the held one's (the optimum over fewer
    # options), is what it runs, so it cannot win. Within 10%, kept as well; 30% slower, the
    # unheld plan is solved and, simulated faster, kept.
    calls = []

    def solve(unheld: bool = False) -> str:
        calls.append("unheld" if unheld else "held")
        return calls[-1]

    def candidate(solved: str) -> _Candidate:
        if solved == "held":
            return _candidate(solved, 1.0, simulated_s, held=True)
        return _candidate(solved, 1.2, 1.2, held=False)

    chosen = _as_simulated(solve, candidate, lambda _msg: None)
    assert calls == solves
    assert chosen.solution == kept


@pytest.mark.slow
def test_the_issue_36_gpu_plan_is_priced_as_it_runs():
    """GPT-2-XL-like on 36 H100 / A10G / L4 GPUs, global batch 512: the plan predicted 6.99 s
    and simulated 9.89 s (in-flight limit 4 unpriced)."""
    plan = make_plan(load_cluster(ROOT / "plans" / "clusters" / "h100-a10g-l4.yaml"), gpt2xl_like(), 512)
    assert plan.predicted.simulated_iteration_s == pytest.approx(plan.predicted.iteration_s, rel=0.10)


def test_a_plan_whose_simulation_disagrees_says_so(tmp_path):
    spec, net, batch = tight_instance(13)  # a pipeline whose fill the cost model overprices
    save(spec, tmp_path / "c.yaml")
    save(net, tmp_path / "m.yaml")
    args = ["plan", "--cluster", str(tmp_path / "c.yaml"), "--model", str(tmp_path / "m.yaml")]
    args += ["--global-batch", str(batch)]
    result = CliRunner().invoke(app, args + ["--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert abs(data["simulated_iteration_s"] / data["iteration_s"] - 1) > 0.10
    assert data["simulation_agrees"] is False
    shown = CliRunner().invoke(app, args)
    assert shown.exit_code == 0, shown.output
    assert "warning: the simulated iteration is" in " ".join(shown.output.split())
