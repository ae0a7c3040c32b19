"""The worker runtime's pure parts: straggler specs, environment, placement, summary, SDPipe groups."""

from __future__ import annotations

import dataclasses
import re
import time
from pathlib import Path

import pytest
import torch
import torch.distributed
from _worker_helpers import dp_plan, local_worker_config, pipeline_plan, placed

from felactl.agents.worker import fixed
from felactl.agents.worker.config import from_env
from felactl.agents.worker.generations import Heartbeat
from felactl.agents.worker.runtime import choose_device
from felactl.agents.worker.stages import micro_batches, place, split_by_shares
from felactl.agents.worker.stragglers import Straggler
from felactl.agents.worker.sync.groups import MAX_WAIT_S, MIN_WAIT_S, GroupScheduler, adapt_wait
from felactl.control import keys
from felactl.control.documents import HeartbeatDoc
from felactl.control.metrics import summarize
from felactl.control.stragglers import Pattern, parse_pattern, parse_slowdown
from felactl.errors import InputError
from felactl.spec import DeviceKind, save
from felactl.spec.executable import plan_backend


def test_parse_slowdown():
    assert parse_slowdown("1=3, 2=1.5") == {1: 3.0, 2: 1.5}
    assert parse_slowdown("") == {} and parse_slowdown(None) == {}


@pytest.mark.parametrize(
    "text,fragment",
    [("1", "RANK=FACTOR"), ("a=2", "integer"), ("1=0.5", ">= 1"), ("-1=2", ">= 0"), ("1=2,1=3", "twice")],
)
def test_parse_slowdown_errors(text, fragment):
    with pytest.raises(InputError, match=fragment):
        parse_slowdown(text)


def test_parse_pattern():
    assert parse_pattern("roundrobin:0.5") == Pattern("roundrobin", 0.5)
    assert parse_pattern("prob:0.1:2") == Pattern("prob", 2.0, 0.1)
    assert parse_pattern(None) is None


@pytest.mark.parametrize("text", ["roundrobin", "prob:0.1", "prob:x:1", "prob:1.5:1", "roundrobin:-1", "sleep:1"])
def test_parse_pattern_errors(text):
    with pytest.raises(InputError):
        parse_pattern(text)


def test_roundrobin_sleeps_on_its_turn_and_prob_is_seeded():
    s = [Straggler(r, 3, pattern=Pattern("roundrobin", 0.2)) for r in range(3)]
    assert [[w.pattern_s(i) for w in s] for i in range(4)] == [[0.2, 0, 0], [0, 0.2, 0], [0, 0, 0.2], [0.2, 0, 0]]
    stragglers = [Straggler(1, 4, pattern=Pattern("prob", 1.0, 0.3), seed=7) for _ in range(2)]
    draws = [[s.pattern_s(i) for i in range(50)] for s in stragglers]
    assert draws[0] == draws[1] and 5 < sum(d > 0 for d in draws[0]) < 30
    assert Straggler(0, 2, factor=3).slowdown_s(0.1) == pytest.approx(0.2)


def _env(tmp_path, **extra):
    plan_path = save(dp_plan(2), tmp_path / "plan.yaml")
    env = {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "FELACTL_PLAN": str(plan_path),
        "FELACTL_RUN_DIR": str(tmp_path),
        "FELACTL_STORE": "127.0.0.1:29500",
    }
    env.update(extra)
    return env


def test_from_env_reads_the_workers_settings(tmp_path):
    cfg = from_env(_env(tmp_path, FELACTL_SLOWDOWN="1=3,0=2", FELACTL_STEPS="7"))
    assert (cfg.rank, cfg.local_rank, cfg.steps, cfg.slowdown, cfg.host_store) == (1, 1, 7, 3.0, False)


def test_the_plan_is_the_one_source_of_the_sync_mode(tmp_path):
    """``--sync`` travels once, in the run's copy of the plan: an old environment variable that
    named another mode changes nothing."""
    cfg = from_env(_env(tmp_path, FELACTL_SYNC="wbsp", FELACTL_OVERLAP="1"))
    plan = cfg.load_plan()
    assert plan.sync.mode.value == "bsp" and plan.sync.overlap is False


@pytest.mark.parametrize(
    "extra,fragment",
    [
        ({"RANK": "2"}, "< WORLD_SIZE"),
        ({"FELACTL_STEPS": "0"}, ">= 1"),
        ({"FELACTL_STORE": "nohost"}, "host:port"),
        ({"FELACTL_PLAN": ""}, "FELACTL_PLAN"),
    ],
)
def test_from_env_errors(tmp_path, extra, fragment):
    with pytest.raises(InputError, match=fragment):
        from_env(_env(tmp_path, **extra))


def test_the_backend_follows_the_plans_devices_not_the_machine():
    """A CPU plan (or one that places nothing) stays on gloo even where a GPU exists (a 2-slot CPU
    demo on a 1-GPU box used to put worker 1 on a GPU that does not exist); an all-GPU plan gets
    NCCL; a plan of both kinds, which check_executable refuses, would run on gloo."""
    cuda = placed(dp_plan(2), DeviceKind.CUDA)
    mixed = dataclasses.replace(cuda, placement=(cuda.placement[0], placed(dp_plan(2)).placement[1]))
    assert [plan_backend(p) for p in (dp_plan(2), placed(dp_plan(2)), cuda, mixed)] == ["gloo", "gloo", "nccl", "gloo"]
    cfg = dataclasses.replace(local_worker_config(Path("p.yaml"), Path(".")), rank=1, local_rank=1, world_size=2)
    assert choose_device(cfg, "gloo") == torch.device("cpu")


def test_a_worker_started_by_hand_runs_on_its_plans_backend(tmp_path, monkeypatch):
    """The backend travels in the plan only: a worker started without felactl's launcher (which used
    to set FELACTL_BACKEND from the plan) on a plan of GPUs forms its group on NCCL, not on gloo."""
    plan_path = save(placed(dp_plan(1), DeviceKind.CUDA), tmp_path / "plan.yaml")
    env = {"RANK": "0", "WORLD_SIZE": "1", "FELACTL_PLAN": str(plan_path), "FELACTL_RUN_DIR": str(tmp_path)}
    cfg = from_env({**env, "FELACTL_STORE": "127.0.0.1:29500"})
    formed = []

    class Formed(Exception):
        pass

    def start(cfg, backend=None):
        formed.append(backend)
        raise Formed

    monkeypatch.setattr(fixed, "start", start)
    with pytest.raises(Formed):
        fixed.FixedMembership(cfg).start()
    assert formed == ["nccl"]


def test_world_size_must_match_the_plan(tmp_path):
    with pytest.raises(InputError, match="WORLD_SIZE"):
        from_env(_env(tmp_path, WORLD_SIZE="3")).load_plan()


@pytest.mark.parametrize("total,shares", [(32, [0.5, 0.5]), (10, [1, 1, 1]), (7, [0.9, 0.1]), (64, [0.2, 0.3, 0.5])])
def test_split_by_shares_covers_exactly(total, shares):
    ranges = split_by_shares(total, shares)
    assert [i for r in ranges for i in r] == list(range(total))
    for r, share in zip(ranges, shares):
        assert abs(len(r) - total * share / sum(shares)) <= 1


def test_micro_batches():
    assert [list(m) for m in micro_batches(range(3, 10), 3)] == [[3, 4, 5], [6, 7, 8], [9]]


def test_place_data_parallel_and_pipelines():
    plan = dp_plan(3, shares=[0.5, 0.25, 0.25])
    assert [place(plan, r).offsets for r in range(3)] == [range(0, 16), range(16, 24), range(24, 32)]
    pipe = pipeline_plan([0, 1, 3], num_replicas=2)  # cpu0,cpu1 = replica 0; cpu2,cpu3 = replica 1
    p = place(pipe, 3)
    assert (p.stage, p.replica, p.prev_rank, p.next_rank, p.stage_ranks) == (1, 1, 2, None, (1, 3))
    assert p.offsets == range(16, 32) and place(pipe, 0).is_first and place(pipe, 1).is_last


def _record(rank, step, samples, loss, start, duration, compute, stage=0, tokens=0):
    return {
        "time": start + duration,
        "rank": rank,
        "stage": stage,
        "step": step,
        "samples": samples,
        "loss": loss,
        "compute_s": compute,
        "comm_s": 0.1,
        "wait_s": duration - compute - 0.1,
        "duration_s": duration,
        "tokens": tokens,
    }


def test_summarize():
    records = [
        _record(0, 0, 24, 2.0, 10.0, 1.0, 0.8, tokens=3),
        _record(1, 0, 8, 3.0, 10.0, 1.0, 0.4, tokens=1),
        _record(0, 1, 20, 1.0, 11.0, 1.0, 0.8, tokens=5),
        _record(1, 1, 12, 2.0, 11.0, 1.0, 0.4, tokens=3),
    ]
    s = summarize(records)
    assert s["samples"] == 64 and s["steps"] == 2 and s["wall_s"] == pytest.approx(2.0)
    assert s["samples_per_s"] == pytest.approx(32.0)
    assert s["final_loss"] == pytest.approx((1.0 * 20 + 2.0 * 12) / 32)
    assert s["compute_fraction"] == pytest.approx(2.4 / 4.0)
    assert [(w["rank"], w["samples"], w["tokens"]) for w in s["workers"]] == [(0, 44, 8), (1, 20, 4)]
    assert s["workers"][1]["wait_s"] == pytest.approx(2 * 0.5)


def test_summarize_counts_training_steps_when_ranks_come_and_go():
    # rank 0 trains steps 0-2 and dies; rank 2 joined at step 1 and trains on to step 4
    records = [_record(0, s, 8, 2.0, 10.0 + s, 1.0, 0.8) for s in range(3)]
    records += [_record(2, s, 8, 2.0, 10.0 + s, 1.0, 0.8) for s in range(1, 5)]
    records += [_record(2, 4, 8, 2.0, 20.0, 1.0, 0.8)]  # a resume redid step 4
    assert summarize(records)["steps"] == 5


def test_the_final_loss_is_the_last_steps_not_a_dead_workers_stale_one():
    """Worker 2 died after step 3 (its last loss 1.27); workers 0 and 1 trained on to step 9:
    the run's final loss is step 9's, weighted by the samples each computed it on."""
    records = [_record(w, s, 8, 1.27, 10.0 + s, 1.0, 0.8) for w in range(3) for s in range(4)]
    records += [_record(0, s, 16, 1.0, 10.0 + s, 1.0, 0.8) for s in range(4, 10)]
    records += [_record(1, s, 8, 0.994, 10.0 + s, 1.0, 0.8) for s in range(4, 10)]
    records[-1]["loss"] = 0.991
    assert summarize(records)["final_loss"] == pytest.approx((1.0 * 16 + 0.991 * 8) / 24)


def test_a_step_redone_after_a_failure_has_the_loss_of_its_redo():
    """Worker 1 finished step 5 and died before worker 0 could (gloo: the peer that receives the
    last piece of the allreduce first); worker 0 then redid step 5 alone in the next generation,
    on all of its samples. The step's loss is the redo's, not a mean with the dead worker's half."""
    records = [_record(w, s, 8, 2.0, 10.0 + s, 1.0, 0.8) for w in range(2) for s in range(5)]
    records += [_record(1, 5, 8, 1.5, 15.0, 1.0, 0.8)]
    records += [{**_record(0, 5, 16, 1.8, 17.0, 1.0, 0.8), "generation": 1}]
    assert summarize(records)["final_loss"] == pytest.approx(1.8)


def test_summarize_counts_samples_at_the_first_stage_only():
    records = [_record(0, 0, 32, None, 0.0, 1.0, 0.5, stage=0), _record(1, 0, 32, 2.5, 0.0, 1.0, 0.5, stage=1)]
    s = summarize(records)
    assert s["samples"] == 32 and s["final_loss"] == 2.5
    with pytest.raises(InputError):
        summarize([])


def test_adaptive_wait():
    assert adapt_wait(0.001, 1) == 0.002 and adapt_wait(0.008, 1) == MAX_WAIT_S
    assert adapt_wait(0.001, 2) == pytest.approx(0.0009) and adapt_wait(MIN_WAIT_S, 3) == MIN_WAIT_S


def test_group_closes_at_max_group_or_after_the_wait():
    g = GroupScheduler([0, 1, 2, 3], max_group=2, wait_s=0.001, connect_every=100)
    g.arrive(2, 0.0)
    g.arrive(0, 0.0001)
    assert g.poll(0.0001) == [[2, 0]] and g.wait_s == pytest.approx(0.0009)
    g.arrive(1, 0.01)
    assert g.poll(0.0102) == [] and g.deadline() == pytest.approx(0.0109)
    assert g.poll(0.011) == [[1]] and g.wait_s == pytest.approx(0.0018)


def test_a_workers_every_pth_arrival_holds_it_until_the_replicas_connect():
    g = GroupScheduler([0, 1, 2, 3], max_group=2, wait_s=0.001, connect_every=2)
    g.arrive(0, 0.0)
    g.arrive(1, 0.0)
    assert g.poll(0.0) == [[0, 1]]
    g.arrive(0, 1.0)  # rank 0's second arrival: it waits for a connection of {0,1}, {2}, {3}
    assert g.held == [0] and g.deadline() is None
    assert g.poll(5.0) == [], "held, however long, until someone arrives"
    g.arrive(2, 5.0)
    assert g.poll(5.0) == [[0, 2]] and g.held == [0], "averages with each arrival, still held"
    g.arrive(3, 6.0)
    assert g.poll(6.0) == [[0, 3]] and g.held == [] and g.connections == 1, "released on the connection"
    g.arrive(1, 7.0)  # rank 1's second arrival: the union-find started over, so 1 waits again
    assert g.poll(7.0) == [] and g.held == [1]
    g.leave(0), g.leave(2), g.leave(3)
    assert g.poll(8.0) == [[1]] and g.held == [], "the others left: the one replica left is connected"


def test_leavers_are_never_grouped():
    g = GroupScheduler([0, 1, 2], max_group=2, wait_s=0.001, connect_every=100)
    g.arrive(0, 0.0)
    g.leave(1)
    g.arrive(2, 0.0)
    assert g.poll(0.0) == [[0, 2]] and g.active == {0, 2}


@pytest.mark.multiprocess
def test_worker_entry_exits_2_with_one_line_on_bad_input(tmp_path):
    import subprocess
    import sys

    env = {k: v for k, v in _env(tmp_path).items() if k != "FELACTL_PLAN"}
    done = subprocess.run(
        [sys.executable, "-m", "felactl.agents.worker"],
        env={**env, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.strip() == "felactl worker: FELACTL_PLAN is not set"


def test_a_resumed_run_is_timed_over_the_time_it_ran_not_the_time_it_was_stopped():
    """Steps 0-9 at 1 s each, stopped, resumed from step 10 a thousand seconds later, steps 10-19:
    20 s of training (the stop counted as training made samples/s 50x too low)."""
    records = [_record(0, s, 8, 1.0, 100.0 + s, 1.0, 0.8) for s in range(10)]
    records += [_record(0, s, 8, 1.0, 1100.0 + s, 1.0, 0.8) for s in range(10, 20)]
    events = [{"time": 99.0, "kind": "launch"}, {"time": 1099.0, "kind": "resume", "from_step": 10}]
    s = summarize(records, events)
    assert s["wall_s"] == pytest.approx(20.0) and s["samples_per_s"] == pytest.approx(160 / 20.0)


@pytest.mark.parametrize("terminal", [False, True])
def test_the_live_run_view_ends_on_a_line_of_its_own(terminal, tmp_path):
    """Piped to a log (or on a terminal), the run's last table ends with a newline, so the launch's
    result line that follows is a line of its own (rich's Live left it glued to the caption)."""
    import io

    from rich.console import Console

    from felactl.cli.runview import live_run
    from felactl.launcher.follow import LaunchState
    from felactl.launcher.rundir import RunDir

    out = io.StringIO()
    console = Console(file=out, width=100, force_terminal=terminal, color_system=None)
    state = LaunchState(run=RunDir.create("r1", root=tmp_path), plan=dp_plan(1))
    with live_run(console, lambda run_id: f"run {run_id}") as update:
        update(state)  # no record yet: nothing to draw
        state.records = [_record(0, 0, 24, 2.0, 10.0, 1.0, 0.8), _record(0, 1, 24, 1.5, 11.0, 1.0, 0.8)]
        update(state)
    console.print("run r1: 2 steps")
    text = out.getvalue()
    assert "run r1" in text and "loss 1.5000" in text
    assert re.search(r"\n(\x1b\[\?25h)?run r1: 2 steps\n$", text), text  # (a terminal shows its cursor again)
    if not terminal:
        assert text.count("loss 1.5000") == 1


def test_the_live_view_of_a_resumed_run_counts_the_time_it_ran(tmp_path):
    """The live table of a resumed run reads the same samples/s as the summary under it: it
    summarized the records without the run's events, so the time the run lay stopped counted
    (a trial printed 6525 samples/s in the table and 8823 in the result line below it)."""
    import io

    from rich.console import Console

    from felactl.cli.runview import live_run
    from felactl.launcher.follow import LaunchState
    from felactl.launcher.rundir import RunDir, append_jsonl

    run = RunDir.create("r", root=tmp_path)
    for event in ({"time": 99.0, "kind": "launch"}, {"time": 1099.0, "kind": "resume", "from_step": 10}):
        append_jsonl(run.events, event)
    state = LaunchState(run=run, plan=dp_plan(1))
    state.records = [_record(0, s, 8, 1.0, 100.0 + s, 1.0, 0.8) for s in range(10)]
    state.records += [_record(0, s, 8, 1.0, 1100.0 + s, 1.0, 0.8) for s in range(10, 20)]
    out = io.StringIO()
    with live_run(Console(file=out, width=100), lambda run_id: run_id) as update:
        update(state)
    assert "8.0 samples/s" in out.getvalue(), out.getvalue()  # 160 samples in 20 s of training


def test_a_worker_says_it_has_started_before_its_first_step(tmp_path):
    """The coordinator tells "a node could not start" from "a worker failed" by the heartbeats that
    say a step: the one that says the start is on the store when the worker's start returns, not
    up to a beat later (a job whose steps take milliseconds lost a worker at step 10 in CI, and the
    launch failed as if its node had never started)."""
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    cfg = from_env(_env(tmp_path, FELACTL_STORE=f"127.0.0.1:{store.port}", FELACTL_HEARTBEAT_S="60"))
    beat = Heartbeat(cfg)
    beat.start()
    try:
        reader = cfg.reader(store)
        deadline = time.monotonic() + 10
        while (first := reader.read(keys.heartbeat(cfg.worker_id), HeartbeatDoc.KIND.value)) is None:
            assert time.monotonic() < deadline, "no first beat"
            time.sleep(0.01)
        assert first.body["step"] == -1
        beat.say_started(0)
        said = reader.read(keys.heartbeat(cfg.worker_id), HeartbeatDoc.KIND.value)
        assert said is not None and said.body["step"] == 0
    finally:
        beat.stopped.set()
        beat.join(timeout=5)
