"""What a run leaves: ``metrics.jsonl`` (one record per worker per step) and its summary.

The record format is shared: the workers write it (:class:`MetricsWriter`), the launcher and
``felactl status`` read and summarize it, so it lives here, below both, as ``events.jsonl`` does.

Workers append to one shared ``metrics.jsonl``: each record is one ``os.write`` of one line on a
file opened with ``O_APPEND``, which Linux keeps whole even with several writers, so no record is
ever half written or interleaved. :func:`summarize` turns the records into ``summary.json``.
"""

from __future__ import annotations

import bisect
import json
import logging
import math
import os
import statistics
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from felactl.errors import InputError
from felactl.fsutil import read_jsonl

log = logging.getLogger(__name__)
METRICS_FILE = "metrics.jsonl"
RECORD_KEYS = ("time", "rank", "stage", "step", "samples", "loss", "compute_s", "comm_s", "wait_s", "duration_s")
REQUIRED_NUMBERS = ("time", "rank", "step", "samples", "compute_s", "comm_s", "wait_s", "duration_s")
"""What :func:`summarize` reads of every record (``stage`` and ``loss`` may be absent)."""


class MetricsWriter:
    def __init__(self, run_dir: str | os.PathLike, rank: int, stage: int = 0):
        self.path = Path(run_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.stage = stage
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.failed = False
        """Whether a record could not be written (said once, in the worker's log)."""

    def write(
        self,
        *,
        step: int,
        samples: int,
        loss: float | None,
        compute_s: float,
        comm_s: float,
        wait_s: float,
        duration_s: float,
        **extra: Any,
    ) -> dict[str, Any]:
        record = {
            "time": time.time(),
            "rank": self.rank,
            "stage": self.stage,
            "step": step,
            "samples": samples,
            "loss": loss,
            "compute_s": round(compute_s, 6),
            "comm_s": round(comm_s, 6),
            "wait_s": round(wait_s, 6),
            "duration_s": round(duration_s, 6),
            **extra,
        }
        try:
            os.write(self._fd, (json.dumps(record) + "\n").encode("utf-8"))
        except OSError as exc:  # a full or failing disk ends the record, not the training
            if not self.failed:
                log.warning(
                    "worker %d: metrics from step %d on are not recorded in %s (%s)", self.rank, step, self.path, exc
                )
            self.failed = True
        return record

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every complete record of a run's metrics (a torn last line from a crash is skipped)."""
    p = Path(path)
    if p.is_dir():
        p = p / METRICS_FILE
    if not p.exists():
        raise InputError(f"{p}: no such file (did the run start?)")
    return check_records(read_jsonl(p), p)


def check_records(records: list[Any], where: str | os.PathLike) -> list[dict[str, Any]]:
    """``records`` when each is one :func:`summarize` can read; else an InputError naming ``where``,
    the record and what is wrong with it."""
    for i, r in enumerate(records, 1):
        if not isinstance(r, dict):
            raise InputError(f"{where}: record {i} is not a JSON object: {r!r}"[:300])
        which = f"record {i} (rank {r.get('rank', '?')}, step {r.get('step', '?')})"
        for key in REQUIRED_NUMBERS:
            if key not in r:
                raise InputError(f"{where}: {which} has no {key!r}")
            if not _is_number(r[key]):
                raise InputError(f"{where}: {which}: {key!r} must be a number, got {r[key]!r}"[:300])
        if r.get("loss") is not None and not _is_number(r["loss"]):
            raise InputError(f"{where}: {which}: 'loss' must be a number or null, got {r['loss']!r}"[:300])
    return records


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def without_redone(records: Iterable[dict[str, Any]], events: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records, less those a resume redid: written before a ``resume`` event at or past the
    step it continued from (the dead job got that far, but its checkpoint did not). The same for a
    job that restarted from a checkpoint, after a failed worker (``restart``) or to rescale
    (``scale-out``/``scale-in`` with a ``from_step``: a live rescale has none, it redoes nothing)."""
    resumes = [
        (e["time"], e["from_step"]) for e in events if e.get("kind") in ("resume", *RESTART_KINDS) and "from_step" in e
    ]
    return [r for r in records if not any(r["time"] < t and r["step"] >= step for t, step in resumes)]


def step_losses(records: Iterable[dict[str, Any]]) -> dict[int, float]:
    """Each step's loss: the mean of the losses its records carry, each weighted by the samples it
    is over (``loss_samples`` where a record says it: a flexible hybrid's worker may compute the
    loss of other samples than those it took in; else ``samples``). A step recorded
    in several generations was redone: a member finished it and died before the others could,
    and they did it again in the next generation; its loss is the redo's (the newest generation's
    records), never a mean with the dead member's share. (Nor is a worker's last loss the run's:
    a worker that died stopped recording long before the run's last step.)"""
    records = [r for r in records if r.get("loss") is not None]
    newest: dict[int, int] = {}
    for r in records:
        newest[r["step"]] = max(newest.get(r["step"], 0), r.get("generation", 0))
    sums: dict[int, tuple[float, int]] = {}
    for r in records:
        if r.get("generation", 0) == newest[r["step"]]:
            loss_sum, samples = sums.get(r["step"], (0.0, 0))
            weight = max(r.get("loss_samples", r["samples"]), 1)
            sums[r["step"]] = (loss_sum + r["loss"] * weight, samples + weight)
    return {step: loss_sum / samples for step, (loss_sum, samples) in sorted(sums.items())}


def _running_s(records: list[dict[str, Any]], events: list[dict[str, Any]]) -> float:
    """Seconds the run trained: per launch (the records between two ``resume`` events), from its
    first step's start to its last step's end, summed."""
    resumed_at = sorted(e["time"] for e in events if e.get("kind") == "resume")
    spans: dict[int, tuple[float, float]] = {}
    for r in records:
        launch = bisect.bisect(resumed_at, r["time"])
        start, end = spans.get(launch, (math.inf, -math.inf))
        spans[launch] = (min(start, r["time"] - r["duration_s"]), max(end, r["time"]))
    return sum(end - start for start, end in spans.values())


def summary_so_far(records: Iterable[dict[str, Any]], events: Iterable[dict[str, Any]] = ()) -> dict[str, Any] | None:
    """:func:`summarize` of a run under way or stopped: None where no step stands yet, none
    recorded or every one recorded redone (a restart, before the first checkpoint, went back to
    step 0: its records so far are all of steps it trains again)."""
    events = list(events)
    records = without_redone(records, events)
    return summarize(records, events) if records else None  # (what stands, redone already left out)


def summarize(records: Iterable[dict[str, Any]], events: Iterable[dict[str, Any]] = ()) -> dict[str, Any]:
    """Aggregate metrics records into the run summary (pure); ``events``: the run's, so that the
    steps a resume redid count once (:func:`without_redone`).

    Samples are counted at the first stage only (later stages see the same samples again).
    ``wall_s`` runs from the earliest step start to the last step end of each launch (a resume
    starts another: the time a run lay stopped is not training time); ``compute_fraction`` is
    the share of the workers' step time spent computing (injected straggler sleeps count as
    compute: they emulate a slower device). ``first_loss`` and ``final_loss`` are the first and
    the last step's losses (:func:`step_losses`).
    """
    events = list(events)
    records = without_redone(records, events)
    if not records:
        raise InputError("no metrics records to summarize")
    workers: dict[int, dict[str, Any]] = {}
    for r in records:
        w = workers.setdefault(
            r["rank"],
            {
                "rank": r["rank"],
                "stage": r.get("stage", 0),
                "steps": 0,
                "samples": 0,
                "tokens": 0,
                "compute_s": 0.0,
                "comm_s": 0.0,
                "wait_s": 0.0,
                "busy_s": 0.0,
            },
        )
        w["steps"] += 1
        w["samples"] += r["samples"]
        w["tokens"] += r.get("tokens", 0)
        for key in ("compute_s", "comm_s", "wait_s"):
            w[key] += r[key]
        w["busy_s"] += r["duration_s"]
    wall_s = _running_s(records, events)
    first_stage = min(w["stage"] for w in workers.values())
    samples = sum(w["samples"] for w in workers.values() if w["stage"] == first_stage)
    busy = sum(w["busy_s"] for w in workers.values())
    losses = step_losses(records)
    return {
        "samples": samples,
        "samples_per_s": samples / wall_s if wall_s > 0 else 0.0,
        # Training steps, not records: after a rescale or a failure ranks come and go, and after
        # a resume the steps since the last checkpoint are in the file twice.
        "steps": len({r["step"] for r in records}),
        "first_loss": losses[min(losses)] if losses else None,
        "final_loss": losses[max(losses)] if losses else None,
        "compute_fraction": sum(w["compute_s"] for w in workers.values()) / busy if busy > 0 else 0.0,
        "wall_s": wall_s,
        "workers": [
            {k: (round(v, 6) if isinstance(v, float) else v) for k, v in w.items() if k != "busy_s"}
            for _, w in sorted(workers.items())
        ],
    }


RECENT_STEPS = 20
"""The newest steps a run's step rate (and so its ETA) is measured over: recent enough to follow
a rescale or a straggler, long enough not to jump with every step."""


def step_ends(records: Iterable[dict[str, Any]]) -> dict[int, float]:
    """When each step ended: its newest record's time (its last worker's)."""
    ends: dict[int, float] = {}
    for r in records:
        ends[r["step"]] = max(ends.get(r["step"], -math.inf), r["time"])
    return ends


PAUSE_STEPS = 10
"""A gap between two steps' ends this many times the newest steps' median step is a pause (a
resume, a restart): the step rate is measured after it, not across it."""


def recent_step_rate(records: Iterable[dict[str, Any]]) -> float | None:
    """Steps a second over the newest :data:`RECENT_STEPS` steps since the last pause, each step
    ending with its last record; None until two steps have ended (or when they ended at the same
    instant)."""
    ends = [end for _, end in sorted(step_ends(records).items())[-RECENT_STEPS:]]
    gaps = [later - earlier for earlier, later in zip(ends, ends[1:])]
    typical = statistics.median(gaps) if gaps else 0.0
    paused = [i for i, gap in enumerate(gaps) if typical > 0 and gap > PAUSE_STEPS * typical]
    if paused:
        ends = ends[paused[-1] + 1 :]
    span = ends[-1] - ends[0] if len(ends) > 1 else 0.0
    return (len(ends) - 1) / span if span > 0 else None


def progress(summary: dict[str, Any], records: Iterable[dict[str, Any]], steps_total: int) -> dict[str, Any]:
    """Where a run stands against the ``steps_total`` it was launched for: the steps done (the
    summary's), the recent step rate and the seconds left at that rate (None while no rate is
    known). A run whose --steps cannot finish in a lifetime still runs; this says how long."""
    rate = recent_step_rate(records)
    left = max(steps_total - summary["steps"], 0)
    return {
        "steps": summary["steps"],
        "steps_total": steps_total,
        "steps_per_s": rate,
        "eta_s": left / rate if rate else None,
    }


def write_summary(run_dir: str | os.PathLike, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Summarize ``run_dir/metrics.jsonl`` into ``run_dir/summary.json`` (atomically); returns it."""
    from felactl.fsutil import atomic_write_text

    summary = {**summarize(read_metrics(run_dir)), **(extra or {})}
    atomic_write_text(Path(run_dir) / "summary.json", json.dumps(summary, indent=2) + "\n")
    return summary


def pause_at(records: list[dict[str, Any]], when: float) -> float | None:
    """The gap in the records around ``when`` (a restart): the last step recorded before it to
    the first after it; None until both are there."""
    before = [r["time"] for r in records if r["time"] <= when]
    after = [r["time"] for r in records if r["time"] > when]
    return round(min(after) - max(before), 3) if before and after else None


RESTART_KINDS = ("restart", "scale-out", "scale-in")
"""Events of a job that started its workers again from a checkpoint (a rescale of such a job
records ``from_step``; a live rescale of a data-parallel job records none)."""


def restarts(events: Iterable[dict[str, Any]], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each restart or rescale by restart: when, the step it went on from, the steps it redid and
    its pause (the last step recorded before it to the first step after; None until one is)."""
    out = []
    for event in events:
        if event.get("kind") not in RESTART_KINDS or "from_step" not in event:
            continue
        last_step = max((r["step"] for r in records if r["time"] <= event["time"]), default=-1)
        out.append(
            {
                "time": event["time"],
                "kind": event["kind"],
                "attempt": event.get("attempt"),
                "from_step": event["from_step"],
                "redone_steps": max(last_step + 1 - event["from_step"], 0),
                "pause_s": pause_at(records, event["time"]),
                **{key: event[key] for key in ("reason", "lost_nodes") if key in event},
            }
        )
    return out
