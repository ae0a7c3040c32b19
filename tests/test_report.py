"""``felactl report``: what its figures plot is what the run recorded, read back from the figures
and checked against ``metrics.jsonl`` computed here, on its own. A finished, running and rescaled
run with its profiles is reported in ``tests/test_scale.py`` (its job already runs there:
:func:`check_report`); here a lost run, the page, and bad input."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread
from typer.testing import CliRunner

from felactl.cli.main import app
from felactl.launcher.liveness import LaunchIdentity
from felactl.launcher.prepare import job_plan
from felactl.report.figures import plan_figure, prediction_figure, progress_figure, workers_figure
from felactl.report.page import write_report
from felactl.report.series import read_run
from felactl.spec import save


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.endswith("}")]


def check_report(run: Path, out: Path) -> dict:
    """Report ``run`` into ``out`` and check every plotted series against its metrics: the loss line
    is each step's sample-weighted loss, at the time its last record was written; the samples/s
    bins hold every first-stage sample; the share bars are each worker's samples; each worker's
    compute in the time bins sums to its records'; the PNGs are images; the page holds them. (A run
    with no redone step: each step's records are its loss.) What :func:`write_report` said."""
    result = write_report(str(run), run.parent, out)
    series = read_run(str(run), run.parent)
    recorded = _records(run)
    start = min(r["time"] - r["duration_s"] for r in recorded)
    # a running run records on: what the series read ends with its newest record, its last step's end
    records = [r for r in recorded if r["time"] <= start + max(series.step_t_s) + 1e-6]
    by_step: dict[int, list[dict]] = {}
    for r in records:
        by_step.setdefault(r["step"], []).append(r)
    steps = sorted(by_step)
    expected_loss = [
        sum(r["loss"] * r["samples"] for r in by_step[s]) / sum(r["samples"] for r in by_step[s]) for s in steps
    ]
    expected_t = [max(r["time"] for r in by_step[s]) - start for s in steps]

    progress = progress_figure(series)
    loss_line = next(line for line in progress.axes[0].lines if line.get_label() == "loss")
    ys, xs = np.asarray(loss_line.get_ydata(), float), np.asarray(loss_line.get_xdata(), float)
    plotted = ~np.isnan(ys)  # a pause breaks the line with a NaN
    assert plotted.sum() == len(expected_loss)  # every step drawn
    assert np.allclose(ys[plotted], expected_loss[: plotted.sum()], rtol=1e-9)
    assert np.allclose(xs[plotted], expected_t[: plotted.sum()], rtol=1e-9)
    rate = next(line for line in progress.axes[1].lines if line.get_label() == "samples/s")
    first_stage = min(r.get("stage", 0) for r in records)
    counted = [r for r in records if r.get("stage", 0) == first_stage]
    assert math.isclose(
        float(np.sum(rate.get_ydata())) * series.bin_s, sum(r["samples"] for r in counted), rel_tol=1e-6
    )

    workers = workers_figure(series)
    bars = workers.axes[0].patches
    total = sum(r["samples"] for r in counted)
    by_rank: dict[int, int] = {}
    for r in counted:
        by_rank[r["rank"]] = by_rank.get(r["rank"], 0) + r["samples"]
    assert [round(b.get_width(), 9) for b in bars] == [round(by_rank[k] / total, 9) for k in sorted(by_rank)]
    for worker in series.workers:
        mine = sum(r["compute_s"] for r in records if r["rank"] == worker.rank)
        assert math.isclose(sum(worker.compute) * series.bin_s, mine, rel_tol=1e-6, abs_tol=1e-9)

    assert prediction_figure(series).axes[0].patches  # bars per generation
    for path in result["figures"].values():
        image = imread(path)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    page = Path(result["html"]).read_text()
    assert page.count("data:image/png;base64,") == len(result["figures"]) and f"run {series.run}" in page
    return result


def _lost_run(tmp_path: Path) -> Path:
    """A run whose launcher is gone (its pid long dead, no end recorded): 30 steps on two workers,
    worker 1 at half the pace, a scale-in at step 20."""
    run = tmp_path / "runs" / "lost"
    run.mkdir(parents=True)
    save(job_plan("examples.cnn:job", {}, 2, 16, None), run / "plan.yaml")
    dead = dataclasses.replace(LaunchIdentity.of_this_process(), pid=2**22 - 1, started=1.0)
    t0 = 1_700_000_000.0
    events = [
        {"time": t0, "kind": "launch", "run": "lost", "launcher": dead.to_dict()},
        {"time": t0 + 20.5, "kind": "scale-in", "members_before": [0, 1], "members_after": [0], "generation": 1},
    ]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    lines = []
    for step in range(30):
        for rank in (0, 1) if step < 20 else (0,):
            compute = 0.4 if rank == 0 else 0.8
            lines.append(
                {
                    "time": t0 + step + 1,
                    "rank": rank,
                    "stage": 0,
                    "step": step,
                    "samples": 8 if step < 20 else 16,
                    "loss": 3.0 - step * 0.05 + rank * 0.01,
                    "compute_s": compute,
                    "comm_s": 0.1,
                    "wait_s": 0.5 - compute if rank == 0 else 0.0,
                    "duration_s": 1.0,
                    "generation": int(step >= 20),
                    **({"eval": {"val_loss": 2.0 - step / 100}} if rank == 0 and step % 10 == 9 else {}),
                }
            )
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"time": 1')  # torn last line
    return run


def test_a_lost_run_is_drawn_from_what_it_recorded(tmp_path):
    run = _lost_run(tmp_path)
    result = check_report(run, tmp_path / "report")
    assert result["state"] == "lost"
    assert set(result["figures"]) == {"progress", "workers", "prediction", "plan"}
    assert "schedule" in result["left_out"]  # no profiles kept: no simulated iteration
    series = read_run(str(run), run.parent)
    assert [m.label for m in series.marks] == ["scale-in -> 1"]
    evaluated = progress_figure(series).axes[2].lines[0]
    assert evaluated.get_label() == "val_loss" and list(evaluated.get_ydata()) == [1.91, 1.81, 1.71]
    assert series.shares == {0: (20 * 8 + 10 * 16) / (40 * 8 + 10 * 16), 1: 20 * 8 / (40 * 8 + 10 * 16)}


def test_report_is_one_command_and_refuses_what_it_cannot_write(tmp_path):
    run = _lost_run(tmp_path)
    runs = ["--runs-root", str(run.parent)]
    done = CliRunner().invoke(app, ["report", "lost", *runs, "--json"])
    assert done.exit_code == 0, done.output
    written = json.loads(done.stdout)
    assert Path(written["html"]) == run / "report" / "report.html"
    taken = tmp_path / "a-file"
    taken.write_text("mine")
    refused = CliRunner().invoke(app, ["report", "lost", *runs, "-o", str(taken)])
    assert refused.exit_code == 2 and "is not a directory" in refused.output, refused.output
    assert taken.read_text() == "mine"
    missing = CliRunner().invoke(app, ["report", "no-such-run", *runs])
    assert missing.exit_code == 2 and len(missing.output.strip().splitlines()) == 1, missing.output


def test_plan_figure_draws_the_planners_gantt(tmp_path):
    """``felactl plan --figure``: the stages on their devices and one simulated iteration, a bar
    per interval the simulator ran."""
    from felactl.optimizer.planner import make_plan, plan_cost_model
    from felactl.optimizer.simulator import simulate
    from tests.planner_fixtures import fast_feeds_slow

    cluster, model = fast_feeds_slow(50_000_000)
    for path, spec in (("c.yaml", cluster), ("m.yaml", model)):
        save(spec, tmp_path / path)
    done = CliRunner().invoke(
        app,
        [
            "plan",
            "--cluster",
            str(tmp_path / "c.yaml"),
            "--model",
            str(tmp_path / "m.yaml"),
            "--global-batch",
            "32",
            "--figure",
            str(tmp_path / "plan.png"),
            "-o",
            str(tmp_path / "plan.yaml"),
        ],
    )
    assert done.exit_code == 0, done.output
    assert imread(tmp_path / "plan.png").ndim == 3
    plan = make_plan(cluster, model, 32)
    simulated = simulate(plan, plan_cost_model(plan, cluster, model, use_trees=plan.sync.use_trees))
    stages_ax, gantt_ax = plan_figure(plan, simulated).axes[:2]
    assert sum(len(c.get_paths()) for c in gantt_ax.collections) == len(simulated.intervals)
    assert sum(len(c.get_paths()) for c in stages_ax.collections) == sum(len(s.workers) for s in plan.stages)


def tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """The scalars TensorBoard's own reader finds in ``log_dir``: tag -> (step, value)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_tensorboard_gets_each_steps_loss_shares_waits_and_evaluation(tmp_path):
    """What ``--tensorboard`` writes as a launch follows its run (here the lost run's records, read
    in two parts as they would arrive): TensorBoard reads back each step's loss, each worker's
    share and wait, and the evaluate hook's numbers."""
    from felactl.report.tensorboard import TensorBoardFollower

    run = _lost_run(tmp_path)
    text = (run / "metrics.jsonl").read_text()
    growing = tmp_path / "metrics.jsonl"
    follower = TensorBoardFollower(tmp_path / "tb")
    growing.write_text(text[: len(text) // 2])  # a record cut in the middle waits for its end
    follower.follow(growing)
    growing.write_text(text)
    follower.follow(growing)
    follower.close()
    scalars = tensorboard_scalars(tmp_path / "tb")
    records = _records(run)
    expected = {
        s: sum(r["loss"] * r["samples"] for r in records if r["step"] == s)
        / sum(r["samples"] for r in records if r["step"] == s)
        for s in range(30)
    }
    assert [step for step, _ in scalars["train/loss"]] == list(range(30))
    assert all(math.isclose(v, expected[s], rel_tol=1e-6) for s, v in scalars["train/loss"])
    assert scalars["worker/1/share"] == [(s, 0.5) for s in range(20)]
    assert [v for _, v in scalars["worker/0/wait_s"]] == pytest.approx([0.1] * 30)
    assert scalars["eval/val_loss"] == [(9, pytest.approx(1.91)), (19, pytest.approx(1.81)), (29, pytest.approx(1.71))]
    assert [s for s, _ in scalars["train/samples_per_s"]] == list(range(1, 30))


def test_tensorboard_refuses_a_file_for_its_directory(tmp_path):
    taken = tmp_path / "tb"
    taken.write_text("mine")
    command = ["launch", "--job", "examples.cnn:job", "--nproc-per-node", "1", "--global-batch", "8"]
    done = CliRunner().invoke(app, [*command, "--tensorboard", str(taken)])
    assert done.exit_code == 2 and "--tensorboard" in done.output and "not a directory" in done.output, done.output


def test_tensorboard_waits_for_every_worker_of_a_step_and_skips_a_damaged_line(tmp_path):
    """Workers at their own pace record steps out of order: a step is written once, after every
    worker recording has passed it, with its mean over all of them; a damaged line is skipped
    and the run's scalars go on (the follower never stops the training)."""
    from felactl.report.tensorboard import TensorBoardFollower

    def record(rank, step, loss, t):
        return (
            json.dumps(
                {
                    "time": t,
                    "rank": rank,
                    "step": step,
                    "samples": 8,
                    "loss": loss,
                    "compute_s": 0.1,
                    "comm_s": 0.0,
                    "wait_s": 0.0,
                    "duration_s": 0.1,
                }
            )
            + "\n"
        )

    metrics = tmp_path / "metrics.jsonl"
    first = record(0, 0, 1.0, 1) + record(1, 0, 3.0, 1.5) + record(0, 1, 1.0, 2) + record(0, 2, 1.0, 3)
    metrics.write_text(first + '{"time": 1, "ra\n')
    follower = TensorBoardFollower(tmp_path / "tb")
    follower.follow(metrics)
    assert follower.pending.keys() == {0, 1, 2}  # worker 1 is still at step 0: nothing written yet
    metrics.write_text(metrics.read_text() + record(1, 1, 3.0, 4) + record(1, 2, 3.0, 5))
    follower.follow(metrics)
    follower.close()
    assert tensorboard_scalars(tmp_path / "tb")["train/loss"] == [(0, 2.0), (1, 2.0), (2, 2.0)]


def test_the_gantt_draws_a_stragglers_sleep():
    """A simulated iteration with a device asleep (``--straggler``): the sleep is drawn in light
    gray (its label, ``sleep``, once made the colour table read a stage number from it)."""
    from matplotlib.figure import Figure

    from felactl.optimizer.simulator import Interval, SimResult
    from felactl.report.figures import draw_gantt

    plan = job_plan("examples.cnn:job", {}, 2, 16, None)
    dev0, dev1 = plan.devices
    intervals = (Interval(dev0, 0.0, 1.0, "sleep"), Interval(dev1, 0.0, 0.5, "F0"), Interval(dev1, 0.5, 1.0, "B0"))
    ax = Figure().subplots()
    draw_gantt(ax, plan, SimResult(iteration_s=1.0, intervals=intervals))
    assert len(ax.collections) == 3
