"""The worker's one loop and run sequence, driven without processes: a fake strategy and a fake
membership script joins, failures, leaves and graceful stops at chosen steps, and the tests check
the order of the calls, the steps and the samples recorded (milliseconds, no process group).

What they pin down is the loop's contract with its membership and strategy
(:mod:`felactl.agents.worker.loop`, :mod:`felactl.agents.worker.membership`): the multi-process
tests (test_scale, test_resume, ...) check the same paths end to end with real processes."""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest

from felactl.agents.worker import main
from felactl.agents.worker.loop import train
from felactl.agents.worker.membership import Membership
from felactl.agents.worker.strategy import AtOwnPace, StepResult, Strategy, Work
from felactl.errors import InputError

BATCH = 8


class FakeTrainer:
    """What the loop asks of a trainer: the injected stragglers, the metrics record, and what a
    record carries for the user (the optimizer's lr, the job's evaluate hook: none here)."""

    def __init__(self, calls: list):
        self.calls = calls
        self.records: list[dict] = []
        self.straggler = SimpleNamespace(at_iteration=lambda local_step: 0.0)
        self.optimizer = SimpleNamespace(param_groups=[{"lr": 0.1}])
        self.job = SimpleNamespace(evaluate=None)
        self.plan = SimpleNamespace(stages=[SimpleNamespace(shard=False)])

    def record(self, **fields) -> None:
        self.calls.append(("record", fields["step"]))
        self.records.append(fields)


class FakeStrategy(Strategy):
    """Steps ``first .. steps - 1`` of a global batch shared by ``members`` workers; a step in
    ``fail_at`` raises as a collective with a dead peer does, ``stop_at`` ends in a graceful stop,
    ``unsynced_at`` trains but its sync fails (a mode at its own pace)."""

    def __init__(self, trainer, calls, *, name, first=0, steps=10, members=1, fail_at=(), stop_at=None, unsynced_at=()):
        super().__init__(trainer)
        self.calls, self.name, self.first, self.steps, self.members = calls, name, first, steps, members
        self.fail_at, self.stop_at, self.unsynced_at = set(fail_at), stop_at, set(unsynced_at)

    def work(self):
        share = BATCH // self.members
        for step in range(self.first, self.steps):
            yield Work(step, list(range(step * BATCH, step * BATCH + share)), step - self.first)

    def step(self, work: Work) -> StepResult:
        self.calls.append((self.name, "step", work.step))
        if work.step in self.fail_at:
            raise RuntimeError(f"Connection closed by peer (step {work.step})")
        failed = "sync failed" if work.step in self.unsynced_at else None
        return StepResult(len(work.indices), float(len(work.indices)), 0.001, sync_failed=failed)

    def end(self, work: Work) -> bool:
        self.calls.append((self.name, "end", work.step))
        return work.step == self.stop_at

    def finish(self) -> None:
        self.calls.append((self.name, "finish"))

    def close(self) -> None:
        self.calls.append((self.name, "close"))


class FakeMembership(Membership):
    """A scripted membership: ``changes`` maps a completed step to the change agreed after it; a
    change is ``(kind, members, first_step)``; ``failure_change`` is the generation formed after a
    failed step (None: the job's members are fixed, a failure fails the worker)."""

    def __init__(self, calls, trainer, first_strategy, *, changes=None, failure_change=None, steps=10, **script):
        self.calls, self.trainer, self.first_strategy = calls, trainer, first_strategy
        self.changes = dict(changes or {})
        self.failure_change = failure_change
        self.survives_failures = failure_change is not None
        self.steps, self.script = steps, script
        self.generation = 0
        self.dropped: list[bool] = []
        """After each failure: whether the failed strategy was already freed."""

    def start(self):
        self.calls.append(("start",))
        return self.trainer, self.take_first()

    def take_first(self) -> FakeStrategy:
        """The first strategy, no longer held here (the loop's reference is then the only one)."""
        strategy, self.first_strategy = self.first_strategy, None
        return strategy

    def finish(self, finished, wall_s):
        self.calls.append(("finish", finished))
        return {"steps": len(self.trainer.records), "left": not finished}

    def close(self):
        self.calls.append(("close",))

    def record_extra(self):
        return {"generation": self.generation}

    def after_step(self, strategy):
        step = self.trainer.records[-1]["step"]
        self.calls.append(("after_step", step))
        return self.changes.pop(step, None)

    def after_failure(self, why):
        self.calls.append(("after_failure", why))
        gc.collect()
        self.dropped.append(self.failed_strategy() is None)
        return self.failure_change

    def switch(self, change):
        kind, members, first = change
        self.calls.append(("switch", kind))
        if members == 0:
            return None  # this worker is not in the new generation
        self.generation += 1
        return FakeStrategy(
            self.trainer, self.calls, name=f"g{self.generation}", first=first, steps=self.steps, members=members
        )

    def newest_generation(self):
        return self.generation

    def is_planned(self, generation):
        return True

    def members_changed(self):
        return False

    def switch_at_agreed_step(self, lead_steps):
        return None

    def checkpoint_extra(self):
        return {}


def _job(steps=6, *, changes=None, failure_change=None, **first):
    """A fake job's calls, trainer and membership; its first strategy is ``membership.take_first()``."""
    calls: list = []
    trainer = FakeTrainer(calls)
    strategy = FakeStrategy(trainer, calls, name="g0", steps=steps, **first)
    membership = FakeMembership(calls, trainer, strategy, changes=changes, failure_change=failure_change, steps=steps)
    membership.failed_strategy = weakref.ref(strategy)
    return calls, trainer, membership


def _train(trainer, membership) -> bool:
    """``train`` from the membership's first strategy, holding no reference to it here (pytest's
    rewritten ``assert train(...)`` would keep its arguments, and a failed strategy alive)."""
    return train(trainer, membership.take_first(), membership)


def _steps_of(calls, name):
    return [c[2] for c in calls if c[0] == name and c[1] == "step"]


def test_a_fixed_job_runs_every_step_once_then_finishes_its_strategy():
    calls, trainer, membership = _job(steps=4)
    assert _train(trainer, membership) is True
    per_step = lambda s: [("g0", "step", s), ("record", s), ("g0", "end", s), ("after_step", s)]
    assert calls == [*per_step(0), *per_step(1), *per_step(2), *per_step(3), ("g0", "finish"), ("g0", "close")]
    assert [r["samples"] for r in trainer.records] == [BATCH] * 4
    assert [r["generation"] for r in trainer.records] == [0] * 4, "the membership's fields are in each record"


def test_a_join_after_step_k_switches_there_and_the_new_strategy_goes_on_from_k_plus_one():
    k = 2
    calls, trainer, membership = _job(steps=6, changes={k: ("scale-out", 2, k + 1)})
    assert _train(trainer, membership) is True
    assert _steps_of(calls, "g0") == [0, 1, 2] and _steps_of(calls, "g1") == [3, 4, 5]
    switch = calls.index(("switch", "scale-out"))
    assert calls[switch - 2 : switch] == [("after_step", k), ("g0", "close")] and calls[switch + 1] == (
        "g1",
        "step",
        k + 1,
    )
    # A DDP that outlives its gloo group frees the group's last reference in its own dealloc,
    # which holds the GIL while the group's destructor joins a thread that may need it (torch
    # issue 56297): the old strategy lets go of its DDP before the membership switches.
    assert ("g0", "finish") not in calls and calls[-2:] == [("g1", "finish"), ("g1", "close")], (
        "only the strategy that ends finishes"
    )
    assert [r["step"] for r in trainer.records] == list(range(6))
    assert [r["samples"] for r in trainer.records] == [BATCH] * 3 + [BATCH // 2] * 3, "the share halves after the join"
    assert [r["generation"] for r in trainer.records] == [0, 0, 0, 1, 1, 1]


def test_a_failure_at_step_j_is_told_in_one_line_and_the_step_is_trained_again_in_the_next_generation():
    j = 3
    calls, trainer, membership = _job(steps=6, fail_at={j}, failure_change=("failure", 1, j))
    assert _train(trainer, membership) is True
    failure = next(c for c in calls if c[0] == "after_failure")
    assert failure == ("after_failure", f"RuntimeError: Connection closed by peer (step {j})")
    assert calls[calls.index(failure) - 2 : calls.index(failure)] == [("g0", "step", j), ("g0", "close")], (
        "nothing of the failed step is recorded or ended, and the strategy lets go of its groups first"
    )
    assert calls[calls.index(failure) + 1] == ("switch", "failure")
    assert membership.dropped == [True], "the failed strategy (its DDP, its group) is freed before the job re-forms"
    assert [r["step"] for r in trainer.records] == list(range(6)), "every step recorded once, the failed one again"
    assert sum(r["samples"] for r in trainer.records) == 6 * BATCH


def test_a_failure_in_a_fixed_job_fails_the_worker():
    calls, trainer, membership = _job(steps=6, fail_at={2})
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        _train(trainer, membership)
    assert not any(c[0] in ("after_failure", "switch") for c in calls) and ("g0", "finish") not in calls
    assert calls[-1] == ("g0", "close"), "the worker's close() destroys the groups next"


def test_felactls_own_errors_end_even_a_worker_that_survives_failures():
    calls, trainer, membership = _job(steps=6, failure_change=("failure", 1, 0))

    def bad_input(work):
        raise InputError("the plan cannot run")

    membership.first_strategy.step = bad_input
    with pytest.raises(InputError):
        _train(trainer, membership)
    assert not any(c[0] == "after_failure" for c in calls)


def test_a_graceful_stop_at_step_n_ends_there_without_asking_the_membership():
    n = 2
    calls, trainer, membership = _job(steps=6, stop_at=n, changes={n: ("scale-out", 2, n + 1)})
    assert _train(trainer, membership) is True
    assert calls[-4:] == [("record", n), ("g0", "end", n), ("g0", "finish"), ("g0", "close")]
    assert ("after_step", n) not in calls and [r["step"] for r in trainer.records] == [0, 1, 2]


def test_a_worker_that_a_scale_in_removes_leaves_without_finishing():
    calls, trainer, membership = _job(steps=6, changes={1: ("scale-in", 0, 2)})
    assert _train(trainer, membership) is False
    assert calls[-3:] == [("after_step", 1), ("g0", "close"), ("switch", "scale-in")]
    assert not any(c[-1] == "finish" for c in calls)


def test_a_step_trained_then_unsynced_is_recorded_before_it_fails():
    """A mode at its own pace trained the samples into this worker's parameters when its sync
    failed: the record is written (the next generation merges them), then the step fails."""
    calls, trainer, membership = _job(steps=4, unsynced_at={1}, failure_change=("failure", 1, 2))
    assert _train(trainer, membership) is True
    failure = next(i for i, c in enumerate(calls) if c[0] == "after_failure")
    assert calls[failure - 3 : failure + 1] == [
        ("g0", "step", 1),
        ("record", 1),
        ("g0", "close"),
        ("after_failure", "RuntimeError: sync failed"),
    ]
    assert [r["step"] for r in trainer.records] == [0, 1, 2, 3]


def test_join_failure_and_stop_in_one_run():
    """Join after step 1, a peer lost at step 3, a graceful stop at step 5: the generations
    follow one another, each step is recorded once, and the samples are each generation's share."""
    calls, trainer, membership = _job(steps=8, changes={1: ("scale-out", 2, 2)})
    membership.failure_change = ("failure", 1, 3)
    membership.survives_failures = True
    real_switch = membership.switch

    def switch(change):
        strategy = real_switch(change)
        if change[0] == "scale-out":
            strategy.fail_at = {3}
            membership.failed_strategy = weakref.ref(strategy)
        else:
            strategy.stop_at = 5
        return strategy

    membership.switch = switch
    assert _train(trainer, membership) is True
    assert [c for c in calls if c[0] in ("switch", "after_failure")] == [
        ("switch", "scale-out"),
        ("after_failure", "RuntimeError: Connection closed by peer (step 3)"),
        ("switch", "failure"),
    ]
    assert [(r["step"], r["samples"], r["generation"]) for r in trainer.records] == [
        (0, 8, 0),
        (1, 8, 0),
        (2, 4, 1),
        (3, 8, 2),
        (4, 8, 2),
        (5, 8, 2),
    ]
    assert calls[-2:] == [("g2", "finish"), ("g2", "close")] and membership.dropped == [True]
    assert [c[0] for c in calls if c[1:] == ("close",)] == ["g0", "g1", "g2"], "each strategy closed once"


def test_every_worker_runs_one_sequence_start_train_finish_then_close(monkeypatch):
    calls, trainer, membership = _job(steps=2)
    monkeypatch.setattr(main.faulthandler, "register", lambda *args: None)
    monkeypatch.setattr(main, "membership_for", lambda cfg: membership)
    assert main.run_worker(cfg=None) == {"steps": 2, "left": False}
    assert calls[0] == ("start",)
    assert calls[-4:] == [("g0", "finish"), ("g0", "close"), ("finish", True), ("close",)]


def test_the_membership_is_closed_when_the_run_fails(monkeypatch):
    calls, trainer, membership = _job(steps=4, fail_at={1})
    monkeypatch.setattr(main.faulthandler, "register", lambda *args: None)
    monkeypatch.setattr(main, "membership_for", lambda cfg: membership)
    with pytest.raises(RuntimeError):
        main.run_worker(cfg=None)
    assert calls[-2:] == [("g0", "close"), ("close",)] and not any(c[0] == "finish" for c in calls)


def test_a_lockstep_mode_switches_where_the_members_agreed_on_the_store():
    agreed = SimpleNamespace(switch_at_agreed_step=lambda lead_steps: 4 if lead_steps == Strategy.lead_steps else None)
    assert Strategy(trainer=None).generation_to_switch_to(agreed) == 4


@pytest.mark.parametrize("newest,planned,expected", [(3, True, None), (4, False, "re-forms the job after a failure")])
def test_a_mode_at_its_own_pace_settles_only_for_a_planned_generation(newest, planned, expected):
    """A member that sees a generation formed after a failure does not settle (the settle would
    wait on the dead member): its step fails and the membership recovers. (A planned one settles:
    a collective, tested with processes in test_scale.)"""
    membership = SimpleNamespace(generation=3, newest_generation=lambda: newest, is_planned=lambda g: planned)
    strategy = AtOwnPace(trainer=SimpleNamespace(worker_id=7))
    if expected is None:
        assert strategy.generation_to_switch_to(membership) is None
    else:
        with pytest.raises(RuntimeError, match=f"worker 7: generation {newest} {expected}"):
            strategy.generation_to_switch_to(membership)


def _claiming_trainer(offsets: range, counter: list[int], steps: int = 10, global_batch: int = 32):
    """What :meth:`AtOwnPace.claim` reads of a trainer: the data counter (a store's ``add``), the
    worker's share of a batch, the run's length and the drain."""

    def add(key, amount):
        counter[0] += amount
        return counter[0]

    runtime = SimpleNamespace(cfg=SimpleNamespace(steps=steps), store=SimpleNamespace(add=add))
    return SimpleNamespace(
        runtime=runtime,
        global_batch=global_batch,
        placement=SimpleNamespace(offsets=offsets),
        start_position=0,
        drain=SimpleNamespace(requested=lambda: False),
    )


def test_a_member_at_its_own_pace_whose_share_rounds_to_no_sample_still_claims_one():
    """A re-plan by measured speeds gave a member a share of 0.0156 of a 32-sample batch: no sample
    of its own. It took "nothing to claim" for "the data is handed out", left the loop at step 33
    of 110 and sat in the job's final barrier while the others waited in their switch's all-reduce
    (tests/test_scale.py's SDPipe rescale, 1 run in 5). It claims one sample at a time instead,
    until the data is handed out."""
    counter = [0]
    strategy = AtOwnPace(trainer=_claiming_trainer(range(0), counter, steps=1, global_batch=2))
    assert [work.indices for work in strategy.work()] == [[0], [1]]
    counter = [0]
    sharing = AtOwnPace(trainer=_claiming_trainer(range(0, 8), counter, steps=2, global_batch=32))
    assert [len(work.indices) for work in sharing.work()] == [8] * 8  # its share, as before


def test_bsp_lets_go_of_its_ddp_when_closed():
    """What the loop's close() is for under BSP: the strategy's DDP is freed then (not when the
    strategy is), while its group still lives (torch issue 56297)."""
    from felactl.agents.worker.sync.bsp import BSP

    class Replica:  # stands for the DDP wrapper: only its life matters here
        pass

    strategy = BSP.__new__(BSP)  # no trainer, no group: close() touches neither
    strategy.ddp = Replica()
    held = weakref.ref(strategy.ddp)
    strategy.close()
    assert held() is None and strategy.ddp is None


def test_a_run_that_fails_lets_go_of_what_its_failed_steps_frames_held_before_the_membership_closes(monkeypatch):
    """felactl's own error leaves the worker through run_worker's close(): the traceback it carries
    keeps the failed step's frames, and Trainer.compute's frame holds the DDP. Those frames are
    cleared before close() destroys the group (the torch 56297 order, as for the strategy)."""
    calls, trainer, membership = _job(steps=4)

    class Replica:  # stands for the DDP a step's frame holds
        pass

    held = []

    def failing_step(work):
        ddp = Replica()  # a local of the failing frame, as in Trainer.compute
        held.append(weakref.ref(ddp))
        raise InputError("the plan cannot run")

    membership.first_strategy.step = failing_step
    alive_at_close = []
    membership.close = lambda: alive_at_close.append(held[0]() is not None)
    monkeypatch.setattr(main.faulthandler, "register", lambda *args: None)
    monkeypatch.setattr(main, "membership_for", lambda cfg: membership)
    with pytest.raises(InputError):
        main.run_worker(cfg=None)
    assert alive_at_close == [False]
