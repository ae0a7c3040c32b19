"""How far ahead a member proposes to stop (a graceful stop's last step) or to switch (an elastic
job's new generation), without processes: a strategy's ``lead_steps`` travels from its ``end``
through :meth:`Trainer.end_step` to :class:`Drain`, and from ``generation_to_switch_to`` to the
membership. A lead too short lets a member that runs ahead pass the agreed step (a step lost, a
rescale that hangs); the multi-process tests see that only when a member happens to run that far
ahead, so the rule is pinned here (milliseconds, a fake store reader, a fake trainer)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from felactl.agents.worker import drain as drain_module
from felactl.agents.worker.drain import Drain
from felactl.agents.worker.engine import Trainer
from felactl.agents.worker.strategy import Lockstep, Strategy, Work
from felactl.agents.worker.sync import tokens as tokens_module
from felactl.agents.worker.sync.tokens import Tokens
from felactl.control.documents import LastStepDoc


class FakeReader:
    """The job's store as :class:`Drain` reads it: the first proposal stands, for everyone."""

    def __init__(self):
        self.agreed: dict | None = None
        self.proposals: list[int] = []

    def agree(self, key, kind, body):
        self.proposals.append(LastStepDoc.from_body(body).step)
        self.agreed = self.agreed or body
        return self.agreed

    def read(self, key, kind):
        return None if self.agreed is None else SimpleNamespace(body=self.agreed)


@pytest.fixture
def stop_asked(monkeypatch):
    """Asks for a graceful stop as the agent's SIGINT does (a fresh flag; pytest keeps its SIGINT)."""
    asked = threading.Event()
    monkeypatch.setattr(drain_module, "_asked", asked)
    monkeypatch.setattr(drain_module, "listen", lambda: None)
    return asked.set


class EndingTrainer:
    """A trainer faked around the real :meth:`Trainer.end_step` (no checkpoints, no replicas to
    sync): what a lockstep strategy's ``end`` reaches."""

    end_step = Trainer.end_step

    def __init__(self, reader: FakeReader):
        self.drain = Drain(reader)
        self.runtime = SimpleNamespace(cfg=SimpleNamespace(checkpoint_every=0, timeout_s=1.0))
        self.steps_done = self.data_position = 0

    def position_of(self, steps_done: int) -> int:
        return steps_done

    def sync_replicas(self, buffers_only: bool) -> None:
        pass


def _steps_until_stopped(strategy: Lockstep, ask_stop, first: int, stop_asked_at: int) -> int:
    """Run ``strategy.end`` after steps ``first, first + 1, ...``, ``ask_stop()`` just before the
    end of step ``stop_asked_at``; returns the last step (0-based) completed."""
    step = first
    while True:
        if step == stop_asked_at:
            ask_stop()
        if strategy.end(Work(step, [], step)):
            return step
        step += 1


def test_a_signalled_worker_proposes_its_steps_done_plus_the_lead_and_stops_there(stop_asked):
    reader = FakeReader()
    drain = Drain(reader)
    assert drain.last(5, lead_steps=3) is None and reader.proposals == [], "no stop asked: nothing proposed"
    stop_asked()
    assert drain.stop_after(5, lead_steps=3) is False and reader.proposals == [8]
    assert [drain.stop_after(n, lead_steps=3) for n in (6, 7, 8)] == [False, False, True]


def test_a_worker_not_yet_signalled_stops_at_the_step_another_proposed(stop_asked):
    reader = FakeReader()
    reader.agree("", "", LastStepDoc(9).to_body())
    drain = Drain(reader)
    assert [drain.stop_after(n, lead_steps=3) for n in (7, 8, 9)] == [False, False, True]
    assert reader.proposals == [9], "it proposes nothing itself"


def test_the_first_proposal_stands_whoever_proposes_later(stop_asked):
    reader = FakeReader()
    stop_asked()
    first, second = Drain(reader), Drain(reader)
    first.last(4, lead_steps=2)
    assert second.last(7, lead_steps=2) == 6 and reader.proposals == [6, 9]


def test_a_lockstep_strategy_hands_its_lead_through_the_trainer_to_the_drain(stop_asked):
    """``Lockstep.end`` after step ``s`` (``s + 1`` steps done) with a stop asked: the proposal
    is ``s + 1 + lead_steps``, and the run ends after that many steps."""
    reader = FakeReader()
    strategy = Lockstep(EndingTrainer(reader))
    strategy.lead_steps = 5
    assert _steps_until_stopped(strategy, stop_asked, first=0, stop_asked_at=3) == 3 + 5
    assert reader.proposals == [3 + 1 + 5]


def test_lockstep_strategies_look_two_steps_ahead(stop_asked):
    reader = FakeReader()
    assert _steps_until_stopped(Lockstep(EndingTrainer(reader)), stop_asked, first=2, stop_asked_at=4) == 4 + 2
    assert Strategy.lead_steps == 2


# --- tokens: members may run up to ``max_lag`` iterations ahead -------------------------------
def _tokens(trainer, num_workers: int) -> Tokens:
    """A real :class:`Tokens` of rank 0 in a stage of ``num_workers``, built on fakes (no group,
    no store traffic: the bucket's store is touched only once a step runs)."""
    stage = SimpleNamespace(micro_batch=2, workers=[SimpleNamespace(share=1 / num_workers)] * num_workers)
    trainer.placement = SimpleNamespace(stage=0, stage_ranks=tuple(range(num_workers)))
    trainer.plan = SimpleNamespace(
        stages=[stage], global_batch=8, sync=SimpleNamespace(token_policy="ads+hf", use_trees=False)
    )
    trainer.runtime.__dict__.update(group=lambda ranks: None, store=None, rank=0, forms_member_groups=True)
    trainer.params = [torch.nn.Parameter(torch.zeros(4))]
    trainer.membership = SimpleNamespace(members_changed=lambda: False)
    return Tokens(trainer)


@pytest.mark.parametrize(
    "num_workers,lag_cap,max_lag",
    [(1, tokens_module.MAX_LAG, 0), (2, tokens_module.MAX_LAG, tokens_module.MAX_LAG), (2, 3, 3)],
    ids=["one-worker-no-gate", "small-model-max-lag", "max-lag-3"],
)
def test_tokens_look_max_lag_plus_two_steps_ahead_to_stop_and_to_switch(
    stop_asked, monkeypatch, num_workers, lag_cap, max_lag
):
    """Tokens' rule: ``lead_steps = max_lag + Strategy.lead_steps``, that is ``max_lag + 2``.
    A member begins iteration ``t`` once everyone finished ``t - max_lag``: when the slowest
    proposes with ``d`` steps done, another may have ``d + max_lag`` done and complete one more
    before it reads the proposal, so the agreed step must be at least ``d + max_lag + 1`` (two
    past ``max_lag`` leaves a step to spare, as in lockstep). A graceful stop asked at the end of
    step ``s`` (0-based, ``s + 1`` done) proposes ``s + 1 + max_lag + 2``; a switch is proposed
    ``max_lag + 2`` past the step the membership is at (it adds the lead it is handed:
    :meth:`MembershipView.switch_at_agreed_step`)."""
    monkeypatch.setattr(tokens_module, "MAX_LAG", lag_cap)
    reader = FakeReader()
    strategy = _tokens(EndingTrainer(reader), num_workers)
    assert strategy.bucket.max_lag == max_lag
    assert strategy.lead_steps == max_lag + 2

    s = 4
    assert _steps_until_stopped(strategy, stop_asked, first=0, stop_asked_at=s) == s + max_lag + 2
    assert reader.proposals == [s + 1 + max_lag + 2]

    leads = []
    strategy.generation_to_switch_to(SimpleNamespace(switch_at_agreed_step=leads.append))
    assert leads == [max_lag + 2]


def test_workers_at_their_own_pace_learn_of_a_stop_through_the_store(stop_asked):
    """A mode at its own pace stops claiming once anyone asked; the signalled worker still
    proposes, so that one whose agent has not signalled it yet learns of the stop."""
    reader = FakeReader()
    signalled, not_yet = Drain(reader), Drain(reader)
    assert not signalled.requested() and not not_yet.requested()
    stop_asked()
    assert signalled.requested() and reader.proposals == [0]
    drain_module._asked.clear()
    assert not_yet.requested()
