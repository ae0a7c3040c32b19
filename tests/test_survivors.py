"""Stepping together (felactl.agents.worker.survivors.StepCommit) on a real TCPStore, no processes:
nobody steps a step before every worker summed it, the store keeps no key of a step everyone is
past, and a worker waiting to step stops once another of its attempt failed. (The failure itself,
with processes: tests/test_restarts.py.)"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch.distributed as dist
from _worker_helpers import pipeline_plan

from felactl.agents.worker.engine import Trainer
from felactl.agents.worker.survivors import AttemptFailed, StepCommit
from felactl.control import keys


def _worker(store: dist.Store, worker_id: int, world: int = 2, plan=None):
    """What StepCommit asks of a trainer: its store, the job's size, its plan, and the trainer's own
    wait (Trainer.wait_for_key, bound to this stand-in)."""
    worker = SimpleNamespace(
        runtime=SimpleNamespace(store=store, world_size=world, cfg=SimpleNamespace(timeout_s=30.0)),
        plan=plan or pipeline_plan([0, 2, 3], num_replicas=2),
        worker_id=worker_id,
        membership=SimpleNamespace(members_changed=lambda: False),
    )
    worker.wait_for_key = Trainer.wait_for_key.__get__(worker)
    worker._give_up_if_stuck = Trainer._give_up_if_stuck.__get__(worker)
    return worker


@pytest.fixture
def client():
    """A new connection to one attempt's store (a worker process has its own)."""
    server = dist.TCPStore("127.0.0.1", 0, 1, True)
    return lambda: dist.PrefixStore("gen1", dist.TCPStore("127.0.0.1", server.port, 1, False))


def test_nobody_steps_before_every_worker_summed_and_no_key_of_a_step_everyone_is_past_is_kept(client):
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
    assert store.check([keys.step_committed(2)])
    assert not store.check([keys.step_commit(1)]) and not store.check([keys.step_committed(1)])


def test_a_worker_waiting_to_step_stops_once_another_of_its_attempt_failed(client):
    waiting = StepCommit(_worker(client(), 0, world=3))
    store = client()
    store.add(keys.step_commit(7), 1)  # one more has summed; the third died before it
    raised = []

    def agree() -> None:
        try:
            waiting.agree(7)
        except AttemptFailed as exc:
            raised.append(exc)

    thread = threading.Thread(target=agree)
    thread.start()
    time.sleep(0.3)
    assert thread.is_alive()
    store.set(keys.ATTEMPT_FAILED, "1")  # a failing worker's word, or the launcher's
    thread.join(5)
    assert not thread.is_alive() and raised, "it stopped waiting"
    assert not store.check([keys.step_committed(7)]), "and nobody may step"
