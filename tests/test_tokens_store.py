"""The store-backed token bucket and the gradient buckets of ``--sync tokens``, in one process:
a real ``HashStore`` shared by several workers' buckets, a real one-rank gloo group."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from felactl.agents.worker.sync.buckets import GradBuckets
from felactl.agents.worker.sync.tokens import StoreTokenBucket


def _buckets(store, workers, num_tokens, policy="ads+hf"):
    shares = [1 / len(workers)] * len(workers)
    return {w: StoreTokenBucket(store, w, tuple(workers), shares, num_tokens, policy) for w in workers}


def _drain(buckets, step, rng, speeds=None):
    """Interleave the workers' claims at random (a worker with speed 3 claims 3x as often) until
    each has either run out or said its token was its last; returns token -> worker."""
    for b in buckets.values():
        b.begin(step)
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
        b.done(1.0 / weights[w])
    return owner


@pytest.mark.parametrize("policy,workers,num_tokens", [("ads+hf", 2, 8), ("hf", 3, 10), ("ads", 3, 7), ("ads+hf", 4, 4)])
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
        for _ in range(4):
            for w in (0, 1):
                buckets[w].next_token()
        buckets[0].done(1.0)
        buckets[1].done(3.0)
    for b in buckets.values():
        b.begin(2)
    assert buckets[0].next_token() == (0, False)
    assert buckets[1].next_token() == (4, False), "4 tokens left take worker 0 longer than one of worker 1's"
    for _ in range(3):
        buckets[0].next_token()
    token, last = buckets[1].next_token()
    assert (token, last) == (5, True), "2 left: worker 0 drains them in 2 s, worker 1's token takes 3 s"
    assert buckets[0].next_token() == (7, False)  # helping worker 1, from the back of its sub-bucket
    assert buckets[0].next_token() == (6, True)
    assert buckets[0].next_token() is None


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_grad_buckets_accumulate_in_place_and_launch_during_backward(one_rank_group):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    grads = GradBuckets(list(model.parameters()), one_rank_group, bucket_bytes=256)
    assert len(grads.buckets) >= 2
    x = torch.randn(6, 8)
    reference = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    reference.load_state_dict(model.state_dict())
    reference(x).square().sum().backward()
    grads.begin()
    model(x[:3]).square().sum().backward()
    assert grads.works == [], "not armed: nothing launched"
    grads.arm()
    model(x[3:]).square().sum().backward()
    assert len(grads.works) == len(grads.buckets), "armed: every bucket launched inside backward"
    grads.finish()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert p.grad.data_ptr() == grads.views[id(p)].data_ptr()
        assert torch.allclose(p.grad, q.grad, atol=1e-6)
