"""BSP along the plan's packed trees (Blink) on real gloo workers: same parameters as one process."""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from felactl.agents.worker.sync.trees import WINDOW, stage_trees
from felactl.control.metrics import read_metrics
from felactl.profiling.data_parallel import reap
from felactl.spec import Collective, Tree
from felactl.spec.codec import FieldProblem
from felactl.spec.plan import TREE_PIECE_BYTES, deal, deal_by_root, dealt_shares, root_rates

sys.path.insert(0, str(Path(__file__).parent))
from _worker_helpers import dp_plan, final_params, pipeline_plan, reference_params, run_plan  # noqa: E402

pytestmark = pytest.mark.multiprocess
STEPS = 4


def with_trees(plan, devices, trees, root="cpu0"):
    """``plan`` with one packed collective over ``devices``: (edges, weight) per tree."""
    collective = Collective(
        group="stage0",
        devices=tuple(devices),
        root=root,
        trees=tuple(Tree(edges=tuple(map(tuple, e)), weight=w) for e, w in trees),
        rate_gbps=sum(w for _, w in trees),
        bound_gbps=sum(w for _, w in trees),
        ring_gbps=0.0,
    )
    return dataclasses.replace(plan, collectives=(collective,))


THREE_WORKER_TREES = [
    ([("cpu0", "cpu1"), ("cpu1", "cpu2")], 2.0),  # a chain carrying 2/3
    ([("cpu0", "cpu2"), ("cpu0", "cpu1")], 1.0),
]  # a star carrying 1/3


@pytest.mark.parametrize("sync", ["bsp", "tokens"])
def test_a_data_parallel_stage_sums_over_two_packed_trees_and_matches_single_process(tmp_path, sync):
    """BSP sums inside DDP's backward, tokens in its gradient buckets: both along the trees. (Tokens
    priced its sync by the trees but summed through gloo's ring: on the dgx1v-fragment testbed its
    sync took 0.22 s where the trees were priced at 0.15 s.)"""
    plan = with_trees(
        dp_plan(3, sync, global_batch=30, micro_batch=4, optimizer="adamw", lr=3e-3),
        ["cpu0", "cpu1", "cpu2"],
        THREE_WORKER_TREES,
    )
    # Every token 10x slower (a sleep after its compute): an iteration of this tiny model took
    # ~3 ms on a fast CPU, and under the suite's load one worker was late for every one of them
    slower = {"FELACTL_SLOWDOWN": "0=10,1=10,2=10"} if sync == "tokens" else {}
    run_dir = run_plan(plan, tmp_path, STEPS, env=slower)
    assert (final_params(run_dir, STEPS) - reference_params(plan, STEPS)).abs().max().item() < 1e-5
    if sync == "tokens":
        records = read_metrics(run_dir)
        # a worker late under load may be left out of an iteration (the tokens gate): the others
        # sum it through the backend, in a group of some of the workers; every other iteration is
        # summed by the whole stage, along the trees
        skipped = {r["step"] for r in records if r.get("skipped")}
        whole = [r for r in records if r["step"] not in skipped]
        assert len(records) == 3 * STEPS and len(whole) >= 3 and all(r["over_trees"] for r in whole)


def test_pipeline_replicas_sum_their_stage_gradients_over_trees(tmp_path):
    plan = pipeline_plan([0, 2, 3], num_replicas=2)  # stage 0 on cpu0, cpu2; stage 1 on cpu1, cpu3
    trees = []
    for s, (a, b) in enumerate([("cpu0", "cpu2"), ("cpu1", "cpu3")]):
        trees.append(
            Collective(
                group=f"stage{s}",
                devices=(a, b),
                root=b,
                trees=(Tree(edges=((b, a),), weight=1.0),),
                rate_gbps=1.0,
                bound_gbps=1.0,
                ring_gbps=0.0,
            )
        )
    plan = dataclasses.replace(plan, collectives=tuple(trees))
    run_dir = run_plan(plan, tmp_path, STEPS)
    got = torch.cat([final_params(run_dir, STEPS, stage=0), final_params(run_dir, STEPS, stage=1)])
    assert (got - reference_params(plan, STEPS)).abs().max().item() < 1e-5


def test_trees_that_do_not_span_the_group_are_not_used():
    plan = with_trees(dp_plan(3), ["cpu0", "cpu1", "cpu2"], [([("cpu0", "cpu1")], 1.0)])
    assert stage_trees(plan, 0, 0, None) is None
    no_trees = dataclasses.replace(plan, sync=dataclasses.replace(plan.sync, use_trees=False))
    assert stage_trees(no_trees, 0, 0, None) is None
    two_parents = with_trees(
        dp_plan(3), ["cpu0", "cpu1", "cpu2"], [([("cpu0", "cpu1"), ("cpu0", "cpu2"), ("cpu1", "cpu2")], 1.0)]
    )
    assert stage_trees(two_parents, 0, 0, None) is None  # cpu2 would wait for a second parent's send
    with pytest.raises(FieldProblem, match="one root"):  # no root at all: refused as the plan is read
        with_trees(dp_plan(3), ["cpu0", "cpu1", "cpu2"], [([("cpu0", "cpu1"), ("cpu1", "cpu0")], 1.0)])
    good = with_trees(dp_plan(3), ["cpu0", "cpu1", "cpu2"], THREE_WORKER_TREES)
    assert [t.children for t in stage_trees(good, 0, 1, None).trees] == [(2,), ()]


def _sum_over_trees(rank: int, world: int, port: int, plan, results) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=20))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        allreduce = stage_trees(plan, 0, rank, dist.group.WORLD)
        dist.all_reduce = None  # the trees must not fall back on the backend's allreduce
        # fewer elements than trees, uneven pieces; then many more pieces than the receives posted
        # ahead (WINDOW); then the default pieces
        for n, piece_bytes in ((1, None), (2, None), (7, None), (1000, None), (50_001, 1024), (300_000, None)):
            allreduce.piece_bytes = piece_bytes or TREE_PIECE_BYTES
            flat = torch.arange(n, dtype=torch.float64) * (rank + 1)
            allreduce(flat)
            results.put((rank, n, bool(torch.equal(flat, torch.arange(n, dtype=torch.float64) * 6))))
    finally:
        dist.destroy_process_group()


REDUCE_TREES = (
    Tree(edges=(("cpu0", "cpu2"), ("cpu2", "cpu1")), weight=1.0),  # cpu1 -> cpu2 -> cpu0
    Tree(edges=(("cpu0", "cpu1"), ("cpu0", "cpu2")), weight=3.0),
)


# A root per tree, as a ring's reduce-scatter and all-gather: each device sums a share of the pieces
# (cpu0 two broadcast trees, a chain and a star; the rest one chain each, round the ring one way)
# and the reduce comes up chains the other way round into each root.
ROOTED_EVERYWHERE = [
    ([("cpu0", "cpu1"), ("cpu1", "cpu2")], 1.0),
    ([("cpu0", "cpu1"), ("cpu0", "cpu2")], 0.5),
    ([("cpu1", "cpu2"), ("cpu2", "cpu0")], 2.0),
    ([("cpu2", "cpu0"), ("cpu0", "cpu1")], 3.0),
]
REDUCE_INTO_EACH_ROOT = (
    Tree(edges=(("cpu0", "cpu2"), ("cpu2", "cpu1")), weight=1.5),  # cpu1 -> cpu2 -> cpu0
    Tree(edges=(("cpu1", "cpu0"), ("cpu0", "cpu2")), weight=1.0),  # cpu2 -> cpu0 -> cpu1
    Tree(edges=(("cpu1", "cpu2"), ("cpu1", "cpu0")), weight=1.0),  # a star into cpu1
    Tree(edges=(("cpu2", "cpu1"), ("cpu1", "cpu0")), weight=3.0),  # cpu0 -> cpu1 -> cpu2
)


@pytest.mark.parametrize(
    "trees,reduce_trees",
    [(THREE_WORKER_TREES, ()), (THREE_WORKER_TREES, REDUCE_TREES), (ROOTED_EVERYWHERE, REDUCE_INTO_EACH_ROOT)],
    ids=["reversed", "own-reduce-trees", "a-root-per-tree"],
)
def test_tree_allreduce_sums_exactly_with_point_to_point_only(trees, reduce_trees):
    plan = with_trees(dp_plan(3), ["cpu0", "cpu1", "cpu2"], trees)
    plan = dataclasses.replace(plan, collectives=(dataclasses.replace(plan.collectives[0], reduce_trees=reduce_trees),))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_sum_over_trees, args=(r, 3, port, plan, results)) for r in range(3)]
    try:
        for p in procs:
            p.start()
        got = [results.get(timeout=30) for _ in range(3 * 6)]
    finally:
        reap(procs, grace_s=10.0)
    assert all(ok for _, _, ok in got) and len(got) == 18
    assert 50_001 * 8 // 1024 > 4 * WINDOW


def test_pieces_are_dealt_to_the_trees_by_weight_in_every_prefix():
    order = deal([2.0, 1.0], 9)
    assert order.count(0) == 6 and order.count(1) == 3
    for k in range(1, 10):  # every prefix within one piece of 2 : 1
        assert abs(order[:k].count(0) - 2 * k / 3) <= 1
    assert deal([1.0], 3) == [0, 0, 0] and deal([0.5, 0.5], 0) == []


def test_pieces_go_up_and_down_trees_of_one_root_shared_by_the_roots_rates():
    """With several roots each piece is summed at one of them: its reduce tree and its broadcast
    tree must share that root, whatever the two families' weights within it."""
    broadcast = [("a", 1.0), ("a", 0.5), ("b", 2.0), ("c", 3.0)]
    reduce = [("a", 1.5), ("b", 1.0), ("b", 1.0), ("c", 3.0)]
    roots = root_rates(broadcast)
    assert roots == [("a", 1.5), ("b", 2.0), ("c", 3.0)]
    down, up = deal_by_root(broadcast, roots, 65), deal_by_root(reduce, roots, 65)
    assert [broadcast[k][0] for k in down] == [reduce[k][0] for k in up]
    assert [broadcast[k][0] for k in down].count("c") == 30  # 3 / 6.5 of 65
    assert down.count(0) == 10 and down.count(1) == 5 and up.count(1) == up.count(2) == 10  # within a root, by weight
    assert dealt_shares(reduce, roots) == pytest.approx([1.5 / 6.5, 1 / 6.5, 1 / 6.5, 3 / 6.5])
    assert deal_by_root(broadcast[:1], [("a", 1.0)], 4) == deal([1.0], 4)  # one root: the plain deal
    with pytest.raises(ValueError, match="root 'b'"):
        deal_by_root([("a", 1.0)], [("a", 1.0), ("b", 1.0)], 2)


def test_nccl_groups_keep_their_backend_s_allreduce(monkeypatch):
    """NCCL matches a pair's messages by order, not tag: the two-thread streaming is gloo's only."""
    from felactl.agents.worker.sync import trees as trees_module

    plan = with_trees(dp_plan(3), ["cpu0", "cpu1", "cpu2"], THREE_WORKER_TREES)
    monkeypatch.setattr(trees_module.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(trees_module.dist, "get_backend", lambda group=None: "nccl")
    assert stage_trees(plan, 0, 0, "a group") is None
    monkeypatch.setattr(trees_module.dist, "get_backend", lambda group=None: "gloo")
    assert stage_trees(plan, 0, 0, "a group") is not None


@pytest.mark.parametrize("num_bytes", [160_000_004, 16 * 2**20 + 4, 1_000_004, 4 * 2**20 - 12])
def test_the_runtime_cuts_a_buffer_into_as_many_pieces_as_the_planner_prices(num_bytes):
    """The runtime cuts by whole elements, the planner counts bytes (``spec.plan.tree_piece_bytes``):
    a piece size that is not a whole number of elements gave the runtime one piece more (160000004
    bytes over 2 trees: 257 pieces where 256 were priced)."""
    import math

    import torch

    from felactl.agents.worker.sync.trees import TreeAllreduce, _Tree
    from felactl.spec.plan import tree_piece_bytes

    trees = [_Tree(1.0, None, (1,), 0), _Tree(1.0, None, (1,), 0)]
    allreduce = TreeAllreduce(trees, None, 2)
    flat = torch.empty(num_bytes // 4)
    assert len(allreduce._pieces(flat)) == math.ceil(num_bytes / tree_piece_bytes(num_bytes, 2))
