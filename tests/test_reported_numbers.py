"""The numbers a run reports are the run's: the live table, the stop line and felactl status read
the same, newest state; after a failure the per-step loss is the unfaulted run's."""

from __future__ import annotations

import io
import json
import re
import signal
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from felactl.cli.main import app
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
