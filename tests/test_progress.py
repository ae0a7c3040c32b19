"""Progress where there is no terminal, and a running run's ETA (issue 30, items 9 and 6f).

Piped to a log, ``felactl launch`` and ``felactl demo`` said nothing for minutes after "training
300 steps": the live table is drawn on terminals only. Now a plain line comes every few seconds
(step, loss, samples/s, ETA); ``felactl status`` of a running run says its ETA too, even when its
``--steps`` cannot finish in a lifetime.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from _worker_helpers import dp_plan
from rich.console import Console
from typer.testing import CliRunner

from felactl.cli.main import app
from felactl.cli.runview import duration, live_run
from felactl.control.metrics import progress, recent_step_rate, summarize
from felactl.launcher.follow import LaunchState
from felactl.launcher.liveness import LaunchIdentity
from felactl.launcher.rundir import RunDir, append_jsonl, read_jsonl

REPO = Path(__file__).resolve().parents[1]
LINE = re.compile(r"step \d+/\d+   loss \d+\.\d{4}   \d+\.\d samples/s(   ETA \d+:\d\d:\d\d)?")


def _records(steps: range, *, step_s: float = 0.5, start: float = 100.0, ranks: int = 2) -> list[dict]:
    """Two workers' records, 8 samples each a step; step ``s`` ends at ``start + (s + 1) * step_s``."""
    return [
        {
            "time": start + (s + 1) * step_s,
            "rank": r,
            "stage": 0,
            "step": s,
            "samples": 8,
            "loss": 2.0 - s / 100,
            "compute_s": step_s / 2,
            "comm_s": 0.0,
            "wait_s": step_s / 2,
            "duration_s": step_s,
        }
        for s in steps
        for r in range(ranks)
    ]


def test_the_eta_runs_at_the_recent_step_rate():
    """A run that sped up (a straggler gone, a rescale) is timed by its newest steps."""
    slow = _records(range(20), step_s=1.0)
    fast = _records(range(20, 40), step_s=0.25, start=120.0 - 20 * 0.25)
    records = slow + fast
    assert recent_step_rate(records) == pytest.approx(4.0)
    assert progress(summarize(records), records, 300) == {
        "steps": 40,
        "steps_total": 300,
        "steps_per_s": pytest.approx(4.0),
        "eta_s": pytest.approx(65.0),
    }
    one = _records(range(1))
    assert recent_step_rate(one) is None and progress(summarize(one), one, 300)["eta_s"] is None


def test_the_eta_of_a_resumed_run_is_timed_by_the_steps_since_it_resumed():
    """A run resumed a minute after it died: its newest 20 steps spanned the minute, and the ETA
    read 0:05:15 for a run that ended 20 s later (a user's trial). The rate is the newest steps'
    since the last pause much longer than their steps (a resume, a restart's)."""
    before = _records(range(130), step_s=0.1)
    resumed = _records(range(130, 140), step_s=0.1, start=before[-1]["time"] + 60.0 - 130 * 0.1)
    records = before + resumed
    assert recent_step_rate(records) == pytest.approx(10.0)
    just = before + _records(range(130, 131), step_s=0.1, start=before[-1]["time"] + 60.0 - 130 * 0.1)
    assert recent_step_rate(just) is None  # one step since: no rate yet


def test_durations_read_as_a_clock_then_days_then_years():
    assert [duration(s) for s in (0.4, 42, 3725, 99 * 3600)] == ["0:00:00", "0:00:42", "1:02:05", "99:00:00"]
    assert duration(100 * 3600) == "4.17 days" and duration(5e29) == "1.58e+22 years"


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _drive(tmp_path: Path, *, terminal: bool) -> str:
    """A run seen through the launch's live view at made-up times, as a launch would call it."""
    from _worker_helpers import dp_plan

    out, clock = io.StringIO(), _Clock()
    console = Console(file=out, width=120, force_terminal=terminal, color_system=None)
    state = LaunchState(run=RunDir.create("p", root=tmp_path), plan=dp_plan(2))
    with live_run(console, lambda run_id: f"run {run_id}", 300, clock=clock) as update:
        for at, steps in ((0.0, 0), (5.0, 0), (5.1, 10), (10.0, 16), (15.2, 20), (20.0, 22)):
            clock.now = 1000.0 + at
            state.records = _records(range(steps))
            update(state)
    return out.getvalue()


def test_without_a_terminal_a_progress_line_comes_every_ten_seconds(tmp_path):
    """None before the first step; then at once (past the first 3 s), then 10 s later."""
    text = _drive(tmp_path, terminal=False)
    lines = [line for line in text.splitlines() if line.startswith("step ") and "/300" in line]
    assert lines == [
        "step 10/300   loss 1.9100   32.0 samples/s   ETA 0:02:25",  # 290 steps left at 2 steps/s
        "step 20/300   loss 1.8100   32.0 samples/s   ETA 0:02:20",
    ], text
    assert all(LINE.fullmatch(line) for line in lines)
    assert "loss 1.7900" in text  # and the last table, once the run ended


def test_on_a_terminal_the_live_table_is_drawn_instead(tmp_path):
    text = _drive(tmp_path, terminal=True)
    assert "step 10/300" not in text and "loss 1.7900" in text


def _running_run(tmp_path: Path, event_steps: int | None, launched_steps: int | None = None) -> None:
    run = RunDir.create("r", root=tmp_path)
    launched = {"steps": launched_steps} if launched_steps is not None else {}
    (run.path / "launch.json").write_text(json.dumps(launched))  # what makes it a run: a --script's has no plan
    event = {"time": 99.0, "kind": "launch", "launcher": LaunchIdentity.of_this_process().to_dict()}
    append_jsonl(run.events, {**event, **({"steps": event_steps} if event_steps is not None else {})})
    run.heartbeat.touch()
    for record in _records(range(20)):
        append_jsonl(run.metrics, record)


@pytest.mark.parametrize(
    ("event_steps", "launched_steps", "total", "eta"),
    [
        (300, 100, 300, "ETA 0:02:20"),  # the newest launch's (a resume may give more --steps)
        (None, 300, 300, "ETA 0:02:20"),  # a run launched before launches recorded their steps
        (10**30, None, 10**30, "ETA 1.58e+22 years"),  # allowed, and said
    ],
)
def test_status_of_a_running_run_says_its_eta(tmp_path, event_steps, launched_steps, total, eta):
    _running_run(tmp_path, event_steps, launched_steps)
    result = CliRunner().invoke(app, ["status", "r", "--runs-root", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    reply = json.loads(result.stdout)
    assert reply["state"] == "running"
    assert reply["progress"] == {
        "steps": 20,
        "steps_total": total,
        "steps_per_s": pytest.approx(2.0),
        "eta_s": pytest.approx((total - 20) / 2.0),
    }
    shown = CliRunner().invoke(app, ["status", "r", "--runs-root", str(tmp_path)])
    assert f"step 20 of {total} at 2.00 steps/s: {eta}" in shown.stderr, shown.stderr


@pytest.mark.multiprocess
def test_a_launch_piped_to_a_log_prints_progress_lines(tmp_path, no_leftovers):
    """A real launch with stderr a pipe: its progress lines carry the step, loss, samples/s and ETA;
    the launch event records the steps asked for (what status's ETA counts to)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    argv = ["launch", "--job", "mlp", "--nproc-per-node", "2", "--global-batch", "16", "--steps", "30"]
    argv += ["--straggler", "roundrobin:0.1", "--run-id", "p", "--runs-root", str(tmp_path / "runs")]
    proc = subprocess.Popen(
        [sys.executable, "-m", "felactl", *argv],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("step ") and "/30" in line]
    assert lines and all(LINE.fullmatch(line) for line in lines), err[-3000:]
    assert read_jsonl(tmp_path / "runs" / "p" / "events.jsonl")[0]["steps"] == 30


def test_a_run_whose_every_step_so_far_was_redone_by_a_restart_has_no_summary_yet(tmp_path):
    """A user killed a worker twice before the first checkpoint: each restart went back to step 0,
    so every record written so far was redone, and the launch died on its progress view (exit 2,
    "no metrics records to summarize"), as did ``felactl status`` of the run."""
    _running_run(tmp_path, 300)
    run = RunDir(tmp_path / "r")
    append_jsonl(run.events, {"time": 200.0, "kind": "restart", "from_step": 0, "attempt": 1})
    state = LaunchState(run=run, plan=dp_plan(2))
    assert state.summary_so_far() is None
    result = CliRunner().invoke(app, ["status", "r", "--runs-root", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["summary"] is None


def test_the_closing_line_says_how_often_and_why_the_job_restarted():
    """It read "restarted 2 time(s): 2 restart" (a user's trial)."""
    from felactl.cli.launch import _restarts

    def said(*changes):
        return _restarts({"restarts": [{"kind": k, "pause_s": p} for k, p in changes]})

    assert said() == ""
    assert said(("restart", 4.4)) == ", restarted once after a failure (pause 4.4 s)"
    assert said(("restart", 4.4), ("restart", None)) == ", restarted 2 times after a failure (pause 4.4 s)"
    assert said(("restart", 8.1), ("scale-out", 12.3), ("restart", 2.0)) == (
        ", restarted 3 times: 2 after a failure, 1 to scale out (pauses 8.1, 12.3, 2.0 s)"
    )
