"""``felactl launch --resume RUN``: where a run that died continues from.

Checkpoints are ``checkpoints/step<K>/stage0.pt``, each written atomically, so one that exists is
complete; the newest wins. A data-parallel checkpoint records the membership generation it was
taken in, and the run resumes on that generation's plan (``plan.<G>.yaml``, or ``plan.yaml``),
under a fresh generation number so nothing of the dead job's store keys is reused.

The launch keeps the newest ``--keep-checkpoints`` complete checkpoints (every stage's file
written) and deletes older ones as it goes (:func:`prune_checkpoints`), so a long run does not fill
its disk; an incomplete newer one (being written) is never touched.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from felactl.errors import InputError
from felactl.launcher.rundir import RunDir

STEP_DIR = re.compile(r"^step(\d+)$")


@dataclass(frozen=True)
class ResumePoint:
    run: RunDir
    checkpoint: Path
    step: int
    plan_path: Path
    generation: int
    """The generation the resumed job starts at (past every generation the run has used)."""


def find_resume_point(run: str, runs_root: Path) -> ResumePoint:
    rundir = RunDir.find(run, root=runs_root)
    if rundir.read_summary() is not None:
        raise InputError(f"run {rundir.run_id} already finished (summary.json exists); nothing to resume")
    # a resume continues a live-rescaling job: one stage, so stage 0's file is the checkpoint
    steps = complete_checkpoints(rundir.checkpoints, num_stages=1)
    if not steps:
        raise InputError(f"run {rundir.run_id} has no complete checkpoint in {rundir.checkpoints} "
                         "(launch with --checkpoint-every K to make resumable runs)")
    step, directory = steps[-1]
    checkpoint = directory / "stage0.pt"
    saved = torch.load(checkpoint, map_location="cpu", weights_only=False)
    generation = int(saved.get("generation", 0))
    plan_path = rundir.plan if generation == 0 else rundir.path / f"plan.{generation}.yaml"
    if not plan_path.exists():
        raise InputError(f"{plan_path}: the plan of the checkpoint's generation is missing")
    used = [int(p.name.split(".")[1]) for p in rundir.path.glob("plan.*.yaml") if p.name.split(".")[1].isdigit()]
    return ResumePoint(run=rundir, checkpoint=checkpoint, step=step, plan_path=plan_path,
                       generation=max(used + [generation]) + 1)


RUN_COUNTS = ("steps", "checkpoint_every", "keep_checkpoints")
RESUME_FALLBACKS = {"keep_checkpoints": 0}
"""What a resume takes where the run's launch.json lacks the option: a run launched before
checkpoints were pruned kept them all, and so does its resume."""


def run_counts(resume: str | None, runs_root: Path, **given: int | None) -> dict[str, int]:
    """``steps``, ``checkpoint_every`` and ``keep_checkpoints`` for a launch: each as given, else,
    for ``--resume RUN``, as that run was launched; what neither says is left out, for
    :class:`~felactl.launcher.launch.LaunchOptions`' defaults."""
    before = {**RESUME_FALLBACKS, **previous_launch(resume, runs_root)} if resume is not None else {}
    counts = {key: int(before[key]) for key in RUN_COUNTS if key in before}
    counts.update({key: value for key in RUN_COUNTS if (value := given.get(key)) is not None})
    return counts


def previous_launch(run: str, runs_root: Path) -> dict:
    """The options the run was launched with (``launch.json``), for what ``--resume`` does not restate."""
    path = RunDir.find(run, root=runs_root).path / "launch.json"
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return {}


def _step_dirs(checkpoints: Path) -> list[tuple[int, Path]]:
    if not checkpoints.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in checkpoints.iterdir() if (m := STEP_DIR.match(p.name)))


def complete_checkpoints(checkpoints: Path, num_stages: int) -> list[tuple[int, Path]]:
    """(step, directory) of each checkpoint with every stage's file written, oldest first (each
    file is renamed into place whole, so a file that exists is complete)."""
    return [(step, p) for step, p in _step_dirs(checkpoints)
            if all((p / f"stage{s}.pt").exists() for s in range(num_stages))]


def prune_checkpoints(checkpoints: Path, num_stages: int, keep: int) -> list[Path]:
    """Delete the step directories older than the newest ``keep`` complete checkpoints; returns
    them. ``keep`` 0 keeps everything."""
    if keep <= 0 or not checkpoints.is_dir():
        return []
    complete = complete_checkpoints(checkpoints, num_stages)
    if len(complete) <= keep:
        return []
    oldest_kept = complete[-keep][0]
    doomed = [p for step, p in _step_dirs(checkpoints) if step < oldest_kept]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed
