"""Fela's token DAG and policies, tested without processes."""

from __future__ import annotations

import pytest

from felactl.agents.worker.sync.token_policy import (
    SubBucketView,
    Token,
    TokenDAG,
    TokenServer,
    choose_victim,
    token_samples,
)
from felactl.spec.executable import num_first_level_tokens


def test_first_level_count_is_at_least_one_per_worker():
    assert num_first_level_tokens(64, 16, 2) == 4
    assert num_first_level_tokens(64, 16, 8) == 8
    assert num_first_level_tokens(30, 4, 3) == 8


@pytest.mark.parametrize("global_batch,num_tokens", [(64, 4), (30, 8), (7, 7), (5, 8)])
def test_token_samples_partition_the_batch(global_batch, num_tokens):
    covered = [i for j in range(num_tokens) for i in token_samples(global_batch, num_tokens, j)]
    assert covered == list(range(global_batch))


def test_dag_inputs_follow_the_weights():
    dag = TokenDAG(8, (1, 2, 4))
    assert [dag.count(i) for i in range(3)] == [8, 4, 2]
    assert dag.inputs(Token(1, False, 3)) == [Token(0, False, 6), Token(0, False, 7)]
    assert dag.inputs(Token(2, False, 1)) == [Token(1, False, 2), Token(1, False, 3)]
    assert dag.inputs(Token(2, True, 1)) == [Token(2, False, 1)]
    assert dag.inputs(Token(0, True, 5)) == [Token(1, True, 2), Token(0, False, 5)]
    assert [dag.depth(t) for t in (Token(0, False, 0), Token(2, False, 0), Token(2, True, 0), Token(0, True, 0))] == [
        0,
        2,
        3,
        5,
    ]


@pytest.mark.parametrize("weights,num_first", [((2,), 4), ((1, 2, 3), 6), ((1, 2), 5)])
def test_dag_rejects_bad_weights(weights, num_first):
    with pytest.raises(ValueError):
        TokenDAG(num_first, weights)


def _drain(server: TokenServer, order: list[int]) -> dict[Token, int]:
    """Workers in ``order`` (cycled) request, and complete at once, until the iteration is done."""
    done, idle = {}, 0
    while not server.finished:
        progressed = False
        for w in order:
            token = server.request(w)
            if token is not None:
                server.complete(w, token)
                done[token] = w
                progressed = True
        idle = 0 if progressed else idle + 1
        assert idle < 2, "the server stalled with tokens left"
    return done


@pytest.mark.parametrize("policy", ["ads", "hf", "ads+hf"])
def test_every_token_runs_exactly_once_in_dependency_order(policy):
    dag = TokenDAG(8, (1, 2, 4))
    server = TokenServer(dag, [0, 1, 2], policy=policy)
    finished: list[Token] = []
    while not server.finished:
        for w in (0, 1, 2):
            token = server.request(w)
            if token is not None:
                assert all(t in finished for t in dag.inputs(token)), f"{token} ran before its inputs"
                server.complete(w, token)
                finished.append(token)
    assert sorted(finished) == sorted(dag.tokens())


def test_ads_picks_the_deepest_ready_level():
    dag = TokenDAG(4, (1, 2))
    server = TokenServer(dag, [0, 1], policy="ads")
    for _ in range(2):
        server.complete(0, server.request(0))  # F0.0, F0.1 -> F1.0 ready
    assert server.request(1) == Token(1, False, 0), "a level-1 token beats the remaining level-0 ones"


def test_ads_breaks_depth_ties_by_locality():
    dag = TokenDAG(4, (1, 2))
    server = TokenServer(dag, [0, 1], policy="ads")
    order = [(0, Token(0, False, 0)), (0, Token(0, False, 1)), (1, Token(0, False, 2)), (1, Token(0, False, 3))]
    for worker, token in order:
        server.state.ready.pop(token)
        server.state.running[token] = worker
        server.complete(worker, token)
    # F1.0 (inputs by worker 0) and F1.1 (inputs by worker 1) are both ready at depth 1.
    assert server.request(1) == Token(1, False, 1)
    assert server.request(0) == Token(1, False, 0)


def test_hf_drains_own_sub_bucket_first():
    server = TokenServer(TokenDAG(6), [0, 1, 2], policy="hf")
    assert [server.request(1) for _ in range(2)] == [Token(0, False, 2), Token(0, False, 3)]


def test_hf_helper_steals_from_the_slowest_owner_with_fewest_helpers():
    views = [
        SubBucketView(owner=0, backlog=4, helpers=0, completed=4),  # fast
        SubBucketView(owner=1, backlog=4, helpers=1, completed=1),  # slow, already helped
        SubBucketView(owner=2, backlog=4, helpers=0, completed=1),
    ]  # slow, nobody helps
    assert choose_victim(views) == 2
    assert choose_victim(views[:2]) == 1, "a slow owner with one helper still finishes after a fast one"
    assert choose_victim([SubBucketView(0, 0, 0, 3)]) is None


def _drain_own(server: TokenServer, worker: int) -> None:
    while any(owner == worker for owner in server.state.ready.values()):
        server.complete(worker, server.request(worker))


def test_hf_server_sends_idle_workers_to_stragglers_spreading_helpers():
    server = TokenServer(TokenDAG(8), [0, 1, 2, 3], policy="hf")
    _drain_own(server, 0)
    _drain_own(server, 2)  # workers 1 and 3 are stragglers: they have not started
    first = server.request(2)
    assert server.state.helpers[1] == {2} and first.index in (2, 3)
    second = server.request(0)
    assert second.index in (6, 7), f"worker 3 has no helper yet, so worker 0 helps it; got {second}"
    assert server.state.helpers[3] == {0}


def test_ctd_restricts_a_level_to_its_workers():
    dag = TokenDAG(4, (1, 4))
    server = TokenServer(dag, [0, 1, 2], policy="ads+hf", level_workers={1: (2,)})
    done = _drain(server, [0, 1, 2])
    assert {w for t, w in done.items() if t.level == 1} == {2}
    assert {w for t, w in done.items() if t.level == 0} <= {0, 1, 2}


def test_shares_split_the_first_level():
    server = TokenServer(TokenDAG(8), [0, 1], policy="hf", shares={0: 0.75, 1: 0.25})
    owners = [server.state.ready[Token(0, False, j)] for j in range(8)]
    assert owners == [0] * 6 + [1] * 2


def test_complete_rejects_a_token_not_handed_out():
    server = TokenServer(TokenDAG(2), [0, 1])
    with pytest.raises(ValueError):
        server.complete(0, Token(0, False, 1))


def test_pinned_backward_runs_where_its_forward_ran():
    dag = TokenDAG(4, (1, 2))
    server = TokenServer(dag, [0, 1], policy="ads+hf", pin_backward=True)
    done = _drain(server, [0, 1])
    for token, worker in done.items():
        if token.backward:
            assert worker == done[Token(token.level, False, token.index)]


def _run_all(server: TokenServer, workers) -> list[Token]:
    """Each worker in turn asks and at once completes, until the iteration is done."""
    order = []
    while not server.finished:
        progressed = False
        for w in workers:
            token = server.request(w)
            if token is not None:
                server.complete(w, token)
                order.append(token)
                progressed = True
        assert progressed
    return order


def test_a_worker_gets_no_forward_beyond_the_in_flight_limit():
    """Level 0 on worker 0, level 1 on worker 1: worker 0 runs ahead until it holds two forwards."""

    def server(limit):
        return TokenServer(
            TokenDAG(8, (1, 1)),
            (0, 1),
            "ads",
            level_workers={0: (0,), 1: (1,)},
            max_in_flight={0: limit} if limit else None,
        )

    for limit, expected in ((2, None), (None, Token(0, False, 2))):
        s = server(limit)
        for j in range(2):
            assert s.request(0) == Token(0, False, j)
            s.complete(0, Token(0, False, j))
        assert s.request(1) == Token(1, False, 0)  # running on worker 1: the limit is not lifted
        assert s.request(0) == expected
    s = server(2)
    order = _run_all(s, (0, 1))
    assert len(order) == 32 and not s.limit_lifted


def test_the_limit_is_lifted_rather_than_hang():
    """One worker, limit 1, a level of twice the micro-batch: its token needs two forwards held."""
    s = TokenServer(TokenDAG(4, (1, 2)), (0,), "ads", max_in_flight={0: 1, 1: 1})
    assert len(_run_all(s, (0,))) == 12 and s.limit_lifted
