"""A job that cannot go on ends, at once and saying why: an exception in the user's own code, and
a node whose workers cannot start."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from felactl import models
from felactl.launcher.rundir import read_jsonl
from felactl.spec import Placement, save

sys.path.insert(0, str(Path(__file__).parent))
from _worker_helpers import Job, free_endpoint, second_node  # noqa: E402

pytestmark = pytest.mark.multiprocess
TESTS = Path(__file__).parent
SLIP = "RuntimeError: The size of tensor a (2) must match the size of tensor b (16) at non-singleton dimension 1"


def _user_job(tmp_path: Path, *config: str, extra: tuple[str, ...] = ()) -> Job:
    env_path = f"{TESTS}:{os.environ.get('PYTHONPATH', '')}"
    options = [item for pair in (("--config", c) for c in config) for item in pair]
    return Job(
        tmp_path,
        "--job",
        "_user_models:shape_slip",
        *options,
        "--nproc-per-node",
        "2",
        "--global-batch",
        "8",
        "--run-id",
        "slip",
        "--steps",
        "5",
        *extra,
        env={"PYTHONPATH": env_path},
    )


@pytest.mark.parametrize(
    ("config", "line"),
    [
        (("where=loss_fn",), SLIP),
        (("where=forward", "error=label"), "LabelError: label 7 is not one of the 2 classes"),
        (("where=optimizer",), SLIP),
    ],
    ids=["loss_fn-RuntimeError", "forward-own-type", "optimizer-factory"],
)
def test_an_exception_in_the_users_code_ends_an_elastic_launch(config, line, tmp_path, no_leftovers):
    """torch's own RuntimeError from a loss with a shape slip looks like a collective's failure:
    the elastic job re-formed on it forever (335 re-forms, no exit). It ends with exit 1 and the
    user's exception line, whatever the exception's type and wherever the user's code raised it
    (a step's forward or loss, or the optimizer factory while the workers start)."""
    job = _user_job(tmp_path, *config)
    try:
        _, err = job.proc.communicate(timeout=60)
    finally:
        job.stop()
    err = err.decode()
    assert job.proc.returncode == 1, err[-3000:]
    errors = [ln for ln in err.splitlines() if ln.startswith("felactl: error:")]
    assert len(errors) == 1 and line in errors[0], err[-3000:]
    assert str(tmp_path / "runs" / "slip" / "logs" / "worker-") in errors[0], errors[0]


def _two_nodes(tmp_path: Path, nnodes: str) -> tuple[Job, subprocess.Popen]:
    """A launch on node ``na`` of a plan that also places a worker on node ``nb``, whose agent (a
    second local agent) runs with a PYTHONPATH that lacks the job's module: its worker cannot
    import it, as on a node where the user's code was not copied."""
    plan = models.local_data_parallel_plan(
        "_user_models:slow_first_step", {"delay_s": 0.0}, 2, global_batch=8, micro_batch=4
    )
    placement = tuple(Placement(device=f"cpu{i}", node=node, local_index=0) for i, node in enumerate(("na", "nb")))
    plan_path = save(dataclasses.replace(plan, placement=placement), tmp_path / "plan.yaml")
    endpoint = free_endpoint()
    env = {"PYTHONPATH": f"{TESTS}:{os.environ.get('PYTHONPATH', '')}"}
    args = ("--run-id", "a", "--steps", "20", "--node-name", "na", "--rdzv-endpoint", endpoint, "--nnodes", nnodes)
    job = Job(tmp_path, str(plan_path), *args, env=env)
    agent = second_node(job, tmp_path, "a", endpoint, "nb", 1)
    return job, agent


def _stop(job: Job, agent: subprocess.Popen) -> None:
    job.stop()
    if agent.poll() is None:
        os.killpg(agent.pid, signal.SIGKILL)
    agent.wait()


IMPORT_ERROR = "cannot import: No module named '_user_models'"


def test_a_node_that_cannot_start_fails_the_launch_at_once_naming_the_node_and_why(tmp_path, no_leftovers):
    """It failed after 85 s with "generation 1: workers [0] did not switch within 60 s" (worker 0
    waited for worker 1 to arrive, which never would)."""
    job, agent = _two_nodes(tmp_path, "2")
    try:
        _, err = job.proc.communicate(timeout=60)
    finally:
        _stop(job, agent)
    err = err.decode()
    errors = [ln for ln in err.splitlines() if ln.startswith("felactl: error:")]
    assert job.proc.returncode == 2 and len(errors) == 1, err[-3000:]  # its module is not there: bad input
    assert errors[0].startswith("felactl: error: node 'nb' could not start: worker 1 exited with code 2"), errors[0]
    assert IMPORT_ERROR in errors[0] and "nb-logs/worker-1.log" in errors[0], errors[0]


def test_with_nnodes_min_max_the_job_goes_on_without_the_node_that_cannot_start(tmp_path, no_leftovers):
    """--nnodes 1:2 (torchrun's MIN:MAX): node nb is left out, worker 0 starts alone and trains every step."""
    job, agent = _two_nodes(tmp_path, "1:2")
    try:
        summary = job.finish()
    finally:
        _stop(job, agent)
    assert summary["steps"] == 20
    events = read_jsonl(tmp_path / "runs" / "a" / "events.jsonl")
    failure = next(e for e in events if e["kind"] == "failure")
    assert failure["members_after"] == [0] and IMPORT_ERROR in failure["reason"], failure
    assert {r["rank"] for r in job.records("a")} == {0}
