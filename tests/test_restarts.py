"""A job that cannot rescale live (a pipeline, a sharded stage, ``--no-elastic``) survives a failed
worker: every worker starts again from the run's newest checkpoint and trains to the last step
(issue 32, item 3); a failure that repeats the same way after a restart is the job's own and ends it."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
from pathlib import Path

import psutil
import pytest

from felactl.control.metrics import step_losses, without_redone
from felactl.launcher.rundir import read_jsonl
from felactl.spec import ModelRef, Placement, Plan, load_plan, save

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))
from _worker_helpers import (  # noqa: E402
    Job,
    free_endpoint,
    hybrid_plan,
    pipeline_plan,
    second_node,
    single_process,
    wait_checkpoint,
    worker_processes,
)
from test_job_errors import SLIP, _user_job  # noqa: E402

pytestmark = pytest.mark.multiprocess
STARTUP_S = 120.0
"""How long a launch may take to reach its first steps on a loaded machine (a bound, not a measurement)."""


def _step_losses(records: list[dict]) -> dict[tuple[int, int], float]:
    """The last stage's loss of each (generation, step): what each attempt computed."""
    return {(r.get("generation", 0), r["step"]): r["loss"] for r in records if r.get("loss") is not None}


LM = "examples.llama:job"
LM_CONFIG = {"seq_len": 16, "width": 32, "depth": 2, "num_heads": 2, "total_steps": 200}
"""The LLaMA-shaped example (embedding, a ModuleList of RoPE blocks, a tied head; its own AdamW,
schedule and clipping), small: cut at its blocks it is the split model a user's LM is."""


def lm_pipeline(replicas: int = 1) -> Plan:
    """The LM cut after its first block: 2 stages x ``replicas`` pipelines."""
    plan = pipeline_plan([0, 2, 4], num_replicas=replicas, global_batch=16, micro_batch=4, config=LM_CONFIG)
    return dataclasses.replace(plan, model=ModelRef(name=LM, source=LM, config=LM_CONFIG))


LM_ENV = {"PYTHONPATH": f"{TESTS.parent}:{os.environ.get('PYTHONPATH', '')}"}
"""Where the launch and its workers import the example from."""

TWO_STAGES = {
    "lm": lm_pipeline,
    "flexible": lambda replicas: hybrid_plan(
        [(0, 2, 4, list(range(replicas))), (2, 3, 4, list(range(replicas, 2 * replicas)))],
        2 * replicas,
        optimizer="adamw",
        lr=0.01,
    ),
}
"""Two stages, each on ``replicas`` workers: the LM's static pipelines, or the mlp (AdamW) as the flexible hybrid."""


def _pipeline_job(tmp_path: Path, run_id: str, steps: int, num_replicas: int = 1, shape="lm"):
    """``TWO_STAGES[shape]`` launched, with room for 4 workers: (its plan, the job)."""
    plan = TWO_STAGES[shape](num_replicas)
    args = ("--run-id", run_id, "--steps", str(steps), "--straggler", "roundrobin:0.1", "--max-nproc-per-node", "4")
    return plan, Job(tmp_path, str(save(plan, tmp_path / "plan.yaml")), *args, env=LM_ENV)


def _worker_process(job: Job, rank: int) -> psutil.Process:
    """The launch's worker process of ``rank`` (a job of fixed members records no pids)."""
    workers = worker_processes(job.proc.pid)
    assert rank in workers, f"no worker of rank {rank} is running"
    return workers[rank]


def test_a_killed_worker_of_a_two_stage_pipeline_restarts_from_the_checkpoint_and_completes_every_step(
    tmp_path, no_leftovers
):
    """Kill -9 the last stage's worker of the LM cut at a block mid-run: the launch restarts both
    stages from the newest complete checkpoint, redoes the steps after it exactly (the same
    losses), and ends at the last step with the restart, its pause and what it redid in the
    summary."""
    steps = 40
    summary = _killed_after_a_checkpoint(tmp_path, save(lm_pipeline(), tmp_path / "plan.yaml"), "p", steps)
    run = tmp_path / "runs" / "p"
    assert summary["steps"] == steps
    (restart,) = summary["restarts"]
    assert restart["attempt"] == 1 and restart["from_step"] >= 10 and restart["pause_s"] > 0
    events = [e for e in read_jsonl(run / "events.jsonl") if e["kind"] == "restart"]
    assert len(events) == 1 and events[0]["checkpoint"].endswith(f"step{restart['from_step']:06d}")
    losses = _step_losses(read_jsonl(run / "metrics.jsonl"))
    assert {step for _, step in losses} == set(range(steps)), "every step trained"
    _redone_as_first(losses, restart["from_step"])


def _killed_after_a_checkpoint(tmp_path: Path, plan: Path, run_id: str, steps: int, *args: str) -> dict:
    """``plan`` launched for ``steps`` (a checkpoint every 5), its rank 1 killed -9 once step 12
    is done and step 10's checkpoint written: the launch's summary."""
    args = (
        "--run-id",
        run_id,
        "--steps",
        str(steps),
        "--checkpoint-every",
        "5",
        "--straggler",
        "roundrobin:0.1",
        *args,
    )
    job = Job(tmp_path, str(plan), *args, env=LM_ENV)
    try:
        job.wait_step(run_id, 12, timeout_s=STARTUP_S)
        wait_checkpoint(tmp_path / "runs", run_id, at_least=10, timeout_s=STARTUP_S)
        _worker_process(job, rank=1).send_signal(signal.SIGKILL)
        return job.finish(timeout_s=STARTUP_S)
    finally:
        job.stop()


def _redone_as_first(losses: dict[tuple, float], from_step: int) -> None:
    """Each loss of a step the restart redid (keys ``(generation, step, ...)``) is its first
    attempt's: the same state and the same batches."""
    redone = [key for key in losses if key[0] == 1 and (0, *key[1:]) in losses]
    assert redone and min(key[1] for key in redone) == from_step, (from_step, sorted(losses))
    for key in redone:
        assert losses[key] == pytest.approx(losses[(0, *key[1:])], rel=1e-5, abs=1e-6), key


def test_a_killed_worker_of_a_sharded_stage_restarts_from_its_shards_and_completes_every_step(tmp_path, no_leftovers):
    """The LM sharded over 2 workers (FSDP2): a sharded stage's state is lost with any of its
    workers, so kill -9 one mid-run and the launch restarts from the newest checkpoint, each worker
    reading its shards back (torch.distributed.checkpoint); the redone steps have the same losses."""
    from felactl import models
    from felactl.spec import SyncMode, SyncSpec, Training

    plan = models.local_data_parallel_plan(
        LM, LM_CONFIG, 2, global_batch=8, micro_batch=2, sync=SyncSpec(mode=SyncMode.BSP), training=Training(seed=0)
    )
    plan = save(
        dataclasses.replace(plan, stages=(dataclasses.replace(plan.stages[0], shard=True),)), tmp_path / "p.yaml"
    )
    steps = 30
    summary = _killed_after_a_checkpoint(tmp_path, plan, "f", steps, "--keep-checkpoints", "0")
    run = tmp_path / "runs" / "f"
    assert summary["steps"] == steps
    (restart,) = summary["restarts"]
    assert restart["from_step"] >= 10, restart
    assert list((run / "checkpoints" / f"step{restart['from_step']:06d}").glob("stage0.*.shards"))
    # each worker's loss over its own samples (both record one: data parallel), by rank
    records = read_jsonl(run / "metrics.jsonl")
    losses = {(r.get("generation", 0), r["step"], r["rank"]): r["loss"] for r in records}
    assert {step for _, step, _ in losses} == set(range(steps)), "every step trained"
    _redone_as_first(losses, restart["from_step"])


@pytest.mark.parametrize("shape", ["lm", "flexible"])
def test_a_killed_worker_of_replicated_stages_restarts_from_what_the_survivors_hold_and_redoes_no_step(
    tmp_path, no_leftovers, shape
):
    """2 stages of 2 workers each (2 static pipelines of the LM cut at a block, or the flexible
    hybrid's token-scheduled stages of the mlp) and no checkpoint before the run's last: kill -9 a worker mid-run. The three left hold
    every stage of the last step every worker summed (no worker steps its optimizer before all
    have), write it as that step's checkpoint, and the restart goes on from there: no step
    redone, each step's loss one process's."""
    steps = 30
    plan, job = _pipeline_job(tmp_path, "k", steps, num_replicas=2, shape=shape)
    try:
        job.wait_step("k", 10, timeout_s=STARTUP_S)
        # pipelines: cpu2, stage 0 of pipeline 1; flexible: rank 0, whose token server the others
        # wait on (nothing fails in them: the launcher tells them of the failure)
        _worker_process(job, rank=2 if shape == "lm" else 0).send_signal(signal.SIGKILL)
        summary = job.finish(timeout_s=STARTUP_S)
    finally:
        job.stop()
    run = tmp_path / "runs" / "k"
    assert summary["steps"] == steps
    (restart,) = summary["restarts"]
    assert restart["from_step"] >= 10 and restart["redone_steps"] == 0, restart
    (event,) = [e for e in read_jsonl(run / "events.jsonl") if e["kind"] == "restart"]
    assert event["kept_by_survivors"] and event["checkpoint"].endswith(f"step{restart['from_step']:06d}"), event
    records = read_jsonl(run / "metrics.jsonl")
    assert {r["step"] for r in records if r.get("loss") is not None} == set(range(steps)), "every step trained"
    _, want = single_process(plan, steps)
    by_step = step_losses(without_redone(records, read_jsonl(run / "events.jsonl")))
    assert [by_step[s] for s in range(steps)] == pytest.approx(want, rel=1e-4, abs=1e-5)


def test_a_failure_that_repeats_after_a_restart_ends_the_job_as_the_jobs_own(tmp_path, no_leftovers):
    """A user's loss that raises fails every attempt at the same step with the same line: one
    restart, then exit 1 saying so, not ``--max-restarts`` rounds of the same failure."""
    job = _user_job(tmp_path, "where=loss_fn", extra=("--no-elastic",))
    try:
        _, err = job.proc.communicate(timeout=STARTUP_S)
    finally:
        job.stop()
    err = err.decode()
    assert job.proc.returncode == 1, err[-3000:]
    errors = [ln for ln in err.splitlines() if ln.startswith("felactl: error:")]
    assert len(errors) == 1 and SLIP in errors[0] and "failed the same way after a restart" in errors[0], errors
    kinds = [e["kind"] for e in read_jsonl(tmp_path / "runs" / "slip" / "events.jsonl")]
    assert kinds.count("restart") == 1 and kinds[-1] == "failed", kinds


def test_a_two_stage_pipeline_scaled_out_and_in_restarts_on_each_plan_and_trains_as_one_process(tmp_path, no_leftovers):
    """``felactl scale`` on the LM cut at a block: the job drains (its workers agree on a last
    step and checkpoint it), restarts on the plan for the new workers (2 stages x 2 pipelines,
    then back to one), each worker taking its stage from the checkpoint; every step is trained
    once and each step's loss is one process's on the same batches."""
    steps = 60
    plan, job = _pipeline_job(tmp_path, "s", steps, shape="lm")
    try:
        job.wait_step("s", 5, timeout_s=STARTUP_S)
        grown = job.scale("s", "--add", "2")
        assert grown.exit_code == 0, grown.output
        out = json.loads(grown.stdout)
        assert out["kind"] == "scale-out" and len(out["members_after"]) == 4 and out["stages"] == 2, out
        assert out["by_restart"] and out["pause_s"] > 0, out
        shrunk = job.scale("s", "--remove", "2,3")
        assert shrunk.exit_code == 0, shrunk.output
        assert len(json.loads(shrunk.stdout)["members_after"]) == 2
        summary = job.finish(timeout_s=STARTUP_S)
    finally:
        job.stop()
    assert summary["steps"] == steps
    assert [r["kind"] for r in summary["restarts"]] == ["scale-out", "scale-in"]
    assert all(r["redone_steps"] == 0 for r in summary["restarts"]), summary["restarts"]
    run = tmp_path / "runs" / "s"
    assert (run / "plan.1.yaml").exists() and (run / "plan.2.yaml").exists()
    records = read_jsonl(run / "metrics.jsonl")
    losses = {r["step"]: r["loss"] for r in records if r.get("loss") is not None}
    assert set(losses) == set(range(steps)), "every step trained"
    two_pipelines = {r["step"] for r in records if r.get("generation") == 1}
    assert two_pipelines, "some steps ran on the 2 x 2 plan"
    _, want = single_process(plan, steps)
    by_step = step_losses(without_redone(records, read_jsonl(run / "events.jsonl")))
    got = [by_step[s] for s in range(steps)]
    assert got == pytest.approx(want, rel=1e-4, abs=1e-5)


def test_with_its_profiles_a_pipeline_scaled_in_is_re_planned_and_its_stages_re_split(tmp_path, no_leftovers):
    """Launched with its profiles, a two-stage pipeline scaled in to one worker is re-planned by
    the planner (one stage on one device) and that worker takes the whole model from the two
    stage files of the drain's checkpoint, by the model's names; scaled out again, the planner's
    plan for two takes its stages from that one-stage checkpoint (a user's trial lost the run
    here: the checkpoint was judged by the launch's two-stage plan, found incomplete, and the job
    started over). Training goes on as one process."""
    from felactl.machine import short_hostname
    from felactl.profiling.model import profile_model
    from felactl.spec import ClusterSpec, Device, DeviceKind, LinkDefault, LinkType, Node, load_plan

    plan = pipeline_plan([0, 2, 3], optimizer="adamw", lr=0.01)
    devices = tuple(
        Device(name=f"cpu{i}", kind=DeviceKind.CPU, model="cpu", tflops=0.05, memory_gb=4.0, local_index=i)
        for i in range(2)
    )
    cluster = ClusterSpec(
        name="here",
        nodes=(Node(name=short_hostname(), devices=devices),),
        intra_node_default=LinkDefault(bandwidth_gbps=5.0, latency_us=50.0, type=LinkType.LOOPBACK),
    )
    model = profile_model(plan.model.source, plan.model.config, [plan.stages[0].micro_batch], repeats=1)
    steps = 80
    args = ["--run-id", "p", "--steps", str(steps), "--straggler", "roundrobin:0.1"]
    args += [
        "--cluster",
        str(save(cluster, tmp_path / "cluster.yaml")),
        "--model",
        str(save(model, tmp_path / "m.yaml")),
    ]
    job = Job(tmp_path, str(save(plan, tmp_path / "plan.yaml")), *args)
    try:
        job.wait_step("p", 5, timeout_s=STARTUP_S)
        shrunk = job.scale("p", "--remove", "1")
        assert shrunk.exit_code == 0, shrunk.output
        out = json.loads(shrunk.stdout)
        # and back: the one-stage plan's checkpoint (one file) is complete, and re-split again
        grown = job.scale("p", "--add", "1")
        assert grown.exit_code == 0, grown.output
        summary = job.finish(timeout_s=STARTUP_S)
    finally:
        job.stop()
    assert (out["planned_by"], out["members_after"], out["stages"]) == ("planner", ["cpu0"], 1), out
    run = tmp_path / "runs" / "p"
    assert len(load_plan(run / "plan.1.yaml").stages) == 1
    assert summary["steps"] == steps and [r["kind"] for r in summary["restarts"]] == ["scale-in", "scale-out"]
    assert all(r["from_step"] > 0 and r["redone_steps"] == 0 for r in summary["restarts"]), summary["restarts"]
    records = read_jsonl(run / "metrics.jsonl")
    by_step = step_losses(without_redone(records, read_jsonl(run / "events.jsonl")))
    _, want = single_process(plan, steps)
    assert [by_step[s] for s in range(steps)] == pytest.approx(want, rel=1e-4, abs=1e-5)


def test_a_pipeline_that_loses_a_node_restarts_without_it_and_trains_as_one_process(tmp_path, no_leftovers):
    """Two pipelines, one per node; the second node's agent and workers killed: the launch finds
    that node gone (its agent does not report), re-plans the two stages on the node left, restarts
    there from the state its workers kept (they hold both stages: nothing is redone) and trains
    every step, as one process would."""
    plan = pipeline_plan([0, 2, 3], num_replicas=2, optimizer="adamw", lr=0.01)
    nodes = ("na", "na", "nb", "nb")
    placement = tuple(
        Placement(device=d, node=n, local_index=i % 2) for i, (d, n) in enumerate(zip(plan.devices, nodes))
    )
    path = save(dataclasses.replace(plan, placement=placement), tmp_path / "plan.yaml")
    endpoint = free_endpoint()
    steps = 60
    args = ("--run-id", "n", "--steps", str(steps), "--checkpoint-every", "5", "--straggler", "roundrobin:0.1")
    job = Job(tmp_path, str(path), *args, "--node-name", "na", "--rdzv-endpoint", endpoint, "--nnodes", "2")
    agent = None
    try:
        agent = second_node(job, tmp_path, "n", endpoint, "nb", 2, timeout_s=STARTUP_S)
        job.wait_step("n", 8, timeout_s=STARTUP_S)
        wait_checkpoint(tmp_path / "runs", "n", at_least=5, timeout_s=STARTUP_S)
        for proc in [psutil.Process(agent.pid), *psutil.Process(agent.pid).children(recursive=True)]:
            proc.kill()  # the node is gone: its agent and its workers at once
        summary = job.finish(timeout_s=STARTUP_S)
    finally:
        job.stop()
        if agent is not None and agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
        if agent is not None:
            agent.wait()
    (restart,) = summary["restarts"]
    assert restart["lost_nodes"] == ["nb"] and summary["steps"] == steps, restart
    assert restart["redone_steps"] == 0, restart
    run = tmp_path / "runs" / "n"
    assert [len(s.workers) for s in load_plan(run / "plan.1.yaml").stages] == [1, 1]
    records = read_jsonl(run / "metrics.jsonl")
    by_step = step_losses(without_redone(records, read_jsonl(run / "events.jsonl")))
    _, want = single_process(plan, steps)
    assert [by_step[s] for s in range(steps)] == pytest.approx(want, rel=1e-4, abs=1e-5)
