"""BSP and Fela tokens on real worker processes (gloo): parameters equal single-process training."""

from __future__ import annotations

import json

import pytest
import torch
from _worker_helpers import dp_plan, final_params, metrics, reference_params, run_plan

from felactl.control.metrics import write_summary

pytestmark = pytest.mark.multiprocess
STEPS = 5


def _worker_checksums(run_dir) -> list[float]:
    return [json.loads(p.read_text())["param_checksum"] for p in sorted((run_dir / "workers").glob("rank*.json"))]


@pytest.mark.parametrize("optimizer,lr", [("sgd", 0.05), ("adamw", 3e-3)])
def test_bsp_matches_single_process(tmp_path, optimizer, lr):
    plan = dp_plan(2, "bsp", optimizer=optimizer, lr=lr)
    run_dir = run_plan(plan, tmp_path, STEPS)
    got, want = final_params(run_dir, STEPS), reference_params(plan, STEPS)
    assert (got - want).abs().max().item() < 1e-5
    start = torch.cat(
        [
            v.reshape(-1)
            for v in __import__("felactl").models.build("mlp", plan.model.config, seed=0).layers.state_dict().values()
        ]
    )
    assert (got - start).abs().max().item() > 1e-3, "training must have moved the parameters"
    checksums = _worker_checksums(run_dir)
    assert len(checksums) == 2 and checksums[0] == pytest.approx(checksums[1], abs=1e-6)


def test_bsp_uneven_shares_and_metrics(tmp_path):
    plan = dp_plan(2, "bsp", shares=[0.75, 0.25], micro_batch=5)
    run_dir = run_plan(plan, tmp_path, STEPS, env={"FELACTL_STRAGGLER": "roundrobin:0.2"})
    assert (final_params(run_dir, STEPS) - reference_params(plan, STEPS)).abs().max().item() < 1e-5
    records = metrics(run_dir)
    assert sorted((r["rank"], r["step"]) for r in records) == [(r, s) for r in range(2) for s in range(STEPS)]
    for r in records:
        assert {"time", "step", "samples", "loss", "compute_s", "comm_s", "wait_s"} <= r.keys()
        assert r["samples"] == (24 if r["rank"] == 0 else 8)
        if r["step"] % 2 == r["rank"]:  # roundrobin: worker i mod N sleeps in iteration i
            assert r["compute_s"] >= 0.2
        elif r["step"] != 1:  # DDP's one-time bucket rebuild (a collective in the 2nd forward) waits instead
            assert r["wait_s"] >= 0.1, "the other worker waits for the sleeper"
    summary = write_summary(run_dir)
    assert summary["samples"] == STEPS * 32 and summary["steps"] == STEPS
    assert json.loads((run_dir / "summary.json").read_text())["samples_per_s"] == summary["samples_per_s"] > 0


def test_tokens_match_single_process_with_a_slow_worker(tmp_path):
    config = {"input_dim": 64, "hidden": 256, "depth": 3}
    plan = dp_plan(2, "tokens", global_batch=64, micro_batch=4, config=config, optimizer="adamw", lr=3e-3)
    run_dir = run_plan(plan, tmp_path, STEPS, env={"FELACTL_SLOWDOWN": "1=3"})
    assert (final_params(run_dir, STEPS) - reference_params(plan, STEPS)).abs().max().item() < 1e-5
    records = metrics(run_dir)
    for step in range(STEPS):
        at_step = [r for r in records if r["step"] == step]
        assert sum(r["samples"] for r in at_step) == 64
        assert sum(r["tokens"] for r in at_step) == 16
    fast = sum(r["samples"] for r in records if r["rank"] == 0)
    slow = sum(r["samples"] for r in records if r["rank"] == 1)
    assert fast > slow, f"the 3x slower worker should pull fewer tokens (fast {fast}, slow {slow})"


@pytest.mark.parametrize("workers,sleeps", [(2, {1: 0.4}), (3, {2: 0.4})])
def test_tokens_stalled_workers_skip_iterations_and_still_match_single_process(tmp_path, workers, sleeps):
    """Sleepers sleep far longer than an iteration (in iteration ``i`` when ``i mod N`` is their
    rank): the others take all their tokens, sum without them and go on; a sleeper applies their
    sum. With 3 workers, the two awake ones sum in a group of two formed mid-run by them alone
    (tests/test_member_groups.py has members whose histories differ)."""
    config = {"input_dim": 32, "hidden": 64, "depth": 2}
    plan = dp_plan(workers, "tokens", global_batch=48, micro_batch=4, config=config, optimizer="adamw", lr=3e-3)
    steps = 3 * workers
    # Every token made 4x slower (a sleep after its compute): an iteration of this tiny model lasts
    # ~10 ms, not ~2, so an awake worker the OS held back a moment still claims a token (on a fast
    # CPU one worker took every token of four iterations in a row: no group of two ever formed).
    slower = ",".join(f"{rank}=4" for rank in range(workers))
    run_dir = run_plan(
        plan,
        tmp_path,
        steps,
        env={"FELACTL_SLOWDOWN": slower},
        per_rank_env={r: {"FELACTL_STRAGGLER": f"roundrobin:{s}"} for r, s in sleeps.items()},
    )
    assert (final_params(run_dir, steps) - reference_params(plan, steps)).abs().max().item() < 1e-5
    checksums = _worker_checksums(run_dir)
    assert len(checksums) == workers and all(c == pytest.approx(checksums[0], abs=1e-6) for c in checksums)
    records = metrics(run_dir)
    members = []
    for step in range(steps):
        at_step = [r for r in records if r["step"] == step]
        assert len(at_step) == workers and sum(r["samples"] for r in at_step) == 48
        members.append(tuple(sorted(r["rank"] for r in at_step if not r.get("skipped"))))
    skipped = [r for r in records if r.get("skipped")]
    # (a worker the OS holds back, 3 processes on 2 cores, may skip one too: that is the point)
    assert set(sleeps) <= {r["rank"] for r in skipped}, "the sleepers skip iterations"
    assert all(r["samples"] == 0 and r["tokens"] == 0 and r["loss"] is None for r in skipped)
    if workers == 3:
        assert (0, 1) in members, f"members per iteration: {members}"


def test_tokens_one_each_sum_under_the_last_backward(tmp_path):
    """A token per worker per iteration (micro-batch = the global batch's share): each worker's
    gradient sum starts inside its backward, as the planner prices it. The first to claim cannot
    call its token its last at once (the other has not claimed yet); it used to sum only after
    its backward, and so held the other's sum with it (issue 15: the fragment's 75 ms sum)."""
    config = {"input_dim": 256, "hidden": 512, "depth": 4}  # a backward of ~10 ms: the claims come first
    # SGD: two micro-batches' summed gradients differ from one batch's in float order, and AdamW
    # (lr 3e-3, as this test had) turns that noise on near-zero gradients into 2e-4 after 8 steps,
    # with bsp exactly as with tokens (on torch 2.13); SGD keeps it at 1.5e-8.
    plan = dp_plan(2, "tokens", global_batch=512, micro_batch=256, config=config)
    steps = 8
    run_dir = run_plan(plan, tmp_path, steps)
    # each worker's token is half the batch: summed as one process sums the two halves
    assert (final_params(run_dir, steps) - reference_params(plan, steps, micro_batch=256)).abs().max().item() < 1e-6
    records = metrics(run_dir)
    assert len(records) == 2 * steps
    assert all(sum(r["tokens"] for r in records if r["step"] == step) == 2 for step in range(steps))
    # A worker may take the other's token before it claims it (one with none has no backward), and
    # a peer late by more than a forward leaves the question open: most, not all. Before the fix one
    # worker of each iteration summed after its backward: half.
    ran = [r for r in records if r["tokens"]]
    late = [(r["rank"], r["step"]) for r in ran if r["buckets_in_backward"] < 1]
    # Under load (the suite runs two test files at once) a peer is late more often: 4 of 13 seen.
    assert len(late) < len(ran) / 2, f"sums launched only after backward: {late}"


@pytest.mark.parametrize("policy", ["hf", "ads"])
def test_tokens_with_a_single_worker_match_single_process(tmp_path, policy):
    """A one-device plan (what the planner gives a one-GPU machine) pulls every token itself."""
    plan = dp_plan(1, "tokens", micro_batch=4, token_policy=policy)
    run_dir = run_plan(plan, tmp_path, STEPS)
    assert (final_params(run_dir, STEPS) - reference_params(plan, STEPS)).abs().max().item() < 1e-5


def test_tokens_shared_bucket_policy(tmp_path):
    plan = dp_plan(3, "tokens", global_batch=30, micro_batch=4, token_policy="ads")
    run_dir = run_plan(plan, tmp_path, 3)
    assert (final_params(run_dir, 3) - reference_params(plan, 3)).abs().max().item() < 1e-5
    records = metrics(run_dir)
    assert sum(r["tokens"] for r in records) == 3 * 8
    assert sum(r["samples"] for r in records) == 3 * 30
