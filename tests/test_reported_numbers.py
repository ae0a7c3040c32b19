"""The numbers a run reports are the run's: the live table, the stop line and felactl status read
the same, newest state; after a failure the per-step loss is the unfaulted run's."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from felactl.cli.main import app
from felactl.control.metrics import step_losses
from felactl.launcher.rundir import read_jsonl
from felactl.spec import save

sys.path.insert(0, str(Path(__file__).parent))
from _worker_helpers import Job, dp_plan  # noqa: E402


def _status(tmp_path: Path, run_id: str) -> dict:
    result = CliRunner().invoke(app, ["status", run_id, "--runs-root", str(tmp_path / "runs"), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.multiprocess
def test_the_table_the_stop_line_and_status_say_the_same_step(tmp_path, no_leftovers):
    """A launch stopped by SIGTERM drains: its workers train a few more steps, agree on a last one
    and checkpoint it. The table printed at the end (stderr is not a terminal here), the stop line
    and felactl status then all say that step (the table used to show the last step it had read
    before the drain)."""
    plan = save(dp_plan(2), tmp_path / "plan.yaml")
    job = Job(tmp_path, str(plan), "--run-id", "st", "--steps", "100000")
    try:
        job.wait_step("st", 20)
        job.proc.send_signal(signal.SIGTERM)
        _, err = job.proc.communicate(timeout=60)
    finally:
        job.stop()
    said = err.decode()
    assert job.proc.returncode == 130, said[-3000:]
    stopped_at = int(re.search(r"stopped at step (\d+);", said).group(1))
    table_step = int(re.findall(r"^step (\d+) ", said, re.MULTILINE)[-1])
    assert table_step == stopped_at, said[-1500:]
    status = _status(tmp_path, "st")
    assert status["state"] == "stopped" and status["summary"]["steps"] == stopped_at


def test_the_table_left_on_a_terminal_is_drawn_when_the_run_has_ended():
    """On a terminal the table is redrawn in place at each update; the one left on screen is
    drawn once more at the end, from every step recorded by then (a drain trains a few steps
    after the last update)."""
    from types import SimpleNamespace

    from rich.console import Console

    from felactl.cli.runview import live_run

    steps = iter(range(1, 100))
    state = SimpleNamespace(
        run=SimpleNamespace(run_id="t"),
        summary_so_far=lambda: {"steps": next(steps), "final_loss": 1.0, "workers": []},
    )
    out = io.StringIO()
    with live_run(Console(file=out, force_terminal=True, width=100), lambda run_id: f"run {run_id}") as update:
        update(state)  # step 1 read here; the run then trains on before it ends
    assert re.findall(r"step (\d+) ", out.getvalue())[-1] == "2", out.getvalue()


def _whole_steps(records: list[dict], global_batch: int) -> set[int]:
    """The steps whose loss was recorded over their whole global batch: a worker that dies after
    its part of a step was summed, and before it recorded it, leaves that step's loss to the
    survivors' samples alone (or to none, if it was the step's only member)."""
    samples: dict[int, int] = {}
    for r in records:
        if r.get("loss") is not None:
            samples[r["step"]] = samples.get(r["step"], 0) + r["samples"]
    return {step for step, n in samples.items() if n == global_batch}


def _reference_losses(steps: int, global_batch: int) -> list[float]:
    """Each step's loss in single-process training of ``_user_models:short_data`` on the global
    batches ``k * global_batch + i`` (wrapping around the data): what every membership must see."""
    from _user_models import short_data

    job = short_data()
    optimizer = job.optimizer(job.model.parameters())
    losses = []
    for step in range(steps):
        inputs, targets = job.batch(range(step * global_batch, (step + 1) * global_batch))
        loss = job.loss_fn(job.model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.multiprocess
def test_after_a_worker_failure_each_step_has_the_single_process_loss_past_the_datasets_end(tmp_path, no_leftovers):
    """The same global batches in the same order whatever the membership: a run that lost a worker
    mid-run and went around its 64 samples (4 steps of 16) several more times on the survivor
    alone has, at every step, the loss of single-process training on the same batches."""
    steps = 40
    job = Job(
        tmp_path,
        *("--job", "_user_models:short_data", "--nproc-per-node", "2", "--global-batch", "16", "--sync", "tokens"),
        *("--run-id", "f", "--steps", str(steps), "--heartbeat-timeout", "2"),
        env={"PYTHONPATH": f"{Path(__file__).parent}:{os.environ.get('PYTHONPATH', '')}"},
    )
    try:
        job.wait_step("f", 10)
        job.signal_worker("f", 1, signal.SIGKILL)
        summary = job.finish()
    finally:
        job.stop()
    failure = next(e for e in read_jsonl(tmp_path / "runs" / "f" / "events.jsonl") if e["kind"] == "failure")
    assert failure["members_after"] == [0]
    records = job.records("f")
    expected, got = _reference_losses(steps, 16), step_losses(records)
    compared = sorted(_whole_steps(records, 16) - set(range(4)))
    assert len(compared) >= steps - 4 - 2, "only the steps the dead worker was part of lack a whole record"
    assert [s for s in compared if s > failure["step"]] == list(range(failure["step"] + 1, steps))
    differ = [s for s in compared if got[s] != pytest.approx(expected[s], rel=1e-4)]
    assert differ == [], [(s, expected[s], got[s]) for s in differ]
    assert summary["final_loss"] == pytest.approx(expected[-1], rel=1e-4)


def test_the_run_table_gives_each_worker_its_share_of_its_own_stages_samples():
    """A pipeline's stages each compute every sample: each is 100% of its stage (the table said 50%
    for both stages of a 2-stage pipeline, as if they had split the batch). Data parallel workers
    split theirs; a flexible plan's later stages, which record no samples, show none."""
    from rich.console import Console

    from felactl.cli.runview import run_table

    def shares(workers: list[dict]) -> list[str]:
        console = Console(width=200, record=True)
        summary = {"steps": 1, "samples_per_s": 1.0, "compute_fraction": 1.0, "workers": workers}
        console.print(run_table(summary, "run"))
        rows = [line.split("│") for line in console.export_text().splitlines() if line.startswith("│")]
        return [cells[5].strip() for cells in rows]

    def worker(rank: int, stage: int, samples: int) -> dict:
        return {
            "rank": rank,
            "stage": stage,
            "steps": 1,
            "samples": samples,
            "compute_s": 0.0,
            "comm_s": 0.0,
            "wait_s": 0.0,
        }

    assert shares([worker(0, 0, 960), worker(1, 1, 960)]) == ["100%", "100%"]
    assert shares([worker(0, 0, 720), worker(1, 0, 240)]) == ["75%", "25%"]
    assert shares([worker(0, 0, 64), worker(1, 1, 0)]) == ["100%", "-"]


def test_a_steps_loss_weighs_each_record_by_the_samples_its_loss_is_over():
    """A flexible hybrid's worker records the samples it took in at the first stage and the loss of
    those it ran the last stage for, which may be others (the fast worker takes more backward
    tokens): the step's loss weighs each record's by ``loss_samples``, not ``samples``. (Weighed by
    ``samples``, a 2 x 2 flexible run's losses were 0.1-4% off one process's.)"""
    records = [
        {"step": 0, "rank": 0, "samples": 16, "loss": 1.0, "loss_samples": 24},
        {"step": 0, "rank": 1, "samples": 16, "loss": 3.0, "loss_samples": 8},
        {"step": 1, "rank": 0, "samples": 32, "loss": 2.0},  # no loss_samples: over its samples
    ]
    assert step_losses(records) == {0: pytest.approx((24 * 1.0 + 8 * 3.0) / 32), 1: 2.0}
