"""Stepping together (felactl.agents.worker.survivors.StepCommit) on a real TCPStore, no processes:
nobody steps a step before every worker summed it, the store keeps no key of a step everyone is
past, and a worker waiting to step stops once another of its attempt failed. (The failure itself,
with processes: tests/test_restarts.py.)"""

from __future__ import annotations

import itertools
import threading
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from _worker_helpers import pipeline_plan
from torch import nn

from felactl.agents.worker.checkpoint import checkpoint_path
from felactl.agents.worker.survivors import GIVEN_UP, KeptState, StepCommit, leave_state
from felactl.agents.worker.waits import Waits
from felactl.control import keys
from felactl.control.store import generation_store
from felactl.errors import AnotherWorkerFailed


class _Worker(Waits):
    """What StepCommit asks of a trainer: its store, the job's size, its plan, and the trainer's own
    waits (:class:`~felactl.agents.worker.waits.Waits`)."""

    def __init__(self, store: dist.Store, worker_id: int, world: int, plan):
        self.runtime = SimpleNamespace(store=store, world_size=world, cfg=SimpleNamespace(timeout_s=30.0))
        self.plan, self.worker_id = plan, worker_id
        self.membership = SimpleNamespace(members_changed=lambda: False)


def _worker(store: dist.Store, worker_id: int, world: int = 2, plan=None) -> _Worker:
    return _Worker(store, worker_id, world, plan or pipeline_plan([0, 2, 3], num_replicas=2))


@pytest.fixture
def client():
    """A new connection to one attempt's store (a worker process has its own)."""
    server = dist.TCPStore("127.0.0.1", 0, 1, True)
    return lambda: dist.PrefixStore("gen1", dist.TCPStore("127.0.0.1", server.port, 1, False))


def test_nobody_steps_before_every_worker_summed_and_the_keys_of_a_step_everyone_is_past_are_deleted(client):
    first, last = StepCommit(_worker(client(), 0)), StepCommit(_worker(client(), 1))
    for step in range(3):
        stepped: list[float] = []
        waiter = threading.Thread(target=lambda at=step, out=stepped: out.append(first.agree(at)))
        waiter.start()
        time.sleep(0.3)
        assert waiter.is_alive() and not stepped, "the first to sum waits for the other"
        last.agree(step)
        waiter.join(5)
        assert stepped and not waiter.is_alive()
    store = client()
    assert store.check([keys.step_committed(2)]) and store.check([keys.step_committed(1)])
    assert not store.check([keys.step_commit(0)]) and not store.check([keys.step_committed(0)])


def test_a_worker_waiting_to_step_stops_once_another_of_its_attempt_failed(client):
    waiting = StepCommit(_worker(client(), 0, world=3))
    store = client()
    store.add(keys.step_commit(7), 1)  # one more has summed; the third died before it
    raised = []

    def agree() -> None:
        try:
            waiting.agree(7)
        except AnotherWorkerFailed as exc:
            raised.append(exc)

    thread = threading.Thread(target=agree)
    thread.start()
    time.sleep(0.3)
    assert thread.is_alive()
    store.set(keys.ATTEMPT_FAILED, "1")  # a failing worker's word, or the launcher's
    thread.join(5)
    assert not thread.is_alive() and raised, "it stopped waiting"
    assert store.get(keys.step_committed(7)) == GIVEN_UP, "and it gave the step up for everyone"


def test_a_step_given_up_by_a_waiter_is_stepped_by_nobody_though_the_last_then_sums_it(client):
    """Worker 2 summed step 3 and was killed waiting; worker 0, waiting too, sees the failure and
    gives the step up; worker 1, slower, then sums it last: it must not step either (the first to
    decide decides for everyone), or the survivors' states would be a step apart."""
    store = client()
    store.add(keys.step_commit(3), 1)  # worker 2, dead now
    store.set(keys.ATTEMPT_FAILED, "1")
    with pytest.raises(AnotherWorkerFailed):
        StepCommit(_worker(client(), 0, world=3)).agree(3)  # gives it up
    with pytest.raises(AnotherWorkerFailed, match="step 3 is given up"):
        StepCommit(_worker(client(), 1, world=3)).agree(3)


def test_a_waiter_that_learns_of_a_failure_after_the_last_summed_steps_with_everyone(client):
    store = client()
    store.add(keys.step_commit(5), 1)
    waiting = StepCommit(_worker(client(), 0, world=3))
    done = []
    thread = threading.Thread(target=lambda: done.append(waiting.agree(5)))
    thread.start()
    time.sleep(0.1)
    StepCommit(_worker(client(), 1, world=3)).agree(5)  # the last to sum it: everyone steps
    store.set(keys.ATTEMPT_FAILED, "1")  # and then a worker fails
    thread.join(5)
    assert done, "the step was decided before the failure: it is stepped"


class _Stage(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear, self.norm = nn.Linear(4, 4), nn.BatchNorm1d(4)

    def forward(self, x):
        return self.norm(self.linear(x))


def _trainer_with_one_stage(client, run_dir):
    """A stand-in trainer holding stage 0 of a 2 x 2 pipeline, with a batch norm; what it writes
    is recorded."""
    torch.manual_seed(0)
    module = _Stage()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    trainer = _worker(client(), 0, world=1)
    trainer.parts = [SimpleNamespace(stage=0, module=module, optimizer=optimizer)]
    trainer.steps_done, trainer.runtime.cfg.run_dir = 0, run_dir
    trainer.written = []
    trainer.write_checkpoint = lambda part, state, steps, **extra: trainer.written.append((part.stage, state, steps))

    def optimizer_step():
        optimizer.step()
        optimizer.zero_grad()

    trainer.optimizer_step = optimizer_step
    return trainer, module


def _train_a_step(module):
    module(torch.randn(8, 4)).square().mean().backward()


def test_the_state_left_is_the_committed_steps_buffers_included(client, tmp_path):
    """A batch norm's running statistics move in the forwards of the step that then fails; the
    state left for the restart, which trains that step again, has them as the last step left them."""
    trainer, module = _trainer_with_one_stage(client, tmp_path)
    kept = KeptState(trainer)
    _train_a_step(module)
    kept.optimizer_step(0)
    committed = module.norm.running_mean.clone()
    _train_a_step(module)  # step 1's forward moves the statistics; then the step fails
    assert not torch.equal(module.norm.running_mean, committed)
    leave_state(trainer, SimpleNamespace(kept_state=lambda: kept))
    ((stage, (model_state, _), steps),) = trainer.written
    assert (stage, steps) == (0, 1)
    assert torch.equal(model_state["norm.running_mean"], committed)
    assert trainer.runtime.store.check([keys.ATTEMPT_FAILED]), "the others stop waiting"


def test_a_stage_the_regular_checkpoint_of_that_step_holds_is_not_written_again(client, tmp_path):
    trainer, module = _trainer_with_one_stage(client, tmp_path)
    kept = KeptState(trainer)
    _train_a_step(module)
    kept.optimizer_step(0)
    checkpoint_path(tmp_path, 1, 0).parent.mkdir(parents=True)
    checkpoint_path(tmp_path, 1, 0).write_bytes(b"step 1's regular checkpoint of stage 0")
    leave_state(trainer, SimpleNamespace(kept_state=lambda: kept))
    assert trainer.written == []


def test_an_agent_still_ending_past_its_time_is_lost_with_its_node(monkeypatch):
    """After a failure the launcher waits for each agent's report of how its workers ended; one
    that said its workers were still ending (writing their state) and then was heard of no more
    is gone with its node, as one never heard of is: the next attempt must not count on it."""
    from felactl.launcher import restarts

    monkeypatch.setattr(restarts, "LOST_AFTER_S", 0.2)
    monkeypatch.setattr(restarts, "KEEP_STATE_S", 0.4)
    reports = {
        "a": {"attempt": 0, "state": "failed", "ending": True},  # and then its node died
        "b": {"attempt": 0, "state": "stopped"},
        "c": None,  # never heard of
    }
    coordinator = SimpleNamespace(
        prefix="felactl/j/0/",
        store=dist.TCPStore("127.0.0.1", 0, 1, True),
        publish=lambda *args, **kwargs: None,
        agent_state=reports.get,
        agent_beat=lambda agent_id: None,  # no beats seen: each wait runs to its deadline
    )
    members = [SimpleNamespace(agent_id=a, node_name=f"node-{a}") for a in reports]
    state = SimpleNamespace(plan=pipeline_plan([0, 2, 3], num_replicas=2), members=members)
    job = restarts.Restarts(coordinator, state, None, {}, None, 3, 10, None, {}, None)
    assert job._lost_nodes(0) == ["node-a", "node-c"]
    # and it told the attempt's workers, where they look (a worker waiting to step stops waiting)
    workers = generation_store(coordinator.store, coordinator.prefix, 0)
    assert workers.check([keys.ATTEMPT_FAILED])


def test_an_agent_told_to_give_its_workers_time_says_they_are_ending():
    """The restart's stop after a failure gives the workers time to write their state (drain_s): an
    agent that takes it says at once that its workers are ending, so that the launcher waits for
    them past LOST_AFTER_S instead of taking its node as lost. A plain stop says nothing."""
    from felactl.agents.node import _superseded
    from felactl.agents.session import StopOrder

    said = []
    session = SimpleNamespace(
        attempt_published=lambda attempt: False,
        attempt_stopped=lambda attempt: order,
        report=lambda state, **details: said.append((state, details)),
    )
    assignment = SimpleNamespace(attempt=2, more_may_follow=True)
    order = StopOrder("restart", 20.0)
    assert _superseded(session, assignment) is order
    assert said == [("healthy", {"attempt": 2, "ending": True})]
    said.clear()
    order = StopOrder("restart", 0.0)
    assert _superseded(session, assignment) is order and said == []


def test_an_agent_whose_beat_stopped_is_lost_at_once_and_one_that_beats_is_waited_for(monkeypatch):
    """An agent beats from a thread of its own (``AgentSession.beating``), busy or not: after a
    failure, one whose beat stopped is gone with its node within :data:`SILENT_S`, not after
    :data:`LOST_AFTER_S` (a node's loss paused a restart 10 s); one that beats on is waited for
    until it reports, however long its workers take to stop."""
    from felactl.launcher import restarts

    monkeypatch.setattr(restarts, "LOST_AFTER_S", 30.0)
    monkeypatch.setattr(restarts, "SILENT_S", 0.3)
    start = time.monotonic()
    beats = {"a": itertools.repeat("7"), "b": itertools.count()}  # a's node died; b beats on
    coordinator = SimpleNamespace(
        prefix="felactl/j/0/",
        store=dist.TCPStore("127.0.0.1", 0, 1, True),
        publish=lambda *args, **kwargs: None,
        agent_state=lambda a: {"attempt": 0, "state": "stopped"} if a == "b" and time.monotonic() > start + 1 else None,
        agent_beat=lambda a: str(next(beats[a])),
    )
    members = [SimpleNamespace(agent_id=a, node_name=f"node-{a}") for a in beats]
    state = SimpleNamespace(plan=pipeline_plan([0, 2, 3], num_replicas=1), members=members)
    job = restarts.Restarts(coordinator, state, None, {}, None, 3, 10, None, {}, None)
    assert job._lost_nodes(0) == ["node-a"]
    assert 1 < time.monotonic() - start < 10


def test_a_silence_that_the_launcher_itself_slept_through_is_not_the_agents():
    """The launcher process stalled (swapped out, say): the beats it did not see in that time
    were not missing; an agent is silent only over time the launcher was looking."""
    from felactl.launcher.restarts import SILENT_S, _BeatWatch

    now = [0.0]
    watch = _BeatWatch(lambda agent_id: "7", clock=lambda: now[0])
    for now[0] in (0.0, 0.1, 0.2, 0.2 + 3 * SILENT_S):  # the last look after a stall
        assert not watch.silent("a")
    t = now[0]
    while now[0] < t + SILENT_S - 0.1:
        now[0] += 0.1
        assert not watch.silent("a")
    now[0] = t + SILENT_S + 0.2
    assert watch.silent("a")


def test_an_agent_whose_beat_stopped_but_that_reports_how_its_workers_ended_is_not_lost(monkeypatch):
    """A silent agent's report is read all the same, before its silence is judged: a beat held
    up must not cost a node that says how its workers ended (the first reading skipped it)."""
    from felactl.launcher import restarts

    monkeypatch.setattr(restarts, "LOST_AFTER_S", 30.0)
    monkeypatch.setattr(restarts, "SILENT_S", 0.0)  # silent from the second look on
    looks = itertools.count()
    coordinator = SimpleNamespace(
        prefix="felactl/j/0/",
        store=dist.TCPStore("127.0.0.1", 0, 1, True),
        publish=lambda *args, **kwargs: None,
        agent_state=lambda a: {"attempt": 0, "state": "stopped"} if next(looks) >= 1 else None,
        agent_beat=lambda a: "7",
    )
    members = [SimpleNamespace(agent_id="a", node_name="node-a")]
    state = SimpleNamespace(plan=pipeline_plan([0, 2, 3], num_replicas=1), members=members)
    job = restarts.Restarts(coordinator, state, None, {}, None, 3, 10, None, {}, None)
    assert job._lost_nodes(0) == []


def test_survivors_get_the_time_their_stage_takes_to_write():
    """Fixed at 20 s, a 7B stage's survivors (20 GB to write) were stopped half-way, and the restart
    went back to the newest regular checkpoint."""
    import dataclasses

    from felactl.launcher import restarts
    from felactl.spec import Prediction

    plan = pipeline_plan([0, 2, 3], num_replicas=2)
    assert restarts.keep_state_s(plan) == restarts.KEEP_STATE_S  # no memory known: the floor
    big = Prediction(iteration_s=1.0, samples_per_s=32.0, simulated_peak_memory_gb={"cpu0": 20.0, "cpu1": 4.0})
    assert restarts.keep_state_s(dataclasses.replace(plan, predicted=big)) == pytest.approx(
        restarts.KEEP_STATE_S + 20.0 / restarts.STATE_WRITE_GBPS
    )
    assert restarts.keep_state_s(pipeline_plan([0, 2, 3], num_replicas=1)) == 0.0  # no replica holds a stage
