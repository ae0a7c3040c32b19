"""A run as the series its report draws, read from its directory alone (pure: no matplotlib).

Every number here comes from what the run recorded (``metrics.jsonl``, ``events.jsonl``, its
plans): a finished run, one still training (its last record may be half written) and one whose
launcher was lost read alike. Times are seconds since the run's first step started.

* **loss**: each step's (:func:`~felactl.control.metrics.step_losses`: sample-weighted over the
  workers, a redone step's newest), at the time the step's last record was written;
* **samples/s**: the first stage's samples trained in each time bin, over the bin (a step's
  samples spread over the time it took);
* **each worker's time**: the compute, communication and waiting of its steps in each bin, as
  shares of the bin, each step's spread over its time (a straggler computes while the others wait);
* **evaluation**: what the job's ``evaluate`` hook returned, each number where its step ended;
* **events**: what changed the job (scale, failure, re-form, restart, resume, stop), each where it
  happened;
* **prediction**: each generation's plan's predicted samples/s next to what that generation measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from felactl.control.metrics import check_records, step_ends, step_losses, without_redone
from felactl.errors import InputError
from felactl.launcher.rundir import RunDir, read_jsonl
from felactl.spec import Plan, load_plan

MARKED = ("scale-out", "scale-in", "failure", "re-form", "restart", "resume", "stopped", "failed", "node-joined")
"""The events the report marks on its time axes."""

BINS = 60
"""Time bins across a run: throughput and each worker's time are shown per bin."""


@dataclass(frozen=True)
class Mark:
    t_s: float
    kind: str
    label: str


@dataclass(frozen=True)
class WorkerTime:
    rank: int
    stage: int
    samples: int
    compute: tuple[float, ...]
    """Per bin, the share of the bin this worker spent computing (likewise ``comm``, ``wait``)."""
    comm: tuple[float, ...]
    wait: tuple[float, ...]


@dataclass(frozen=True)
class GenerationPace:
    generation: int
    predicted_samples_per_s: float | None
    measured_samples_per_s: float | None
    workers: int


@dataclass(frozen=True)
class RunSeries:
    run: str
    state: str
    state_reason: str
    steps: tuple[int, ...]
    step_t_s: tuple[float, ...]
    loss: tuple[float, ...]
    bin_s: float
    bin_t_s: tuple[float, ...]
    """Each bin's middle."""
    samples_per_s: tuple[float, ...]
    workers: tuple[WorkerTime, ...]
    marks: tuple[Mark, ...]
    generations: tuple[GenerationPace, ...]
    plan: Plan | None
    summary: dict[str, Any] = field(default_factory=dict)
    evaluations: dict[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    """What the job's ``evaluate`` hook returned: name -> (time, value) at each step it ran."""

    @property
    def shares(self) -> dict[int, float]:
        """Each first-stage worker's share of the samples the run trained."""
        first = min((w.stage for w in self.workers), default=0)
        counted = {w.rank: w.samples for w in self.workers if w.stage == first}
        total = sum(counted.values())
        return {rank: samples / total for rank, samples in counted.items()} if total else {}


def read_run(run: str, runs_root: Path) -> RunSeries:
    """The series of run ``run`` (a name under ``runs_root``, or a run directory)."""
    rundir = RunDir.find(run, root=runs_root)
    events = read_jsonl(rundir.events)
    records = without_redone(check_records(read_jsonl(rundir.metrics), rundir.metrics), events)
    start = min((r["time"] - r["duration_s"] for r in records), default=_first_time(events))
    end = max((r["time"] for r in records), default=start)
    bin_s = max((end - start) / BINS, 1e-3)
    bins = max(1, math.ceil((end - start) / bin_s - 1e-9))
    losses = step_losses(records)
    step_end = step_ends(records)
    steps = tuple(s for s in sorted(losses) if s in step_end)
    state = rundir.run_state()
    return RunSeries(
        run=rundir.run_id,
        state=state.name,
        state_reason=state.reason,
        steps=steps,
        step_t_s=tuple(step_end[s] - start for s in steps),
        loss=tuple(losses[s] for s in steps),
        bin_s=bin_s,
        bin_t_s=tuple(start + (i + 0.5) * bin_s - start for i in range(bins)),
        samples_per_s=_throughput(records, start, bin_s, bins),
        workers=_worker_times(records, start, bin_s, bins),
        marks=_marks(events, start),
        generations=_generations(rundir, records),
        plan=_plan(rundir.plan),
        summary=rundir.read_summary() or {},
        evaluations=_evaluations(records, start),
    )


def _first_time(events: list[dict[str, Any]]) -> float:
    return min((e["time"] for e in events if isinstance(e.get("time"), (int, float))), default=0.0)


def _bin(t: float, start: float, bin_s: float, bins: int) -> int:
    return min(bins - 1, max(0, int((t - start) / bin_s)))


def _first_stage(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    first = min((r.get("stage", 0) for r in records), default=0)
    return [r for r in records if r.get("stage", 0) == first]


def _spread(total: float, record: dict[str, Any], start: float, bin_s: float, into: list[float]) -> None:
    """Add ``total`` (a record's samples or seconds) to the bins its step spans, each its share of
    the step's time (a step of several bins is not all in the bin where it ended)."""
    began, ended = record["time"] - record["duration_s"] - start, record["time"] - start
    if ended - began <= 0:
        into[_bin(record["time"], start, bin_s, len(into))] += total
        return
    first, last = _bin(began + start, start, bin_s, len(into)), _bin(ended + start, start, bin_s, len(into))
    for b in range(first, last + 1):
        overlap = min(ended, (b + 1) * bin_s) - max(began, b * bin_s)
        into[b] += total * max(0.0, overlap) / (ended - began)


def _throughput(records: list[dict[str, Any]], start: float, bin_s: float, bins: int) -> tuple[float, ...]:
    samples = [0.0] * bins
    for r in _first_stage(records):
        _spread(r["samples"], r, start, bin_s, samples)
    return tuple(s / bin_s for s in samples)


def _worker_times(records: list[dict[str, Any]], start: float, bin_s: float, bins: int) -> tuple[WorkerTime, ...]:
    by_rank: dict[int, dict[str, Any]] = {}
    for r in records:
        w = by_rank.setdefault(
            r["rank"],
            {"stage": r.get("stage", 0), "samples": 0, **{k: [0.0] * bins for k in ("compute", "comm", "wait")}},
        )
        w["samples"] += r["samples"]
        for key in ("compute", "comm", "wait"):
            _spread(r[f"{key}_s"] / bin_s, r, start, bin_s, w[key])
    return tuple(
        WorkerTime(
            rank=rank,
            stage=w["stage"],
            samples=w["samples"],
            compute=tuple(w["compute"]),
            comm=tuple(w["comm"]),
            wait=tuple(w["wait"]),
        )
        for rank, w in sorted(by_rank.items())
    )


def _evaluations(records: list[dict[str, Any]], start: float) -> dict[str, tuple[tuple[float, float], ...]]:
    found: dict[str, list[tuple[float, float]]] = {}
    for r in records:
        for name, value in (r.get("eval") or {}).items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                found.setdefault(name, []).append((r["time"] - start, float(value)))
    return {name: tuple(points) for name, points in found.items()}


def _marks(events: list[dict[str, Any]], start: float) -> tuple[Mark, ...]:
    marks = []
    for e in events:
        if e.get("kind") not in MARKED or not isinstance(e.get("time"), (int, float)):
            continue
        label = e["kind"]
        if "members_after" in e:
            label += f" -> {len(e['members_after'])}"
        elif e.get("node"):
            label += f" {e['node']}"
        marks.append(Mark(e["time"] - start, e["kind"], label))
    return tuple(marks)


def _generations(rundir: RunDir, records: list[dict[str, Any]]) -> tuple[GenerationPace, ...]:
    """Each generation that trained: its plan's predicted samples/s (where the plan has one) and
    the samples/s its first stage measured, from its first step's start to its last step's end."""
    by_generation: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        by_generation.setdefault(r.get("generation", 0), []).append(r)
    paces = []
    for generation, mine in sorted(by_generation.items()):
        counted = _first_stage(mine)
        span = max(r["time"] for r in mine) - min(r["time"] - r["duration_s"] for r in mine)
        plan = _plan(rundir.plan_of(generation))
        paces.append(
            GenerationPace(
                generation=generation,
                predicted_samples_per_s=plan.predicted.samples_per_s if plan and plan.predicted else None,
                measured_samples_per_s=sum(r["samples"] for r in counted) / span if span > 0 else None,
                workers=len({r["rank"] for r in mine}),
            )
        )
    return tuple(paces)


def _plan(path: Path) -> Plan | None:
    try:
        return load_plan(path) if path.exists() else None
    except InputError:  # a plan the report cannot read costs it a figure, never the report
        return None
