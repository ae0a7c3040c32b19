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

from felactl.errors import InputError
from felactl.launcher.rundir import RunDir
from felactl.spec import Plan, load_plan

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
    """Where ``run`` continues: its newest complete checkpoint (every stage's file), on the plan
    of the generation it was taken in. The workers restore every stage from its directory."""
    rundir = RunDir.find(run, root=runs_root)
    if rundir.read_summary() is not None:
        raise InputError(f"run {rundir.run_id} already finished (summary.json exists); nothing to resume")
    chosen = pick_checkpoint(rundir)
    check_stage_shards(chosen)
    _, generation = checkpoint_plan(rundir, chosen.stage0)
    used = [int(p.name.split(".")[1]) for p in rundir.path.glob("plan.*.yaml") if p.name.split(".")[1].isdigit()]
    return ResumePoint(
        run=rundir,
        checkpoint=chosen.directory,
        step=chosen.step,
        plan_path=chosen.plan_path,
        generation=max(used + [generation]) + 1,
    )


def check_stage_shards(chosen: Checkpoint) -> None:
    """Each sharded stage of ``chosen`` has every shard its ``.metadata`` names, whole (InputError
    else, naming the file): found before the workers start."""
    from felactl.parallel.fsdp import SHARDS, check_shards

    for s in range(len(chosen.plan.stages)):
        stage = chosen.stage0 if s == 0 else load_stage(chosen.directory / f"stage{s}.pt", tensors=())
        if SHARDS in stage:
            try:
                check_shards(chosen.directory / stage[SHARDS])
            except OSError as exc:
                raise InputError(
                    f"{chosen.directory}: the stage's shards are not readable ({exc}); {OLDER_CHECKPOINT}"
                ) from None


@dataclass(frozen=True)
class Checkpoint:
    step: int
    directory: Path
    plan: Plan
    plan_path: Path
    stage0: dict


def pick_checkpoint(rundir: RunDir, step: int | None = None) -> Checkpoint:
    """The newest complete checkpoint, or ``step``'s, which must be complete. How many stage
    files make one complete is the plan's, and the plan is the checkpoint's generation's, which
    stage 0's file says."""
    candidates = [(k, d) for k, d in reversed(step_dirs(rundir.checkpoints)) if step is None or k == step]
    if step is not None and not candidates:
        have = ", ".join(str(k) for k, _ in step_dirs(rundir.checkpoints)) or "none"
        raise InputError(f"run {rundir.run_id} has no checkpoint of step {step} (it has: {have})")
    for k, directory in candidates:
        if not (directory / "stage0.pt").exists():
            continue
        stage0 = load_stage(directory / "stage0.pt", tensors=())
        plan_path = checkpoint_plan(rundir, stage0)[0]
        plan = load_plan(plan_path)
        if is_complete(directory, len(plan.stages)):
            return Checkpoint(step=k, directory=directory, plan=plan, plan_path=plan_path, stage0=stage0)
    if step is not None:
        raise InputError(f"{candidates[0][1]}: checkpoint of step {step} is not complete (a stage's file is missing)")
    raise InputError(
        f"run {rundir.run_id} has no complete checkpoint in {rundir.checkpoints} "
        "(every run writes one at its last step; launch with --checkpoint-every K for more)"
    )


OLDER_CHECKPOINT = (
    "export an older step with --step K, or move this step's directory away to resume from the one before"
)


def resume_hint(rundir: RunDir) -> str:
    """Where a run that stopped stands, for its user: its newest complete checkpoint and how to
    continue from it."""
    try:
        step = pick_checkpoint(rundir).step
    except InputError:
        return f"run {rundir.run_id} has no complete checkpoint to resume from"
    return f"its newest complete checkpoint is step {step}: continue with `felactl launch --resume {rundir.run_id}`"


def load_stage(path: Path, tensors: tuple[str, ...] = ("model", "optimizer")) -> dict:
    """A stage's checkpoint file (``model``, ``optimizer``, ``step``, ``data_position``, and
    ``generation`` where the job rescaled), its tensors on the CPU. A sharded stage's state of
    ``tensors`` is read whole from its shards (none: the file alone, its step and the rest)."""
    import torch  # here: `felactl status` reads runs through this module and never pays for torch

    from felactl.parallel.fsdp import SHARDS, with_shards

    try:
        state = torch.load(path, map_location="cpu", weights_only=False, mmap=True)  # tensors read where used
    except FileNotFoundError:
        raise InputError(f"{path}: deleted while it was read (the run pruned it); try again") from None
    except Exception as exc:  # torch.load fails in many ways on a damaged file (zip, pickle, EOF)
        raise InputError(
            f"{path}: not a readable checkpoint, truncated or corrupt ({type(exc).__name__}); {OLDER_CHECKPOINT}"
        ) from None
    sharded = isinstance(state, dict) and isinstance(state.get(SHARDS), str)
    if not isinstance(state, dict) or not (sharded or isinstance(state.get("model"), dict)):
        raise InputError(f"{path}: not a felactl checkpoint (no model state); {OLDER_CHECKPOINT}")
    try:
        return with_shards(state, path.parent, tensors)
    except InputError as exc:
        raise InputError(f"{exc}; {OLDER_CHECKPOINT}") from None


def checkpoint_plan(rundir: RunDir, stage0: dict) -> tuple[Path, int]:
    """The plan a checkpoint was taken under and its generation: a data-parallel checkpoint records
    the membership generation it was taken in (``plan.<G>.yaml``); without one it is ``plan.yaml``."""
    generation = int(stage0.get("generation", 0))
    plan_path = rundir.plan_of(generation)
    if not plan_path.exists():
        raise InputError(f"{plan_path}: the plan of the checkpoint's generation is missing")
    return plan_path, generation


RUN_COUNTS = ("steps", "checkpoint_every", "keep_checkpoints")
RUN_CHOICES = ("slowdown", "straggler")
"""Launch options a resume takes from the run unless restated (the sync mode needs none: the run's
plan records the one it ran with)."""
RESUME_FALLBACKS = {"keep_checkpoints": 0}
"""What a resume takes where the run's launch.json lacks the option: a run launched before
checkpoints were pruned kept them all, and so does its resume."""


def run_counts(resume: str | None, runs_root: Path, **given: int | str | None) -> dict[str, int | str]:
    """``steps``, ``checkpoint_every``, ``keep_checkpoints`` and the injected stragglers for a
    launch: each as given, else, for ``--resume RUN``, as that run was launched; what neither says
    is left out, for :class:`~felactl.launcher.prepare.LaunchOptions`' defaults."""
    before = {**RESUME_FALLBACKS, **previous_launch(resume, runs_root)} if resume is not None else {}
    counts: dict[str, int | str] = {key: int(before[key]) for key in RUN_COUNTS if key in before}
    counts.update({key: str(before[key]) for key in RUN_CHOICES if before.get(key) is not None})
    counts.update({key: value for key in (*RUN_COUNTS, *RUN_CHOICES) if (value := given.get(key)) is not None})
    return counts


def previous_launch(run: str, runs_root: Path) -> dict:
    """The options the run was launched with (``launch.json``), for what ``--resume`` does not restate."""
    path = RunDir.find(run, root=runs_root).path / "launch.json"
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return {}


def step_dirs(checkpoints: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every ``step<K>`` directory, complete or not, oldest first."""
    if not checkpoints.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in checkpoints.iterdir() if (m := STEP_DIR.match(p.name)))


def complete_checkpoints(checkpoints: Path, num_stages: int) -> list[tuple[int, Path]]:
    """(step, directory) of each checkpoint with every stage's file written, oldest first (each
    file is renamed into place whole, so a file that exists is complete)."""
    return [(step, p) for step, p in step_dirs(checkpoints) if is_complete(p, num_stages)]


def is_complete(directory: Path, num_stages: int) -> bool:
    return all((directory / f"stage{s}.pt").exists() for s in range(num_stages))


def prune_checkpoints(checkpoints: Path, num_stages: int, keep: int) -> list[Path]:
    """Delete the step directories older than the newest ``keep`` complete checkpoints; returns
    them. ``keep`` 0 keeps everything."""
    if keep <= 0 or not checkpoints.is_dir():
        return []
    complete = complete_checkpoints(checkpoints, num_stages)
    if len(complete) <= keep:
        return []
    oldest_kept = complete[-keep][0]
    doomed = [p for step, p in step_dirs(checkpoints) if step < oldest_kept]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed
