"""What ``felactl status`` reports about a run, read from its directory alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from felactl.control import EventKind
from felactl.control.metrics import check_records, progress, restarts, summary_so_far
from felactl.launcher.resume import previous_launch
from felactl.launcher.rundir import RunDir, read_jsonl

HISTORY_KINDS = tuple(
    k.value
    for k in (
        EventKind.SCALE_OUT,
        EventKind.SCALE_IN,
        EventKind.FAILURE,
        EventKind.RE_FORM,
        EventKind.REFUSED,
        EventKind.REPAIRED,
        EventKind.RESUME,
        EventKind.RESTART,
        EventKind.NODE_JOINED,
        EventKind.SLURM_NODES,
        EventKind.SLURM_RELEASED,
    )
)
"""The events that changed (or were refused to change) the job's membership (nodes Slurm granted
and took back included), and tampering with its control plane (forgeries refused, keys written back)."""


def run_status(run: str, runs_root: Path) -> dict[str, Any]:
    """The run's state (see :meth:`RunDir.run_state`) and why, its summary so far and its events;
    for a running run, its progress towards its ``--steps`` (:func:`progress`: the ETA)."""
    rundir = RunDir.find(run, root=runs_root)
    events = read_jsonl(rundir.events)
    summary = rundir.read_summary()
    records: list[dict[str, Any]] = []
    if not summary:
        records = check_records(read_jsonl(rundir.metrics), rundir.metrics)
        summary = summary_so_far(records, events)
    state = rundir.run_state()
    history = _with_restart_pauses([e for e in events if e.get("kind") in HISTORY_KINDS], summary, events, records)
    steps_total = _steps_total(rundir, runs_root) if state.name == "running" and summary else None
    return {
        "run": rundir.run_id,
        "run_dir": str(rundir.path),
        "state": state.name,
        "state_reason": state.reason,
        "summary": summary,
        "events": events,
        "history": history,
        "progress": progress(summary, records, steps_total) if steps_total else None,
    }


def _with_restart_pauses(
    history: list[dict], summary: dict | None, events: list[dict], records: list[dict]
) -> list[dict]:
    """A restart's pause is known only once the next attempt trains a step: the summary's (a
    finished run), else measured on the records read for a running one."""
    known = (summary or {}).get("restarts") or restarts(events, records)
    pauses = {change["time"]: change["pause_s"] for change in known if "time" in change}
    return [{**e, "pause_s": pauses[e["time"]]} if e.get("time") in pauses else e for e in history]


def _steps_total(rundir: RunDir, runs_root: Path) -> int | None:
    """The steps the running launch was asked for: its ``launch``/``resume`` event's, else (a run
    launched before events recorded them) its ``launch.json``'s."""
    started = rundir.last_start_or_end() or {}
    if "steps" not in started:
        started = previous_launch(str(rundir.path), runs_root)
    steps = started.get("steps") if isinstance(started, dict) else None
    return steps if isinstance(steps, int) and not isinstance(steps, bool) and steps > 0 else None
