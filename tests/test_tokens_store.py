"""The store-backed token bucket and the gradient buckets of ``--sync tokens``, in one process:
a real ``HashStore`` shared by several workers' buckets, a real one-rank gloo group."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from felactl.agents.worker.sync import tokens as tokens_mod
from felactl.agents.worker.sync.buckets import GradBuckets
from felactl.agents.worker.sync.tokens import LAG_BUDGET_BYTES, StoreTokenBucket, skip_ahead_limit
from felactl.errors import WorkerFailed


def _buckets(store, workers, num_tokens, policy="ads+hf", max_lag=2):
    shares = [1 / len(workers)] * len(workers)
    return {w: StoreTokenBucket(store, w, tuple(workers), shares, num_tokens, policy, max_lag=max_lag) for w in workers}


def _drain(buckets, step, rng, speeds=None):
    """Interleave the workers' claims at random (a worker with speed 3 claims 3x as often) until
    each has either run out or said its token was its last; returns token -> worker."""
    for b in buckets.values():
        b.begin(step)
        assert b.join()
    active, owner = set(buckets), {}
    weights = speeds or {w: 1.0 for w in buckets}
    while active:
        w = rng.choices(sorted(active), [weights[x] for x in sorted(active)])[0]
        claim = buckets[w].next_token()
        if claim is None:
            active.discard(w)
            continue
        token, last = claim
        assert token not in owner, f"token {token} claimed twice ({owner[token]} and {w})"
        owner[token] = w
        if last:
            active.discard(w)
    for w, b in buckets.items():
        assert b.close() == tuple(sorted(buckets)), "everyone joined before the gate closed"
        b.record_speed(1.0 / weights[w])
        b.finish_iteration(0)
    return owner


@pytest.mark.parametrize(
    "policy,workers,num_tokens", [("ads+hf", 2, 8), ("hf", 3, 10), ("ads", 3, 7), ("ads+hf", 4, 4)]
)
def test_every_token_claimed_exactly_once_even_with_retirements(policy, workers, num_tokens):
    store = dist.HashStore()
    buckets = _buckets(store, list(range(workers)), num_tokens, policy)
    rng = random.Random(0)
    speeds = {w: 1.0 + 2.0 * (w == workers - 1) for w in range(workers)}
    for step in range(12):
        owner = _drain(buckets, step, rng, speeds)
        assert sorted(owner) == list(range(num_tokens)), f"step {step}: {sorted(owner)}"


def test_slow_worker_retires_once_speeds_are_known():
    store = dist.HashStore()
    buckets = _buckets(store, [0, 1], 8)
    for step in range(2):  # equal counts, but worker 1 reports 3x the seconds per token
        for b in buckets.values():
            b.begin(step)
            b.join()
        for _ in range(4):
            for w in (0, 1):
                buckets[w].next_token()
        buckets[0].record_speed(1.0)
        buckets[1].record_speed(3.0)
        for b in buckets.values():
            b.close()
            b.finish_iteration(0)
    for b in buckets.values():
        b.begin(2)
        b.join()
    assert buckets[0].next_token() == (0, False)
    assert buckets[1].next_token() == (4, False), "4 tokens left take worker 0 longer than one of worker 1's"
    for _ in range(3):
        buckets[0].next_token()
    token, last = buckets[1].next_token()
    assert (token, last) == (5, True), "2 left: worker 0 drains them in 2 s, worker 1's token takes 3 s"
    assert buckets[0].next_token() == (7, False)  # helping worker 1, from the back of its sub-bucket
    assert buckets[0].next_token() == (6, True)
    assert buckets[0].next_token() is None


def _claim_all(bucket):
    claimed = []
    while (claim := bucket.next_token()) is not None:
        claimed.append(claim[0])
        if claim[1]:
            break
    return claimed


@pytest.mark.parametrize("policy", ["ads+hf", "ads"])
def test_a_worker_that_stalls_past_the_iteration_is_left_out_and_the_others_do_its_tokens(policy):
    store = dist.HashStore()
    buckets = _buckets(store, [0, 1, 2], 9, policy)
    for b in buckets.values():
        b.begin(0)
    assert buckets[0].join() and buckets[1].join()  # worker 2 is asleep
    claimed = _claim_all(buckets[0]) + _claim_all(buckets[1])
    assert sorted(claimed) == list(range(9)), "the two awake workers take the sleeper's tokens too"
    assert buckets[0].close() == buckets[1].close() == (0, 1)
    assert not buckets[2].join(), "waking after the gate closed: it skipped the iteration"
    for b in buckets.values():
        b.finish_iteration(1)
    assert store.check(["tok/groups/3"]), "the job formed a group of workers 0 and 1"
    assert store.num_keys() == 2, "the last worker to finish deleted the iteration's keys (2: the job's group count)"


def test_a_worker_that_joins_before_the_close_is_a_member_even_with_no_token_left():
    store = dist.HashStore()
    buckets = _buckets(store, [0, 1], 4)
    for b in buckets.values():
        b.begin(0)
    assert buckets[0].join()
    assert _claim_all(buckets[0]) == [0, 1, 3, 2], "its own two, then the other's from the back"
    assert buckets[1].join(), "in before anyone found the bucket empty"
    assert buckets[1].next_token() is None
    assert buckets[1].close() == (0, 1) == buckets[0].close()


def test_the_first_of_two_one_token_workers_learns_later_that_its_token_was_its_last():
    """One token each (the planner's favourite: a whole share per micro-batch): the first to claim
    cannot yet call its token its last, the other has not claimed; once it has, nothing is left
    anywhere and the first may arm its buckets after all."""
    store = dist.HashStore()
    buckets = _buckets(store, [0, 1], 2)
    for b in buckets.values():
        b.begin(0)
        assert b.join()
    assert buckets[0].next_token() == (0, False), "worker 1 has not claimed: its token may still be worker 0's"
    assert not buckets[0].nothing_left()
    assert buckets[1].next_token() == (1, True)
    assert buckets[0].nothing_left(), "every token claimed: worker 0 will claim no more"
    assert buckets[0].next_token() is None
    assert buckets[0].close() == buckets[1].close() == (0, 1)


def test_nothing_left_under_the_shared_bucket_policy():
    store = dist.HashStore()
    buckets = _buckets(store, [0, 1], 3, policy="ads")
    for b in buckets.values():
        b.begin(0)
        assert b.join()
    assert buckets[0].next_token() == (0, False)
    assert buckets[1].next_token() == (1, False)
    assert not buckets[0].nothing_left()
    assert buckets[0].next_token() == (2, True)
    assert buckets[1].nothing_left()


def test_nobody_retires_while_a_worker_has_not_joined():
    """Retiring leaves tokens to the others; one that has not joined may be stalled for long."""
    store = dist.HashStore()
    buckets = _buckets(store, [0, 1], 8)
    for b in buckets.values():  # speeds known: worker 0 is 3x slower than worker 1
        b.token_s = 3.0 if b.rank == 0 else 1.0
        b.others_token_s = {1 - b.rank: 1.0 if b.rank == 0 else 3.0}
        b.begin(0)
    slow = buckets[0]
    slow.join()  # worker 1, the fast one, stalls before joining
    assert [slow.next_token() for _ in range(4)] == [(0, False), (1, False), (2, False), (3, False)]
    assert slow.next_token() == (7, False), (
        "helping: 3 tokens left would take worker 1 3 s, less than one of its own 3 s tokens; it would retire "
        "if worker 1 had joined"
    )
    assert [slow.next_token() for _ in range(3)] == [(6, False), (5, False), (4, True)]
    assert slow.close() == (0,)


def test_a_member_set_that_would_need_one_group_too_many_is_widened_to_everyone():
    store = dist.HashStore()
    store.add("tok/groups/count", tokens_mod.MAX_MEMBER_GROUPS)  # the job formed its last one already
    buckets = _buckets(store, [0, 1, 2], 6)
    for b in buckets.values():
        b.begin(0)
    assert buckets[0].join() and buckets[1].join()
    _claim_all(buckets[0]), _claim_all(buckets[1])
    assert buckets[0].close() == (0, 1, 2), "no group of 0 and 1 to sum in: everyone sums, BSP's wait"
    assert buckets[2].join(), "the late worker finds itself in the published members"
    assert buckets[2].next_token() is None and buckets[2].close() == (0, 1, 2) == buckets[1].close()


def test_a_sum_over_the_stores_largest_value_travels_in_pieces():
    """TCPStore refuses values over 8 MiB; a 12 MiB gradient bucket must still get through."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    bucket = StoreTokenBucket(store, 0, (0, 1), [0.5, 0.5], 4, "ads+hf", max_lag=2)
    bucket.begin(0)
    sent, got = torch.nn.Linear(2048, 1536), torch.nn.Linear(2048, 1536)
    members, skipper = GradBuckets(list(sent.parameters())), GradBuckets(list(got.parameters()))
    assert max(b.numel() * 4 for b in members.buffers) > 8 << 20
    members.begin()
    sent(torch.randn(3, 2048)).sum().backward()
    tokens_mod.publish_sum(bucket, members)
    assert len(tokens_mod.sum_pieces(members)) > len(members.buffers)
    tokens_mod.receive_sum(bucket, skipper)
    assert torch.equal(got.weight.grad, sent.weight.grad) and torch.equal(got.bias.grad, sent.bias.grad)


def test_members_wait_for_a_worker_max_lag_iterations_behind():
    store = dist.HashStore()
    fast, slow = _buckets(store, [0, 1], 4, max_lag=2).values()
    fast.timeout_s = 0.2
    for step in range(2):  # the slow worker sleeps through two iterations
        fast.begin(step)
        assert fast.join() and len(_claim_all(fast)) == 4 and fast.close() == (0,)
        fast.finish_iteration(1)
    with pytest.raises(WorkerFailed, match="has not finished iteration 0"):
        fast.begin(2)
    slow.begin(0)
    assert not slow.join()
    slow.finish_iteration(1)
    assert fast.begin(2) < 0.1, "iteration 0 is over: no need to wait"


def test_no_gate_for_a_single_worker_or_a_sum_too_big_to_park():
    assert skip_ahead_limit(1 << 20, 1) == 0
    assert skip_ahead_limit(1 << 20, 2) == 8
    assert skip_ahead_limit(LAG_BUDGET_BYTES // 3, 2) == 3
    assert skip_ahead_limit(LAG_BUDGET_BYTES, 2) == 1, "one sum parked: one iteration of a stall hidden"
    assert skip_ahead_limit(LAG_BUDGET_BYTES + 1, 2) == 0, "a sum over the budget: no gate"
    assert skip_ahead_limit(1 << 20, 3, member_groups=False) == 0, "3 workers may need a group of two"
    assert skip_ahead_limit(1 << 20, 2, member_groups=False) == 8, "2 workers: the members are one or both"
    store = dist.HashStore()
    ungated = _buckets(store, [0, 1], 4, max_lag=0)
    ungated[0].begin(0)
    assert ungated[0].join() and len(_claim_all(ungated[0])) == 4
    assert ungated[0].close() == (0, 1), "without a gate everyone is in every iteration"


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_grad_buckets_accumulate_in_place_and_launch_during_backward(one_rank_group):
    torch.manual_seed(0)
    wide = 1 << 15  # the last layer's 2 MiB of weights fill the first (1 MiB) bucket

    def make():
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, wide))

    model = make()
    grads = GradBuckets(list(model.parameters()))
    assert len(grads.buckets) == 2
    x = torch.randn(6, 8)
    reference = make()
    reference.load_state_dict(model.state_dict())
    reference(x).square().sum().backward()
    grads.begin()
    model(x[:3]).square().sum().backward()
    assert grads.works == [], "not armed: nothing launched"
    grads.arm(one_rank_group)
    model(x[3:]).square().sum().backward()
    assert len(grads.works) == len(grads.buckets), "armed: every bucket launched inside backward"
    grads.finish(one_rank_group)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert p.grad.data_ptr() == grads.views[id(p)].data_ptr()
        # Sums over 32768 outputs: rounding relative to the largest gradient, not to each.
        assert torch.allclose(p.grad, q.grad, rtol=0, atol=1e-5 * q.grad.abs().max().item())


def test_grad_buckets_armed_at_the_first_complete_bucket_when_the_token_turns_out_last(one_rank_group):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1 << 15))
    grads = GradBuckets(list(model.parameters()))
    x = torch.randn(4, 8)
    grads.begin()
    grads.arm_if_last(lambda: False, lambda: one_rank_group)
    model(x).square().sum().backward()
    assert grads.works == [] and not grads.armed, "still tokens left: nothing launched"
    asked = []
    grads.arm_if_last(lambda: asked.append(len(grads.works)) or True, lambda: one_rank_group)
    model(x).square().sum().backward()
    assert asked == [0], "asked once, when backward completed the first bucket"
    assert grads.armed and len(grads.works) == len(grads.buckets) == grads.launched_in_backward
    grads.finish(one_rank_group)
    assert grads.launched_in_backward == len(grads.buckets), "what the step's metrics report"


def test_grad_buckets_ask_at_a_later_bucket_when_backward_never_completes_the_first(one_rank_group):
    """A parameter backward never reaches (an unused head) holds the first bucket open: the
    question comes when another bucket completes, and the worker still arms (the first bucket
    then sums at finish, in order)."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1 << 15))
    unused = torch.nn.Parameter(torch.zeros(4))
    grads = GradBuckets([*model.parameters(), unused])  # last in the list: first in backward's order
    assert grads.bucket_of[id(unused)] == 0 and len(grads.buckets) == 2
    grads.begin()
    asked = []
    grads.arm_if_last(lambda: asked.append(True) or True, lambda: one_rank_group)
    model(torch.randn(4, 8)).square().sum().backward()
    assert asked == [True] and grads.armed and grads.works == [], "armed; the first bucket waits for finish"
    grads.finish(one_rank_group)
    assert len(grads.works) == 2


def test_bsp_wraps_replicas_with_the_planners_bucket_cap(one_rank_group):
    """bsp's DDP closes its later buckets at felactl's cap, whatever torch's default: torch 2.11
    (the GPU machines' image) has no ``_DEFAULT_BUCKET_CAP_MB`` to read it from."""
    from felactl.parallel.ddp import wrap_replica
    from felactl.spec.plan import BUCKET_BYTES

    replica = wrap_replica(torch.nn.Linear(4, 4), one_rank_group)
    assert replica.bucket_bytes_cap == BUCKET_BYTES


@pytest.mark.parametrize("widths", [(8, 16, 4), (8, 16, 1 << 15), (600, 600, 600, 600), (3000, 3000, 1000, 10)])
def test_grad_buckets_are_the_buckets_ddp_makes(widths):
    """One bucket rule for bsp (DDP) and tokens (GradBuckets), the one the planner prices the overlap
    of sync with backward by: DDP's own assignment, in backward order, is the reference."""
    from felactl.spec.plan import BUCKET_BYTES, FIRST_BUCKET_BYTES

    # DDP's first bucket is its own constant; the later buckets' cap felactl's bsp passes
    # (test_bsp_wraps_replicas_with_the_planners_bucket_cap)
    assert FIRST_BUCKET_BYTES == dist._DEFAULT_FIRST_BUCKET_BYTES
    layers = [torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:])]
    params = [p for layer in layers for p in layer.parameters()]
    grads = GradBuckets(params)
    backward_order = list(reversed(params))
    ddp, _ = dist._compute_bucket_assignment_by_size(backward_order, [dist._DEFAULT_FIRST_BUCKET_BYTES, BUCKET_BYTES])
    position = {id(p): i for i, p in enumerate(backward_order)}
    assert [[position[id(p)] for p in bucket] for bucket in grads.buckets] == ddp
