"""What ``felactl status`` reports about a run, read from its directory alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from felactl.agents.worker.metrics import summarize
from felactl.launcher.rundir import RunDir, read_jsonl


HISTORY_KINDS = ("scale-out", "scale-in", "failure", "re-form", "refused", "resume", "node-joined")
"""The events that changed (or were refused to change) the job's membership."""


def run_status(run: str, runs_root: Path) -> dict[str, Any]:
    """The run's state (running, finished, failed), its summary so far and its events."""
    rundir = RunDir.find(run, root=runs_root)
    events = read_jsonl(rundir.events)
    final = rundir.read_summary()
    records = read_jsonl(rundir.metrics)
    summary = final or (summarize(records) if records else None)
    state = rundir.state()
    history = [e for e in events if e.get("kind") in HISTORY_KINDS]
    return {"run": rundir.run_id, "run_dir": str(rundir.path), "state": state, "summary": summary, "events": events,
            "history": history}
